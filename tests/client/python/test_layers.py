"""draftfeed.layers: the recipes' layer choices, against the values their projects pick."""

import pytest

from draftfeed import layers


def test_dflash_on_the_64_layer_27b_is_what_dflash_picks():
    # DFlash's Qwen3.6-27B drafter captures layers 1, 16, 31, 46, 61.
    assert layers.dflash(64) == [1, 16, 31, 46, 61]
    assert layers.dflash(64, k=5) == [1, 16, 31, 46, 61]


def test_dflash_on_40_and_48_layers():
    # Evenly spaced from 1 to L-3: span 36 over 4 steps, span 44 over 4 steps.
    assert layers.dflash(40) == [1, 10, 19, 28, 37]
    assert layers.dflash(48) == [1, 12, 23, 34, 45]
    assert layers.dflash(48, k=3) == [1, 23, 45]
    # A span that does not divide: 23 / 4 = 5.75 per step, and 12.5 rounds to even (12).
    assert layers.dflash(27) == [1, 7, 12, 18, 24]
    assert layers.dflash(40, k=1) == [20]


def test_eagle3_low_middle_high_and_final():
    # Inputs of layers 2, L//2, L-3 = outputs of 1, L//2-1, L-4; then the final normed state.
    assert layers.eagle3(64) == [1, 31, 60, -1]
    assert layers.eagle3(40) == [1, 19, 36, -1]
    assert layers.eagle3(48) == [1, 23, 44, -1]


def test_recipes_refuse_what_cannot_be_picked():
    with pytest.raises(ValueError, match="num_layers=3"):
        layers.dflash(3)
    with pytest.raises(ValueError, match="k=9"):
        layers.dflash(8, k=9)  # ids between 1 and 5 cannot be 9 distinct ones
    with pytest.raises(ValueError, match="k=0"):
        layers.dflash(64, k=0)
    with pytest.raises(ValueError, match="num_layers=6"):
        layers.eagle3(6)  # L//2-1 == L-4: one id twice
    with pytest.raises(TypeError):
        layers.eagle3(64.0)



def test_eagle3_on_a_built_in_model(make_target):
    """tiny-random has 4 layers, too few for EAGLE-3's picks; tiny-random-8l (its layers twice
    over) is the built-in model whose eagle3() ids a feed can capture."""
    import draftfeed

    with pytest.raises(ValueError, match="num_layers=4"):
        layers.eagle3(draftfeed.describe_target(make_target().address)["num_layers"])
    t = make_target(model="tiny-random-8l")
    info = draftfeed.describe_target(t.address)
    assert (info["model_id"], info["num_layers"], info["hidden_size"]) == ("tiny-random-8l:0", 8,
                                                                           128)
    ids = layers.eagle3(info["num_layers"])
    assert ids == [1, 3, 4, -1]
    tokens = list(range(100, 140))
    with draftfeed.Feed(targets=[t.address], layers=ids) as feed:
        (r,) = list(feed.map([(tokens, [15, 25])]))
    h = r.hidden
    assert h.shape == (40, 4, 128)
    # Four different states: layer 1, 3 and 4's outputs and the final normed one.
    for i in range(4):
        for j in range(i + 1, 4):
            assert not (h[:, i] == h[:, j]).all(), (ids[i], ids[j])
