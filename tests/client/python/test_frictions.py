"""What a new user meets first: the target's command line, unreachable and mismatched
targets, describe_target, leaving a loop early, and a module built for another Python."""

import os
import pathlib
import re
import shutil
import socket
import subprocess
import sys
import tempfile

import numpy as np
import pytest

import draftfeed

from conftest import REPO, TARGET_BIN, TargetProcess


def run_target(*args, timeout=60):
    return subprocess.run([str(TARGET_BIN), *args], capture_output=True, text=True,
                          timeout=timeout)


def builtin_specs():
    """The built-in specs as the target's own table lists them (its error for a bad one)."""
    r = run_target("--model=tiny-random:x", "--device=cpu", "--listen=127.0.0.1:0")
    assert r.returncode == 1
    listed = r.stderr.split("built-in specs are ", 1)[1].split(" (", 1)[0]
    specs = [s.strip() for s in listed.split(",")]
    assert "tiny-random[:SEED]" in specs and len(specs) >= 10
    return specs


def test_help_and_version_exit_zero_and_list_every_model():
    r = run_target("--help")
    assert r.returncode == 0, r.stderr
    text = r.stdout
    for spec in builtin_specs():
        assert spec in text, spec
    for flag in ("--model", "--listen", "--port_file", "--max_credits"):
        assert f"  {flag} (default" in text, flag
    # absl's header names the build machine's source path; this help does not.
    assert "Flags from" not in text and "main.cc" not in text and str(REPO) not in text
    v = run_target("--version")
    assert v.returncode == 0, v.stderr
    assert re.fullmatch(r"draftfeed-target \d+\.\d+\.\d+", v.stdout.strip()), v.stdout


def test_unwritable_port_file_fails_start_up_naming_it():
    path = "/nonexistent-dir/port"
    r = run_target("--model=tiny-random", "--device=cpu", "--listen=127.0.0.1:0",
                   f"--port_file={path}")
    assert r.returncode == 1
    assert f"--port_file={path}" in r.stderr and "No such file or directory" in r.stderr
    assert "serving" not in r.stderr  # refused before the model loaded and the port opened


@pytest.mark.parametrize("listen,why", [
    ("1.2.3.4.5:99", "does not resolve"),
    ("127.0.0.1:99999", "not a number in 0..65535"),
    ("127.0.0.1", "expected host:port"),
    ("::1:5000", "needs brackets"),
])
def test_bad_listen_is_one_clear_error(listen, why):
    r = run_target("--device=cpu", f"--listen={listen}")
    assert r.returncode == 1
    assert r.stderr.count("\n") == 1, r.stderr  # one line, no gRPC log before it
    assert f"--listen={listen}" in r.stderr and why in r.stderr, r.stderr


def test_a_port_in_use_is_refused_even_by_another_target():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        r = run_target("--device=cpu", f"--listen=127.0.0.1:{port}")
    assert r.returncode == 1 and "already in use" in r.stderr and "chttp2" not in r.stderr
    # gRPC's SO_REUSEPORT would have let a second target share a serving one's port.
    first = TargetProcess()
    try:
        r = run_target("--device=cpu", f"--listen={first.address}")
        assert r.returncode == 1 and "already in use" in r.stderr, r.stderr
    finally:
        first.kill()


def test_unreachable_target_says_why_and_where():
    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        addr = f"127.0.0.1:{s.getsockname()[1]}"
    # connect_timeout_s is long: the refusal itself ends the wait, not the deadline.
    with pytest.raises(draftfeed.DraftfeedError) as e:
        draftfeed.Feed(targets=[addr], layers=[0], connect_timeout_s=600)
    assert e.value.code_name == "UNAVAILABLE"
    assert "connection refused" in str(e.value) and addr in str(e.value)
    with pytest.raises(draftfeed.DraftfeedError) as e:
        draftfeed.describe_target("no-such-host.invalid:50051", timeout_s=600)
    assert "name not resolved" in str(e.value) and "no-such-host.invalid:50051" in str(e.value)
    with pytest.raises(draftfeed.DraftfeedError) as e:
        draftfeed.Feed(targets=["dns:///no-such-host.invalid:50051"], layers=[0])
    assert "name not resolved" in str(e.value) and "dns:///no-such-host.invalid" in str(e.value)


def test_describe_target_returns_every_target_info_field(target):
    proto = (REPO / "proto/draftfeed/v1/draftfeed.proto").read_text()
    body = re.search(r"message TargetInfo \{(.*?)\n\}", proto, re.S).group(1)
    fields = re.findall(r"^\s*(?:repeated\s+)?\w+\s+(\w+)\s*=\s*\d+;", body, re.M)
    assert "max_capture_layers" in fields and len(fields) >= 15
    d = draftfeed.describe_target(target.address)
    assert set(fields) <= set(d), set(fields) - set(d)
    assert d["dtype"] == "bf16" and "bf16" in d["encodings"] and "grpc" in d["transports"]
    assert d["max_credits"] == 32  # the target's --max_credits default
    assert d["max_capture_layers"] == 0  # the CPU engine has no limit
    assert d["num_layers"] == 4 and d["hidden_size"] == 128


def tokens(n, seed):
    return np.random.default_rng(seed).integers(0, 4096, size=n, dtype=np.int32)


def test_leaving_a_loop_early_cancels_what_is_in_flight(make_target):
    # 400 tokens at 1,000 tokens/s: 0.4 s a batch; 8 in flight would take 3.2 s.
    t = make_target(extra=["--throttle_tokens_per_s=1000"])
    batches = [(tokens(400, i), [400]) for i in range(8)]
    with draftfeed.Feed(targets=[t.address], layers=[0, -1], prefetch=8,
                        credits_per_target=8) as feed:
        for r in feed.map(batches):
            first = r
            break
        s = feed.stats()
        assert s["cancelled"] == 7 and s["outstanding"] == 0 and s["delivered"] == 1
        assert s["targets"][0]["failures"] == 0 and s["duplicates_dropped"] == 0
        # The feed goes on: the same batch again, bit for bit.
        again = next(iter(feed.map(batches[:1])))
        assert np.array_equal(again.hidden_bits, first.hidden_bits)
    assert t.terminate() == 0
    m = re.search(r"stopped after (\d+) batches, \d+ tokens \((\d+) batches skipped",
                  t.output())
    ran = int(m.group(1)) - int(m.group(2))
    # The first, the one running when the loop left, perhaps the next one the
    # scheduler had taken, and the one sent again; the others were skipped.
    assert 2 <= ran <= 4 and int(m.group(2)) >= 5, t.output()


def test_module_built_for_another_python_says_so():
    pkg = pathlib.Path(draftfeed.__file__).resolve().parent
    built = sorted(pkg.glob("_draftfeed*.so"))
    assert built, pkg
    tmp = pathlib.Path(tempfile.mkdtemp(prefix="draftfeed-abi-"))
    try:
        shutil.copytree(pkg, tmp / "draftfeed",
                        ignore=shutil.ignore_patterns("_draftfeed*", "__pycache__"))
        # The same module as another interpreter's build would be named.
        shutil.copy2(built[0], tmp / "draftfeed" / "_draftfeed.cpython-39-x86_64-linux-gnu.so")
        env = dict(os.environ, PYTHONPATH=str(tmp))
        env.pop("DRAFTFEED_TRANSPORT", None)
        # The import goes on with the pure-Python client (grpcio), warning once with the
        # reason; as an error (-W error) the warning is what the import fails with.
        r = subprocess.run([sys.executable, "-W", "error::RuntimeWarning", "-c",
                            "import draftfeed"], capture_output=True, text=True, env=env, cwd=tmp)
        fell_back = subprocess.run(
            [sys.executable, "-c", "import draftfeed; print(draftfeed._client.native is None)"],
            capture_output=True, text=True, env=env, cwd=tmp)
    finally:
        shutil.rmtree(tmp)
    assert r.returncode != 0
    here = f"{sys.version_info.major}.{sys.version_info.minor}"
    assert "built for another Python" in r.stderr and "CPython 3.9" in r.stderr, r.stderr
    assert f"Python {here}" in r.stderr and "circular import" not in r.stderr
    assert fell_back.returncode == 0 and fell_back.stdout.split() == ["True"], fell_back.stderr
    assert "built for another Python" in fell_back.stderr and "grpcio" in fell_back.stderr
