"""draftfeed-bench --help lists its flags and exits 0 (absl's own --help matched none of them, it
looks for a file named as the program, and exited 1). draftfeed-bench is built where CUDA
compiles; elsewhere this skips."""

import os
import pathlib
import re
import subprocess

import pytest

REPO = pathlib.Path(__file__).resolve().parents[2]
BUILD = pathlib.Path(os.environ.get("DRAFTFEED_BUILD_DIR", REPO / "build"))
BENCH = BUILD / "bin" / "draftfeed-bench"


@pytest.mark.skipif(not BENCH.exists(), reason=f"no {BENCH} (built with CUDA only)")
def test_bench_help_lists_every_subcommands_flags():
    r = subprocess.run([str(BENCH), "--help"], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stdout + r.stderr
    assert r.stdout.startswith("draftfeed-bench engine|"), r.stdout
    assert "No flags matched" not in r.stdout
    flags = set(re.findall(r"^  --([a-z0-9_]+) \(default ", r.stdout, re.M))
    # engine, long, write-random and load flags (draftfeed_bench.cc, load_bench.cc).
    assert {"model", "tokens", "iters", "device", "sequence_tokens", "out", "repeats"} <= flags, \
        sorted(flags)
    assert "flagfile" not in flags  # absl's own stay out
    v = subprocess.run([str(BENCH), "--version"], capture_output=True, text=True, timeout=60)
    assert v.returncode == 0 and re.fullmatch(r"draftfeed-bench \d+\.\d+\.\d+\n", v.stdout)
