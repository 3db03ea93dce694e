"""A real one-node SLURM cluster for tests: munge, MariaDB, slurmdbd, slurmctld and slurmd from Debian's packages.

Everything lives under one scratch directory (configs, state, logs, sockets, fake GPU device files) and the daemons
listen on free loopback ports, so the cluster touches nothing of the machine's own setup and several can coexist.
Clients find it through ``SLURM_CONF`` (:attr:`OneNodeCluster.env`). Needs root (SlurmUser=root, munged run as the
``munge`` user) and the packages ``munge slurm-client slurmctld slurmd slurmdbd mariadb-server`` (``.ci/run``
installs them with apt-get); :func:`missing` says what is absent.

- Node: this host, ``NodeAddr=127.0.0.1``, declared with ``cpus`` CPUs and ``memory_mb`` MB whatever the hardware
  has (``SlurmdParameters=config_overrides``), so the jobs of ``profiles/slurm`` (up to 8 CPUs, 128 GB) are
  accepted on a small machine; ``gpus`` fake GPUs (``Gres=gpu:N``, gres.conf ``File=`` character devices made with
  mknod, or existing ones such as /dev/null without the right to make them). ``TaskPlugin=task/none`` constrains
  no device, so a job sees ``CUDA_VISIBLE_DEVICES`` set by SLURM and no real GPU.
- Partitions ``cpu`` (default) and ``gpu``, both on the node.
- Accounting through slurmdbd on a MariaDB server (loopback TCP, networking otherwise off), with the cluster, an
  account and root as its user: the executor plugin polls ``sacct`` and checks the account with ``sacctmgr``.
- ``/etc/slurm/slurm.conf`` is a symlink to the cluster's config while it runs: inside a job the executor plugin
  runs ``srun`` with every ``SLURM_*`` variable removed (``SLURM_CONF`` too), so it must find the config where a
  real cluster keeps it. A machine with a config of its own there is refused (:class:`ClusterError`).

Start with :meth:`OneNodeCluster.start` (about 15 s), stop with :meth:`OneNodeCluster.stop` (only the processes it
started, by pid). Logs: ``<root>/log/*.log``.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from pathlib import Path

PACKAGES = ("munge", "slurm-client", "slurmctld", "slurmd", "slurmdbd", "mariadb-server")
SYSTEM_CONF = Path("/etc/slurm/slurm.conf")
COMMANDS = (
    "munged",
    "slurmctld",
    "slurmd",
    "slurmdbd",
    "sbatch",
    "sacct",
    "sacctmgr",
    "squeue",
    "scontrol",
    "mariadbd",
    "mariadb-install-db",
    "mariadb",
    "setpriv",
)
CLUSTER = "eagle3ci"
ACCOUNT = "eagle3ci"
DB_PASSWORD = "eagle3ci-test-only"


def missing() -> list[str]:
    """Commands the cluster needs that are not on PATH (or ``["root"]`` when not running as root)."""
    out = [c for c in COMMANDS if shutil.which(c) is None and not Path("/usr/sbin", c).exists()]
    if os.geteuid() != 0:
        out.append("root")
    return out


def _which(cmd: str) -> str:
    return shutil.which(cmd) or str(Path("/usr/sbin", cmd))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def has_own_config() -> bool:
    """Whether ``/etc/slurm/slurm.conf`` is the machine's own. A link to this harness's config whose slurmctld no
    longer answers (left by a killed test run, dangling or not) is removed first."""
    if SYSTEM_CONF.is_symlink():
        text = SYSTEM_CONF.read_text(errors="replace") if SYSTEM_CONF.exists() else ""
        port = re.search(r"^SlurmctldPort=(\d+)", text, re.M)
        ours = not text or f"ClusterName={CLUSTER}\n" in text
        if ours and not (port and _listening(int(port.group(1)))):
            SYSTEM_CONF.unlink()
    return SYSTEM_CONF.exists()


def _listening(port: int) -> bool:
    with socket.socket() as s:
        s.settimeout(1)
        return s.connect_ex(("127.0.0.1", port)) == 0


class ClusterError(RuntimeError):
    """The cluster did not come up; the message carries the relevant log tail."""


class OneNodeCluster:
    """See the module docstring. ``root``: scratch directory (created); ``gpus``: fake GPUs on the node."""

    def __init__(self, root: Path, *, gpus: int = 2, cpus: int = 16, memory_mb: int = 262144):
        self.root = Path(root).resolve()
        self.gpus, self.cpus, self.memory_mb = gpus, cpus, memory_mb
        self.host = socket.gethostname().split(".")[0]
        self.procs: dict[str, subprocess.Popen] = {}
        self.ports = {k: _free_port() for k in ("slurmctld", "slurmd", "slurmdbd", "mysql")}
        self.conf = self.root / "etc" / "slurm.conf"
        self.munge_dir: Path | None = None  # under /tmp: munged (user munge) can't reach into a 0700 test dir
        self.linked = False

    # ---------------------------------------------------------------------------------------------- public

    @property
    def env(self) -> dict:
        """Environment entries a SLURM client (sbatch, sacct, the executor plugin) needs to reach this cluster."""
        return {"SLURM_CONF": str(self.conf)}

    def start(self, timeout: float = 120) -> "OneNodeCluster":
        """Write the configs, start every daemon and wait until a test job runs and sacct sees it COMPLETED."""
        for d in ("etc", "log", "state", "spool", "db", "dev", "run"):
            (self.root / d).mkdir(parents=True, exist_ok=True)
        if has_own_config():
            raise ClusterError(f"this machine has a SLURM config of its own ({SYSTEM_CONF}); not replacing it")
        self.munge_dir = Path(tempfile.mkdtemp(prefix="eagle3-munge-"))
        try:
            self._start_munge()
            self._start_mariadb(timeout)
            self._write_slurm_configs()
            SYSTEM_CONF.parent.mkdir(parents=True, exist_ok=True)
            SYSTEM_CONF.symlink_to(self.conf)
            self.linked = True
            self._start("slurmdbd", [_which("slurmdbd"), "-D"])  # reads slurmdbd.conf next to $SLURM_CONF
            self._wait(
                lambda: self._run(["sacctmgr", "-n", "list", "cluster"], check=False).returncode == 0,
                timeout,
                "slurmdbd answering sacctmgr",
                "slurmdbd",
            )
            self._run(["sacctmgr", "-i", "add", "cluster", CLUSTER], check=False)
            self._run(["sacctmgr", "-i", "add", "account", ACCOUNT, f"Cluster={CLUSTER}"], check=False)
            self._run(
                ["sacctmgr", "-i", "add", "user", "root", f"Account={ACCOUNT}", f"Cluster={CLUSTER}"], check=False
            )
            self._start("slurmctld", [_which("slurmctld"), "-D", "-i", "-f", str(self.conf)])
            self._start("slurmd", [_which("slurmd"), "-D", "-f", str(self.conf)])
            self._wait(self._node_idle, timeout, "the node to be idle", "slurmctld")
            self._check_a_job(timeout)
        except BaseException:
            self.stop()
            raise
        return self

    def stop(self) -> None:
        """Stop the daemons this object started (SIGTERM, then SIGKILL after 10 s), newest first."""
        for name in reversed(list(self.procs)):
            proc = self.procs[name]
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
                try:
                    proc.wait(timeout=10)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait(timeout=10)
        self.procs.clear()
        if self.munge_dir is not None:
            shutil.rmtree(self.munge_dir, ignore_errors=True)
            self.munge_dir = None
        if self.linked and SYSTEM_CONF.is_symlink() and os.readlink(SYSTEM_CONF) == str(self.conf):
            SYSTEM_CONF.unlink()
        self.linked = False

    @property
    def munge_socket(self) -> Path:
        return self.munge_dir / "munge.socket.2"

    def log_tail(self, name: str, lines: int = 30) -> str:
        p = self.root / "log" / f"{name}.log"
        return "\n".join(p.read_text(errors="replace").splitlines()[-lines:]) if p.exists() else f"(no {p})"

    def sacct_jobs(self) -> list[dict]:
        """Every job of the cluster, as sacct sees it: id, name, partition, state, exit code, AllocTRES."""
        out = self._run(
            [
                "sacct",
                "-a",
                "-X",
                "-n",
                "-P",
                "-S",
                "2000-01-01",
                "--format",
                "JobID,JobName,Partition,State,ExitCode,AllocTRES",
            ]
        ).stdout
        keys = ("id", "name", "partition", "state", "exit_code", "tres")
        return [dict(zip(keys, line.split("|"))) for line in out.splitlines() if line.strip()]

    # ---------------------------------------------------------------------------------------------- daemons

    def _run(self, argv: list[str], check: bool = True, timeout: float = 60) -> subprocess.CompletedProcess:
        env = {**os.environ, **self.env}
        proc = subprocess.run(argv, capture_output=True, text=True, env=env, timeout=timeout)
        if check and proc.returncode != 0:
            raise ClusterError(f"{' '.join(argv)} failed ({proc.returncode}): {proc.stdout}{proc.stderr}")
        return proc

    def _start(self, name: str, argv: list[str]) -> None:
        log = open(self.root / "log" / f"{name}.out", "ab")
        self.procs[name] = subprocess.Popen(
            argv,
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=subprocess.STDOUT,
            env={**os.environ, **self.env},
            start_new_session=True,
        )
        log.close()

    def _wait(self, ready, timeout: float, what: str, log: str) -> None:
        t0 = time.monotonic()
        while True:
            for name, proc in self.procs.items():
                if proc.poll() is not None:
                    raise ClusterError(
                        f"{name} exited ({proc.returncode}) while waiting for {what}:\n"
                        f"{self.log_tail(name)}\n{self._out_tail(name)}"
                    )
            if ready():
                return
            if time.monotonic() - t0 > timeout:
                raise ClusterError(f"timed out after {timeout:.0f} s waiting for {what}:\n{self.log_tail(log)}")
            time.sleep(0.5)

    def _out_tail(self, name: str) -> str:
        p = self.root / "log" / f"{name}.out"
        return p.read_text(errors="replace")[-2000:] if p.exists() else ""

    def _start_munge(self) -> None:
        sock_dir = self.munge_dir
        shutil.chown(sock_dir, "munge", "munge")
        sock_dir.chmod(0o755)
        logf = sock_dir / "munged.log"
        self._start(
            "munged",
            [
                _which("setpriv"),
                "--reuid",
                "munge",
                "--regid",
                "munge",
                "--init-groups",
                _which("munged"),
                "-F",
                f"--socket={self.munge_socket}",
                f"--pid-file={sock_dir / 'munged.pid'}",
                f"--log-file={logf}",
                f"--seed-file={sock_dir / 'munged.seed'}",
            ],
        )
        self._wait(self.munge_socket.exists, 30, "the munge socket", "munged")

    def _start_mariadb(self, timeout: float) -> None:
        data = self.root / "db"
        if not (data / "mysql").exists():
            self._run(
                [
                    _which("mariadb-install-db"),
                    "--no-defaults",
                    f"--datadir={data}",
                    "--user=root",
                    "--auth-root-authentication-method=socket",
                    "--skip-test-db",
                ],
                timeout=timeout,
            )
        sock = self.root / "run" / "mysqld.sock"
        self._start(
            "mariadbd",
            [
                _which("mariadbd"),
                "--no-defaults",
                f"--datadir={data}",
                "--user=root",
                f"--socket={sock}",
                "--bind-address=127.0.0.1",
                f"--port={self.ports['mysql']}",
                f"--pid-file={self.root / 'run' / 'mysqld.pid'}",
                f"--log-error={self.root / 'log' / 'mariadbd.log'}",
                "--skip-name-resolve",
            ],
        )
        self._wait(sock.exists, timeout, "the MariaDB socket", "mariadbd")
        sql = (
            f"CREATE USER IF NOT EXISTS 'slurm'@'127.0.0.1' IDENTIFIED BY '{DB_PASSWORD}'; "
            "GRANT ALL ON slurm_acct_db.* TO 'slurm'@'127.0.0.1'; FLUSH PRIVILEGES;"
        )
        self._wait(
            lambda: (
                self._run([_which("mariadb"), f"--socket={sock}", "-u", "root", "-e", sql], check=False).returncode == 0
            ),
            timeout,
            "MariaDB accepting the user",
            "mariadbd",
        )

    def _fake_gpus(self) -> list[str]:
        files = []
        for i in range(self.gpus):
            dev = self.root / "dev" / f"fakegpu{i}"
            if not dev.exists():
                try:
                    os.mknod(dev, 0o666 | 0o020000, os.makedev(1, 3))  # a character device, like /dev/null
                except OSError:
                    dev = Path(("/dev/null", "/dev/zero", "/dev/full", "/dev/random")[i % 4])
            files.append(str(dev))
        return files

    def _write_slurm_configs(self) -> None:
        r = self.root
        auth = f"AuthType=auth/munge\nAuthInfo=socket={self.munge_socket}\n"
        dbd = r / "etc" / "slurmdbd.conf"
        dbd.write_text(
            auth + f"DbdHost=localhost\nDbdAddr=127.0.0.1\nDbdPort={self.ports['slurmdbd']}\nSlurmUser=root\n"
            f"PidFile={r / 'run' / 'slurmdbd.pid'}\nLogFile={r / 'log' / 'slurmdbd.log'}\n"
            "StorageType=accounting_storage/mysql\nStorageHost=127.0.0.1\n"
            f"StoragePort={self.ports['mysql']}\nStorageUser=slurm\nStoragePass={DB_PASSWORD}\n"
            "StorageLoc=slurm_acct_db\n"
        )
        dbd.chmod(0o600)
        gres = self._fake_gpus()
        (r / "etc" / "gres.conf").write_text("AutoDetect=off\n" + "".join(f"Name=gpu File={f}\n" for f in gres))
        self.conf.write_text(
            f"ClusterName={CLUSTER}\nSlurmctldHost={self.host}(127.0.0.1)\n"
            f"SlurmctldPort={self.ports['slurmctld']}\nSlurmdPort={self.ports['slurmd']}\n"
            + auth
            + "CredType=cred/munge\nSlurmUser=root\nSlurmdUser=root\n"
            f"StateSaveLocation={r / 'state'}\nSlurmdSpoolDir={r / 'spool'}\n"
            f"SlurmctldPidFile={r / 'run' / 'slurmctld.pid'}\nSlurmdPidFile={r / 'run' / 'slurmd.pid'}\n"
            f"SlurmctldLogFile={r / 'log' / 'slurmctld.log'}\nSlurmdLogFile={r / 'log' / 'slurmd.log'}\n"
            "ProctrackType=proctrack/linuxproc\nTaskPlugin=task/none\nSelectType=select/cons_tres\n"
            "SelectTypeParameters=CR_Core_Memory\nDefMemPerCPU=1000\nSlurmdParameters=config_overrides\n"
            "MailProg=/bin/true\nReturnToService=2\nMinJobAge=600\n"
            "SchedulerType=sched/backfill\nJobAcctGatherType=jobacct_gather/none\n"
            f"AccountingStorageType=accounting_storage/slurmdbd\nAccountingStorageHost=127.0.0.1\n"
            f"AccountingStoragePort={self.ports['slurmdbd']}\nAccountingStorageTRES=gres/gpu\n"
            # the munge socket of connections to slurmdbd (AuthInfo covers the others)
            f"AccountingStoragePass={self.munge_socket}\n"
            "GresTypes=gpu\n"
            f"NodeName={self.host} NodeAddr=127.0.0.1 CPUs={self.cpus} RealMemory={self.memory_mb} "
            f"Gres=gpu:{self.gpus} State=UNKNOWN\n"
            f"PartitionName=cpu Nodes={self.host} Default=YES MaxTime=INFINITE State=UP\n"
            f"PartitionName=gpu Nodes={self.host} MaxTime=INFINITE State=UP\n"
        )

    def _node_idle(self) -> bool:
        out = self._run(["sinfo", "-h", "-N", "-o", "%t"], check=False).stdout.split()
        return bool(out) and all(s.startswith("idle") for s in out)

    def _check_a_job(self, timeout: float) -> None:
        out = self._run(
            [
                "sbatch",
                "--parsable",
                "-p",
                "gpu",
                "--gpus=1",
                "-A",
                ACCOUNT,
                "-t",
                "1",
                f"--output={self.root / 'log' / 'check-%j.out'}",
                "--wrap",
                "echo CUDA_VISIBLE_DEVICES=$CUDA_VISIBLE_DEVICES",
            ]
        ).stdout.strip()
        job = out.split(";")[0]

        def done() -> bool:
            states = self._run(["sacct", "-j", job, "-X", "-n", "-P", "--format", "State"], check=False).stdout.split()
            if states and states[0] not in ("PENDING", "RUNNING", "COMPLETING", "CONFIGURING"):
                if states[0] != "COMPLETED":
                    raise ClusterError(f"check job {job} ended {states[0]}:\n{self.log_tail('slurmd')}")
                return True
            return False

        self._wait(done, timeout, f"check job {job} COMPLETED in sacct", "slurmctld")


def sbatch_option(argv: list[str], flag: str) -> str | None:
    """Value of ``flag`` in an sbatch argv: ``-p gpu`` or ``--gpus=1`` forms."""
    for i, a in enumerate(argv):
        if a == flag and i + 1 < len(argv):
            return argv[i + 1]
        if a.startswith(flag + "="):
            return a.split("=", 1)[1]
    return None
