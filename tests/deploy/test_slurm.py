"""deploy/slurm/draftfeed-hetjob.sbatch through sbatch on a local Slurm this test starts.

The cluster is this host (tests/deploy/local_slurm.py: two slurmd nodes, GPUs as counted
resources), started and stopped by the test and skipped only when Slurm is not installed or cannot start here.

Two tiny-random targets on the CPU (component 0) and the synthetic trainer (component 1) run as
one heterogeneous job; the trainer must print the main job's run checksum, which folds every
batch's checksum in order and so does not depend on how many targets computed them.
"""

import os
import pathlib
import re
import sys

import pytest

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
import local_slurm  # noqa: E402

REPO = pathlib.Path(__file__).resolve().parents[2]
BUILD = pathlib.Path(os.environ.get("DRAFTFEED_BUILD_DIR", REPO / "build"))
SCRIPT = REPO / "deploy" / "slurm" / "draftfeed-hetjob.sbatch"
MAIN_JOB_CHECKSUM = "03c93acea493a7d7"  # scripts/run_main_job.sh on tiny-random, 300 batches

missing = local_slurm.missing_tools()
pytestmark = pytest.mark.skipif(
    bool(missing), reason=f"Slurm is not installed ({', '.join(missing)} missing; "
    "Debian: apt-get install slurm-wlm munge)")


@pytest.fixture(scope="module")
def cluster():
    if not (BUILD / "bin" / "draftfeed-target").exists():
        pytest.skip(f"no {BUILD}/bin/draftfeed-target (set DRAFTFEED_BUILD_DIR)")
    try:
        c = local_slurm.LocalSlurm(nodes=2, cpus=16, gpus=2).__enter__()
    except RuntimeError as e:
        pytest.skip(f"a local Slurm could not start here: {e}")
    yield c
    c.__exit__(None, None, None)


def job_env(**extra):
    return {
        "DRAFTFEED_BUILD_DIR": str(BUILD),
        "DRAFTFEED_DEVICE": "cpu",
        "DRAFTFEED_TARGET_ARGS": "--threads=1",
        "DRAFTFEED_TRAINER": f"/usr/bin/python3 {REPO}/client/python/examples/synthetic_trainer.py "
                             "--batches=300",
        "DRAFTFEED_START_TIMEOUT_S": "120",
        **extra,
    }


def test_hetjob_targets_and_trainer(cluster, tmp_path):
    out = tmp_path / "job.out"
    r = cluster.sbatch([f"--output={out}", str(SCRIPT)], cwd=tmp_path, env=job_env())
    log = out.read_text(errors="replace") if out.exists() else ""
    assert r.returncode == 0, f"sbatch: {r.stderr}\njob output:\n{log}\n{cluster.logs()}"
    # Both targets served, each on this node, and the trainer was given both addresses.
    m = re.search(r"draftfeed-hetjob: 2 targets serving: (\S+)", log)
    assert m, log
    addresses = m.group(1).split(",")
    assert len(addresses) == 2 and len(set(addresses)) == 2, addresses
    assert all(re.fullmatch(r"[\w.-]+:\d+", a) for a in addresses), addresses
    # --gpus-per-task binds one GPU to each target task (its cuda:0); the two nodes share a host
    # name, so which node each ran on is not visible here, only that each has one GPU of two.
    gpus = re.findall(r"draftfeed-hetjob: target \d on \S+, CUDA_VISIBLE_DEVICES=(\S+)", log)
    assert len(gpus) == 2 and set(gpus) <= {"0", "1"}, log
    assert f"checksum {MAIN_JOB_CHECKSUM}" in log, log
    assert "draftfeed-hetjob: trainers exited 0, targets exited 0" in log, log
    # Both targets drained on SIGTERM (not killed) and between them computed every batch.
    served = [int(n) for n in re.findall(r"draftfeed-target: stopped after (\d+) batches", log)]
    assert len(served) == 2 and sum(served) == 300, log
    # The address files lived in the submit directory and are removed with the job.
    assert not list(tmp_path.glob("draftfeed-run.*")), list(tmp_path.iterdir())


def test_hetjob_reports_a_target_that_cannot_start(cluster, tmp_path):
    out = tmp_path / "job.out"
    r = cluster.sbatch([f"--output={out}", str(SCRIPT)], cwd=tmp_path,
                       env=job_env(DRAFTFEED_MODEL=str(tmp_path / "no-such-checkpoint")))
    log = out.read_text(errors="replace") if out.exists() else ""
    assert r.returncode != 0, log
    assert "the targets' step ended before all 2 served (0 did)" in log, log
    assert "no-such-checkpoint" in log, log  # the target's own error reaches the job output
    assert "checksum" not in log, log
