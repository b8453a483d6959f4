"""NCCL across hosts, as far as a machine without GPUs can check it: the feed's
keywords and their refusals, the target's flags, its start-up line and what
GetTargetInfo says (the transfers themselves: nccl_hosts_gpu_test)."""

import os
import subprocess

import pytest

import draftfeed
from conftest import TARGET_BIN


def test_nccl_across_hosts_is_a_keyword_of_the_feed(target):
    # With gRPC it would mean nothing: refused, naming the field.
    with pytest.raises(draftfeed.DraftfeedError) as e:
        draftfeed.Feed(targets=[target.address], layers=[0], nccl_across_hosts=True)
    assert e.value.code_name == "INVALID_ARGUMENT"
    assert "FeedOptions.nccl_across_hosts is set but FeedOptions.transport is grpc" in str(e.value)
    # With auto it passes the option checks; what fails next is the GPU.
    with pytest.raises(draftfeed.DraftfeedError) as e:
        draftfeed.Feed(targets=[target.address], layers=[0], transport="auto",
                       nccl_across_hosts=True)
    assert "cuda_device" in str(e.value) or "without NCCL" in str(e.value)


@pytest.mark.parametrize("keyword,value,message", [
    ("nccl_setup_timeout_s", 0.0, "FeedOptions.nccl_setup_timeout_s must be a finite number"),
    ("nccl_setup_timeout_s", float("nan"), "FeedOptions.nccl_setup_timeout_s must be a finite"),
    ("nccl_timeout_s", -1.0, "FeedOptions.nccl_timeout_s must be a finite number"),
    ("nccl_socket_ifname", "eth 0", "FeedOptions.nccl_socket_ifname='eth 0' has whitespace"),
])
def test_advanced_nccl_keywords_are_checked(target, keyword, value, message):
    with pytest.raises(draftfeed.DraftfeedError) as e:
        draftfeed.Feed(targets=[target.address], layers=[0], transport="auto",
                       **{keyword: value})
    assert e.value.code_name == "INVALID_ARGUMENT"
    assert message in str(e.value)


def test_a_cpu_target_says_it_offers_no_nccl_to_other_hosts(target):
    info = draftfeed.describe_target(target.address)
    assert info["nccl_across_hosts"] is False
    assert info["transports"] == ["grpc"]
    out = target.output()
    assert "token budget 16384, transport grpc, loaded in" in out, out
    assert "draftfeed-target: nccl not offered: " in out, out


def run_target(*args, env=None, timeout=60):
    return subprocess.run([str(TARGET_BIN), "--listen=127.0.0.1:0", "--threads=1", *args],
                          capture_output=True, text=True, timeout=timeout,
                          env={**os.environ, **(env or {})})


@pytest.mark.parametrize("flag,message", [
    ("--nccl_setup_timeout_s=0", "--nccl_setup_timeout_s=0 must be a finite number > 0"),
    ("--nccl_setup_timeout_s=inf", "--nccl_setup_timeout_s=inf must be a finite number > 0"),
    ("--nccl_socket_ifname=eth 0", "--nccl_socket_ifname='eth 0' has whitespace"),
])
def test_nccl_flags_are_checked(flag, message):
    r = run_target(flag)
    assert r.returncode == 1, r.stderr
    assert "draftfeed-target: error: " + message in r.stderr, r.stderr
    assert "serving" not in r.stderr


def test_an_interface_other_than_the_environments_is_refused():
    r = run_target("--nccl_socket_ifname=eth0", env={"NCCL_SOCKET_IFNAME": "ib0"})
    assert r.returncode == 1, r.stderr
    assert ("--nccl_socket_ifname=eth0 but this process already has NCCL_SOCKET_IFNAME=ib0"
            in r.stderr), r.stderr


def test_the_nccl_flags_are_taken(make_target):
    # The same interface as the environment's, and a host-only target: it
    # serves (the line says why NCCL is not offered on a CPU target).
    env_before = os.environ.get("NCCL_SOCKET_IFNAME")
    os.environ["NCCL_SOCKET_IFNAME"] = "lo"
    try:
        t = make_target(extra=["--nccl_socket_ifname=lo", "--nccl_across_hosts=false",
                               "--nccl_setup_timeout_s=5"])
    finally:
        if env_before is None:
            del os.environ["NCCL_SOCKET_IFNAME"]
        else:
            os.environ["NCCL_SOCKET_IFNAME"] = env_before
    assert draftfeed.describe_target(t.address)["nccl_across_hosts"] is False
    assert t.terminate() == 0
    assert "nccl not offered: " in t.output()
