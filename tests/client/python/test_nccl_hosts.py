"""NCCL across hosts, as far as a machine without GPUs can check it: the feed's
keywords and their refusals, the target's flags, its start-up line and what
GetTargetInfo says (the transfers themselves: nccl_hosts_gpu_test)."""

import os
import subprocess

import pytest

import draftfeed
from conftest import TARGET_BIN


def test_nccl_across_hosts_is_a_keyword_of_the_feed(target):
    # With gRPC it would mean nothing: refused, naming the field.
    with pytest.raises(draftfeed.DraftfeedError) as e:
        draftfeed.Feed(targets=[target.address], layers=[0], nccl_across_hosts=True)
    assert e.value.code_name == "INVALID_ARGUMENT"
    assert "FeedOptions.nccl_across_hosts is set but FeedOptions.transport is grpc" in str(e.value)
    # With auto it passes the option checks; what fails next is the GPU.
    with pytest.raises(draftfeed.DraftfeedError) as e:
        draftfeed.Feed(targets=[target.address], layers=[0], transport="auto",
                       nccl_across_hosts=True)
    assert "cuda_device" in str(e.value) or "without NCCL" in str(e.value)


@pytest.mark.parametrize("keyword,value,message", [
    ("nccl_setup_timeout_s", 0.0, "FeedOptions.nccl_setup_timeout_s must be a finite number"),
    ("nccl_setup_timeout_s", float("nan"), "FeedOptions.nccl_setup_timeout_s must be a finite"),
    ("nccl_timeout_s", -1.0, "FeedOptions.nccl_timeout_s must be a finite number"),
    ("nccl_socket_ifname", "eth 0", "FeedOptions.nccl_socket_ifname='eth 0' has whitespace"),
])
def test_advanced_nccl_keywords_are_checked(target, keyword, value, message):
    with pytest.raises(draftfeed.DraftfeedError) as e:
        draftfeed.Feed(targets=[target.address], layers=[0], transport="auto",
                       **{keyword: value})
    assert e.value.code_name == "INVALID_ARGUMENT"
    assert message in str(e.value)


def test_a_cpu_target_says_it_offers_no_nccl_to_other_hosts(target):
    info = draftfeed.describe_target(target.address)
    assert info["nccl_across_hosts"] is False
    assert info["transports"] == ["grpc"]
    out = target.output()
    assert "token budget 16384 (batches up to 262144), transport grpc, loaded in" in out, out
    assert "draftfeed-target: nccl not offered: " in out, out


def run_target(*args, env=None, timeout=60):
    return subprocess.run([str(TARGET_BIN), "--listen=127.0.0.1:0", "--threads=1", *args],
                          capture_output=True, text=True, timeout=timeout,
                          env={**os.environ, **(env or {})})


@pytest.mark.parametrize("flag,message", [
    ("--nccl_setup_timeout_s=0", "--nccl_setup_timeout_s=0 must be a finite number > 0"),
    ("--nccl_setup_timeout_s=inf", "--nccl_setup_timeout_s=inf must be a finite number > 0"),
    ("--nccl_socket_ifname=eth 0", "--nccl_socket_ifname='eth 0' has whitespace"),
])
def test_nccl_flags_are_checked(flag, message):
    r = run_target(flag)
    assert r.returncode == 1, r.stderr
    assert "draftfeed-target: error: " + message in r.stderr, r.stderr
    assert "serving" not in r.stderr


def test_an_interface_other_than_the_environments_is_refused():
    r = run_target("--nccl_socket_ifname=eth0", env={"NCCL_SOCKET_IFNAME": "ib0"})
    assert r.returncode == 1, r.stderr
    assert ("--nccl_socket_ifname=eth0 but this process already has NCCL_SOCKET_IFNAME=ib0"
            in r.stderr), r.stderr


def test_the_nccl_flags_are_taken(make_target):
    # The same interface as the environment's, and a host-only target: it
    # serves (the line says why NCCL is not offered on a CPU target).
    env_before = os.environ.get("NCCL_SOCKET_IFNAME")
    os.environ["NCCL_SOCKET_IFNAME"] = "lo"
    try:
        t = make_target(extra=["--nccl_socket_ifname=lo", "--nccl_across_hosts=false",
                               "--nccl_setup_timeout_s=5"])
    finally:
        if env_before is None:
            del os.environ["NCCL_SOCKET_IFNAME"]
        else:
            os.environ["NCCL_SOCKET_IFNAME"] = env_before
    assert draftfeed.describe_target(t.address)["nccl_across_hosts"] is False
    assert t.terminate() == 0
    assert "nccl not offered: " in t.output()


def _cuda_devices():
    try:
        import torch
    except ImportError:
        return 0
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


# Two hosts on one machine: each process names its own (DRAFTFEED_HOST_ID for
# draftfeed, NCCL_HOSTID for NCCL), and NCCL is kept off NVLink and shared
# memory, so the stream takes the path it takes between hosts.
AS_HOST = {"NCCL_P2P_DISABLE": "1", "NCCL_SHM_DISABLE": "1", "NCCL_NET": "Socket",
           "NCCL_IB_DISABLE": "1", "NCCL_NVLS_ENABLE": "0", "NCCL_DEBUG": "INFO",
           "NCCL_DEBUG_SUBSYS": "INIT,NET"}

TRAINER = """
import json, sys
import numpy as np
import draftfeed
address = sys.argv[1]
batches = [(np.random.default_rng(7 + n).integers(0, 4096, size=n, dtype=np.int32), [n])
           for n in (1, 300, 2048)]
out = {}
for name, kw in (("auto", dict(transport="auto")),
                 ("auto_across", dict(transport="auto", nccl_across_hosts=True)),
                 ("nccl", dict(transport="nccl"))):
    with draftfeed.Feed(targets=[address], layers=[0, 2, -1], prefetch=2, cuda_device=1,
                        nccl_socket_ifname="lo", nccl_setup_timeout_s=60, **kw) as feed:
        results = list(feed.map(batches))
        target = feed.stats()["targets"][0]
    out[name] = dict(checksums=[r.checksum for r in results], devices=[r.device for r in results],
                     transport=target["transport"], note=target["transport_note"])
print(json.dumps(out))
"""


@pytest.mark.skipif(_cuda_devices() < 2, reason="needs two CUDA devices")
def test_two_processes_as_two_hosts_get_grpcs_bytes_over_nccls_sockets(make_target):
    import json
    import sys

    import numpy as np

    saved = {k: os.environ.get(k) for k in [*AS_HOST, "DRAFTFEED_HOST_ID", "NCCL_HOSTID"]}
    os.environ.update(AS_HOST, DRAFTFEED_HOST_ID="host-a", NCCL_HOSTID="host-a")
    try:
        t = make_target(model="small-random",
                        extra=["--device=cuda:0", "--nccl_socket_ifname=lo"])
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
    batches = [(np.random.default_rng(7 + n).integers(0, 4096, size=n, dtype=np.int32), [n])
               for n in (1, 300, 2048)]
    with draftfeed.Feed(targets=[t.address], layers=[0, 2, -1], prefetch=2) as feed:
        by_grpc = [r.checksum for r in feed.map(batches)]
    assert draftfeed.describe_target(t.address)["nccl_across_hosts"] is True
    r = subprocess.run([sys.executable, "-c", TRAINER, t.address], capture_output=True,
                       text=True, timeout=300,
                       env={**os.environ, **AS_HOST, "DRAFTFEED_HOST_ID": "host-b",
                            "NCCL_HOSTID": "host-b"})
    assert r.returncode == 0, r.stdout + r.stderr
    out = json.loads(r.stdout.strip().splitlines()[-1])
    assert out["auto"]["transport"] == "grpc"
    assert out["auto"]["note"] == ("auto chose grpc: trainer on host host-b, target on host "
                                   "host-a: NCCL across hosts needs nccl_across_hosts=True (or "
                                   "transport=nccl)")
    assert out["auto"]["checksums"] == by_grpc
    for name in ("auto_across", "nccl"):
        assert out[name]["transport"] == "nccl", out[name]
        assert out[name]["note"] == ("nccl across hosts (trainer on host host-b, target on host "
                                     "host-a)")
        assert out[name]["devices"] == [1, 1, 1]
        assert out[name]["checksums"] == by_grpc
    assert t.terminate() == 0  # NCCL's log is flushed at exit
    log = t.output()
    assert "transports grpc,nccl (nccl across hosts)" in log, log
    assert "transport nccl (nccl across hosts (trainer on host host-b" in log, log
    assert "via NET/Socket" in log, log
    assert "via P2P" not in log and "via SHM" not in log, log
