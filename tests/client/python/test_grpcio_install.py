"""The pure-Python wheel: built here without network or build isolation (DRAFTFEED_NATIVE=0),
installed into a fresh venv, imported with no compiled module anywhere in reach, and streaming
from a real target with its checksums verified."""

import os
import shutil
import subprocess
import sys
import textwrap
import zipfile

import numpy as np
import pytest

import draftfeed
from conftest import REPO

pytest.importorskip("grpc")


@pytest.fixture(scope="module")
def wheel(tmp_path_factory):
    # Built from a copy of client/python: pip's build/ and egg-info stay out of the shared tree.
    work = tmp_path_factory.mktemp("wheel")
    src = work / "python"
    shutil.copytree(REPO / "client" / "python", src,
                    ignore=shutil.ignore_patterns("build", "*.egg-info", "__pycache__",
                                                  "_draftfeed*.so"))
    env = dict(os.environ, DRAFTFEED_NATIVE="0", DRAFTFEED_SOURCE_DIR=str(REPO))
    r = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-build-isolation",
                        "--no-deps", "--no-index", "-w", str(work / "dist"), str(src)],
                       capture_output=True, text=True, env=env, timeout=600)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    (whl,) = (work / "dist").glob("draftfeed-*.whl")
    return whl


def test_the_wheel_is_pure_python_and_carries_the_descriptor_set(wheel):
    assert wheel.name.endswith("-py3-none-any.whl"), wheel.name
    names = zipfile.ZipFile(wheel).namelist()
    assert "draftfeed/_grpcio/draftfeed_v1.desc" in names
    assert "draftfeed/_grpcio/feed.py" in names
    assert not [n for n in names if n.endswith((".so", ".pyd"))]
    meta = zipfile.ZipFile(wheel).read(
        next(n for n in names if n.endswith("METADATA"))).decode()
    for dep in ("numpy", "grpcio", "protobuf"):
        assert f"Requires-Dist: {dep}" in meta, meta


def test_an_unknown_native_mode_is_refused_by_name(tmp_path):
    env = dict(os.environ, DRAFTFEED_NATIVE="maybe", DRAFTFEED_SOURCE_DIR=str(REPO))
    r = subprocess.run([sys.executable, "setup.py", "--version"],
                       cwd=REPO / "client" / "python", capture_output=True, text=True, env=env)
    assert r.returncode != 0 and "DRAFTFEED_NATIVE='maybe'" in r.stderr


def test_installed_into_a_fresh_venv_it_streams_without_the_compiled_module(wheel, target,
                                                                             tmp_path):
    venv = tmp_path / "venv"
    subprocess.run(["/usr/bin/python3", "-m", "venv", "--system-site-packages", str(venv)],
                   check=True)
    py = venv / "bin" / "python"
    # numpy, grpcio and protobuf come from the system's site-packages (no index here).
    r = subprocess.run([str(py), "-m", "pip", "install", "--no-index", "-q", str(wheel)],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    with draftfeed.Feed(targets=[target.address], layers=[0, -1], transport="grpcio") as feed:
        want = [(r.checksum, r.hidden_bits.copy())
                for r in feed.map([(np.arange(50, dtype=np.int32), [20, 30])])]
    script = textwrap.dedent(f"""
        import importlib.util, sys, numpy as np
        import draftfeed
        assert draftfeed.__file__.startswith(sys.prefix), (draftfeed.__file__, sys.prefix)
        assert importlib.util.find_spec("draftfeed._draftfeed") is None
        assert draftfeed.native_import_error, "no reason given for the missing module"
        with draftfeed.Feed(targets=["{target.address}"], layers=[0, -1]) as feed:
            assert feed.client == "grpcio", feed.client
            (r,) = feed.map([(np.arange(50, dtype=np.int32), [20, 30])])
            np.save(sys.argv[1], r.hidden_bits)
            print(r.checksum)
    """)
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "DRAFTFEED_TRANSPORT")}
    out = tmp_path / "bits.npy"
    r = subprocess.run([str(py), "-c", script, str(out)], cwd=tmp_path, capture_output=True,
                       text=True, env=env, timeout=300)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert int(r.stdout.split()[-1]) == want[0][0]
    np.testing.assert_array_equal(np.load(out), want[0][1])
