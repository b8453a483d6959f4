"""The layer ids that drafter recipes capture, in draftfeed's convention.

draftfeed's id i is the raw output of decoder layer i (transformers'
`hidden_states[i + 1]`), -1 the post-final-norm state (`hidden_states[L]`),
for a target of L decoder layers (`describe_target(addr)["num_layers"]`):

    feed = draftfeed.Feed(targets, layers=draftfeed.layers.dflash(64))  # [1, 16, 31, 46, 61]
    feed = draftfeed.Feed(targets, layers=draftfeed.layers.eagle3(64))  # [1, 31, 60, -1]
"""

from __future__ import annotations

from typing import List

__all__ = ["dflash", "eagle3"]


def _check_layers(num_layers: int, least: int, recipe: str) -> int:
    if isinstance(num_layers, bool) or not isinstance(num_layers, int):
        raise TypeError(f"{recipe}: num_layers must be an int, got {num_layers!r}")
    if num_layers < least:
        raise ValueError(f"{recipe}: num_layers={num_layers} is too few; the recipe needs at "
                         f"least {least} decoder layers to pick distinct ones")
    return num_layers


def dflash(num_layers: int, k: int = 5) -> List[int]:
    """DFlash's target layers: k ids evenly spaced from layer 1 to layer L-3.

    DFlash (z-lab/dflash, `build_target_layer_ids`) takes
    `int(round(1 + i * (L - 4) / (k - 1)))` for i = 0..k-1 (Python's round,
    halves to even), and reads `hidden_states[id + 1]` for each, which is
    draftfeed's id itself; k = 1 takes the middle layer, L // 2. The 64-layer
    Qwen3.6-27B gives [1, 16, 31, 46, 61]. The drafter's fc takes the k
    states concatenated: `Result.torch().view(T, k * H)`.
    """
    if isinstance(k, bool) or not isinstance(k, int) or k < 1:
        raise ValueError(f"dflash: k={k!r} must be an int >= 1 (the drafter's context layers)")
    num_layers = _check_layers(num_layers, 4, "dflash")
    if k == 1:
        return [num_layers // 2]
    start, end = 1, num_layers - 3
    ids = [int(round(start + i * (end - start) / (k - 1))) for i in range(k)]
    if len(set(ids)) != k:
        raise ValueError(f"dflash: k={k} layers do not fit between layer 1 and layer "
                         f"{end} of a {num_layers}-layer target without repeats ({ids})")
    return ids


def eagle3(num_layers: int) -> List[int]:
    """EAGLE-3's low, middle and high features plus the final state.

    EAGLE-3 (SafeAILab/EAGLE; SGLang's and SpecForge's EAGLE-3 paths the same)
    keeps the hidden state entering decoder layers 2, L // 2 and L - 3, i.e.
    the outputs of layers 1, L // 2 - 1 and L - 4 (transformers'
    `hidden_states[2]`, `[L // 2]`, `[L - 3]`), fused by its fc, and trains
    against the target's own next-token distribution from the post-final-norm
    state (id -1). The 64-layer Qwen3.6-27B gives [1, 31, 60, -1].
    """
    num_layers = _check_layers(num_layers, 7, "eagle3")
    return [1, num_layers // 2 - 1, num_layers - 4, -1]
