"""TLS, mutual TLS and bearer tokens between draftfeed-target processes and the
Python client, with certificates this test makes with openssl: the happy paths
serve exactly what plaintext does, and every misconfiguration ends in a status
whose message says what to fix, with nothing served."""

import signal
import subprocess
import time

import numpy as np
import pytest

import draftfeed
from conftest import TARGET_BIN, TargetProcess

TOKEN_A = "a1" * 16
TOKEN_B = "b2" * 16


def openssl(*args, cwd):
    subprocess.run(["openssl", *args], cwd=cwd, check=True, capture_output=True)


def make_certificates(d):
    """A CA, a server certificate for localhost / 127.0.0.1, a client certificate, the
    same two expired (issued for a day in 2020), and a second, unrelated CA."""
    def key(name):
        openssl("genpkey", "-algorithm", "EC", "-pkeyopt", "ec_paramgen_curve:P-256",
                "-out", name, cwd=d)

    for ca in ("ca", "other-ca"):
        key(f"{ca}.key")
        openssl("req", "-x509", "-new", "-key", f"{ca}.key", "-out", f"{ca}.pem", "-days", "2",
                "-subj", f"/CN={ca}", cwd=d)
    (d / "server.ext").write_text(
        "subjectAltName=DNS:localhost,IP:127.0.0.1\nextendedKeyUsage=serverAuth\n")
    (d / "client.ext").write_text("extendedKeyUsage=clientAuth\n")
    (d / "db").mkdir()
    (d / "db" / "index.txt").write_text("")
    (d / "db" / "serial").write_text("01\n")
    (d / "ca.cnf").write_text(
        "[ca]\ndefault_ca = d\n[d]\ndatabase = db/index.txt\nserial = db/serial\n"
        "new_certs_dir = db\ndefault_md = sha256\npolicy = p\nunique_subject = no\n"
        "[p]\ncommonName = supplied\n")
    for who, cn in (("server", "localhost"), ("client", "trainer-a")):
        key(f"{who}.key")
        openssl("req", "-new", "-key", f"{who}.key", "-out", f"{who}.csr", "-subj", f"/CN={cn}",
                cwd=d)
        openssl("ca", "-batch", "-config", "ca.cnf", "-cert", "ca.pem", "-keyfile", "ca.key",
                "-in", f"{who}.csr", "-out", f"{who}.pem", "-days", "2",
                "-extfile", f"{who}.ext", "-notext", cwd=d)
        openssl("ca", "-batch", "-config", "ca.cnf", "-cert", "ca.pem", "-keyfile", "ca.key",
                "-in", f"{who}.csr", "-out", f"expired-{who}.pem",
                "-startdate", "20200101000000Z", "-enddate", "20200102000000Z",
                "-extfile", f"{who}.ext", "-notext", cwd=d)
    # A client certificate of the other CA, which the target does not trust.
    openssl("x509", "-req", "-in", "client.csr", "-CA", "other-ca.pem", "-CAkey", "other-ca.key",
            "-CAcreateserial", "-out", "stranger.pem", "-days", "2", "-extfile", "client.ext",
            cwd=d)


@pytest.fixture(scope="module")
def certs(tmp_path_factory):
    d = tmp_path_factory.mktemp("certs")
    make_certificates(d)
    return d


def tls_flags(certs, server="server.pem", client_ca=False):
    flags = [f"--tls_cert={certs / server}", f"--tls_key={certs / 'server.key'}"]
    if client_ca:
        flags.append(f"--tls_client_ca={certs / 'ca.pem'}")
    return flags


def token_file(path, **tokens):
    path.write_text("# name: token\n" + "".join(f"{n}: {t}\n" for n, t in tokens.items()))
    path.chmod(0o600)
    return path


def client_tls(certs, ca="ca.pem", cert="client.pem"):
    return draftfeed.Tls(ca=certs / ca, cert=certs / cert if cert else None,
                         key=certs / "client.key" if cert else None)


BATCHES = [(np.arange(i, i + 40, dtype=np.int32) % 4096, [25, 15]) for i in range(4)]


def serve(address, **kw):
    with draftfeed.Feed(targets=[address], layers=[0, 2, -1], connect_timeout_s=10, **kw) as f:
        return [(r.hidden_bits.copy(), r.checksum) for r in f.map(BATCHES)]


def refusal(address, **kw):
    with pytest.raises(draftfeed.DraftfeedError) as e:
        with draftfeed.Feed(targets=[address], layers=[0, -1], connect_timeout_s=10,
                            unavailable_timeout_s=5, **kw) as f:
            f.submit(*BATCHES[0])
            f.next()
    return e.value


def stopped_with_nothing_served(t):
    assert t.terminate() == 0
    log = t.output()
    assert "stopped after 0 batches, 0 tokens" in log, log
    assert "stream opened" not in log, log
    return log


def test_tls_and_mutual_tls_with_tokens_serve_exactly_what_plaintext_does(make_target, certs,
                                                                           tmp_path):
    plain = make_target()
    tls = make_target(extra=tls_flags(certs))
    mtls = make_target(extra=[*tls_flags(certs, client_ca=True),
                              f"--auth_tokens_file={token_file(tmp_path / 't', trainer_a=TOKEN_A)}"])
    want = serve(plain.address)
    for got in (serve(tls.address, tls=draftfeed.Tls(ca=certs / "ca.pem")),
                serve(mtls.address, tls=client_tls(certs), token=TOKEN_A,
                      client_name="sec-test")):
        assert len(got) == len(want)
        for (g, gc), (w, wc) in zip(got, want):
            np.testing.assert_array_equal(g, w)
            assert gc == wc
    info = draftfeed.describe_target(mtls.address, tls=client_tls(certs), token=TOKEN_A)
    assert info["fingerprint"] == draftfeed.describe_target(plain.address)["fingerprint"]
    assert mtls.terminate() == 0
    log = mtls.output()
    assert "(mutual TLS, 1 bearer tokens)" in log, log
    # The stream's line names the token and the client certificate, never the token itself.
    assert ("token trainer_a certificate trainer-a client 'sec-test': layers 0,2,-1, bf16, "
            "transport grpc") in log, log
    assert TOKEN_A not in log


@pytest.mark.parametrize("case,server,ca,message", [
    ("wrong CA", "server.pem", "other-ca.pem",
     "TLS: the target's certificate was refused: it does not chain to the CA of Tls(ca=...), "
     "or it has expired or is not yet valid"),
    ("expired server certificate", "expired-server.pem", "ca.pem",
     "TLS: the target's certificate was refused"),
])
def test_a_server_certificate_the_client_cannot_trust_is_refused(make_target, certs, case, server,
                                                                 ca, message):
    t = make_target(extra=tls_flags(certs, server=server))
    e = refusal(t.address, tls=draftfeed.Tls(ca=certs / ca))
    assert e.code_name == "UNAVAILABLE", e
    assert message in e.message, e.message
    assert "certificate verify failed" in e.message, e.message  # gRPC's own words follow
    stopped_with_nothing_served(t)


@pytest.mark.parametrize("cert,message", [
    (None, "it requires a client certificate (mutual TLS: give Tls(cert=..., key=...))"),
    ("expired-client.pem", "it refused this client's certificate (not signed by its "
                           "--tls_client_ca, or expired)"),
    ("stranger.pem", "it refused this client's certificate"),
])
def test_mutual_tls_refuses_missing_expired_and_untrusted_client_certificates(make_target, certs,
                                                                              cert, message):
    t = make_target(extra=tls_flags(certs, client_ca=True))
    e = refusal(t.address, tls=client_tls(certs, cert=cert))
    assert e.code_name == "UNAVAILABLE", e
    assert "the target closed the connection in the TLS handshake: " + message in e.message, e
    stopped_with_nothing_served(t)


@pytest.mark.parametrize("arg", ["ca", "cert", "key"])
def test_unreadable_tls_files_name_the_python_argument(make_target, certs, tmp_path, arg):
    """A Python caller wrote Tls(ca=..., cert=..., key=...): the error names that argument and
    its value, not the C++ client's TlsOptions field (ca_file, ...)."""
    t = make_target(extra=tls_flags(certs, client_ca=True))
    files = {"ca": certs / "ca.pem", "cert": certs / "client.pem", "key": certs / "client.key"}
    files[arg] = tmp_path / f"missing-{arg}.pem"
    with pytest.raises(draftfeed.DraftfeedError) as e:
        draftfeed.Feed(targets=[t.address], layers=[0], connect_timeout_s=10,
                       tls=draftfeed.Tls(**files))
    assert e.value.code_name == "INVALID_ARGUMENT", e.value
    assert e.value.message == f"Tls({arg}='{files[arg]}'): cannot open", e.value.message
    # A file that holds no PEM block of the kind asked for.
    (tmp_path / "empty.pem").write_text("not a certificate\n")
    files[arg] = tmp_path / "empty.pem"
    with pytest.raises(draftfeed.DraftfeedError, match=rf"^INVALID_ARGUMENT: Tls\({arg}='"):
        draftfeed.describe_target(t.address, tls=draftfeed.Tls(**files))


def test_plaintext_and_tls_clients_against_the_other_kind_of_target(make_target, certs):
    tls = make_target(extra=tls_flags(certs))
    e = refusal(tls.address)
    assert e.code_name == "UNAVAILABLE", e
    assert ("the target closed the connection: it may serve TLS only (started with --tls_cert); "
            "connect with tls") in e.message, e
    stopped_with_nothing_served(tls)

    plain = make_target()
    e = refusal(plain.address, tls=draftfeed.Tls(ca=certs / "ca.pem"))
    assert e.code_name == "UNAVAILABLE", e
    assert ("TLS handshake failed: the target does not speak TLS (it was started without "
            "--tls_cert); connect without tls") in e.message, e
    stopped_with_nothing_served(plain)


def test_missing_and_unknown_tokens_are_unauthenticated(make_target, tmp_path):
    t = make_target(extra=[f"--auth_tokens_file={token_file(tmp_path / 't', a=TOKEN_A)}"])
    e = refusal(t.address)
    assert e.code_name == "UNAUTHENTICATED", e
    assert "missing bearer token" in e.message, e
    e = refusal(t.address, token=TOKEN_B)
    assert e.code_name == "UNAUTHENTICATED", e
    assert "unknown bearer token" in e.message, e
    assert TOKEN_B not in e.message
    with pytest.raises(draftfeed.DraftfeedError, match="UNAUTHENTICATED: .*missing bearer token"):
        draftfeed.describe_target(t.address)
    log = stopped_with_nothing_served(t)
    assert "refused GetTargetInfo from ipv4:127.0.0.1:" in log, log
    assert TOKEN_B not in log


def call_health(address):
    """grpc.health.v1.Health/Check for the whole server, without generated stubs:
    an empty request; the reply b"\\x08\\x01" is status SERVING."""
    grpc = pytest.importorskip("grpc")
    with grpc.insecure_channel(address) as ch:
        return ch.unary_unary("/grpc.health.v1.Health/Check")(b"", timeout=10)


def test_health_needs_no_token(make_target, tmp_path):
    t = make_target(extra=[f"--auth_tokens_file={token_file(tmp_path / 't', a=TOKEN_A)}"])
    assert call_health(t.address) == b"\x08\x01"


def list_services(address, metadata=None):
    """grpc.reflection's ServerReflectionInfo asking list_services (field 7, ""): the status
    code and the first reply's bytes."""
    grpc = pytest.importorskip("grpc")
    with grpc.insecure_channel(address) as ch:
        for version in ("v1", "v1alpha"):
            call = ch.stream_stream(f"/grpc.reflection.{version}.ServerReflection/"
                                    "ServerReflectionInfo")
            try:
                replies = list(call(iter([b"\x3a\x00"]), timeout=10, metadata=metadata))
                return grpc.StatusCode.OK, replies[0]
            except grpc.RpcError as e:
                if e.code() != grpc.StatusCode.UNIMPLEMENTED or version == "v1alpha":
                    return e.code(), b""


def test_reflection_is_served_only_to_targets_without_tokens(make_target, tmp_path):
    """Reflection cannot check a bearer token: a target with --auth_tokens_file serves none
    (it answered every caller, token or not, though a comment said otherwise)."""
    grpc = pytest.importorskip("grpc")
    code, reply = list_services(make_target().address)
    assert code == grpc.StatusCode.OK and b"draftfeed.v1.TargetService" in reply
    t = make_target(extra=[f"--auth_tokens_file={token_file(tmp_path / 't', a=TOKEN_A)}"])
    assert list_services(t.address) == (grpc.StatusCode.UNIMPLEMENTED, b"")
    assert list_services(t.address, [("authorization", f"Bearer {TOKEN_A}")]) == (
        grpc.StatusCode.UNIMPLEMENTED, b"")
    assert call_health(t.address) == b"\x08\x01"


def wait_for(t, text, timeout=30):
    deadline = time.time() + timeout
    while text not in t.output():
        assert time.time() < deadline, t.output()
        time.sleep(0.05)


def test_sighup_rereads_the_token_file(make_target, tmp_path):
    path = token_file(tmp_path / "tokens", a=TOKEN_A)
    t = make_target(extra=[f"--auth_tokens_file={path}"])
    assert serve(t.address, token=TOKEN_A)
    assert refusal(t.address, token=TOKEN_B).code_name == "UNAUTHENTICATED"

    token_file(path, b=TOKEN_B)
    t.proc.send_signal(signal.SIGHUP)
    wait_for(t, f"SIGHUP: 1 bearer tokens from {path}, for calls from now on")
    assert serve(t.address, token=TOKEN_B)
    e = refusal(t.address, token=TOKEN_A)
    assert e.code_name == "UNAUTHENTICATED" and "unknown bearer token" in e.message, e

    # A bad file keeps the set in use and says why.
    path.write_text("b: short\n")
    t.proc.send_signal(signal.SIGHUP)
    wait_for(t, f"SIGHUP: kept the 1 tokens in use: {path}:1: the token of 'b' has 5 characters")
    assert serve(t.address, token=TOKEN_B)
    assert t.terminate() == 0


def run_target(*args):
    return subprocess.run([str(TARGET_BIN), "--threads=1", *args], capture_output=True, text=True,
                          timeout=60)


def test_start_up_refuses_what_it_cannot_serve_safely(certs, tmp_path):
    r = run_target("--listen=0.0.0.0:0")
    assert r.returncode == 1
    assert ("draftfeed-target: error: --listen=0.0.0.0:0 is not a loopback address and no TLS "
            "is configured: add --tls_cert and --tls_key (and --tls_client_ca for mutual TLS), "
            "or --insecure to serve plaintext on it") in r.stderr, r.stderr
    bad = tmp_path / "bad-tokens"
    bad.write_text("trainer-a " + TOKEN_A + "\n")
    r = run_target(f"--auth_tokens_file={bad}")
    assert r.returncode == 1
    assert f"draftfeed-target: error: {bad}:1: expected 'name: token'" in r.stderr, r.stderr
    assert TOKEN_A not in r.stderr
    r = run_target(f"--tls_cert={certs / 'server.pem'}")
    assert r.returncode == 1
    assert "--tls_cert needs --tls_key" in r.stderr, r.stderr
    r = run_target(f"--tls_cert={certs / 'server.key'}", f"--tls_key={certs / 'server.key'}")
    assert r.returncode == 1
    assert "no PEM '-----BEGIN ...CERTIFICATE-----' block in it" in r.stderr, r.stderr
    # A key that is not the certificate's: OpenSSL refuses it as the server starts.
    r = run_target("--listen=127.0.0.1:0", f"--tls_cert={certs / 'server.pem'}",
                   f"--tls_key={certs / 'client.key'}")
    assert r.returncode == 1
    assert "--tls_key is not the private key of --tls_cert?" in r.stderr, r.stderr
    assert "serving" not in r.stderr


def test_insecure_allows_plaintext_beyond_loopback_and_world_readable_tokens_warn(tmp_path):
    path = token_file(tmp_path / "tokens", a=TOKEN_A)
    path.chmod(0o644)
    t = TargetProcess(extra=["--listen=0.0.0.0:0", "--insecure", f"--auth_tokens_file={path}"])
    try:
        assert serve(t.address, token=TOKEN_A)
        assert t.terminate() == 0
        assert (f"warning: --auth_tokens_file={path} has mode 0644: every user of this host can "
                f"read it; chmod 600 {path}") in t.output()
    finally:
        t.kill()


def _cuda_devices():
    try:
        import torch
    except ImportError:
        return 0
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


@pytest.mark.skipif(_cuda_devices() < 2, reason="needs two CUDA devices")
def test_nccl_streams_carry_mutual_tls_and_the_token(make_target, certs, tmp_path):
    # NCCL's set-up and announcements travel on the gRPC stream, so they need the
    # certificate and the token like any stream; the payload lands on the trainer's GPU
    # with the checksum of the same batch over plaintext gRPC.
    import torch

    tokens = token_file(tmp_path / "t", trainer_a=TOKEN_A)
    t = make_target(model="small-random", extra=["--device=cuda:0",
                                                 *tls_flags(certs, client_ca=True),
                                                 f"--auth_tokens_file={tokens}"])
    plain = make_target(model="small-random", extra=["--device=cuda:0"])
    want = serve(plain.address)
    with draftfeed.Feed(targets=[t.address], layers=[0, 2, -1], transport="nccl", cuda_device=1,
                        tls=client_tls(certs), token=TOKEN_A) as f:
        got = list(f.map(BATCHES))
        assert f.stats()["targets"][0]["transport"] == "nccl"
    for r, (bits, checksum) in zip(got, want):
        assert r.device == 1 and r.checksum == checksum
        np.testing.assert_array_equal(r.torch().cpu().view(torch.int16).numpy().view(np.uint16),
                                      bits)
    e = refusal(t.address, transport="nccl", cuda_device=1, tls=client_tls(certs))
    assert e.code_name == "UNAUTHENTICATED" and "missing bearer token" in e.message, e
    assert t.terminate() == 0
    assert "token trainer_a certificate trainer-a" in t.output() and "transport nccl" in t.output()
