"""Fixtures: real draftfeed-target processes on loopback."""

import os
import pathlib
import signal
import subprocess
import tempfile
import time

import pytest

REPO = pathlib.Path(__file__).resolve().parents[1]
BUILD = pathlib.Path(os.environ.get("DRAFTFEED_BUILD_DIR", REPO / "build"))
TARGET_BIN = BUILD / "bin" / "draftfeed-target"


class TargetProcess:
    def __init__(self, model="tiny-random", extra=()):
        self.dir = tempfile.mkdtemp(prefix="draftfeed-target-")
        port_file = os.path.join(self.dir, "port")
        self.log = open(os.path.join(self.dir, "log"), "w+")
        self.proc = subprocess.Popen(
            [str(TARGET_BIN), f"--model={model}", "--listen=127.0.0.1:0", f"--port_file={port_file}",
             "--threads=1", "--check_weights", *extra],  # a later --listen in `extra` wins
            stdout=self.log, stderr=subprocess.STDOUT)
        deadline = time.time() + 60
        while not os.path.exists(port_file):
            if self.proc.poll() is not None:
                raise RuntimeError(f"target exited: {self.output()}")
            if time.time() > deadline:
                raise RuntimeError("target did not start within 60s")
            time.sleep(0.05)
        self.port = int(open(port_file).read())
        self.address = f"127.0.0.1:{self.port}"

    def output(self):
        self.log.flush()
        self.log.seek(0)
        return self.log.read()

    def terminate(self, timeout=60):
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        return self.proc.wait(timeout)

    def kill(self):
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()


@pytest.fixture
def target():
    t = TargetProcess()
    yield t
    t.kill()


@pytest.fixture
def make_target():
    made = []

    def make(**kw):
        t = TargetProcess(**kw)
        made.append(t)
        return t

    yield make
    for t in made:
        t.kill()
