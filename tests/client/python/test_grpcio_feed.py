"""The pure-Python client (transport="grpcio": the pip grpcio and protobuf packages, no compiled
module in the path) against real CPU target processes: the same results, bit for bit and
checksum for checksum, as the compiled client's, the same errors, exactly-once delivery when a
target is killed, TLS and tokens."""

import importlib.util

import numpy as np
import pytest

import draftfeed
from conftest import REPO

pytest.importorskip("grpc")
from draftfeed import _client  # noqa: E402
from draftfeed._grpcio import checksum, conn  # noqa: E402

NATIVE = _client.native is not None
needs_native = pytest.mark.skipif(not NATIVE, reason="the compiled module is not built here")
LENS = [[5], [1, 2, 3], [64, 65], [200], [7, 300, 1]]


def tokens(n, seed, vocab=4096):
    return np.random.default_rng(seed).integers(0, vocab, size=n, dtype=np.int32)


BATCHES = [(tokens(sum(l), 10 + i), np.array(l, dtype=np.int32)) for i, l in enumerate(LENS)]


def run(address, transport, layers=(3, 0, -1), batches=BATCHES, **kw):
    with draftfeed.Feed(targets=[address], layers=list(layers), prefetch=4, transport=transport,
                        **kw) as feed:
        assert feed.client == ("grpcio" if transport == "grpcio" else "native")
        out = [(r.batch_id, r.hidden_bits.copy(), r.checksum, r.encoding, r.bytes_per_token)
               for r in feed.map(batches)]
        return out, feed.stats()


@pytest.mark.parametrize("read_handoff", [False, True])
def test_results_and_checksums_as_the_compiled_clients(target, read_handoff):
    got, stats = run(target.address, "grpcio", read_handoff=read_handoff)
    assert [g[0] for g in got] == list(range(1, len(BATCHES) + 1))
    for (tok, _), (_, bits, ck, enc, bpt) in zip(BATCHES, got):
        assert bits.shape == (len(tok), 3, 128) and bits.dtype == np.uint16
        assert enc == "bf16" and bpt == 3 * 128 * 2
        # The checksum the target sent is the payload's, as this client assembled it.
        assert checksum.payload_checksum(bits) == ck
    assert stats["delivered"] == len(BATCHES) and stats["failed"] == 0
    assert stats["bytes_received"] == sum(t.size for t, _ in BATCHES) * 3 * 128 * 2
    assert stats["targets"][0]["transport"] == "grpc"
    if NATIVE:
        want, want_stats = run(target.address, "grpc")
        for w, g in zip(want, got):
            np.testing.assert_array_equal(w[1], g[1])
            assert w[2] == g[2]
        assert set(stats) == set(want_stats)
        assert set(stats["targets"][0]) == set(want_stats["targets"][0])


def test_describe_target_and_feed_target(target):
    info = draftfeed.describe_target(target.address, transport="grpcio")
    assert info["model_id"] == "tiny-random:0" and info["num_layers"] == 4
    assert info["address"] == target.address and "grpc" in info["transports"]
    if NATIVE:
        assert info == draftfeed.describe_target(target.address)
    with draftfeed.Feed(targets=[target.address], layers=[0], transport="grpcio") as feed:
        assert feed.target["fingerprint"] == info["fingerprint"]


def test_torch_and_float_views(target):
    torch = pytest.importorskip("torch")
    with draftfeed.Feed(targets=[target.address], layers=[0, -1], transport="grpcio") as feed:
        r = list(feed.map([(tokens(33, 2), [33])]))[0]
    t = r.torch()
    assert t.dtype == torch.bfloat16 and tuple(t.shape) == (33, 2, 128)
    np.testing.assert_array_equal(t.float().numpy(), r.hidden)
    np.testing.assert_array_equal(r.hidden.view(np.uint32) >> 16, r.hidden_bits)
    assert r.device == -1 and r.__dlpack_device__() == (1, 0)


def test_fp8_dequantized_and_raw_as_the_compiled_clients(target):
    deq, _ = run(target.address, "grpcio", encoding="fp8_e4m3")
    with draftfeed.Feed(targets=[target.address], layers=[3, 0, -1], prefetch=4,
                        transport="grpcio", encoding="fp8_e4m3", fp8_raw=True) as feed:
        raw = [(r.values.copy(), r.scales.copy(), r.checksum, r.bytes_per_token)
               for r in feed.map(BATCHES)]
    for (_, bits, ck, enc, bpt), (codes, scales, rck, rbpt) in zip(deq, raw):
        assert enc == "bf16" and bpt == 3 * 128 * 2 and rbpt == 3 * 128 + 4 * 3
        assert ck == rck  # of the fp8 bytes sent, for both
        # bf16(float32(code) * scale), rounded to nearest even: the compiled client's rule.
        f = (draftfeed.E4M3_VALUES[codes] * scales[:, :, None]).astype(np.float32)
        u = f.view(np.uint32)
        np.testing.assert_array_equal(bits, ((u + 0x7FFF + ((u >> 16) & 1)) >> 16)
                                      .astype(np.uint16))
    if NATIVE:
        want, _ = run(target.address, "grpc", encoding="fp8_e4m3")
        for w, g in zip(want, deq):
            np.testing.assert_array_equal(w[1], g[1])
            assert w[2] == g[2]


def test_refusals_and_bad_batches_as_the_compiled_clients(target):
    with draftfeed.Feed(targets=[target.address], layers=[-1], transport="grpcio") as feed:
        bad = tokens(10, 1)
        bad[4] = 4096
        feed.submit(bad, [10])
        with pytest.raises(draftfeed.DraftfeedError) as e:
            feed.next()
        assert e.value.code_name == "INVALID_ARGUMENT" and "4096" in str(e.value)
        feed.submit(tokens(10, 1), [6, 5])
        with pytest.raises(draftfeed.DraftfeedError, match="11"):
            feed.next()
        assert list(feed.map([(tokens(10, 1), [10])]))[0].num_tokens == 10
        with pytest.raises(draftfeed.DraftfeedError, match="Submit first"):
            feed.next()
    with pytest.raises(draftfeed.DraftfeedError) as e:
        draftfeed.Feed(targets=[target.address], layers=[0], transport="grpcio",
                       expected_fingerprint="deadbeef")
    assert e.value.code_name == "FAILED_PRECONDITION" and "deadbeef" in str(e.value)
    with pytest.raises(draftfeed.DraftfeedError) as e:
        draftfeed.Feed(targets=[target.address], layers=[0, 9], transport="grpcio")
    assert e.value.code_name == "INVALID_ARGUMENT" and "9" in str(e.value)
    with pytest.raises(draftfeed.DraftfeedError, match="fp8_raw"):
        draftfeed.Feed(targets=[target.address], layers=[0], transport="grpcio", fp8_raw=True)
    with pytest.raises(ValueError, match="unknown Feed option: bogus"):
        draftfeed.Feed(targets=[target.address], layers=[0], transport="grpcio", bogus=1)
    with pytest.raises(ValueError, match="'grpcio'"):
        draftfeed.Feed(targets=[target.address], layers=[0], transport="pigeon")
    with pytest.raises(draftfeed.DraftfeedError) as e:
        draftfeed.Feed(targets=["127.0.0.1:1"], layers=[0], transport="grpcio",
                       connect_timeout_s=1.0)
    assert e.value.code_name == "UNAVAILABLE" and "connection refused" in str(e.value)


def test_nccl_needs_the_compiled_client(target, monkeypatch):
    monkeypatch.setattr(_client, "native", None)  # as in an install without it
    with pytest.raises(draftfeed.DraftfeedError) as e:
        draftfeed.Feed(targets=[target.address], layers=[0], transport="nccl", cuda_device=0)
    assert e.value.code_name == "UNIMPLEMENTED"
    assert "without NCCL" in str(e.value) and "grpcio" in str(e.value)


def test_a_corrupted_chunk_fails_its_batch_by_checksum(target, monkeypatch):
    real = conn.copy_and_hash

    def corrupting(dst, offset, src):  # one bit flipped on the way, as a bad link would
        bad = src.copy()
        bad[len(bad) // 2] ^= 1
        return real(dst, offset, bad)

    monkeypatch.setattr(conn, "copy_and_hash", corrupting)
    with draftfeed.Feed(targets=[target.address], layers=[0], transport="grpcio",
                        read_handoff=False) as feed:
        feed.submit(*BATCHES[0])
        with pytest.raises(draftfeed.DraftfeedError, match="checksum mismatch") as e:
            feed.next()
        assert e.value.code_name == "DATA_LOSS"


def test_killed_target_every_batch_once_and_bit_identical(make_target):
    a, b = make_target(), make_target()
    batches = [(tokens(40 + 7 * i, 100 + i), [40 + 7 * i]) for i in range(40)]
    want = [bits for _, bits, *_ in run(a.address, "grpcio", layers=[1, -1],
                                        batches=batches)[0]]
    got = {}
    with draftfeed.Feed(targets=[a.address, b.address], layers=[1, -1], prefetch=8,
                        credits_per_target=2, transport="grpcio", unavailable_timeout_s=30,
                        reconnect_backoff_max_s=0.5) as feed:
        for i, r in enumerate(feed.map(batches)):
            assert r.batch_id not in got
            got[r.batch_id] = r.hidden_bits.copy()
            if i == 5:
                b.kill()  # mid-stream: its batches go to a
        stats = feed.stats()
    assert sorted(got) == list(range(1, len(batches) + 1))
    for i, w in enumerate(want):
        np.testing.assert_array_equal(got[i + 1], w)
    per = {t["address"]: t for t in stats["targets"]}
    assert per[b.address]["state"] != "live" and per[b.address]["failures"] >= 1
    assert per[a.address]["delivered_batches"] + per[b.address]["delivered_batches"] == 40
    assert stats["delivered"] == 40 and stats["failed"] == 0


def test_leaving_map_early_cancels_and_the_feed_goes_on(target):
    with draftfeed.Feed(targets=[target.address], layers=[0], prefetch=6,
                        transport="grpcio") as feed:
        for r in feed.map([(tokens(64, i), [64]) for i in range(12)]):
            break
        s = feed.stats()
        assert s["outstanding"] == 0 and s["cancelled"] >= 1
        assert [r.num_tokens for r in feed.map([(tokens(9, 1), [9])])] == [9]
    assert feed.stats()["closed"] is True


def _security():
    spec = importlib.util.spec_from_file_location(
        "df_security", REPO / "tests" / "server" / "service" / "test_security.py")
    m = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(m)
    return m


@pytest.fixture(scope="module")
def certs(tmp_path_factory):
    d = tmp_path_factory.mktemp("certs")
    _security().make_certificates(d)
    return d


def test_tls_mutual_tls_and_tokens(make_target, certs, tmp_path):
    sec = _security()
    plain = make_target()
    mtls = make_target(extra=[*sec.tls_flags(certs, client_ca=True),
                              f"--auth_tokens_file="
                              f"{sec.token_file(tmp_path / 't', trainer_a=sec.TOKEN_A)}"])
    want, _ = run(plain.address, "grpcio", layers=[0, -1])
    got, _ = run(mtls.address, "grpcio", layers=[0, -1], tls=sec.client_tls(certs),
                 token=sec.TOKEN_A, connect_timeout_s=10)
    for w, g in zip(want, got):
        np.testing.assert_array_equal(w[1], g[1])
        assert w[2] == g[2]
    info = draftfeed.describe_target(mtls.address, tls=sec.client_tls(certs), token=sec.TOKEN_A,
                                     transport="grpcio")
    assert info["model_id"] == "tiny-random:0"

    def refused(**kw):
        with pytest.raises(draftfeed.DraftfeedError) as e:
            draftfeed.Feed(targets=[mtls.address], layers=[0], transport="grpcio",
                           connect_timeout_s=10, unavailable_timeout_s=5, **kw)
        return e.value

    e = refused(tls=sec.client_tls(certs))  # no token
    assert e.code_name == "UNAUTHENTICATED"
    e = refused(tls=draftfeed.Tls(ca=certs / "other-ca.pem", cert=certs / "client.pem",
                                  key=certs / "client.key"), token=sec.TOKEN_A)
    assert e.code_name == "UNAVAILABLE" and "certificate" in str(e)
    with pytest.raises(draftfeed.DraftfeedError, match=r"Tls\(ca='.*missing\.pem'\): cannot open"):
        draftfeed.Feed(targets=[mtls.address], layers=[0], transport="grpcio",
                       tls=draftfeed.Tls(ca=tmp_path / "missing.pem"))


def test_environment_variable_picks_the_grpcio_client(target, monkeypatch):
    monkeypatch.setenv("DRAFTFEED_TRANSPORT", "grpcio")
    with draftfeed.Feed(targets=[target.address], layers=[0]) as feed:
        assert feed.client == "grpcio"
        assert [r.num_tokens for r in feed.map(BATCHES[:2])] == [5, 6]
