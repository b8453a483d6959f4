"""Target flags that make a target refuse batches over n tokens.

A target runs batches over --max_batch_tokens in chunks up to --max_sequence_tokens (default
262,144); tests that need a refusal cap both."""


def refuse_over(n: int) -> tuple:
    return (f"--max_batch_tokens={n}", f"--max_sequence_tokens={n}")


# The refusal's words.
OVER = r"over this target's --max_batch_tokens of"
