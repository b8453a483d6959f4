"""The image deploy/container/build.sh makes, run: its target serves the synthetic trainer.

The container runs through `buildah run --isolation=chroot` (no user namespaces and no OCI
runtime needed, and the host's network), so the trainer on the host reaches the target inside
and must print the main job's checksum. Building the image takes minutes and is not part of the
test: it skips unless the image (DRAFTFEED_IMAGE, default localhost/draftfeed-target:latest)
exists in buildah's store (STORAGE_DRIVER as for build.sh).
"""

import os
import pathlib
import shutil
import subprocess
import tempfile
import time

import pytest

REPO = pathlib.Path(__file__).resolve().parents[2]
BUILD = pathlib.Path(os.environ.get("DRAFTFEED_BUILD_DIR", REPO / "build"))
IMAGE = os.environ.get("DRAFTFEED_IMAGE", "localhost/draftfeed-target:latest")
MAIN_JOB_CHECKSUM = "03c93acea493a7d7"


def buildah(*args, **kw):
    driver = os.environ.get("STORAGE_DRIVER")
    argv = ["buildah", *([f"--storage-driver={driver}"] if driver else []), *args]
    return subprocess.run(argv, capture_output=True, text=True, **kw)


@pytest.fixture
def container():
    if shutil.which("buildah") is None:
        pytest.skip("buildah is not installed")
    if buildah("inspect", "--type", "image", IMAGE).returncode != 0:
        pytest.skip(f"no image {IMAGE} (bash deploy/container/build.sh makes it)")
    r = buildah("from", IMAGE)
    assert r.returncode == 0, r.stderr
    name = r.stdout.strip().splitlines()[-1]
    yield name
    buildah("rm", name)


def test_image_serves_the_trainer(container):
    run_dir = tempfile.mkdtemp(prefix="draftfeed-container-")
    os.chmod(run_dir, 0o777)  # the image's user (nobody) writes the port file
    log = open(os.path.join(run_dir, "log"), "w+")
    target = subprocess.Popen(
        ["buildah", *([f"--storage-driver={os.environ['STORAGE_DRIVER']}"]
                      if os.environ.get("STORAGE_DRIVER") else []),
         "run", "--isolation=chroot", "-v", f"{run_dir}:/run/draftfeed", container, "--",
         "/opt/draftfeed/bin/draftfeed-target", "--model=tiny-random", "--device=cpu",
         "--listen=127.0.0.1:0", "--port_file=/run/draftfeed/port", "--threads=1"],
        stdout=log, stderr=subprocess.STDOUT)
    try:
        port_file = pathlib.Path(run_dir, "port")
        deadline = time.time() + 120
        while not port_file.exists():
            log.seek(0)
            assert target.poll() is None, f"the container's target exited: {log.read()}"
            assert time.time() < deadline, "the container's target did not serve within 120 s"
            time.sleep(0.2)
        port = int(port_file.read_text())
        r = subprocess.run(
            ["/usr/bin/python3", str(REPO / "client/python/examples/synthetic_trainer.py"),
             "--target", f"127.0.0.1:{port}", "--batches", "300"],
            env=dict(os.environ, PYTHONPATH=str(BUILD / "python")), capture_output=True,
            text=True, timeout=600)
        assert r.returncode == 0, r.stdout + r.stderr
        assert f"checksum {MAIN_JOB_CHECKSUM}" in r.stdout, r.stdout
    finally:
        if target.poll() is None:
            target.terminate()
            target.wait(60)
        shutil.rmtree(run_dir, ignore_errors=True)
