"""What a new user of draftfeed-target meets first: --help grouped by purpose and in step with
docs/target.md, a mistyped flag answered with the flag meant, a wrong --model answered with every
built-in model, and log lines that each carry the time they were written."""

import datetime
import re
import subprocess
import time

import numpy as np
import pytest

import draftfeed
from conftest import REPO, TARGET_BIN, TargetProcess

GROUPS = ["Model", "Serving", "Security", "Limits", "GPU and CPU", "Observability"]
STAMP = re.compile(r"(\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{3})Z ")


def run_target(*args, timeout=60):
    return subprocess.run([str(TARGET_BIN), "--listen=127.0.0.1:0", "--threads=1", *args],
                          capture_output=True, text=True, timeout=timeout)


def help_text():
    r = run_target("--help")
    assert r.returncode == 0, r.stderr
    return r.stdout


def help_groups(text):
    """{group title's first words: [flag, ...]} in the order --help lists them."""
    body = text.split("Flags (--name=value), by purpose:\n", 1)[1]
    groups, current = {}, None
    for line in body.splitlines():
        if line and not line.startswith(" "):
            current = line.split(" (", 1)[0].rstrip(":")
            groups[current] = []
        elif m := re.match(r"  --([a-z0-9_]+) \(default ", line):
            groups[current].append(m.group(1))
    return groups


def flag_help(text, flag):
    m = re.search(rf"^  --{flag} \(default [^\n]*\)\n((?:      [^\n]*\n)+)", text, re.M)
    assert m, flag
    return " ".join(m.group(1).split())


def test_help_groups_every_flag_by_purpose():
    groups = help_groups(help_text())
    assert list(groups) == GROUPS, list(groups)  # no "Other flags", no stale names
    every = [f for fs in groups.values() for f in fs]
    assert len(every) == len(set(every)) and len(every) >= 40, every
    where = {f: g for g, fs in groups.items() for f in fs}
    for flag, group in [("model", "Model"), ("quantize", "Model"), ("listen", "Serving"),
                        ("nccl", "Serving"), ("tls_cert", "Security"), ("insecure", "Security"),
                        ("auth_tokens_file", "Security"), ("max_batch_tokens", "Limits"),
                        ("max_sequence_tokens", "Limits"), ("max_streams", "Limits"),
                        ("devices", "GPU and CPU"), ("tp", "GPU and CPU"),
                        ("fp8_experts", "GPU and CPU"), ("metrics_listen", "Observability"),
                        ("log_every_s", "Observability")]:
        assert where[flag] == group, (flag, where.get(flag))
    # docs/target.md's flag tables document the same flags.
    doc = (REPO / "docs" / "target.md").read_text()
    table = set(re.findall(r"^\| `--([a-z0-9_]+)`(?:, `--([a-z0-9_]+)`)? \|", doc, re.M))
    documented = {f for pair in table for f in pair if f}
    assert set(every) - documented == set(), sorted(set(every) - documented)


def test_fp8_experts_help_says_what_the_measurements_say():
    """docs/performance.md: the 35B-A3B-FP8 shape's tokens/s with FP8 experts and with
    --fp8_experts bf16 (bench/results); the help quotes both and must not say bf16 is the
    faster."""
    readme = (REPO / "docs" / "performance.md").read_text()
    m = re.search(r"\*\*([\d,]+) tokens/s\*\* \(FP8 experts[^|]*?; ([\d,]+) with `--fp8_experts "
                  r"bf16`", readme)
    assert m, "docs/performance.md's FP8 MoE engine row"
    fp8, bf16 = (int(x.replace(",", "")) for x in m.groups())
    assert fp8 > bf16
    text = flag_help(help_text(), "fp8_experts")
    assert "faster on the H200 today" not in text and "bf16: twice the expert memory, faster" \
        not in text, text
    assert m.group(1) in text and m.group(2) in text, text
    assert "fp8: the FP8 engine's maths, half the expert memory, and the faster" in text, text


@pytest.mark.parametrize("arg,message", [
    ("--max_batch_token=5", "unknown flag --max_batch_token; did you mean --max_batch_tokens?"),
    ("--max-batch-tokens=5", "unknown flag --max-batch-tokens; did you mean --max_batch_tokens? "
                             "(flag names are written with '_')"),
    ("--modle=tiny-random", "unknown flag --modle; did you mean --model?"),
    ("--tls_certs=x.pem", "unknown flag --tls_certs; did you mean --tls_cert?"),
    ("--nocheck_weight", "unknown flag --nocheck_weight; did you mean --nocheck_weights?"),
    ("--frobnicate_everything", "unknown flag --frobnicate_everything; draftfeed-target --help "
                                "lists the flags"),
])
def test_a_mistyped_flag_names_the_nearest_flag(arg, message):
    r = run_target("--model=tiny-random", arg)
    assert r.returncode == 1, r.stderr
    assert r.stderr.count("\n") == 1, r.stderr  # this line only: nothing loaded, nothing served
    assert r.stderr.endswith(f" draftfeed-target: error: {message}\n"), r.stderr


def test_flag_forms_absl_accepts_are_not_mistakes():
    """--name value, -name=value, --noBOOL and --undefok=NAME all parse as absl parses them, and
    the target starts serving."""
    t = TargetProcess(extra=["--model", "tiny-random-qwen3", "-listen=127.0.0.1:0",
                             "--nocheck_weights", "--threads", "1", "--undefok=some_old_flag",
                             "--some_old_flag=3"])
    try:
        assert "serving tiny-random-qwen3:0" in t.output(), t.output()
        assert t.terminate() == 0
    finally:
        t.kill()


def test_a_wrong_model_path_lists_every_built_in_model():
    text = help_text()
    models = text.split("Models (--model):\n", 1)[1].split("\n\n", 1)[0]
    builtins = re.findall(r"^  (\S+\[:SEED\])", models, re.M)
    assert "tiny-random[:SEED]" in builtins and "random:qwen3-8b[:SEED]" in builtins, builtins
    r = run_target("--model=/nonexistent/Qwen3.6-27B")
    assert r.returncode == 1
    listed = r.stderr.split("not a built-in model (", 1)[1].rsplit(")", 1)[0].split(", ")
    assert listed == builtins, (listed, builtins)


def stamp_time(line):
    m = STAMP.match(line)
    assert m, f"no ISO-8601 UTC time first: {line!r}"
    return datetime.datetime.fromisoformat(m.group(1)).replace(tzinfo=datetime.timezone.utc)


def now_to_the_millisecond():
    t = datetime.datetime.now(datetime.timezone.utc)
    return t.replace(microsecond=t.microsecond // 1000 * 1000)


def test_every_log_line_of_a_run_carries_its_time():
    """Start-up, the stream lines, a refusal, the throughput line, SIGTERM and the closing line:
    each line starts with the UTC time it was written, in the order written."""
    before = now_to_the_millisecond()
    t = TargetProcess(extra=["--log_every_s=0.2"])
    try:
        rng = np.random.default_rng(0)
        batches = [(rng.integers(0, 4096, size=40, dtype=np.int32), [40]) for _ in range(3)]
        with draftfeed.Feed(targets=[t.address], layers=[0, -1], client_name="stamps") as feed:
            list(feed.map(batches))
        with pytest.raises(draftfeed.DraftfeedError):
            draftfeed.Feed(targets=[t.address], layers=[99], connect_timeout_s=5)
        deadline = datetime.datetime.now() + datetime.timedelta(seconds=10)
        while "last " not in t.output() and datetime.datetime.now() < deadline:
            time.sleep(0.05)
        assert t.terminate() == 0
        after = now_to_the_millisecond()
        lines = t.output().splitlines()
    finally:
        t.kill()
    for want in ("serving tiny-random:0", "stream opened from", "stream closed from",
                 "stream refused from", "draftfeed-target: last ", "SIGTERM received",
                 "stopped after 3 batches"):
        assert any(want in line for line in lines), (want, lines)
    times = [stamp_time(line) for line in lines]
    assert times == sorted(times), lines
    assert before <= times[0] and times[-1] <= after, (before, lines, after)


def test_a_start_up_error_carries_its_time():
    before = now_to_the_millisecond()
    r = run_target("--max_queued_batches=0")
    after = now_to_the_millisecond()
    assert r.returncode == 1
    (line,) = r.stderr.splitlines()
    assert before <= stamp_time(line) <= after, line
    assert line[STAMP.match(line).end():].startswith("draftfeed-target: error: "), line
