"""fp8_e4m3 on the wire, from Python, against a real CPU target process.

The target encodes its fp32 states: per token and layer, scale = max|x| / 448 and codes
round x / scale to nearest even. A gRPC feed dequantizes on the way in (bf16(code * scale));
fp8_raw=True keeps the codes and scales. Both are checked against the bf16 feed's states."""

import numpy as np
import pytest

import draftfeed

LAYERS = [2, 0, -1]
K, H = 3, 128


def tokens(n, seed, vocab=4096):
    return np.random.default_rng(seed).integers(0, vocab, size=n, dtype=np.int32)


BATCHES = [(tokens(sum(l), 90 + i), np.array(l, dtype=np.int32))
           for i, l in enumerate([[1], [5, 17, 9], [64, 65], [200]])]


def run(target, **kw):
    with draftfeed.Feed(targets=[target.address], layers=LAYERS, prefetch=4, **kw) as feed:
        results = list(feed.map(BATCHES))
        stats = feed.stats()
    return results, stats


def within_e4m3(got, ref, scales):
    """|got - ref| within half an e4m3 step of ref (at most |ref| / 16 for normals, 2^-10 of
    the scale below them) plus a bf16 rounding on each side (2^-8 relative)."""
    bound = (np.maximum(np.abs(ref) / 16, 2.0 ** -10 * scales[:, :, None])
             + 2.0 ** -8 * (np.abs(ref) + np.abs(got)))
    return np.abs(got - ref) <= bound


def test_fp8_feed_dequantizes_on_the_way_in(target):
    want, want_stats = run(target)
    got, stats = run(target, encoding="fp8_e4m3")
    raw, _ = run(target, encoding="fp8_e4m3", fp8_raw=True)
    for w, g, r in zip(want, got, raw):
        T = w.num_tokens
        assert g.encoding == "bf16" and g.bytes_per_token == K * H * 2
        assert g.hidden_bits.shape == (T, K, H) and g.hidden_bits.dtype == np.uint16
        # The checksum sent (and verified) is the fp8 bytes', the same for both modes.
        assert g.checksum == r.checksum != w.checksum
        assert within_e4m3(g.hidden, w.hidden, r.scales).all()
        # Rounding really happened: e4m3 keeps 4 significant bits, bf16 8.
        err = np.abs(g.hidden - w.hidden)
        assert 0 < err.mean() < 0.05 * np.abs(w.hidden).mean()
    # About half the bytes: K*H + 4K against 2*K*H.
    tokens_sent = sum(b[0].size for b in BATCHES)
    assert want_stats["bytes_received"] == tokens_sent * K * H * 2
    assert stats["bytes_received"] == tokens_sent * (K * H + 4 * K)


def test_fp8_raw_gives_codes_and_scales(target):
    dequantized, _ = run(target, encoding="fp8_e4m3")
    raw, _ = run(target, encoding="fp8_e4m3", fp8_raw=True)
    bf16, _ = run(target)
    for d, r, b in zip(dequantized, raw, bf16):
        T = r.num_tokens
        assert r.encoding == "fp8_e4m3" and r.bytes_per_token == K * H + 4 * K
        assert r.values.shape == (T, K, H) and r.values.dtype == np.uint8
        assert r.scales.shape == (T, K) and r.scales.dtype == np.float32
        # The scale is the row's amax / 448: the amax element codes to +-448 (0x7e / 0xfe).
        amax = np.abs(b.hidden).max(axis=2)
        np.testing.assert_allclose(r.scales * 448, amax, rtol=2.0 ** -8)
        assert ((r.values & 0x7F) == 0x7E).any(axis=2).all()
        assert not ((r.values & 0x7F) == 0x7F).any()  # no NaN codes
        # Decoding here gives what the client decoded on the way in, bit for bit.
        f = draftfeed.E4M3_VALUES[r.values] * r.scales[:, :, None]
        np.testing.assert_array_equal(r.hidden, f)
        bits = f.view(np.uint32)
        rounded = ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16).astype(np.uint16)
        np.testing.assert_array_equal(rounded, d.hidden_bits)


def test_fp8_raw_torch_views_and_dequantization(target):
    torch = pytest.importorskip("torch")
    dequantized, _ = run(target, encoding="fp8_e4m3")
    raw, _ = run(target, encoding="fp8_e4m3", fp8_raw=True)
    for d, r in zip(dequantized, raw):
        codes, scales = r.fp8()
        assert tuple(codes.shape) == (r.num_tokens, K, H)
        assert codes.dtype in (torch.uint8, getattr(torch, "float8_e4m3fn", torch.uint8))
        np.testing.assert_array_equal(codes.view(torch.uint8).numpy(), r.values)
        np.testing.assert_array_equal(scales.numpy(), r.scales)
        # torch's dequantization (the one NCCL results get on the GPU) matches the C++ one.
        t = r.torch()
        assert t.dtype == torch.bfloat16
        np.testing.assert_array_equal(t.view(torch.int16).numpy().view(np.uint16),
                                      d.hidden_bits)
        # The uint8 path (torch without float8) gives the same bits.
        u = draftfeed.dequantize_fp8(codes.view(torch.uint8), scales)
        assert torch.equal(u.view(torch.int16), t.view(torch.int16))


def test_fp8_options_are_checked(target):
    with pytest.raises(draftfeed.DraftfeedError, match="fp8_raw"):
        draftfeed.Feed(targets=[target.address], layers=[0], fp8_raw=True)
    with pytest.raises(ValueError, match="encoding must be 'bf16' or 'fp8_e4m3'"):
        draftfeed.Feed(targets=[target.address], layers=[0], encoding="fp4")
    bf16, _ = run(target)
    with pytest.raises(draftfeed.DraftfeedError, match="fp8_raw=True"):
        bf16[0].values


def test_dataset_hands_raw_codes_and_scales(target):
    torch = pytest.importorskip("torch")
    from draftfeed.torch import HiddenStateDataset

    loader = [(t, l) for t, l in BATCHES]
    with draftfeed.Feed(targets=[target.address], layers=LAYERS, prefetch=2,
                        encoding="fp8_e4m3", fp8_raw=True) as feed:
        items = list(HiddenStateDataset(loader, feed))
    with draftfeed.Feed(targets=[target.address], layers=LAYERS, prefetch=2,
                        encoding="fp8_e4m3") as feed:
        plain = list(HiddenStateDataset(loader, feed))
    for it, p, (tok, _) in zip(items, plain, BATCHES):
        assert tuple(it["hidden"].shape) == (tok.size, K, H)
        assert tuple(it["hidden_scales"].shape) == (tok.size, K)
        assert "hidden_scales" not in p and p["hidden"].dtype == torch.bfloat16
        again = draftfeed.dequantize_fp8(it["hidden"], it["hidden_scales"])
        assert torch.equal(again.view(torch.int16), p["hidden"].view(torch.int16))


def _cuda_devices():
    try:
        import torch
    except ImportError:
        return 0
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


@pytest.mark.skipif(_cuda_devices() < 1, reason="needs a CUDA device")
def test_dequantization_on_a_gpu_gives_the_cpu_bits(target):
    # What an NCCL result gets on the trainer's GPU: the same bf16 bits as the
    # C++ client's dequantization on the way in.
    import torch

    dequantized, _ = run(target, encoding="fp8_e4m3")
    raw, _ = run(target, encoding="fp8_e4m3", fp8_raw=True)
    for d, r in zip(dequantized, raw):
        codes, scales = r.fp8("cuda:0")
        t = draftfeed.dequantize_fp8(codes, scales)
        assert t.is_cuda
        np.testing.assert_array_equal(t.cpu().view(torch.int16).numpy().view(np.uint16),
                                      d.hidden_bits)
        on_gpu = r.torch("cuda:0")  # dequantized on the device it goes to
        assert on_gpu.is_cuda and torch.equal(on_gpu.view(torch.int16), t.view(torch.int16))


@pytest.mark.skipif(_cuda_devices() < 2, reason="needs two CUDA devices")
def test_nccl_fp8_lands_on_the_trainers_gpu(make_target):
    # A CUDA target on GPU 0 sending fp8 by NCCL to GPU 1: the raw payload is the
    # gRPC raw payload; torch() dequantizes it there to the gRPC feed's bf16 bits.
    import torch

    t = make_target(model="small-random", extra=["--device=cuda:0"])
    layers = [0, 2, -1]
    batches = [(tokens(n, 7 + n), [n]) for n in (1, 300, 2048)]

    def results(**kw):
        with draftfeed.Feed(targets=[t.address], layers=layers, prefetch=2,
                            encoding="fp8_e4m3", **kw) as feed:
            out = list(feed.map(batches))
            assert feed.stats()["targets"][0]["transport"] == kw.get("transport", "grpc")
        return out

    grpc_bf16 = results()
    grpc_raw = results(fp8_raw=True)
    nccl = results(transport="nccl", cuda_device=1)
    for g, gr, n in zip(grpc_bf16, grpc_raw, nccl):
        assert n.device == 1 and n.encoding == "fp8_e4m3"
        assert n.checksum == gr.checksum
        codes, scales = n.fp8()
        assert codes.device == torch.device("cuda", 1)
        np.testing.assert_array_equal(codes.view(torch.uint8).cpu().numpy(), gr.values)
        np.testing.assert_array_equal(scales.cpu().numpy(), gr.scales)
        h = n.torch()
        assert h.device == torch.device("cuda", 1) and h.dtype == torch.bfloat16
        np.testing.assert_array_equal(h.cpu().view(torch.int16).numpy().view(np.uint16),
                                      g.hidden_bits)
