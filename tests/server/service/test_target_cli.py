"""draftfeed-target refuses what it cannot serve at start-up, naming the cause:
nonsensical flag values, checkpoints that are not regular files or whose tensors
do not tile their data section, and (unless --check_weights=false) non-finite weights."""

import json
import os
import shutil
import struct
import subprocess

import pytest

from conftest import REPO, TARGET_BIN, TargetProcess

QWEN3 = REPO / "tests" / "data" / "models" / "qwen3"


def run_target(*args, timeout=60):
    """Runs the target expecting it to exit by itself (it must not start serving)."""
    return subprocess.run([str(TARGET_BIN), "--listen=127.0.0.1:0", "--threads=1", *args],
                          capture_output=True, text=True, timeout=timeout)


@pytest.mark.parametrize("flag,message", [
    ("--max_queued_batches=0",
     "--max_queued_batches=0 must be >= 1 (the scheduler queue across all streams; 0 would fail "
     "every batch)"),
    ("--max_queued_batches=-3", "--max_queued_batches=-3 must be >= 1"),
    ("--max_credits=-1", "--max_credits=-1 must be >= 1"),
    ("--default_credits=0", "--default_credits=0 must be in [1, --max_credits=32]"),
    ("--default_credits=40", "--default_credits=40 must be in [1, --max_credits=32]"),
    ("--chunk_bytes=0", "--chunk_bytes=0 must be in [1, 1073741824] (a chunk is one gRPC message)"),
    ("--chunk_bytes=4294967296", "--chunk_bytes=4294967296 must be in [1, 1073741824]"),
    ("--max_batch_tokens=0", "--max_batch_tokens=0 must be >= 1"),
    ("--max_capture_layers=0", "--max_capture_layers=0 must be >= 1"),
    ("--threads=-2", "--threads=-2 must be >= 0 (0 = all cores)"),
    ("--load_threads=-1", "--load_threads=-1 must be >= 0 (0 = min(8, cores))"),
    ("--drain_timeout_s=-1", "--drain_timeout_s=-1 must be >= 0"),
    ("--throttle_tokens_per_s=-5", "--throttle_tokens_per_s=-5 must be >= 0 (0 = off)"),
    ("--throttle_tokens_per_s=nan", "--throttle_tokens_per_s=nan must be >= 0"),
    ("--host_memory_cap_gib=-1", "--host_memory_cap_gib=-1 must be in [0, 1048576] (0 = no cap)"),
    ("--host_memory_cap_gib=inf", "--host_memory_cap_gib=inf must be in [0, 1048576]"),
    ("--nccl_timeout_s=0", "--nccl_timeout_s=0 must be a finite number > 0"),
    ("--nccl_timeout_s=nan", "--nccl_timeout_s=nan must be a finite number > 0"),
    # Time flags overflowed a clock's nanoseconds (1e10 s never finished start-up; 1e300
    # served nothing and ignored SIGTERM) or made sleeps of hours.
    ("--stream_idle_timeout_s=1e10",
     "--stream_idle_timeout_s=1e+10 must be in [0, 604800] seconds (7 days at most)"),
    ("--stream_idle_timeout_s=1e300", "--stream_idle_timeout_s=1e+300 must be in [0, 604800]"),
    ("--log_every_s=1e10", "--log_every_s=1e+10 must be in [0, 604800] seconds"),
    ("--nccl_setup_timeout_s=1e12", "--nccl_setup_timeout_s=1e+12 must be in [0, 604800]"),
    ("--drain_timeout_s=700000", "--drain_timeout_s=700000 must be in [0, 604800]"),
    ("--open_timeout_s=-1", "--open_timeout_s=-1 must be in [0, 604800] seconds"),
    ("--throttle_tokens_per_s=0.01",
     "--throttle_tokens_per_s=0.01 must be 0 (off) or a finite number >= 1 token/s"),
    ("--max_streams_per_client=65",
     "--max_streams_per_client=65 must be in [0, --max_streams=64] (0 = half of --max_streams)"),
])
def test_nonsensical_flags_are_refused(flag, message):
    r = run_target(flag)
    assert r.returncode == 1, r.stderr
    assert "draftfeed-target: error: " + message in r.stderr, r.stderr
    assert "serving" not in r.stderr


def copy_checkpoint(tmp_path):
    d = tmp_path / "ckpt"
    shutil.copytree(QWEN3, d)
    return d


def tensor_entries(path):
    data = path.read_bytes()
    n = struct.unpack("<Q", data[:8])[0]
    header = json.loads(data[8:8 + n])
    header.pop("__metadata__", None)
    return 8 + n, header


def test_fifo_checkpoint_is_refused_without_hanging(tmp_path):
    d = copy_checkpoint(tmp_path)
    st = d / "model.safetensors"
    st.unlink()
    os.mkfifo(st)
    r = run_target(f"--model={d}", timeout=30)  # before: blocked in open() until the timeout
    assert r.returncode == 1, r.stderr
    assert f"safetensors file {st}: not a regular file (a FIFO)" in r.stderr, r.stderr


def test_header_length_cut_into_its_padding_is_refused(tmp_path):
    # The checkpoint's header ends in spaces (padding to 8 bytes): cutting the
    # length into them still parses, and every tensor would read 7 bytes early.
    d = copy_checkpoint(tmp_path)
    st = d / "model.safetensors"
    data = bytearray(st.read_bytes())
    n = struct.unpack("<Q", data[:8])[0]
    pad = len(data[8:8 + n]) - len(data[8:8 + n].rstrip(b" "))
    assert pad > 0, "the test checkpoint's header has no padding to cut into"
    data[:8] = struct.pack("<Q", n - pad)
    st.write_bytes(bytes(data))
    r = run_target(f"--model={d}")
    assert r.returncode == 1, r.stderr
    assert f"safetensors file {st}: the data section is" in r.stderr, r.stderr
    assert f"{pad} trailing bytes belong to no tensor" in r.stderr, r.stderr


DATA_MODELS = REPO / "tests" / "data" / "models"


@pytest.mark.parametrize("model,tensor,element,bytes_,named", [
    # bf16 NaN in a dense weight and in a MoE router; an e4m3 NaN code in an expert; FP8
    # scales that are not finite, and 3e38 (finite, but 448 x 3e38 overflows: the check
    # passed it before).
    ("qwen3", "model.layers.1.mlp.down_proj.weight", 5, struct.pack("<H", 0x7FC0),
     "tensor layers.1.mlp.down_proj.weight (BF16 [64, 128]) holds NaN at element 5 "
     "(index [0, 5])"),
    ("qwen3_moe", "model.layers.2.mlp.gate.weight", 65, struct.pack("<H", 0xFF80),
     "tensor layers.2.mlp.gate.weight (BF16 [8, 64]) holds -Inf at element 65 (index [1, 1])"),
    ("qwen35_moe_fp8", "model.language_model.layers.1.mlp.experts.1.down_proj.weight", 130,
     b"\x7f", "tensor layers.1.mlp.experts.down_proj (F8_E4M3 [8, 128, 128]) holds NaN at "
     "element 16514 (index [1, 1, 2])"),
    ("qwen3_fp8", "model.layers.1.self_attn.o_proj.weight_scale_inv", 1, struct.pack("<f", 3e38),
     "tensor layers.1.self_attn.o_proj.weight_scale_inv (F32 [1, 2]) holds 3e+38 at element 1 "
     "(index [0, 1]); an FP8 block scale must be finite, > 0 and <= 4.11758e+16"),
    ("qwen35_moe_fp8", "model.language_model.layers.1.self_attn.o_proj.weight_scale_inv", 0,
     struct.pack("<H", 0x7FC0),
     "tensor layers.1.self_attn.o_proj.weight_scale_inv (BF16 [1, 2]) holds nan at element 0"),
])
def test_corrupt_weights_are_refused_by_default(tmp_path, model, tensor, element, bytes_, named):
    """On by default (they used to load and serve NaN states with OK): the error names the
    tensor, the element and the fix; --check_weights=false serves the checkpoint anyway."""
    d = tmp_path / "ckpt"
    shutil.copytree(DATA_MODELS / model, d)
    st = d / "model.safetensors"
    start, entries = tensor_entries(st)
    data = bytearray(st.read_bytes())
    at = start + entries[tensor]["data_offsets"][0] + len(bytes_) * element
    data[at:at + len(bytes_)] = bytes_
    st.write_bytes(bytes(data))

    r = run_target(f"--model={d}")
    assert r.returncode == 1, r.stderr
    assert f"draftfeed-target: error: {d}: {named}" in r.stderr, r.stderr
    assert ("the checkpoint is corrupt: download or convert it again (--check_weights=false "
            "starts without this check") in r.stderr, r.stderr
    port_file = tmp_path / "port"
    p = subprocess.Popen([str(TARGET_BIN), f"--model={d}", "--listen=127.0.0.1:0", "--threads=1",
                          f"--port_file={port_file}", "--check_weights=false"],
                         stderr=subprocess.PIPE, text=True)
    try:
        # The start-up line ("serving ...") comes after whatever the engines report first.
        lines = []
        while not lines or ("serving" not in lines[-1] and lines[-1]):
            lines.append(p.stderr.readline())
        assert "serving" in lines[-1], lines
        assert not any("checked" in line for line in lines), lines
    finally:
        p.kill()
        p.wait()


def test_a_clean_checkpoint_is_checked_in_one_timed_line():
    t = TargetProcess(model=str(QWEN3), extra=["--nocheck_weights", "--check_weights"])
    try:
        import re
        assert re.search(r"draftfeed-target: checked 46 weight tensors \([\d.]+ MiB\) for NaN, "
                         r"Inf and bad FP8 scales in [\d.]+s on \d+ threads "
                         r"\(--check_weights=false skips it\)", t.output()), t.output()
        assert "serving" in t.output()
        assert t.terminate() == 0
    finally:
        t.kill()


def blocks_sighup(pid):
    """Whether the process's main thread blocks SIGHUP (SigBlk in /proc): main has begun."""
    import signal
    try:
        for line in open(f"/proc/{pid}/status"):
            if line.startswith("SigBlk:"):
                return int(line.split()[1], 16) & (1 << (signal.SIGHUP - 1)) != 0
    except FileNotFoundError:
        pass
    return False


def start_loading(tmp_path):
    """A target making and checking small-random-moe (about 1.5 s of loading here), once its
    main thread has blocked SIGHUP; its log file and port file."""
    import time
    log = open(tmp_path / "log", "w+")
    port_file = tmp_path / "port"
    p = subprocess.Popen([str(TARGET_BIN), "--model=small-random-moe", "--listen=127.0.0.1:0",
                          f"--port_file={port_file}", "--threads=1", "--check_weights"],
                         stdout=log, stderr=subprocess.STDOUT)
    deadline = time.time() + 30
    while not blocks_sighup(p.pid):
        assert p.poll() is None and time.time() < deadline
        time.sleep(0.001)
    return p, log, port_file


def read_log(log):
    log.flush()
    log.seek(0)
    return log.read()


def test_sighup_while_loading_never_kills_and_sigterm_exits_cleanly(tmp_path):
    """gRPC's threads started before the signals were blocked: a SIGHUP or SIGTERM during the
    model load went to one of them and killed the target by the default action. Now SIGHUP
    is logged and the target serves; SIGTERM while loading exits 0, saying so."""
    import signal
    import time
    p, log, port_file = start_loading(tmp_path)
    try:
        for _ in range(3):
            p.send_signal(signal.SIGHUP)
            time.sleep(0.05)
        deadline = time.time() + 60
        while not port_file.exists():
            assert p.poll() is None, read_log(log)
            assert time.time() < deadline
            time.sleep(0.05)
        assert "SIGHUP: nothing to re-read" in read_log(log)
        p.send_signal(signal.SIGHUP)  # serving: the same
        p.send_signal(signal.SIGTERM)
        assert p.wait(60) == 0, read_log(log)
        assert "stopped after 0 batches" in read_log(log)
    finally:
        p.kill()
    (tmp_path / "second").mkdir()
    p, log, port_file = start_loading(tmp_path / "second")
    try:
        p.send_signal(signal.SIGTERM)
        assert p.wait(30) == 0, read_log(log)
        assert "SIGTERM received while loading: exiting, nothing was served" in read_log(log)
        assert not port_file.exists()
    finally:
        p.kill()


def test_a_second_sigterm_during_the_drain_exits_at_once(tmp_path):
    """The drain waits for accepted batches (here one of 30 tokens at 1 token/s); a second
    SIGTERM is the documented fast exit: status 1, logging what it abandons. It used to be
    ignored until the drain ended."""
    import re
    import signal
    import time
    import numpy as np
    import draftfeed
    t = TargetProcess(extra=["--throttle_tokens_per_s=1"])
    try:
        feed = draftfeed.Feed(targets=[t.address], layers=[-1], connect_timeout_s=10)
        feed.submit(np.arange(30, dtype=np.int32), [30])
        deadline = time.time() + 10
        while "stream opened" not in t.output():
            assert time.time() < deadline
            time.sleep(0.05)
        time.sleep(0.3)  # the batch is running
        t.proc.send_signal(signal.SIGTERM)
        while "SIGTERM received, finishing accepted batches" not in t.output():
            assert time.time() < deadline
            time.sleep(0.05)
        t.proc.send_signal(signal.SIGTERM)
        assert t.proc.wait(10) == 1
        assert re.search(r"second SIGTERM during the drain: exiting now, abandoning 1 open "
                         r"streams and \d+ queued batches", t.output()), t.output()
        try:
            feed.close()
        except draftfeed.DraftfeedError:
            pass
    finally:
        t.kill()


def test_sighup_storms_in_every_phase_kill_nothing_and_lose_nothing(tmp_path):
    """Issue 30's bound, 0 deaths under signals in every phase: 200 SIGHUPs while the model
    loads, 200 while serving a client (each re-reading the token file) and 200 while
    draining. The target serves on, drains its accepted batch to the client and exits 0."""
    import signal
    import time
    import numpy as np
    import draftfeed
    token = "storm-token-0123456789abcdef"
    tokens = tmp_path / "tokens"
    tokens.write_text(f"trainer: {token}\n")
    tokens.chmod(0o600)
    log = open(tmp_path / "log", "w+")
    port_file = tmp_path / "port"
    # small-random-moe loads in about 1.5 s here; 30 tokens/s keeps a batch draining.
    p = subprocess.Popen([str(TARGET_BIN), "--model=small-random-moe", "--listen=127.0.0.1:0",
                          f"--port_file={port_file}", "--threads=1",
                          f"--auth_tokens_file={tokens}", "--throttle_tokens_per_s=30"],
                         stdout=log, stderr=subprocess.STDOUT)

    def storm():
        for _ in range(200):
            p.send_signal(signal.SIGHUP)
        time.sleep(0.2)
        assert p.poll() is None, read_log(log)

    try:
        deadline = time.time() + 30
        while not blocks_sighup(p.pid):
            assert p.poll() is None and time.time() < deadline
            time.sleep(0.001)
        storm()
        assert not port_file.exists(), "the model loaded before the storm ended"
        while not port_file.exists():
            assert p.poll() is None, read_log(log)
            assert time.time() < deadline + 60
            time.sleep(0.05)
        address = f"127.0.0.1:{int(port_file.read_text())}"
        feed = draftfeed.Feed(targets=[address], layers=[-1], token=token)
        batch = np.arange(15, dtype=np.int32)
        feed.submit(batch, [15])
        storm()  # serving, a batch running
        first = feed.next()
        assert np.array_equal(first.token_ids, batch)
        feed.submit(batch, [15])
        deadline = time.time() + 30
        while "stream opened" not in read_log(log) or feed.stats()["outstanding"] == 0:
            assert time.time() < deadline
            time.sleep(0.05)
        time.sleep(0.1)  # the second batch runs (0.5 s at 30 tokens/s)
        p.send_signal(signal.SIGTERM)
        while "SIGTERM received, finishing accepted batches" not in read_log(log):
            assert time.time() < deadline, read_log(log)
            time.sleep(0.01)
        storm()  # draining
        second = feed.next()  # the accepted batch is still delivered
        assert np.array_equal(second.hidden_bits, first.hidden_bits)
        assert p.wait(60) == 0, read_log(log)
        out = read_log(log)
        assert "SIGHUP: 1 bearer tokens from" in out
        assert "stopped after 2 batches" in out, out
        try:
            feed.close()
        except draftfeed.DraftfeedError:
            pass
    finally:
        p.kill()
        p.wait()
