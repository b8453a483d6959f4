"""Target outputs (argmax, top-k, draft-vocabulary probabilities) through the Python client,
against a real CPU target serving a transformers-format checkpoint.

The expected values are computed here from what the feed itself returns and the checkpoint's
own lm_head: logits = final_state (layer -1, bf16 on the wire) @ lm_head^T in float64. The
target computes from the fp32 final state, so the two differ by the bf16 rounding of the state
(2^-9 relative per element): the tolerances below are a few times that effect on the logits
(|Δlogit| <= 2^-9 * Σ|x_i w_i| ≈ 0.01 at this model's magnitudes), not the wire's."""

import json
import pathlib
import struct

import numpy as np
import pytest

import draftfeed

MODEL = pathlib.Path(__file__).resolve().parents[2] / "data" / "models" / "qwen35_text"
VOCAB, H = 512, 64


def read_bf16(path, name):
    with open(path, "rb") as f:
        n = struct.unpack("<Q", f.read(8))[0]
        header = json.loads(f.read(n))
        info = header[name]
        assert info["dtype"] == "BF16"
        a, b = info["data_offsets"]
        f.seek(8 + n + a)
        bits = np.frombuffer(f.read(b - a), dtype="<u2").reshape(info["shape"])
    return (bits.astype(np.uint32) << 16).view(np.float32)


LM_HEAD = read_bf16(MODEL / "model.safetensors", "lm_head.weight").astype(np.float64)
RNG = np.random.default_rng(7)
DRAFT = RNG.permutation(VOCAB)[:300].astype(np.int32)  # any order: columns follow it
BATCHES = [(RNG.integers(0, VOCAB, size=sum(l), dtype=np.int32), np.array(l, dtype=np.int32))
           for l in [[1], [5, 17, 9], [64, 65], [130]]]


@pytest.fixture(scope="module")
def ckpt_target():
    from conftest import TargetProcess

    t = TargetProcess(model=str(MODEL))
    yield t
    t.kill()


def run(target, layers, **kw):
    with draftfeed.Feed(targets=[target.address], layers=layers, prefetch=4, **kw) as feed:
        return list(feed.map(BATCHES))


def expected(final_bf16):
    logits = final_bf16.astype(np.float64) @ LM_HEAD.T
    m = logits.max(axis=1, keepdims=True)
    lse = m + np.log(np.exp(logits - m).sum(axis=1, keepdims=True))
    d = logits[:, DRAFT]
    p = np.exp(d - d.max(axis=1, keepdims=True))
    return logits, logits - lse, p / p.sum(axis=1, keepdims=True)


def test_target_info_offers_target_outputs(ckpt_target):
    info = draftfeed.describe_target(ckpt_target.address)
    assert info["target_outputs"] == {"max_top_k": 256, "max_draft_vocab": VOCAB,
                                      "draft_probs_encodings": ["bf16", "fp8_e4m3"]}


def test_outputs_match_lm_head_of_the_final_state(ckpt_target):
    plain = run(ckpt_target, [1, -1])
    got = run(ckpt_target, [1, -1], draft_vocab=DRAFT, top_k=5, argmax=True)
    checked = total = 0
    for p, g in zip(plain, got):
        T = g.num_tokens
        # The hidden states are untouched by the outputs after them in each row.
        assert np.array_equal(p.hidden_bits, g.hidden_bits)
        assert g.bytes_per_token == 2 * 2 * H + 4 + 5 * 8 + 300 * 2
        final = g.hidden[:, 1, :]
        logits, logprobs, probs = expected(final)
        assert g.argmax.shape == (T,) and g.argmax.dtype == np.int32
        assert g.top_k_ids.shape == (T, 5) and g.top_k_logprobs.shape == (T, 5)
        assert g.draft_probs.shape == (T, 300) and g.draft_probs.dtype == np.float32
        # How far the bf16 state's logits can be from the target's: each product moves by at
        # most 2^-9 of itself (twice that, for safety).
        slack = 2.0 ** -8 * (np.abs(final).astype(np.float64) @ np.abs(LM_HEAD).T).max(axis=1)
        top2 = np.sort(logits, axis=1)[:, -2:]
        clear = top2[:, 1] - top2[:, 0] > 2 * slack
        assert np.array_equal(g.argmax[clear], logits.argmax(axis=1)[clear])
        checked += clear.sum()
        total += T
        ids = g.top_k_ids
        assert np.array_equal(ids[:, 0], g.argmax)
        # log-probs are of the ids returned, descending, and near the reference's values.
        ref_lp = np.take_along_axis(logprobs, ids.astype(np.int64), axis=1)
        assert (np.abs(g.top_k_logprobs - ref_lp) <= 2 * slack[:, None] + 1e-5).all()
        assert (np.diff(g.top_k_logprobs, axis=1) <= 0).all()
        tv = 0.5 * np.abs(g.draft_probs - probs).sum(axis=1)
        assert np.median(tv) <= 2 ** -8 and tv.max() <= 2 ** -6
        assert np.abs(g.draft_probs.sum(axis=1) - 1).max() < 300 * 2 ** -8
    assert checked > total / 2  # the argmax check covered most tokens


def test_outputs_alone_fp8_probs_and_fp8_hidden_states(ckpt_target):
    ref = run(ckpt_target, [1, -1], draft_vocab=DRAFT, top_k=5, argmax=True)
    alone = run(ckpt_target, [], draft_vocab=DRAFT, top_k=5, argmax=True)
    fp8p = run(ckpt_target, [], draft_vocab=DRAFT, probs_encoding="fp8_e4m3")
    fp8h = run(ckpt_target, [1, -1], draft_vocab=DRAFT, top_k=5, argmax=True,
               encoding="fp8_e4m3")
    fp8h_plain = run(ckpt_target, [1, -1], encoding="fp8_e4m3")
    for r, a, f, h, hp in zip(ref, alone, fp8p, fp8h, fp8h_plain):
        assert a.bytes_per_token == 4 + 5 * 8 + 300 * 2 and a.num_layers == 0
        # The same outputs whatever else the row holds.
        assert np.array_equal(a.argmax, r.argmax) and np.array_equal(a.draft_probs, r.draft_probs)
        assert np.array_equal(a.top_k_logprobs, r.top_k_logprobs)
        assert np.array_equal(h.argmax, r.argmax) and np.array_equal(h.top_k_ids, r.top_k_ids)
        assert np.array_equal(h.draft_probs, r.draft_probs)
        assert np.array_equal(h.hidden_bits, hp.hidden_bits)  # dequantized as without outputs
        # e4m3 probabilities: 4 significant bits, one scale per token (max p / 448).
        assert f.bytes_per_token == 4 + 300
        want = r.draft_probs
        assert np.all(np.abs(f.draft_probs - want) <= want / 16 + want.max(axis=1, keepdims=True)
                      * 2.0 ** -9 / 448 * 2 + 2.0 ** -8 * want)
        with pytest.raises(draftfeed.DraftfeedError, match="argmax=True"):
            f.argmax


def test_torch_accessors(ckpt_target):
    torch = pytest.importorskip("torch")
    (r,) = run(ckpt_target, [-1], draft_vocab=DRAFT, top_k=3, argmax=True)[:1]
    assert torch.equal(r.argmax_torch(), torch.from_numpy(r.argmax))
    ids, lp = r.top_k_torch()
    assert torch.equal(ids, torch.from_numpy(r.top_k_ids))
    assert torch.equal(lp, torch.from_numpy(r.top_k_logprobs))
    assert torch.equal(r.draft_probs_torch(), torch.from_numpy(r.draft_probs))
    assert r.draft_probs_torch(dtype=torch.bfloat16).dtype == torch.bfloat16
    # The hidden states still come out whole beside the outputs.
    assert np.array_equal(r.torch().view(torch.int16).numpy().view(np.uint16), r.hidden_bits)


def test_hidden_state_dataset_hands_out_the_outputs(ckpt_target):
    torch = pytest.importorskip("torch")
    from draftfeed.torch import HiddenStateDataset

    want = run(ckpt_target, [1], draft_vocab=DRAFT, top_k=3, argmax=True)
    with draftfeed.Feed(targets=[ckpt_target.address], layers=[1], draft_vocab=DRAFT, top_k=3,
                        argmax=True) as feed:
        got = list(HiddenStateDataset(BATCHES, feed))
    assert len(got) == len(want)
    for w, g in zip(want, got):
        assert torch.equal(g["draft_probs"], torch.from_numpy(w.draft_probs))
        assert torch.equal(g["argmax"], torch.from_numpy(w.argmax))
        assert torch.equal(g["top_k_ids"], torch.from_numpy(w.top_k_ids))
        assert torch.equal(g["top_k_logprobs"], torch.from_numpy(w.top_k_logprobs))
        assert g["hidden"].shape == (w.num_tokens, 1, H)


@pytest.mark.parametrize("kw, field", [
    (dict(draft_vocab=[3, 9, 3]), "draft_vocab lists id 3 twice"),
    (dict(draft_vocab=[1, VOCAB]), r"draft_vocab\[1\] is 512"),
    (dict(draft_vocab=[-1]), r"draft_vocab\[0\] is -1"),
    (dict(draft_vocab=np.arange(65537) % 1000), "at most 65536"),
    (dict(top_k=257), "top_k is 257"),
    (dict(top_k=-1), "top_k is -1"),
    (dict(probs_encoding="fp16"), "probs_encoding"),
])
def test_bad_target_outputs_are_refused_by_name(ckpt_target, kw, field):
    with pytest.raises((draftfeed.DraftfeedError, ValueError), match=field):
        with draftfeed.Feed(targets=[ckpt_target.address], layers=[1], connect_timeout_s=5,
                            unavailable_timeout_s=5, **kw) as feed:
            feed.submit(*BATCHES[0])
            feed.next()
    # The target keeps serving.
    assert len(run(ckpt_target, [1], top_k=2)) == len(BATCHES)
