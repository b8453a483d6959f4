"""A Slurm cluster on localhost for tests: its own munged, slurmctld and one slurmd per node.

Everything lives in one temporary directory (keys, sockets, spool, state, logs) and uses free
ports, so it neither needs nor touches a system Slurm. Process tracking is proctrack/linuxproc and
task binding task/none: both work without cgroups, which containers and sandboxes often withhold.
It has two nodes by default, both on this host (one slurmd each, on its own port): only the
backfill scheduler starts heterogeneous jobs, and it reserves whole nodes, so two components never
start on one node. The nodes declare GPUs as counted generic resources whose device files are
links to /dev/null and the like (Gres=gpu:N, N at most 4), so job scripts that ask for
--gpus-per-task are scheduled as on a GPU cluster; the tasks then run on the CPU.
"""

import os
import pathlib
import shutil
import socket
import subprocess
import tempfile
import time

DAEMONS = ("munged", "slurmctld", "slurmd", "sbatch", "sinfo", "scancel")


def missing_tools():
    """Names of the programs a LocalSlurm needs that are not installed (Debian: slurm-wlm, munge)."""
    paths = os.environ.get("PATH", "") + ":/usr/sbin:/sbin"
    return [d for d in DAEMONS if shutil.which(d, path=paths) is None]


def _which(name):
    return shutil.which(name, path=os.environ.get("PATH", "") + ":/usr/sbin:/sbin")


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class LocalSlurm:
    """Starts the cluster on enter, stops every daemon it started and removes its files on exit."""

    def __init__(self, nodes=2, cpus=8, gpus=4):
        self.cpus = cpus  # per node
        self.gpus = gpus  # per node
        self.node_names = [f"draftfeed-node{i}" for i in range(1, nodes + 1)]
        self.dir = pathlib.Path(tempfile.mkdtemp(prefix="draftfeed-slurm-"))
        self.procs = []
        self.env = dict(os.environ, SLURM_CONF=str(self.dir / "slurm.conf"))

    def _log(self, name):
        p = self.dir / f"{name}.log"
        return p.read_text(errors="replace") if p.exists() else ""

    def logs(self):
        """The daemons' logs, for a failing test's message."""
        names = ["munged", "slurmctld"] + [f"slurmd-{n}" for n in self.node_names]
        return "\n".join(f"--- {n}.log ---\n{self._log(n)}" for n in names)

    def _start(self, name, argv):
        log = open(self.dir / f"{name}.log", "ab")
        proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, env=self.env)
        self.procs.append((name, proc))
        return proc

    def _write_config(self):
        d = self.dir
        for sub in ("state", "spool", "munge"):
            (d / sub).mkdir()
        os.chmod(d / "munge", 0o700)
        key = d / "munge" / "munge.key"
        key.write_bytes(os.urandom(1024))
        os.chmod(key, 0o400)
        self.munge_socket = d / "munge" / "munge.socket"
        user = subprocess.run(["id", "-un"], capture_output=True, text=True, check=True).stdout.strip()
        # slurmd counts a GPU by its device file, which must be a character device: links to
        # harmless ones stand in for /dev/nvidiaN (task/none never opens them).
        (d / "dev").mkdir()
        devices = ("null", "zero", "full", "urandom")
        if not 1 <= self.gpus <= len(devices):
            raise ValueError(f"LocalSlurm: gpus={self.gpus}: 1 to {len(devices)} per node")
        for i, dev in enumerate(devices[:self.gpus]):
            (d / "dev" / f"gpu{i}").symlink_to(f"/dev/{dev}")
        (d / "gres.conf").write_text("AutoDetect=off\n" + "".join(
            f"NodeName={n} Name=gpu File={d / 'dev'}/gpu[0-{self.gpus - 1}]\n"
            for n in self.node_names))
        host = socket.gethostname()
        node_lines = "".join(
            f"NodeName={n} NodeAddr=127.0.0.1 NodeHostname={host} Port={_free_port()} "
            f"CPUs={self.cpus} RealMemory=8000 Gres=gpu:{self.gpus} State=UNKNOWN\n"
            for n in self.node_names)
        (d / "slurm.conf").write_text(f"""\
ClusterName=draftfeedtest
SlurmctldHost={socket.gethostname()}(127.0.0.1)
SlurmctldPort={_free_port()}
SlurmUser={user}
SlurmdUser={user}
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket={self.munge_socket}
StateSaveLocation={d / 'state'}
SlurmdSpoolDir={d / 'spool'}/%n
SlurmctldPidFile={d / 'slurmctld.pid'}
SlurmdPidFile={d}/slurmd-%n.pid
SlurmctldLogFile={d / 'slurmctld.log'}
SlurmdLogFile={d}/slurmd-%n.log
SlurmctldDebug=info
SlurmdDebug=info
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
SwitchType=switch/none
MpiDefault=none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core_Memory
DefMemPerCPU=100
SlurmdParameters=config_overrides
ReturnToService=2
# Heterogeneous jobs start from the backfill pass (all components at once): every second, not 30.
SchedulerType=sched/backfill
SchedulerParameters=bf_interval=1,bf_hetjob_immediate
GresTypes=gpu
InactiveLimit=0
KillWait=30
MinJobAge=300
{node_lines}PartitionName=debug Nodes={",".join(self.node_names)} Default=YES MaxTime=INFINITE State=UP
""")

    def __enter__(self):
        try:
            self._write_config()
            d = self.dir
            self._start("munged-stdout", [
                _which("munged"), "--foreground", "--force", f"--socket={self.munge_socket}",
                f"--key-file={d / 'munge' / 'munge.key'}", f"--pid-file={d / 'munge' / 'munged.pid'}",
                f"--seed-file={d / 'munge' / 'munged.seed'}", f"--log-file={d / 'munged.log'}"])
            self._wait(lambda: self.munge_socket.exists(), "munged to create its socket")
            conf = str(d / "slurm.conf")
            self._start("slurmctld-stdout", [_which("slurmctld"), "-D", "-i", "-f", conf])
            for n in self.node_names:
                self._start(f"slurmd-{n}-stdout", [_which("slurmd"), "-D", "-f", conf, "-N", n])
            self._wait(self._nodes_idle, "the nodes to become idle")
        except BaseException:
            self.__exit__(None, None, None)
            raise
        return self

    def _nodes_idle(self):
        r = subprocess.run([_which("sinfo"), "-h", "-N", "-o", "%T"], env=self.env,
                           capture_output=True, text=True)
        return r.returncode == 0 and r.stdout.split() == ["idle"] * len(self.node_names)

    def _wait(self, ready, what, timeout=60):
        deadline = time.time() + timeout
        while not ready():
            for name, p in self.procs:
                if p.poll() is not None:
                    raise RuntimeError(f"{name.removesuffix('-stdout')} exited with {p.returncode} "
                                       f"while waiting for {what}\n{self._log(name)}\n{self.logs()}")
            if time.time() > deadline:
                raise RuntimeError(f"timed out after {timeout}s waiting for {what}\n{self.logs()}")
            time.sleep(0.2)

    def sbatch(self, argv, cwd, env=None, timeout=600):
        """Runs `sbatch --wait ARGV` from `cwd` with `env` on top of the cluster's environment."""
        return subprocess.run([_which("sbatch"), "--wait", *argv], cwd=cwd,
                              env={**self.env, **(env or {})}, capture_output=True, text=True,
                              timeout=timeout)

    def __exit__(self, *exc):
        if self.procs and _which("scancel"):
            subprocess.run([_which("scancel"), "--full", "--user", str(os.getuid())],
                           env=self.env, capture_output=True)
        for _, p in reversed(self.procs):
            if p.poll() is None:
                p.terminate()
                try:
                    p.wait(30)
                except subprocess.TimeoutExpired:
                    p.kill()
                    p.wait()
        self.procs.clear()
        shutil.rmtree(self.dir, ignore_errors=True)
        return False
