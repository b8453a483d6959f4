"""Target flags that make a target refuse batches over n tokens.

A target that runs long batches in chunks (--max_sequence_tokens, default 262,144) takes
batches over --max_batch_tokens; tests that need a refusal cap both. A target binary from
before chunked prefill has no --max_sequence_tokens flag (and refuses unknown flags), so it is
passed only where the binary lists it."""

import functools
import subprocess

from conftest import TARGET_BIN


@functools.lru_cache(maxsize=None)
def _chunks() -> bool:
    out = subprocess.run([str(TARGET_BIN), "--helpfull"], capture_output=True, text=True,
                         timeout=60)
    return "max_sequence_tokens" in out.stdout + out.stderr


def refuse_over(n: int) -> tuple:
    return (f"--max_batch_tokens={n}",) + ((f"--max_sequence_tokens={n}",) if _chunks() else ())


# The refusal's words, before and after chunked prefill.
OVER = r"over (the token budget of|this target's --max_batch_tokens of)"
