"""draftfeed.vocab: token counting, the draft vocabulary's d2t / t2d, safetensors and torch files,
drafter checkpoints, and every refusal.

The module is pure numpy; the package imports without the compiled client (its pure-Python
client then stands in), so it is tested the way trainers import it.
"""

import json
import pathlib
import pickle
import struct
import subprocess
import sys
import tracemalloc
import warnings
from fractions import Fraction

import numpy as np
import pytest

REPO = pathlib.Path(__file__).resolve().parents[3]

from draftfeed import vocab  # noqa: E402
TokenCounter, DraftVocab, count_tokens = vocab.TokenCounter, vocab.DraftVocab, vocab.count_tokens

try:
    import torch
except ImportError:
    torch = None
needs_torch = pytest.mark.skipif(torch is None, reason="torch is not importable")


# ---------------------------------------------------------------------------------------------
# a safetensors file built by hand from the format's spec (not with vocab's writer): 8 bytes
# little-endian u64 header length N, N bytes of UTF-8 JSON starting with '{' and padded with
# spaces, {name: {"dtype", "shape", "data_offsets": [begin, end)}} with offsets relative to
# the byte buffer after the header, an optional "__metadata__" of strings.

def hand_safetensors(entries, metadata=None, pad=8):
    header, data = {}, b""
    if metadata is not None:
        header["__metadata__"] = metadata
    for name, dtype, shape, raw in entries:
        header[name] = {"dtype": dtype, "shape": shape,
                        "data_offsets": [len(data), len(data) + len(raw)]}
        data += raw
    text = json.dumps(header).encode("utf-8")
    text += b" " * (-len(text) % pad)
    return struct.pack("<Q", len(text)) + text + data


def i64(values):
    return struct.pack(f"<{len(values)}q", *values)


def bools(values):
    return bytes(1 if v else 0 for v in values)


def bf16_zeros(n):
    return b"\x00\x00" * n


# A 12-id target vocabulary, 5 draft ids: target ids 0, 3, 4, 8, 11.
IDS = [0, 3, 4, 8, 11]
D2T = [0, 2, 2, 5, 7]  # IDS[d] - d
T2D = [i in IDS for i in range(12)]


def drafter_entries(d2t_name="d2t", t2d_name="t2d", d2t=D2T, t2d=T2D):
    """A drafter's weights as SpecForge's save_pretrained writes them: fc, norm, lm_head,
    midlayer..., and the two buffers."""
    return [("fc.weight", "BF16", [4, 12], bf16_zeros(48)),
            ("lm_head.weight", "BF16", [len(d2t), 4], bf16_zeros(4 * len(d2t))),
            ("midlayer.input_layernorm.weight", "F32", [4], struct.pack("<4f", 1, 1, 1, 1)),
            ("norm.weight", "F32", [4], struct.pack("<4f", 1, 2, 3, 4)),
            (d2t_name, "I64", [len(d2t)], i64(d2t)),
            (t2d_name, "BOOL", [len(t2d)], bools(t2d))]


# ---------------------------------------------------------------------------------------------
# counting

def test_counts_one_sequence_and_a_masked_padded_batch():
    c = TokenCounter(10)
    c.update([1, 2, 2, 3])
    assert c.counts.tolist() == [0, 1, 2, 1, 0, 0, 0, 0, 0, 0]
    # Two padded rows; -100 padding sits under mask 0 and is neither counted nor checked.
    ids = np.array([[1, 5, -100, -100], [4, 4, 9, 0]])
    mask = np.array([[1, 1, 0, 0], [0, 1, 1, 1]])
    c.update(ids, mask)
    assert c.counts.tolist() == [1, 2, 2, 1, 1, 1, 0, 0, 0, 1]
    assert c.tokens == 9 and c.sequences == 3
    c.update(np.array([7, 7, 8]), np.array([True, False, True]))
    assert c.counts[7] == 1 and c.counts[8] == 1
    c.update(np.array([6, 6]), np.array([1.0, 0.0]))  # float masks of 0/1 count too
    assert c.counts[6] == 1
    assert c.counts.dtype == np.int64 and c.counts.shape == (10,)
    with pytest.raises(ValueError):
        c.counts[0] = 5  # the view handed out is read-only
    c.update([])  # nothing to count
    assert c.tokens == 12 and c.sequences == 6


def test_rows_of_different_lengths_and_lists_with_masks():
    c = TokenCounter(6)
    c.update([[0, 1, 2], [5], [3, 3]], [[1, 0, 1], [1], [1, 1]])
    assert c.counts.tolist() == [1, 0, 1, 2, 0, 1]
    assert c.sequences == 3
    c.update([[4, 4], [4, 0]])  # a regular list of lists is a [2, 2] batch
    assert c.counts.tolist() == [2, 0, 1, 2, 3, 1]


@needs_torch
def test_torch_inputs_count_like_numpy():
    ids = torch.tensor([[3, 1, 4, 1, 5], [9, 2, 6, 0, 0]])
    mask = torch.tensor([[1, 1, 1, 1, 1], [1, 1, 1, 0, 0]], dtype=torch.bool)
    a, b = TokenCounter(10), TokenCounter(10)
    a.update(ids, mask)
    b.update(ids.numpy(), mask.numpy())
    assert a == b and a.counts.tolist() == [0, 2, 1, 1, 1, 1, 1, 0, 0, 1]
    a.update(torch.tensor([7, 7], dtype=torch.int32))
    assert a.counts[7] == 2


def test_merge_equals_counting_the_concatenation():
    rng = np.random.default_rng(7)
    seqs = [rng.integers(0, 500, size=rng.integers(1, 60)) for _ in range(300)]
    masks = [rng.integers(0, 2, size=s.size) for s in seqs]
    whole = TokenCounter(500)
    whole.update(np.concatenate(seqs), np.concatenate(masks))
    shards = [TokenCounter(500) for _ in range(3)]
    for i, (s, m) in enumerate(zip(seqs, masks)):
        shards[i % 3].update(s, m)
    merged = shards[0] + shards[1] + shards[2]
    assert merged == whole
    np.testing.assert_array_equal(merged.counts, whole.counts)
    assert shards[0].merge(shards[1]).merge(shards[2]) == whole
    assert sum(shards) == whole
    assert merged.sequences == 300
    acc = TokenCounter(500)
    for s in shards:
        acc += s
    assert acc == whole and acc.sequences == 300
    # Merging made new counters; the shards are as they were.
    assert sum(s.tokens for s in shards) == whole.tokens
    expected = np.bincount(np.concatenate(seqs)[np.concatenate(masks) == 1], minlength=500)
    np.testing.assert_array_equal(whole.counts, expected)


def _rss_bytes():
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * 4096
    except OSError:
        return None


def test_streaming_200k_sequences_keeps_one_array():
    vocab_size, n, length, traced = 1000, 200_000, 8, 20_000

    def stream():  # a generator: the dataset never exists as a whole
        for i in range(n):
            if i == n - traced:  # trace allocations over the last 20k (tracing is slow)
                tracemalloc.start()
            yield {"input_ids": [(i * 37 + j * 101) % vocab_size for j in range(length)],
                   "loss_mask": [j % 4 != 0 for j in range(length)]}

    counter = TokenCounter(vocab_size)
    rss_before = _rss_bytes()
    try:
        counts = count_tokens(stream(), vocab_size, counter=counter)
        current, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    rss_after = _rss_bytes()
    # 1.6M ids went through (12.8 MB as int64, far more as the Python lists they came in);
    # the counter is still one int64 array of vocab_size counters, nothing the last 20k items
    # allocated is still held, and the process did not grow with the stream.
    assert counter.counts.nbytes == vocab_size * 8
    assert [k for k, v in vars(counter).items() if isinstance(v, np.ndarray)] == ["_counts"]
    assert current < 20_000 and peak < 200_000, (current, peak)
    if rss_before is not None:
        assert rss_after - rss_before < 8 << 20, (rss_before, rss_after)
    i = np.arange(n)[:, None]
    j = np.arange(length)[None, :]
    all_ids = (i * 37 + j * 101) % vocab_size
    expected = np.bincount(all_ids[:, np.arange(length) % 4 != 0].ravel(), minlength=vocab_size)
    np.testing.assert_array_equal(counts, expected)
    assert counter.tokens == n * 6 and counter.sequences == n


def test_count_tokens_items_keys_and_progress():
    data = [{"input_ids": [1, 2, 3], "loss_mask": [0, 1, 1]},
            {"input_ids": np.array([[3, 3]]), "loss_mask": np.array([[1, 0]])},  # EAGLE's [1, T]
            {"input_ids": [4]},  # no mask: every token
            [0, 0, 4]]  # a bare sequence
    calls = []
    counts = count_tokens(data, 5, progress=lambda items, tokens: calls.append((items, tokens)))
    assert counts.tolist() == [2, 0, 1, 2, 2]
    assert calls[-1] == (4, 7)
    every = count_tokens(data, 5, loss_mask_key=None)
    assert every.tolist() == [2, 1, 1, 3, 2]
    renamed = count_tokens([{"ids": [1, 1], "mask": [1, 0]}], 5, input_ids_key="ids",
                           loss_mask_key="mask")
    assert renamed.tolist() == [0, 1, 0, 0, 0]
    counts = count_tokens(iter(data), 5, progress=True)  # tqdm, or a line on stderr
    assert counts.tolist() == [2, 0, 1, 2, 2]
    with pytest.raises(ValueError, match=r"dataset item 1 has no 'input_ids' key"):
        count_tokens([{"input_ids": [1]}, {"tokens": [1]}], 5)
    with pytest.raises(ValueError, match=r"dataset item 1: token id 7 at position 0"):
        count_tokens([[1], [7]], 5)
    with pytest.raises(ValueError, match="counter has vocab_size 6, not 5"):
        count_tokens(data, 5, counter=TokenCounter(6))


def test_most_common_and_repr():
    c = TokenCounter(6, counts=[4, 9, 4, 0, 9, 1])
    assert c.most_common(4) == [(1, 9), (4, 9), (0, 4), (2, 4)]
    assert "distinct=5" in repr(c)
    assert c.draft_vocab(3).ids.tolist() == [0, 1, 4]


# ---------------------------------------------------------------------------------------------
# choosing the draft vocabulary

def test_top_n_by_count_ties_to_the_lower_id():
    counts = np.array([5, 3, 5, 3, 0, 3, 7, 1])
    assert DraftVocab.from_counts(counts, 1).ids.tolist() == [6]
    assert DraftVocab.from_counts(counts, 3).ids.tolist() == [0, 2, 6]
    # Three ids tie at 3 for the last two places: 1 and 3 win over 5.
    v = DraftVocab.from_counts(counts, 5)
    assert v.ids.tolist() == [0, 1, 2, 3, 6]
    assert v.ids.dtype == np.int32 and v.target_vocab_size == 8 and len(v) == v.size == 5
    # The same counts in any order of arrival give the same vocabulary.
    assert DraftVocab.from_counts(counts.astype(np.float64), 5) == v
    c = TokenCounter(8)
    c.update(np.repeat(np.arange(8), counts))
    assert DraftVocab.from_counts(c, 5) == v
    with pytest.warns(UserWarning, match="only 7 distinct"):  # id 4 was never seen
        assert DraftVocab.from_counts(counts, 8).ids.tolist() == list(range(8))


def test_too_few_seen_ids_fill_with_the_lowest_unseen_and_warn():
    counts = np.zeros(10, dtype=np.int64)
    counts[[7, 2, 9]] = [4, 1, 4]
    with pytest.warns(UserWarning, match=r"only 3 distinct target ids .* the 2 lowest unseen"):
        v = DraftVocab.from_counts(counts, 5)
    assert v.ids.tolist() == [0, 1, 2, 7, 9] and v.size == 5
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        DraftVocab.from_counts(counts, 3)  # enough seen: no warning


def test_d2t_t2d_round_trips():
    rng = np.random.default_rng(1)
    counts = rng.integers(0, 1000, size=4096)
    v = DraftVocab.from_counts(counts, 1000)
    d2t, t2d = v.d2t, v.t2d
    assert d2t.dtype == np.int64 and d2t.shape == (1000,)
    assert t2d.dtype == np.bool_ and t2d.shape == (4096,)
    assert int(t2d.sum()) == v.size == 1000
    d = np.arange(v.size)
    np.testing.assert_array_equal(v.ids, d + d2t)
    assert all(int(v.ids[k]) == k + int(d2t[k]) for k in range(0, 1000, 37))
    np.testing.assert_array_equal(np.flatnonzero(t2d), v.ids)
    assert DraftVocab.from_d2t(d2t, 4096) == v
    assert DraftVocab.from_t2d(t2d) == v
    assert DraftVocab.from_t2d(t2d.astype(np.int64)) == v  # 0/1 integers read as a mask
    assert DraftVocab.from_d2t(d2t.astype(np.int32), 4096) == v
    assert DraftVocab(list(v.ids), 4096) == v
    assert DraftVocab(v.ids, 4097) != v
    assert pickle.loads(pickle.dumps(v)) == v
    assert hash(DraftVocab.from_t2d(t2d)) == hash(v)
    # The arrays handed out are the caller's to change.
    t2d[:] = False
    assert int(v.t2d.sum()) == 1000
    # EAGLE's own example: selected ids 0, 3, 4, 8, 11.
    w = DraftVocab(IDS, 12)
    assert w.d2t.tolist() == D2T and w.t2d.tolist() == T2D


def test_draft_to_target_and_back():
    v = DraftVocab(IDS, 12)
    assert v.draft_to_target(3) == 8 and isinstance(v.draft_to_target(3), int)
    assert v.draft_to_target([0, 4, 1]).tolist() == [0, 11, 3]
    np.testing.assert_array_equal(v.draft_to_target(np.array([[0, 1], [2, 3]])),
                                  [[0, 3], [4, 8]])
    assert v.target_to_draft(list(range(12))).tolist() == [0, -1, -1, 1, 2, -1, -1, -1, 3, -1,
                                                           -1, 4]
    assert v.target_to_draft(5) == -1
    d = np.arange(v.size)
    np.testing.assert_array_equal(v.target_to_draft(v.draft_to_target(d)), d)


@needs_torch
def test_draft_to_target_torch_stays_torch():
    v = DraftVocab(IDS, 12)
    t = v.draft_to_target(torch.tensor([4, 0, 2]))
    assert isinstance(t, torch.Tensor) and t.tolist() == [11, 0, 4] and t.dtype == torch.int64
    back = v.target_to_draft(torch.tensor([[11, 1], [3, 8]], dtype=torch.int32))
    assert back.tolist() == [[4, -1], [1, 3]]


def test_position_mask_numpy():
    v = DraftVocab(IDS, 12)
    argmax = np.array([[0, 1, 3], [11, 5, 8]])
    loss = np.array([[1, 1, 1], [0, 1, 1]])
    m = v.position_mask(argmax, loss)
    assert isinstance(m, np.ndarray) and m.tolist() == [[1, 0, 1], [0, 0, 1]]
    assert m.dtype == loss.dtype
    only = v.position_mask(argmax)
    assert only.dtype == np.bool_ and only.tolist() == [[True, False, True], [True, False, True]]
    # The same as EAGLE's t2d[argmax][..., None].int() * loss_mask on a [B, T, 1] mask.
    loss3 = loss[..., None].astype(np.float32)
    m3 = v.position_mask(argmax, loss3)
    assert m3.shape == (2, 3, 1) and m3.dtype == np.float32
    np.testing.assert_array_equal(m3, v.t2d[argmax][..., None].astype(np.int32) * loss3)
    assert v.position_mask(argmax, loss.astype(bool)).dtype == np.bool_
    assert v.position_mask([4, 5]).tolist() == [True, False]


@needs_torch
def test_position_mask_torch():
    v = DraftVocab(IDS, 12)
    argmax = torch.tensor([[0, 1, 3], [11, 5, 8]])
    loss = torch.tensor([[1, 1, 1], [0, 1, 1]])
    m = v.position_mask(argmax, loss)
    assert isinstance(m, torch.Tensor) and m.tolist() == [[1, 0, 1], [0, 0, 1]]
    assert m.dtype == loss.dtype and m.device == argmax.device
    t2d = torch.from_numpy(v.t2d)
    loss3 = loss[..., None].float()
    expected = t2d[argmax][..., None].int() * loss3
    assert torch.equal(v.position_mask(argmax, loss3), expected)
    assert v.position_mask(argmax).dtype == torch.bool
    assert v.position_mask(argmax, loss.bool()).tolist() == [[True, False, True],
                                                             [False, False, True]]
    assert v.position_mask(argmax, loss.numpy()).tolist() == [[1, 0, 1], [0, 0, 1]]


# ---------------------------------------------------------------------------------------------
# files

def test_safetensors_written_reads_back_identical(tmp_path):
    v = DraftVocab.from_counts(np.random.default_rng(2).integers(0, 50, size=3000), 700)
    path = v.save(tmp_path / "draft_vocab.safetensors")
    assert DraftVocab.load(path) == v
    raw = path.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8:8 + n])
    assert (8 + n) % 8 == 0 and raw[8:9] == b"{"
    assert header["d2t"] == {"dtype": "I64", "shape": [700], "data_offsets": [0, 5600]}
    assert header["t2d"] == {"dtype": "BOOL", "shape": [3000], "data_offsets": [5600, 8600]}
    assert header["__metadata__"]["format"] == "pt"
    assert len(raw) == 8 + n + 8600
    # The bytes are the spec's: little-endian int64 offsets, one byte per bool.
    data = raw[8 + n:]
    assert list(struct.unpack("<700q", data[:5600])) == v.d2t.tolist()
    assert list(data[5600:]) == v.t2d.astype(np.uint8).tolist()
    tensors = vocab.read_safetensors(path)
    np.testing.assert_array_equal(tensors["d2t"], v.d2t)
    np.testing.assert_array_equal(tensors["t2d"], v.t2d)
    assert tensors["d2t"].dtype == np.int64 and tensors["t2d"].dtype == np.bool_


def test_safetensors_writer_and_reader_over_every_numpy_dtype(tmp_path):
    arrays = {f"x_{d}": (np.arange(6).reshape(2, 3) % 2).astype(d) for d in
              ["bool", "u1", "i1", "<u2", "<i2", "<f2", "<u4", "<i4", "<f4", "<u8", "<i8",
               "<f8", ">i4"]}
    arrays["scalar"] = np.array(3.5)
    arrays["empty"] = np.zeros((0, 4), dtype=np.float32)
    vocab.write_safetensors(tmp_path / "t.safetensors", arrays, metadata={"k": "v"})
    back = vocab.read_safetensors(tmp_path / "t.safetensors")
    assert set(back) == set(arrays)
    for k, a in arrays.items():
        assert back[k].shape == a.shape and np.array_equal(back[k], a), k
    assert back["x_>i4"].dtype == np.int32  # big-endian in, little-endian on disk
    assert vocab.read_safetensors(tmp_path / "t.safetensors", ["x_bool"]).keys() == {"x_bool"}


def test_hand_built_drafter_safetensors(tmp_path):
    path = tmp_path / "model.safetensors"
    path.write_bytes(hand_safetensors(drafter_entries(), metadata={"format": "pt"}))
    v = DraftVocab.load(path)
    assert v.ids.tolist() == IDS and v.target_vocab_size == 12
    # Any padding, no metadata, and prefixed names (a trainer's state: draft_model.*).
    path.write_bytes(hand_safetensors(drafter_entries("draft_model.d2t", "draft_model.t2d"),
                                      pad=1))
    assert DraftVocab.load(path) == v
    # BF16 weights come back as their bits.
    got = vocab.read_safetensors(path, ["fc.weight", "norm.weight"])
    assert got["fc.weight"].dtype == np.uint16 and got["fc.weight"].shape == (4, 12)
    assert got["norm.weight"].tolist() == [1, 2, 3, 4]


def test_checkpoint_directory_with_config(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(
        {"architectures": ["LlamaForCausalLMEagle3"], "vocab_size": 12, "draft_vocab_size": 5}))
    (tmp_path / "model.safetensors").write_bytes(hand_safetensors(drafter_entries()))
    assert DraftVocab.load(tmp_path).ids.tolist() == IDS
    # d2t alone (vLLM and SGLang read only d2t): the target's size comes from config.json.
    entries = [e for e in drafter_entries() if e[0] != "t2d"]
    (tmp_path / "model.safetensors").write_bytes(hand_safetensors(entries))
    v = DraftVocab.load(tmp_path)
    assert v.ids.tolist() == IDS and v.target_vocab_size == 12
    # A config.json that disagrees is named.
    (tmp_path / "config.json").write_text(json.dumps({"vocab_size": 12, "draft_vocab_size": 6}))
    with pytest.raises(ValueError, match="draft_vocab_size=6"):
        DraftVocab.load(tmp_path)


def test_d2t_alone_needs_the_target_vocab_size(tmp_path):
    entries = [e for e in drafter_entries() if e[0] != "t2d"]
    path = tmp_path / "d2t_only.safetensors"
    path.write_bytes(hand_safetensors(entries))
    with pytest.raises(ValueError, match="holds d2t but no t2d: pass target_vocab_size"):
        DraftVocab.load(path)
    assert DraftVocab.load(path, target_vocab_size=12).ids.tolist() == IDS
    with pytest.raises(ValueError, match="outside the target's vocabulary"):
        DraftVocab.load(path, target_vocab_size=11)  # id 11 does not fit


def test_sharded_checkpoint_index(tmp_path):
    entries = drafter_entries()
    (tmp_path / "model-00001-of-00002.safetensors").write_bytes(hand_safetensors(entries[:3]))
    (tmp_path / "model-00002-of-00002.safetensors").write_bytes(hand_safetensors(entries[3:]))
    weight_map = {e[0]: ("model-00001-of-00002.safetensors" if i < 3 else
                         "model-00002-of-00002.safetensors") for i, e in enumerate(entries)}
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps(
        {"metadata": {"total_size": 0}, "weight_map": weight_map}))
    assert DraftVocab.load(tmp_path).ids.tolist() == IDS
    assert DraftVocab.load(tmp_path / "model.safetensors.index.json").ids.tolist() == IDS


@needs_torch
def test_torch_save_files(tmp_path):
    d2t, t2d = torch.tensor(D2T), torch.tensor(T2D)  # the dtypes EAGLE's and SpecForge's get
    assert d2t.dtype == torch.int64 and t2d.dtype == torch.bool
    torch.save({"d2t": d2t, "t2d": t2d}, tmp_path / "cache.pt")
    v = DraftVocab.load(tmp_path / "cache.pt")
    assert v.ids.tolist() == IDS and v.target_vocab_size == 12
    # Our .pt is that dict, read back by torch itself.
    v.save(tmp_path / "vocab_mapping.pt")
    mapping = torch.load(tmp_path / "vocab_mapping.pt")
    assert set(mapping) == {"d2t", "t2d"}
    assert mapping["d2t"].dtype == torch.int64 and mapping["d2t"].tolist() == D2T
    assert mapping["t2d"].dtype == torch.bool and mapping["t2d"].tolist() == T2D
    assert DraftVocab.load(tmp_path / "vocab_mapping.pt") == v
    # A drafter's pytorch_model.bin (EAGLE's), with other weights, in a directory.
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    torch.save({"fc.weight": torch.zeros(4, 12, dtype=torch.bfloat16),
                "lm_head.weight": torch.zeros(5, 4), "d2t": d2t, "t2d": t2d},
               ckpt / "pytorch_model.bin")
    assert DraftVocab.load(ckpt) == v
    # A trainer's state with the draft's weights nested under a key, or prefixed (DDP's module.).
    torch.save({"step": torch.tensor(3), "draft_state_dict": {"d2t": d2t, "t2d": t2d,
                                                              "norm.weight": torch.ones(4)}},
               tmp_path / "training_state.pt")
    assert DraftVocab.load(tmp_path / "training_state.pt") == v
    torch.save({"module.d2t": d2t, "module.t2d": t2d}, tmp_path / "ddp.bin")
    assert DraftVocab.load(tmp_path / "ddp.bin") == v
    torch.save({"module.d2t": d2t, "draft_model.d2t": d2t}, tmp_path / "two.bin")
    with pytest.raises(ValueError, match="several d2t tensors"):
        DraftVocab.load(tmp_path / "two.bin", target_vocab_size=12)


def test_d2t_and_t2d_must_agree(tmp_path):
    path = tmp_path / "model.safetensors"
    wrong_t2d = list(T2D)
    wrong_t2d[4], wrong_t2d[5] = False, True  # t2d says 5 where d2t says 4
    path.write_bytes(hand_safetensors(drafter_entries(t2d=wrong_t2d)))
    with pytest.raises(ValueError, match=r"disagree at draft id 2: d2t gives target id 4, "
                                         r"t2d's 2-th selected id is 5"):
        DraftVocab.load(path)
    # SpecForge's buffers before a mapping is loaded: t2d all True, d2t all zeros.
    path.write_bytes(hand_safetensors(drafter_entries(d2t=[0] * 5, t2d=[True] * 12)))
    with pytest.raises(ValueError, match="d2t has 5 draft ids, t2d selects 12"):
        DraftVocab.load(path)
    path.write_bytes(hand_safetensors(drafter_entries(t2d=T2D + [False])))
    with pytest.raises(ValueError, match="t2d has 13"):
        DraftVocab.load(path, target_vocab_size=12)


# ---------------------------------------------------------------------------------------------
# refusals

def test_choosing_refuses_bad_sizes_and_counts():
    counts = np.arange(10)
    with pytest.raises(ValueError, match=r"size 11 is more than the target's vocabulary \(10"):
        DraftVocab.from_counts(counts, 11)
    with pytest.raises(ValueError, match="size must be positive, got 0"):
        DraftVocab.from_counts(counts, 0)
    with pytest.raises(ValueError, match="size must be positive, got -3"):
        DraftVocab.from_counts(counts, -3)
    with pytest.raises(ValueError, match="size must be an int"):
        DraftVocab.from_counts(counts, 3.0)
    with pytest.raises(ValueError, match=r"non-negative: counts\[2\] is -1"):
        DraftVocab.from_counts([1, 1, -1], 2)
    with pytest.raises(ValueError, match="1-D"):
        DraftVocab.from_counts(np.ones((2, 3)), 2)
    with pytest.raises(ValueError, match="not finite"):
        DraftVocab.from_counts([1.0, np.nan], 1)


def test_building_refuses_bad_ids():
    with pytest.raises(ValueError, match=r"strictly ascending: ids\[2\] = 3 follows ids\[1\] = 5"):
        DraftVocab([0, 5, 3], 10)
    with pytest.raises(ValueError, match=r"strictly ascending: ids\[1\] = 2"):
        DraftVocab([2, 2], 10)
    with pytest.raises(ValueError, match=r"ids\[2\] is 10, outside the target's vocabulary"):
        DraftVocab([0, 1, 10], 10)
    with pytest.raises(ValueError, match=r"ids\[0\] is -1"):
        DraftVocab([-1, 1], 10)
    with pytest.raises(ValueError, match="at least one id"):
        DraftVocab([], 10)
    with pytest.raises(ValueError, match="4 draft ids is more than the target's vocabulary"):
        DraftVocab([0, 1, 2, 3], 3)
    with pytest.raises(ValueError, match="target_vocab_size must be positive"):
        DraftVocab([0], 0)
    with pytest.raises(ValueError, match="ids must be integers"):
        DraftVocab([0.0, 1.0], 3)
    with pytest.raises(ValueError, match="1-D"):
        DraftVocab([[0, 1]], 3)


def test_from_d2t_and_from_t2d_refuse_what_is_no_vocabulary():
    with pytest.raises(ValueError, match=r"d2t does not give .* strictly ascending: ids\[2\] = 3"):
        DraftVocab.from_d2t([0, 2, 1], 10)  # ids 0, 3, 3
    with pytest.raises(ValueError, match=r"d2t does not give .* ids\[1\] = 0 follows"):
        DraftVocab.from_d2t([0, -1], 10)
    with pytest.raises(ValueError, match=r"d2t does not give .* ids\[0\] is -2"):
        DraftVocab.from_d2t([-2, 0], 10)
    with pytest.raises(ValueError, match=r"ids\[2\] is 12, outside"):
        DraftVocab.from_d2t([0, 0, 10], 10)
    with pytest.raises(ValueError, match="d2t must be integers"):
        DraftVocab.from_d2t(np.zeros(3, dtype=np.float32), 10)
    with pytest.raises(ValueError, match="d2t must be 1-D"):
        DraftVocab.from_d2t(np.zeros((2, 2), dtype=np.int64), 10)
    with pytest.raises(ValueError, match="at least one id"):
        DraftVocab.from_d2t(np.zeros(0, dtype=np.int64), 10)
    with pytest.raises(ValueError, match=r"t2d must hold 0/1: t2d\[1\] is 2"):
        DraftVocab.from_t2d([0, 2, 1])
    with pytest.raises(ValueError, match="t2d selects no id"):
        DraftVocab.from_t2d(np.zeros(5, dtype=bool))
    with pytest.raises(ValueError, match="t2d must be bool"):
        DraftVocab.from_t2d(np.ones(5, dtype=np.float32))
    with pytest.raises(ValueError, match="t2d must be 1-D"):
        DraftVocab.from_t2d(np.ones((2, 2), dtype=bool))


def test_counting_refuses_bad_input():
    c = TokenCounter(10)
    with pytest.raises(ValueError, match=r"token id 10 at position 2 is outside the vocabulary "
                                         r"\[0, 10\)"):
        c.update([1, 2, 10])
    with pytest.raises(ValueError, match=r"token id -1 at position \(1, 0\)"):
        c.update(np.array([[1, 2], [-1, 3]]))
    with pytest.raises(ValueError, match=r"token id 12 at position \(1, 2\)"):
        c.update(np.array([[1, 12, 0], [0, 0, 12]]), np.array([[1, 0, 0], [0, 0, 1]]))
    with pytest.raises(ValueError, match=r"token id 99 at position \(2, 1\)"):
        c.update([[1], [2], [3, 99]])
    assert c.tokens == 0  # a refused update counts nothing
    with pytest.raises(ValueError, match="token_ids must be integers, got float64"):
        c.update([1.0, 2.0])
    with pytest.raises(ValueError, match=r"loss_mask's shape \(2,\) is not token_ids' \(3,\)"):
        c.update([1, 2, 3], [1, 1])
    with pytest.raises(ValueError, match=r"loss_mask must hold 0/1 .* position 1 is 2"):
        c.update([1, 2, 3], [1, 2, 1])
    with pytest.raises(ValueError, match=r"1-D \[T\] or 2-D \[B, T\], got shape \(1, 1, 2\)"):
        c.update(np.zeros((1, 1, 2), dtype=np.int64))
    with pytest.raises(ValueError, match="vocab_size must be positive"):
        TokenCounter(0)
    with pytest.raises(ValueError, match="vocab_size must be an int"):
        TokenCounter(10.0)
    with pytest.raises(ValueError, match=r"counts must be integers of shape \(10,\)"):
        TokenCounter(10, counts=np.zeros(9, dtype=np.int64))
    with pytest.raises(ValueError, match=r"non-negative: counts\[3\] is -2"):
        TokenCounter(4, counts=[0, 0, 0, -2])
    with pytest.raises(ValueError, match="cannot merge counters of vocab_size 10 and 11"):
        c + TokenCounter(11)
    with pytest.raises(ValueError, match="cannot merge counters of vocab_size 10 and 11"):
        c += TokenCounter(11)
    with pytest.raises(TypeError):
        c + 1
    with pytest.raises(TypeError, match="cannot merge a TokenCounter with dict"):
        c.merge({})


def test_lookups_refuse_ids_outside():
    v = DraftVocab(IDS, 12)
    with pytest.raises(ValueError, match=r"draft id 5 is outside \[0, 5\)"):
        v.draft_to_target([0, 5])
    with pytest.raises(ValueError, match=r"draft id -1 is outside"):
        v.draft_to_target(-1)
    with pytest.raises(ValueError, match=r"target id 12 is outside \[0, 12\)"):
        v.target_to_draft([12])
    with pytest.raises(ValueError, match="draft ids must be integers"):
        v.draft_to_target([1.5])
    with pytest.raises(ValueError, match=r"argmax 12 is outside the target's vocabulary"):
        v.position_mask(np.array([0, 12]))
    with pytest.raises(ValueError, match="argmax must be integers"):
        v.position_mask(np.array([0.0]))
    with pytest.raises(ValueError, match=r"loss_mask's shape \(3,\) is neither argmax's \(2,\)"):
        v.position_mask(np.array([0, 1]), np.array([1, 1, 1]))
    with pytest.raises(ValueError, match=r"loss_mask's shape \(2, 2\) is neither"):
        v.position_mask(np.array([0, 1]), np.ones((2, 2)))  # would broadcast to [2, 2]
    if torch is not None:
        with pytest.raises(ValueError, match=r"argmax -1 is outside"):
            v.position_mask(torch.tensor([-1, 0]))
        with pytest.raises(ValueError, match=r"draft id 7 is outside"):
            v.draft_to_target(torch.tensor([7]))
        with pytest.raises(ValueError, match="argmax must be integers"):
            v.position_mask(torch.tensor([0.5]))


def test_files_refuse_what_they_cannot_read(tmp_path):
    v = DraftVocab(IDS, 12)
    with pytest.raises(ValueError, match="save writes .safetensors, .pt or .bin, not 'v.npy'"):
        v.save(tmp_path / "v.npy")
    with pytest.raises(ValueError, match="is a directory"):
        v.save(tmp_path)
    with pytest.raises(FileNotFoundError):
        DraftVocab.load(tmp_path / "missing.safetensors")
    other = tmp_path / "other.safetensors"
    other.write_bytes(hand_safetensors(drafter_entries()[:4]))
    with pytest.raises(ValueError, match="holds no d2t / t2d tensors"):
        DraftVocab.load(other)
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(ValueError, match=r"holds no d2t / t2d tensors \(looked in: no weight"):
        DraftVocab.load(empty)
    bad = tmp_path / "bad.safetensors"
    bad.write_bytes(b"\x01\x00")
    with pytest.raises(ValueError, match="shorter than the 8-byte header length"):
        DraftVocab.load(bad)
    bad.write_bytes(struct.pack("<Q", 1000) + b"{}")
    with pytest.raises(ValueError, match="header length 1000 does not fit"):
        DraftVocab.load(bad)
    bad.write_bytes(struct.pack("<Q", 2) + b"[]")
    with pytest.raises(ValueError, match="does not start with"):
        DraftVocab.load(bad)
    bad.write_bytes(struct.pack("<Q", 3) + b"{x}")
    with pytest.raises(ValueError, match="not JSON"):
        DraftVocab.load(bad)
    # Offsets past the data, a size that does not match the shape, an unknown dtype.
    raw = hand_safetensors([("d2t", "I64", [5], i64(D2T))])
    bad.write_bytes(raw[:-8])
    with pytest.raises(ValueError, match=r"'d2t'.s data_offsets \[0, 40\] are outside the 32"):
        DraftVocab.load(bad)
    bad.write_bytes(hand_safetensors([("d2t", "I64", [4], i64(D2T))]))
    with pytest.raises(ValueError, match=r"needs 32 bytes, its data_offsets give 40"):
        DraftVocab.load(bad)
    bad.write_bytes(hand_safetensors([("d2t", "Q99", [5], i64(D2T))]))
    with pytest.raises(ValueError, match="unknown dtype 'Q99'"):
        DraftVocab.load(bad)
    bad.write_bytes(hand_safetensors([("t2d", "BOOL", [3], b"\x00\x02\x01")]))
    with pytest.raises(ValueError, match="BOOL tensor 't2d' holds byte 2"):
        DraftVocab.load(bad)
    bad.write_bytes(hand_safetensors([("a.d2t", "I64", [5], i64(D2T)),
                                      ("b.d2t", "I64", [5], i64(D2T))]))
    with pytest.raises(ValueError, match=r"several d2t tensors: \['a.d2t', 'b.d2t'\]"):
        DraftVocab.load(bad, target_vocab_size=12)
    with pytest.raises(ValueError, match="holds no tensor 'nope'"):
        vocab.read_safetensors(other, ["nope"])
    with pytest.raises(ValueError, match="safetensors has no dtype for complex64"):
        vocab.write_safetensors(tmp_path / "c.safetensors", {"c": np.zeros(2, np.complex64)})
    with pytest.raises(ValueError, match="metadata maps strings to strings"):
        vocab.write_safetensors(tmp_path / "c.safetensors", {}, metadata={"n": 1})
    index = tmp_path / "model.safetensors.index.json"
    index.write_text("{}")
    with pytest.raises(ValueError, match="not a checkpoint index"):
        DraftVocab.load(index)


@needs_torch
def test_torch_files_load_weights_only(tmp_path):
    # An arbitrary pickled object beside the buffers: weights_only refuses it.
    torch.save({"d2t": torch.tensor(D2T), "t2d": torch.tensor(T2D), "obj": Fraction(1, 3)},
               tmp_path / "pickled.pt")
    with pytest.raises(ValueError, match="weights_only=False if you trust it"):
        DraftVocab.load(tmp_path / "pickled.pt")
    assert DraftVocab.load(tmp_path / "pickled.pt", weights_only=False).ids.tolist() == IDS


def test_module_imports_neither_torch_nor_the_compiled_client():
    # The three vocab modules loaded under a bare package (no draftfeed/__init__, which
    # imports a client): what they import themselves is all that loads.
    source = REPO / "client" / "python" / "draftfeed"
    code = ("import sys, types\n"
            "pkg = types.ModuleType('draftfeed')\n"
            f"pkg.__path__ = [{str(source)!r}]\n"
            "sys.modules['draftfeed'] = pkg\n"
            "import draftfeed.vocab as m\n"
            "v = m.DraftVocab.from_counts([3, 0, 2, 1], 2)\n"
            "assert v.ids.tolist() == [0, 2]\n"
            "print(sorted(k for k in sys.modules if k == 'torch' or k.startswith('draftfeed')))\n")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert r.stdout.strip() == ("['draftfeed', 'draftfeed.vocab', 'draftfeed.vocab_counting', "
                                "'draftfeed.vocab_files']"), r.stdout + r.stderr
