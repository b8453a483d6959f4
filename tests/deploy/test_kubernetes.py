"""deploy/kubernetes: the manifests agree with the target binary, the proto and each other.

The fields that decide whether the deployment works are checked against their sources of truth:
the target's flags against `draftfeed-target --help`, the probes' service name against the
proto and a running target's health service, the trainer's dns:/// target against the headless
Service and the client's resolver, the checkpoint claim against the PersistentVolumeClaim that
ships beside them, the pods' resources against the flags that size threads and memory, and the
metrics port against the Prometheus scrape annotations. Schema validation runs offline through the npm package
kubernetes-models (NODE_PATH) and `kubectl --dry-run=client` where a cluster answers; both skip
with the reason otherwise.
"""

import os
import pathlib
import re
import shutil
import subprocess
import sys

import pytest
import yaml

REPO = pathlib.Path(__file__).resolve().parents[2]
BUILD = pathlib.Path(os.environ.get("DRAFTFEED_BUILD_DIR", REPO / "build"))
TARGET_BIN = BUILD / "bin" / "draftfeed-target"
K8S = REPO / "deploy" / "kubernetes"
TARGET_MANIFESTS = ["targets.yaml", "targets-gpu.yaml"]
ALL_MANIFESTS = TARGET_MANIFESTS + ["trainer-job.yaml", "models-pvc.yaml"]
DASHBOARD = REPO / "deploy" / "grafana" / "draftfeed-dashboard.json"
PROTO = REPO / "proto" / "draftfeed" / "v1" / "draftfeed.proto"


def load(name):
    docs = [d for d in yaml.safe_load_all((K8S / name).read_text()) if d is not None]
    return {d["kind"]: d for d in docs}


def target_container(objs):
    (c,) = objs["StatefulSet"]["spec"]["template"]["spec"]["containers"]
    return c


def flags(args):
    """{'--name': 'value' or None} of a container's args."""
    out = {}
    for a in args:
        assert a.startswith("--"), f"argument {a!r} is not a --flag"
        name, _, value = a.partition("=")
        out[name] = value if _ else None
    return out


@pytest.fixture(scope="module")
def help_flags():
    if not TARGET_BIN.exists():
        pytest.skip(f"no {TARGET_BIN} (set DRAFTFEED_BUILD_DIR)")
    r = subprocess.run([str(TARGET_BIN), "--help"], capture_output=True, text=True, timeout=30)
    assert r.returncode == 0, r.stderr
    found = set(re.findall(r"^\s+(--[a-z_0-9]+)", r.stdout, flags=re.M))
    assert {"--model", "--listen", "--insecure", "--port_file"} <= found, r.stdout
    return found


def health_service_name():
    text = PROTO.read_text()
    package = re.search(r"^package\s+([\w.]+);", text, flags=re.M).group(1)
    assert re.search(r"^service\s+TargetService\s*\{", text, flags=re.M), PROTO
    return f"{package}.TargetService"


@pytest.mark.parametrize("name", TARGET_MANIFESTS)
def test_targets_manifest_matches_the_binary_and_service(name, help_flags):
    objs = load(name)
    svc, sts = objs["Service"], objs["StatefulSet"]
    c = target_container(objs)
    f = flags(c["args"])
    unknown = set(f) - help_flags
    assert not unknown, f"{name}: flags draftfeed-target does not have: {sorted(unknown)}"

    # Headless Service in front of the StatefulSet's pods, on the port the target listens on.
    assert svc["spec"]["clusterIP"] == "None"
    assert sts["spec"]["serviceName"] == svc["metadata"]["name"]
    labels = sts["spec"]["template"]["metadata"]["labels"]
    assert sts["spec"]["selector"]["matchLabels"].items() <= labels.items()
    assert svc["spec"]["selector"].items() <= labels.items()
    host, _, port = f["--listen"].rpartition(":")
    assert host == "0.0.0.0" and "--insecure" in f, f"{name}: pods must listen beyond loopback"
    (cport,) = [p for p in c["ports"] if p["name"] == "grpc"]
    (sport,) = svc["spec"]["ports"]
    assert int(port) == cport["containerPort"] == sport["port"]
    assert sport["targetPort"] in (cport["name"], cport["containerPort"])

    # Every probe asks the gRPC health service about draftfeed.v1.TargetService, which goes
    # NOT_SERVING while the target drains, so a draining pod leaves the Service's DNS answer.
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        g = c[probe]["grpc"]
        assert g == {"port": int(port), "service": health_service_name()}, (name, probe)
    # Liveness and readiness start only after the startup probe passes: it must allow a load.
    start = c["startupProbe"]
    assert start["periodSeconds"] * start["failureThreshold"] >= 600
    # SIGTERM drains for --drain_timeout_s; the kubelet must not SIGKILL before that.
    grace = sts["spec"]["template"]["spec"]["terminationGracePeriodSeconds"]
    assert grace > int(f["--drain_timeout_s"])

    # Image: the name deploy/container/build.sh tags by default (:cuda for the GPU variant).
    build_sh = (REPO / "deploy" / "container" / "build.sh").read_text()
    repo_name = re.search(r"TAG=\$\{TAG:-([^:}]+):", build_sh).group(1)
    assert c["image"].startswith(f"{repo_name}:"), c["image"]

    limits = c.get("resources", {}).get("limits", {})
    if name == "targets-gpu.yaml":
        assert limits.get("nvidia.com/gpu") == 1 and f["--device"] == "cuda:0"
    else:
        assert "nvidia.com/gpu" not in limits and f["--device"] == "cpu"


def quantity(q):
    """A Kubernetes quantity ("8", "500m", "64Gi", "128G") in base units (cores, bytes)."""
    m = re.fullmatch(r"(\d+(?:\.\d+)?)(m|Ki|Mi|Gi|Ti|k|M|G|T)?", str(q))
    assert m, q
    scale = {None: 1, "m": 1e-3, "Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "Ti": 2**40, "k": 1e3,
             "M": 1e6, "G": 1e9, "T": 1e12}[m.group(2)]
    return float(m.group(1)) * scale


def test_every_claim_the_manifests_mount_is_defined_here():
    """The targets mount draftfeed-models; a PersistentVolumeClaim of that name ships beside them
    (its own file, so that deleting the targets keeps the checkpoint), large enough for a real
    checkpoint and mountable by every replica at once, on whichever nodes they run."""
    claims = {}
    for m in K8S.glob("*.yaml"):
        for d in yaml.safe_load_all(m.read_text()):
            if d and d["kind"] == "PersistentVolumeClaim":
                claims[d["metadata"]["name"]] = (m.name, d)
    for name in TARGET_MANIFESTS:
        objs = load(name)
        assert "PersistentVolumeClaim" not in objs, f"{name}: the claim lives in models-pvc.yaml"
        spec = objs["StatefulSet"]["spec"]["template"]["spec"]
        volumes = {v["name"]: v for v in spec["volumes"]}
        (c,) = spec["containers"]
        for mount in c["volumeMounts"]:
            claim = volumes[mount["name"]]["persistentVolumeClaim"]["claimName"]
            assert claim in claims, f"{name} mounts claim {claim!r}, defined nowhere in {K8S}"
            file, pvc = claims[claim]
            assert file == "models-pvc.yaml"
            assert mount["readOnly"] is True
            assert set(pvc["spec"]["accessModes"]) & {"ReadOnlyMany", "ReadWriteMany"}, pvc
            assert objs["StatefulSet"]["spec"]["replicas"] > 1
            # Holds Qwen3.6-27B in bf16 (54 GB).
            assert quantity(pvc["spec"]["resources"]["requests"]["storage"]) >= 64 * 2**30
            assert flags(c["args"])["--model"].startswith(mount["mountPath"] + "/")


@pytest.mark.parametrize("name", TARGET_MANIFESTS)
def test_targets_have_resources_their_flags_fit(name):
    """Requests equal limits (Guaranteed QoS); the engine's threads are the CPU limit (the
    defaults count the node's cores); the captures' host memory cap leaves room in the memory
    limit for the process itself."""
    c = target_container(load(name))
    f = flags(c["args"])
    req, lim = c["resources"]["requests"], c["resources"]["limits"]
    assert req == lim, (req, lim)
    cpus = quantity(lim["cpu"])
    memory = quantity(lim["memory"])
    assert cpus >= 2 and memory >= 8 * 2**30
    threads = "--load_threads" if name == "targets-gpu.yaml" else "--threads"
    assert int(f[threads]) == cpus, (threads, f, lim)
    cap = float(f["--host_memory_cap_gib"]) * 2**30
    assert 0 < cap <= memory / 2, (f["--host_memory_cap_gib"], lim["memory"])


@pytest.mark.parametrize("name", TARGET_MANIFESTS)
def test_targets_serve_metrics_where_prometheus_is_told_to_scrape(name, help_flags):
    """--metrics_listen on the pod's address, its port named in the container and in the
    prometheus.io/* annotations, so the kubernetes-pods scrape job feeds the shipped dashboard."""
    objs = load(name)
    c = target_container(objs)
    f = flags(c["args"])
    assert "--metrics_listen" in help_flags
    host, _, port = f["--metrics_listen"].rpartition(":")
    assert host == "0.0.0.0", f["--metrics_listen"]
    ports = {p["name"]: p["containerPort"] for p in c["ports"]}
    assert ports["metrics"] == int(port) != ports["grpc"]
    notes = objs["StatefulSet"]["spec"]["template"]["metadata"]["annotations"]
    assert notes == {"prometheus.io/scrape": "true", "prometheus.io/port": port,
                     "prometheus.io/path": "/metrics"}, notes
    assert DASHBOARD.exists() and "draftfeed_tokens_served_total" in DASHBOARD.read_text()


def test_cpu_and_gpu_targets_are_the_same_objects():
    cpu, gpu = load("targets.yaml"), load("targets-gpu.yaml")
    assert cpu["Service"] == gpu["Service"]
    assert cpu["StatefulSet"]["metadata"] == gpu["StatefulSet"]["metadata"]


def test_trainer_job_targets_the_headless_service():
    svc = load("targets.yaml")["Service"]
    job = load("trainer-job.yaml")["Job"]
    (c,) = job["spec"]["template"]["spec"]["containers"]
    args = c["args"]
    target = args[args.index("--target") + 1]
    assert target == f"dns:///{svc['metadata']['name']}:{svc['spec']['ports'][0]['port']}"
    assert c["resources"]["limits"]["nvidia.com/gpu"] == 1
    (wait,) = job["spec"]["template"]["spec"]["initContainers"]
    assert f"'{svc['metadata']['name']}', {svc['spec']['ports'][0]['port']}" in wait["command"][-1]


def _health_check(address, service):
    """grpc.health.v1.Health/Check with hand-encoded messages (field 1 of each)."""
    import grpc
    data = service.encode()
    request = b"\x0a" + bytes([len(data)]) + data
    with grpc.insecure_channel(address) as ch:
        reply = ch.unary_unary("/grpc.health.v1.Health/Check")(request, timeout=10)
    return {b"\x08\x01": "SERVING", b"\x08\x02": "NOT_SERVING"}.get(reply, reply)


def test_manifest_args_start_a_target_whose_health_the_probes_read(make_target):
    """The StatefulSet's args (model and address swapped for a test's) start a target, and the
    service the probes ask about answers SERVING on it; a name the target does not register
    fails, so the check can tell the two apart."""
    import grpc
    if not TARGET_BIN.exists():
        pytest.skip(f"no {TARGET_BIN} (set DRAFTFEED_BUILD_DIR)")
    f = flags(target_container(load("targets.yaml"))["args"])
    extra = [f"{k}={v}" if v is not None else k for k, v in f.items()
             if k not in ("--model", "--listen", "--metrics_listen")]
    t = make_target(extra=[*extra, "--listen=127.0.0.1:0", "--metrics_listen=127.0.0.1:0"])
    assert _health_check(t.address, health_service_name()) == "SERVING", t.output()
    with pytest.raises(grpc.RpcError) as e:
        _health_check(t.address, "draftfeed.v1.NoSuchService")
    assert e.value.code() == grpc.StatusCode.NOT_FOUND


def test_client_resolves_dns_targets_like_the_trainer_job(target):
    """The trainer Job's dns:///NAME:PORT form, with a name this host resolves."""
    sys.path.insert(0, str(BUILD / "python"))
    try:
        import draftfeed
    except ImportError as e:
        pytest.skip(f"no Python client in {BUILD}/python: {e}")
    info = draftfeed.describe_target(f"dns:///localhost:{target.port}")
    assert info["model_id"].startswith("tiny-random")
    tokens = [1, 2, 3, 4, 5, 6, 7, 8]
    with draftfeed.Feed(targets=[f"dns:///localhost:{target.port}"], layers=[-1]) as feed:
        (r,) = list(feed.map([(tokens, [len(tokens)])]))
    assert r.num_tokens == len(tokens)


def test_manifests_pass_the_kubernetes_schemas():
    node = shutil.which("node")
    if node is None:
        pytest.skip("node is not installed")
    probe = subprocess.run([node, "-e", "require('kubernetes-models'); require('js-yaml')"],
                           capture_output=True, text=True)
    if probe.returncode != 0:
        pytest.skip("npm packages kubernetes-models and js-yaml not on NODE_PATH "
                    "(npm install kubernetes-models js-yaml; NODE_PATH=<dir>/node_modules)")
    r = subprocess.run([node, str(pathlib.Path(__file__).with_name("validate_k8s.js")),
                        *[str(K8S / m) for m in ALL_MANIFESTS]], capture_output=True, text=True)
    assert r.returncode == 0, r.stdout + r.stderr
    assert r.stdout.count("\nok ") + r.stdout.startswith("ok ") == 6, r.stdout


def test_kubectl_dry_run_client():
    kubectl = shutil.which("kubectl")
    if kubectl is None:
        pytest.skip("kubectl is not installed")
    # Client-side dry runs still ask the API server for its resource types and schemas.
    if subprocess.run([kubectl, "version", "--request-timeout=5s"],
                      capture_output=True).returncode != 0:
        pytest.skip("kubectl reaches no cluster (a client dry run needs its API discovery)")
    for m in ALL_MANIFESTS:
        r = subprocess.run([kubectl, "apply", "--dry-run=client", "-f", str(K8S / m)],
                           capture_output=True, text=True)
        assert r.returncode == 0, f"{m}: {r.stderr}"
