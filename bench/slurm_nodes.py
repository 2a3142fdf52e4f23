"""A Slurm cluster on network-namespace nodes (bench/netns.py), for the tests and the benches that
run shardwise under a real Slurm on one machine.

Node i is a network namespace with its own address, entered with its own UTS namespace (hostname
`nodeI`, which Slurm's node names and torchft's advertised addresses need) and its own /etc/hosts
naming every node (bind-mounted in a mount namespace of its own: a real cluster's DNS). munged
serves every node from the host (its socket is a file they all see); slurmctld runs on node 0,
a slurmd on each node, all from one generated slurm.conf (SLURM_CONF) in a directory of the
cluster's own. Clients (sbatch, scontrol, squeue) run on node 0. Needs root, and Debian's
`slurmctld slurmd slurm-client munge` packages (.ci/run installs them where they are absent).

`nsenter --net` enters a node's network namespace and leaves /sys as it is: `ip netns exec`
remounts it, which hides /sys/fs/cgroup, and slurmd 22.05 will not start without it.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
import time
from pathlib import Path

from bench.netns import Cluster, unavailable_reason

DAEMONS = ("munged", "slurmctld", "slurmd", "sbatch", "srun", "scontrol")
MUNGE_SOCKET = Path("/run/munge/munge.socket.2")


class SlurmUnavailable(RuntimeError):
    """A Slurm cluster cannot be made here; the message says why (with the daemons' logs)."""


def slurm_unavailable_reason() -> str | None:
    """Why a Slurm cluster of namespace nodes cannot be made here, or None."""
    missing = [name for name in DAEMONS if shutil.which(name) is None and not Path("/usr/sbin", name).exists()]
    if missing:
        return (f"Slurm is not installed ({', '.join(missing)} missing): apt-get install slurmctld slurmd "
                "slurm-client munge")
    return unavailable_reason()


def _conf(directory: Path, nodes: list[tuple[str, str]], cpus: int) -> str:
    """slurm.conf for `nodes` (name, address), the first the controller too; what a cluster of
    namespaces on one machine needs (no cgroups, every process tracked by its parents)."""
    head, head_addr = nodes[0]
    lines = [
        "ClusterName=shardwise", f"SlurmctldHost={head}({head_addr})", "SlurmUser=root", "SlurmdUser=root",
        "AuthType=auth/munge", "CredType=cred/munge", "ProctrackType=proctrack/linuxproc", "TaskPlugin=task/none",
        "SelectType=select/cons_tres", "SelectTypeParameters=CR_CPU", "ReturnToService=2", "MpiDefault=none",
        "JobRequeue=1", "KillWait=5", f"StateSaveLocation={directory}/state", f"SlurmdSpoolDir={directory}/spool/%n",
        f"SlurmctldPidFile={directory}/slurmctld.pid", f"SlurmdPidFile={directory}/slurmd-%n.pid",
        f"SlurmctldLogFile={directory}/slurmctld.log", f"SlurmdLogFile={directory}/slurmd-%n.log",
        *(f"NodeName={name} NodeAddr={addr} CPUs={cpus} State=UNKNOWN" for name, addr in nodes),
        "PartitionName=main Nodes=ALL Default=YES MaxTime=INFINITE State=UP",
    ]
    return "\n".join(lines) + "\n"


class SlurmCluster:
    """`nodes` namespace nodes running Slurm; a context manager that stops and removes all it made."""

    def __init__(self, nodes: int, cpus: int = 2) -> None:
        self.network = Cluster(nodes)
        self.names = [f"node{node.rank}" for node in self.network.nodes]
        self.cpus = cpus
        self.directory = Path(tempfile.mkdtemp(prefix="shardwise-slurm-"))
        self.env = {**os.environ, "SLURM_CONF": str(self.directory / "slurm.conf")}
        self.daemons: list[subprocess.Popen] = []
        self.started_munged = False

    def __enter__(self) -> SlurmCluster:
        self.up()
        return self

    def __exit__(self, *exc: object) -> None:
        self.down()

    def up(self, timeout: float = 30) -> None:
        reason = slurm_unavailable_reason()
        if reason:
            raise SlurmUnavailable(reason)
        try:
            self.network.up()
            for name in ("state", "spool", *(f"spool/{name}" for name in self.names)):
                (self.directory / name).mkdir(parents=True, exist_ok=True)
            addresses = [node.addr for node in self.network.nodes]
            (self.directory / "slurm.conf").write_text(_conf(self.directory, list(zip(self.names, addresses,
                                                                                      strict=True)), self.cpus))
            (self.directory / "hosts").write_text("127.0.0.1 localhost\n" + "".join(
                f"{addr} {name}\n" for name, addr in zip(self.names, addresses, strict=True)))
            self._start_munged()
            self.daemons.append(self._on_node(0, ["slurmctld", "-D"], "slurmctld.out"))
            self.daemons += [self._on_node(i, ["slurmd", "-D", "-N", name], f"slurmd-{name}.out")
                             for i, name in enumerate(self.names)]
            self._wait_idle(timeout)
        except BaseException:
            self.down()
            raise

    def _start_munged(self) -> None:
        """munged for every node, as the munge user, unless one already answers."""
        if subprocess.run(["munge", "-n"], capture_output=True).returncode == 0:
            return
        MUNGE_SOCKET.parent.mkdir(parents=True, exist_ok=True)
        shutil.chown(MUNGE_SOCKET.parent, "munge", "munge")
        started = subprocess.run(["su", "-s", "/bin/sh", "munge", "-c", "/usr/sbin/munged"], capture_output=True,
                                 text=True)
        if started.returncode:
            raise SlurmUnavailable(f"munged did not start: {started.stderr.strip()}")
        self.started_munged = True

    def _on_node(self, rank: int, argv: list[str], log: str) -> subprocess.Popen:
        """`argv` started on node `rank`: its network, its own hostname and its own /etc/hosts."""
        netns = self.network.nodes[rank].netns
        script = f"mount --bind {self.directory}/hosts /etc/hosts && hostname {self.names[rank]} && exec \"$@\""
        with open(self.directory / log, "w") as out:
            return subprocess.Popen(["nsenter", f"--net=/run/netns/{netns}", "unshare", "--mount", "--uts", "sh",
                                     "-c", script, "sh", *argv], env=self.env, stdout=out, stderr=subprocess.STDOUT)

    def _wait_idle(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            states = self.client(["sinfo", "-h", "-N", "-o", "%T"]).stdout.split()
            if len(states) == len(self.names) and all(state == "idle" for state in states):
                return
            if any(daemon.poll() is not None for daemon in self.daemons):
                break
            time.sleep(0.2)
        raise SlurmUnavailable(f"the nodes did not come up idle within {timeout:.0f} s; the daemons' logs:\n"
                               + self.logs())

    def logs(self, lines: int = 15) -> str:
        """The last `lines` of every daemon's log, for a failure's message."""
        parts = []
        for log in sorted(self.directory.glob("*.log")) + sorted(self.directory.glob("*.out")):
            parts.append(f"--- {log.name}\n" + "\n".join(log.read_text(errors="replace").splitlines()[-lines:]))
        return "\n".join(parts)

    def client(self, argv: list[str], check: bool = False, **kwargs: object) -> subprocess.CompletedProcess:
        """A Slurm client command (sbatch, scontrol, squeue, sinfo) run on node 0."""
        kwargs.setdefault("env", self.env)
        result = subprocess.run(["ip", "netns", "exec", self.network.nodes[0].netns, *argv], capture_output=True,
                                text=True, **kwargs)
        if check and result.returncode:
            raise RuntimeError(f"`{' '.join(argv)}` exited {result.returncode}: {result.stderr.strip()}\n"
                               + self.logs())
        return result

    def submit(self, script: Path, wait: bool = False, timeout: float = 300, env: dict[str, str] | None = None) -> int:
        """Submit `script` by sbatch (with `wait`, sbatch --wait: until the job ends), its tasks given
        sbatch's environment and `env`; the job's id."""
        result = self.client(["sbatch", "--parsable", *(["--wait"] if wait else []), str(script)],
                             timeout=timeout, env={**self.env, **(env or {})})
        if result.returncode:
            raise RuntimeError(f"sbatch {script} exited {result.returncode}: {result.stderr.strip()}\n{self.logs()}")
        return int(result.stdout.split()[0].split(";")[0])

    def state(self, job: int) -> str:
        """The job's state as squeue shows it (PENDING, RUNNING, COMPLETING...), or "" once it has left."""
        return self.client(["squeue", "-h", "-j", str(job), "-o", "%T"]).stdout.strip()

    def wait(self, job: int, timeout: float = 300) -> None:
        """Until the job has left the queue: what sbatch --wait does, looking every 0.2 s where
        sbatch looks every few seconds (10 s a job, here)."""
        deadline = time.monotonic() + timeout
        while self.state(job):
            if time.monotonic() > deadline:
                raise TimeoutError(f"job {job} still {self.state(job)} after {timeout:.0f} s\n{self.logs()}")
            time.sleep(0.2)

    def requeue(self, job: int, timeout: float = 60) -> None:
        """`scontrol requeue` the running job, then let it start again at once: slurmctld holds a
        requeued job for 120 s (its BeginTime), which a cluster this small need not wait out."""
        self.client(["scontrol", "requeue", str(job)], check=True)
        deadline = time.monotonic() + timeout
        while self.state(job) != "PENDING":
            if time.monotonic() > deadline:
                raise TimeoutError(f"job {job} requeued, still {self.state(job)} after {timeout:.0f} s")
            time.sleep(0.1)
        self.client(["scontrol", "update", f"JobId={job}", "StartTime=now"], check=True)

    def link_bytes(self, rank: int) -> int:
        """Bytes node `rank` has sent and received over its link so far (its switch port's counters)."""
        port = self.network.nodes[rank].port
        read = self.network.switch
        total = 0
        for counter in ("rx_bytes", "tx_bytes"):
            out = subprocess.run(["ip", "netns", "exec", read, "cat", f"/sys/class/net/{port}/statistics/{counter}"],
                                 capture_output=True, text=True, check=True).stdout
            total += int(out)
        return total

    def down(self) -> None:
        """Stop the daemons (and whatever jobs they run), remove the nodes and the cluster's files."""
        for daemon in self.daemons:
            if daemon.poll() is None:
                daemon.terminate()
        for daemon in self.daemons:
            try:
                daemon.wait(10)
            except subprocess.TimeoutExpired:
                daemon.kill()
                daemon.wait()
        self.network.down()
        if self.started_munged:
            subprocess.run(["pkill", "-x", "munged"], capture_output=True)
        shutil.rmtree(self.directory, ignore_errors=True)
