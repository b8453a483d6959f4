"""draftfeed-target --device cpu --tp N: the sharded CPU engine behind the
service serves a batch bit-identically on every repeat and within bf16
rounding of the unsharded target; --tp values the model cannot take, and GPU
lists that do not make whole tensor-parallel groups, are refused at start-up
naming why."""

import subprocess

import numpy as np
import pytest

import draftfeed
from conftest import TARGET_BIN


def tokens(n, seed, vocab=4096):
    return np.random.default_rng(seed).integers(0, vocab, size=n, dtype=np.int32)


def run_target(*args, timeout=60):
    """Runs the target expecting it to exit by itself (it must not start serving)."""
    return subprocess.run([str(TARGET_BIN), "--listen=127.0.0.1:0", "--threads=1", *args],
                          capture_output=True, text=True, timeout=timeout)


def serve(target, batches, layers):
    with draftfeed.Feed(targets=[target.address], layers=layers, prefetch=2) as feed:
        return [r.hidden_bits.copy() for r in feed.map(batches)]


def bf16_to_float(bits):
    return (bits.astype(np.uint32) << 16).view(np.float32)


@pytest.mark.parametrize("model,moe,tp", [("tiny-random-moe", "ep", 2),
                                          ("tiny-random-moe", "split", 2), ("tiny-random", "ep", 2),
                                          ("tiny-random-qwen3-moe", "ep", 2),
                                          ("tiny-random-moe", "ep", 4)])
def test_tp_target_repeats_its_bits_and_matches_tp1(make_target, model, moe, tp):
    lens = [[5, 60], [1, 2, 3], [200]]
    batches = [(tokens(sum(l), 90 + i), np.array(l, dtype=np.int32)) for i, l in enumerate(lens)]
    layers = [0, 2, -1]  # every model here has at least 3 layers
    sharded = make_target(model=model, extra=["--device=cpu", f"--tp={tp}",
                                              f"--moe_parallel={moe}", "--threads=2"])
    info = draftfeed.describe_target(sharded.address)
    assert info["devices"] == [f"cpu tp{tp}"]
    assert f"tensor parallel over {tp} ranks" in sharded.output()
    first = serve(sharded, batches, layers)
    again = serve(sharded, batches, layers)
    for a, b in zip(first, again):
        np.testing.assert_array_equal(a, b)  # the all-reduce sums in rank order

    whole = make_target(model=model, extra=["--device=cpu"])
    assert draftfeed.describe_target(whole.address)["fingerprint"] == info["fingerprint"]
    for a, b in zip(serve(whole, batches, layers), first):
        fa, fb = bf16_to_float(a), bf16_to_float(b)
        assert fa.shape == fb.shape and np.isfinite(fa).all()
        # fp32 states within 2e-5 of the layer's max |state| (the engine
        # test's bound for the all-reduce's regrouped sums), then each rounded
        # to bf16: at most one bf16 step (2^-7 of the value) apart beyond that.
        bound = np.maximum(np.abs(fa), np.abs(fb)) * 2.0**-7 + 2e-5 * np.abs(fa).max()
        assert (np.abs(fa - fb) <= bound).all()
        assert (a != b).mean() < 0.05  # nearly every value rounds the same


def test_tp_that_does_not_divide_the_heads_is_refused():
    r = run_target("--model=tiny-random", "--device=cpu", "--tp=8")
    assert r.returncode == 1
    assert ("--tp 8 does not divide num_attention_heads=4, linear_num_value_heads=4 (--tp values "
            "this model takes: 1, 2, 4)") in r.stderr


@pytest.mark.parametrize("flag,message", [
    ("--tp=0", "--tp=0 must be >= 1 (1 = no tensor parallelism)"),
    ("--moe_parallel=tp",
     "--moe_parallel=tp is not ep (experts spread over the ranks) or split (every expert cut)"),
])
def test_bad_tp_flags_are_refused(flag, message):
    r = run_target("--model=tiny-random", "--device=cpu", flag)
    assert r.returncode == 1
    assert message in r.stderr


@pytest.mark.parametrize("devices,given", [("--device=cuda:0", "1 GPU(s) given (0)"),
                                           ("--devices=0,1,2", "3 GPU(s) given (0,1,2)")])
def test_cuda_tp_needs_whole_groups_of_gpus(devices, given):
    r = run_target("--model=tiny-random", devices, "--tp=2")
    assert r.returncode == 1
    if "this build has no CUDA engine" in r.stderr:
        pytest.skip("CPU-only build: a CUDA device is refused before --tp is read")
    assert ("--tp 2 groups every 2 GPUs of --devices into one model instance; " + given +
            " is not a multiple of 2") in r.stderr


def test_print_plan_of_a_real_shape():
    r = run_target("--model=random:qwen3.5-122b-a10b", "--tp=2", "--print_plan")
    assert r.returncode == 0, r.stderr
    assert "random:qwen3.5-122b-a10b:0: tensor parallel: tp 2, moe ep (128 experts per rank)" in (
        r.stdout)
    assert "113.76 GiB per rank, 226.03 GiB whole, 1.49 GiB replicated on every rank" in r.stdout
    assert "mlp.experts.gate_up_proj [256, 2048, 3072] -> [128, 2048, 3072]: experts" in r.stdout
    # 2 KV heads over 8 ranks: each KV head on 4.
    r = run_target("--model=random:qwen3.5-122b-a10b", "--tp=8", "--print_plan")
    assert r.returncode == 0, r.stderr
    assert "29.59 GiB per rank" in r.stdout
    assert "self_attn.k_proj.weight [512, 3072] -> [256, 3072]: rows (each KV head on 4 ranks)" in (
        r.stdout)


def test_print_plan_says_whether_an_fp8_checkpoint_cuts_on_its_scale_blocks():
    # The 35B-A3B-FP8 cuts cleanly at tp 4; at tp 8 its 512-wide shared expert
    # would be cut into 64-row pieces, and the plan exits as the target would.
    r = run_target("--model=random:qwen3.6-35b-a3b-fp8", "--tp=4", "--print_plan")
    assert r.returncode == 0, r.stderr
    assert "FP8 block scales: every cut on a 128x128 block edge" in r.stdout
    r = run_target("--model=random:qwen3.6-35b-a3b-fp8", "--tp=8", "--print_plan")
    assert r.returncode == 1
    assert "FP8 block scales: refused: FP8 weight layers.0.mlp.shared_expert.gate_proj.weight" in (
        r.stdout)
    assert "off its 128x128 scale blocks" in r.stderr
    # A bf16 model has no such line.
    r = run_target("--model=random:qwen3.6-35b-a3b", "--tp=8", "--print_plan")
    assert r.returncode == 0, r.stderr
    assert "FP8 block scales" not in r.stdout
