"""The target's /metrics endpoint and its log lines, against a real draftfeed-target process:
the counters scraped during and after a run must equal what the Python client received."""

import re
import shutil
import subprocess
import time
import urllib.request

import numpy as np
import pytest

import draftfeed
from conftest import TARGET_BIN, TargetProcess


def metrics_port(t):
    m = re.search(r"metrics on http port (\d+) /metrics", t.output())
    assert m, t.output()
    return int(m.group(1))


def scrape(port):
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as r:
        assert r.status == 200
        assert r.headers["Content-Type"].startswith("text/plain; version=0.0.4")
        return r.read().decode()


def samples(text):
    """{'name{labels}': value} of every sample line; checks each family has HELP and TYPE."""
    out, typed = {}, set()
    for line in text.splitlines():
        if line.startswith("# TYPE "):
            typed.add(line.split()[2])
            continue
        if line.startswith("#") or not line:
            continue
        key, value = line.rsplit(" ", 1)
        name = key.split("{")[0]
        assert any(name == f or name.startswith(f + "_") for f in typed), line
        out[key] = float(value)
    return out


def tokens(n, seed):
    return np.random.default_rng(seed).integers(0, 4096, size=n, dtype=np.int32)


@pytest.fixture
def metered():
    t = TargetProcess(extra=["--metrics_listen=127.0.0.1:0", "--metrics_per_stream",
                             "--log_every_s=0.2"])
    yield t
    t.kill()


def test_counters_match_what_the_client_received(metered):
    port = metrics_port(metered)
    before = samples(scrape(port))
    assert before["draftfeed_batches_served_total"] == 0
    assert before["draftfeed_open_streams"] == 0
    assert before["draftfeed_resident_bytes"] > 1 << 20
    info = [k for k in before if k.startswith("draftfeed_target_info{")]
    assert len(info) == 1 and 'model="tiny-random:0"' in info[0]

    lens = [[5], [1, 2, 3], [64, 65], [200], [17, 1]]
    batches = [(tokens(sum(l), i), l) for i, l in enumerate(lens)]
    with draftfeed.Feed(targets=[metered.address], layers=[1, -1], prefetch=2,
                        client_name="scraper") as feed:
        results = []
        for r in feed.map(batches[:3]):
            results.append(r)
        # The stream is open now: the gauges see it, with its client name.
        during = samples(scrape(port))
        assert during["draftfeed_open_streams"] == 1
        assert during["draftfeed_credits_granted"] == 4  # the client's credits_per_target
        per_stream = [k for k in during if k.startswith("draftfeed_stream_pending_result_bytes{")]
        assert len(per_stream) == 1 and 'client="scraper"' in per_stream[0]
        assert during["draftfeed_batches_served_total"] == 3
        results += list(feed.map(batches[3:]))
        stats = feed.stats()
    after = samples(scrape(port))
    assert stats["delivered"] == len(results) == 5
    assert after["draftfeed_batches_served_total"] == stats["delivered"]
    n_tokens = sum(map(sum, lens))
    assert after["draftfeed_tokens_served_total"] == stats["tokens_delivered"] == n_tokens
    assert after['draftfeed_payload_bytes_total{transport="grpc"}'] == stats["bytes_received"]
    assert stats["bytes_received"] == sum(r.num_tokens * r.bytes_per_token for r in results)
    assert after['draftfeed_payload_bytes_total{transport="nccl"}'] == 0
    for h in ("queue", "forward", "send"):
        assert after[f"draftfeed_{h}_seconds_count"] == 5
        assert after[f'draftfeed_{h}_seconds_bucket{{le="+Inf"}}'] == 5
    assert after["draftfeed_streams_opened_total"] == 1
    # The stream has closed (close() waits for it): the gauges are back to zero.
    deadline = time.time() + 10
    while after["draftfeed_open_streams"] != 0 and time.time() < deadline:
        time.sleep(0.05)
        after = samples(scrape(port))
    assert after["draftfeed_open_streams"] == 0
    assert after['draftfeed_streams_closed_total{code="OK"}'] == 1
    assert after["draftfeed_credits_in_use"] == 0
    assert after["draftfeed_pending_result_bytes"] == 0


def test_batch_errors_and_refusals_are_counted_and_logged(metered):
    port = metrics_port(metered)
    with draftfeed.Feed(targets=[metered.address], layers=[0]) as feed:
        feed.submit(np.array([1, 2, 3], dtype=np.int32), np.array([2], dtype=np.int32))
        with pytest.raises(draftfeed.DraftfeedError):
            feed.next()
    # A layer the model lacks: the stream is refused before its Opened.
    with pytest.raises(draftfeed.DraftfeedError):
        draftfeed.Feed(targets=[metered.address], layers=[99], connect_timeout_s=5)
    s = samples(scrape(port))
    assert s['draftfeed_batch_errors_total{code="INVALID_ARGUMENT"}'] == 1
    assert s['draftfeed_streams_refused_total{code="INVALID_ARGUMENT"}'] >= 1
    log = metered.output()
    assert re.search(r"stream refused from ipv4:127\.0\.0\.1:\d+: INVALID_ARGUMENT: .*99", log), log
    assert re.search(r"stream closed from \S+: transport grpc, layers 0, bf16: 0 batches, "
                     r"0 tokens, 0\.0 MiB in [\d.]+ s, 1 batch errors: OK", log), log


def test_stream_lines_and_the_throughput_line(metered):
    with draftfeed.Feed(targets=[metered.address], layers=[2, 3], client_name="logline") as feed:
        list(feed.map([(tokens(40, 1), [40]), (tokens(24, 2), [24])]))
    deadline = time.time() + 10
    while "stream closed" not in metered.output() and time.time() < deadline:
        time.sleep(0.05)
    log = metered.output()
    assert re.search(r"stream opened from \S+ client 'logline': layers 2,3, bf16, transport grpc",
                     log), log
    bpt = 2 * 128 * 2
    mib = 64 * bpt / (1 << 20)
    assert re.search(r"stream closed from \S+ client 'logline': transport grpc, layers 2,3, bf16: "
                     rf"2 batches, 64 tokens, {mib:.1f} MiB in [\d.]+ s, 0 batch errors: OK",
                     log), log
    # --log_every_s=0.2: the interval lines add up to what was served, once a line after the
    # stream's last batch is out.
    def interval_lines():
        return re.findall(r"last [\d.]+ s: (\d+) batches, (\d+) tokens \([\d.]+ tok/s\), "
                          r"[\d.]+ MiB sent; (\d+) streams open", metered.output())
    deadline = time.time() + 10
    while time.time() < deadline:
        lines = interval_lines()
        if len(lines) >= 2 and sum(int(b) for b, _, _ in lines) >= 2:
            break
        time.sleep(0.1)
    lines = interval_lines()
    assert len(lines) >= 2
    assert sum(int(b) for b, _, _ in lines) == 2
    assert sum(int(t) for _, t, _ in lines) == 64


def test_bad_metrics_flags_fail_start_up():
    for args, want in [
            (["--metrics_listen=nonsense"], "--metrics_listen=nonsense is not host:port"),
            (["--log_every_s=-1"], "--log_every_s=-1 must be")]:
        p = subprocess.run([str(TARGET_BIN), "--model=tiny-random", "--listen=127.0.0.1:0",
                            *args], capture_output=True, text=True, timeout=60)
        assert p.returncode == 1 and want in p.stderr, p.stderr


def test_metrics_port_in_use_fails_start_up(metered):
    port = metrics_port(metered)
    p = subprocess.run([str(TARGET_BIN), "--model=tiny-random", "--listen=127.0.0.1:0",
                        f"--metrics_listen=127.0.0.1:{port}"], capture_output=True, text=True,
                       timeout=60)
    assert p.returncode == 1 and f"--metrics_listen=127.0.0.1:{port}: cannot listen" in p.stderr


def test_promtool_passes_the_metrics_of_a_live_target(metered):
    """Prometheus's own linter on /metrics with every family holding series: served batches,
    a batch error, a refused stream and a stream open (its per-stream series)."""
    promtool = shutil.which("promtool")
    if promtool is None:
        pytest.skip("promtool is not installed (Debian: prometheus; "
                    "scripts/install-deps.sh --for-tests)")
    port = metrics_port(metered)
    with pytest.raises(draftfeed.DraftfeedError):
        draftfeed.Feed(targets=[metered.address], layers=[99], connect_timeout_s=5)
    with draftfeed.Feed(targets=[metered.address], layers=[0, -1], client_name="lint") as feed:
        list(feed.map([(tokens(30, 1), [30]), (tokens(9, 2), [4, 5])]))
        feed.submit(np.array([1, 2, 3], dtype=np.int32), np.array([2], dtype=np.int32))
        with pytest.raises(draftfeed.DraftfeedError):
            feed.next()
        text = scrape(port)
    assert 'draftfeed_batch_errors_total{code="INVALID_ARGUMENT"} 1' in text
    assert "draftfeed_stream_pending_result_bytes{" in text
    r = subprocess.run([promtool, "check", "metrics"], input=text, capture_output=True, text=True,
                       timeout=60)
    assert r.returncode == 0 and r.stdout + r.stderr == "", r.stdout + r.stderr
    # What promtool cannot see: a count that only grows is a counter, not a gauge.
    assert "# TYPE draftfeed_skipped_batches_total counter\n" in text
    assert samples(text)["draftfeed_skipped_batches_total"] == 0


def test_the_dashboard_queries_only_metrics_the_target_exports(metered):
    import json
    from conftest import REPO
    dash = json.loads((REPO / "deploy/grafana/draftfeed-dashboard.json").read_text())
    exprs = [t["expr"] for p in dash["panels"] for t in p["targets"]]
    names = {re.sub(r"_bucket$", "", n)
             for e in exprs for n in re.findall(r"\b(draftfeed_[a-z0-9_]+)", e)}
    text = scrape(metrics_port(metered))
    families = set(re.findall(r"^# TYPE (\S+) ", text, re.M))
    # GPU memory is exported by CUDA targets only (one series per GPU).
    cuda_only = {"draftfeed_gpu_memory_used_bytes", "draftfeed_gpu_memory_total_bytes"}
    assert names - cuda_only <= families, sorted(names - cuda_only - families)
    assert len(names) >= 15


def peak_rss_mib(pid):
    """The process's peak resident memory (VmHWM), MiB."""
    for line in open(f"/proc/{pid}/status"):
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    raise AssertionError("no VmHWM")


def test_a_request_body_flood_is_refused_unread(metered):
    """POST /metrics announcing 100 GB on two connections: the target answers 405 from the
    headers and closes, so what the clients push is never buffered (it was read into memory
    whole: 3 GB in 5 s)."""
    import socket
    port = metrics_port(metered)
    before = peak_rss_mib(metered.proc.pid)
    answers = []
    for _ in range(2):
        s = socket.create_connection(("127.0.0.1", port), timeout=10)
        s.sendall(b"POST /metrics HTTP/1.1\r\nHost: x\r\nContent-Length: 100000000000\r\n\r\n")
        chunk = b"\0" * (1 << 20)
        try:
            for _ in range(256):  # at most 256 MiB a connection
                s.sendall(chunk)
        except (BrokenPipeError, ConnectionResetError):
            pass  # the target closed the connection: the body goes unread
        try:
            answers.append(s.recv(4096))
        except ConnectionResetError:
            answers.append(b"")
        s.close()
    growth = peak_rss_mib(metered.proc.pid) - before
    assert growth < 64, f"peak RSS grew {growth:.0f} MiB under a body flood"
    assert all(a == b"" or a.startswith(b"HTTP/1.1 405") for a in answers), answers
    # Only GET and HEAD are served, without a body; the target scrapes on.
    import urllib.error
    req = urllib.request.Request(f"http://127.0.0.1:{port}/metrics", data=b"x", method="GET")
    with pytest.raises(urllib.error.HTTPError) as e:
        urllib.request.urlopen(req, timeout=10)
    assert e.value.code == 413
    req = urllib.request.Request(f"http://127.0.0.1:{port}/metrics", method="DELETE")
    with pytest.raises(urllib.error.HTTPError) as e:
        urllib.request.urlopen(req, timeout=10)
    assert e.value.code == 405 and e.value.headers["Allow"] == "GET, HEAD"
    assert "draftfeed_batches_served_total 0" in scrape(port)
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/healthz", timeout=10) as r:
        assert r.read() == b"ok\n"


def test_scrapes_are_answered_beside_slow_header_clients(metered):
    """Three clients that send a request's headers one byte every 0.3 s (slowloris): a scrape
    beside them is answered within 1 s (the 2 workers were all held by them: each
    recv had its own 5 s timeout), and each of them is cut at the 2 s header deadline."""
    import socket
    import threading
    port = metrics_port(metered)
    slow = [socket.create_connection(("127.0.0.1", port), timeout=10) for _ in range(3)]
    stop = threading.Event()
    closed_by_target = [False] * len(slow)

    def trickle(i, s):
        s.sendall(b"GET /metrics HTTP/1.1\r\nHost: x\r\n")
        while not stop.is_set():
            try:
                s.sendall(b"X")
            except OSError:
                closed_by_target[i] = True
                return
            stop.wait(0.3)

    threads = [threading.Thread(target=trickle, args=(i, s)) for i, s in enumerate(slow)]
    for t in threads:
        t.start()
    try:
        time.sleep(0.5)  # the slow clients hold their connections
        for _ in range(3):
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=1) as r:
                assert r.status == 200
        # The header deadline ends every slow connection (with a 400 at most).
        for s in slow:
            s.settimeout(10)
            answer = b""
            while chunk := s.recv(4096):
                answer += chunk
            assert answer == b"" or answer.startswith(b"HTTP/1.1 400"), answer
    finally:
        stop.set()
        for t in threads:
            t.join()
        for s in slow:
            s.close()


def test_metrics_token_file_guards_the_endpoint_and_beyond_loopback_needs_one(tmp_path):
    import urllib.error
    token = "m3" * 16
    path = tmp_path / "metrics-tokens"
    path.write_text(f"prometheus: {token}\n")
    path.chmod(0o600)
    t = TargetProcess(extra=["--metrics_listen=127.0.0.1:0", f"--metrics_token_file={path}"])
    try:
        port = metrics_port(t)
        for headers, why in (({}, "missing bearer token"),
                             ({"Authorization": "Bearer " + "ab" * 16}, "unknown bearer token")):
            req = urllib.request.Request(f"http://127.0.0.1:{port}/metrics", headers=headers)
            with pytest.raises(urllib.error.HTTPError) as e:
                urllib.request.urlopen(req, timeout=10)
            assert e.value.code == 401
            assert why in e.value.read().decode()
        req = urllib.request.Request(f"http://127.0.0.1:{port}/metrics",
                                     headers={"Authorization": f"Bearer {token}"})
        with urllib.request.urlopen(req, timeout=10) as r:
            assert "draftfeed_batches_served_total 0" in r.read().decode()
        assert t.terminate() == 0
        assert token not in t.output()
    finally:
        t.kill()
    # /metrics beyond loopback: plaintext HTTP, so a token or a plaintext target (--insecure).
    p = subprocess.run([str(TARGET_BIN), "--model=tiny-random", "--listen=127.0.0.1:0",
                        "--metrics_listen=0.0.0.0:0"], capture_output=True, text=True, timeout=60)
    assert p.returncode == 1
    assert ("--metrics_listen=0.0.0.0:0 is not a loopback address and /metrics is plaintext "
            "HTTP: add --metrics_token_file") in p.stderr, p.stderr
    for extra in (["--listen=0.0.0.0:0", "--insecure"], [f"--metrics_token_file={path}"]):
        t = TargetProcess(extra=["--metrics_listen=0.0.0.0:0", *extra])
        try:
            assert metrics_port(t) > 0
            assert t.terminate() == 0
        finally:
            t.kill()
