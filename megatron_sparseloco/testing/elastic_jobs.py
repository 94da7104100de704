"""Start a torchft lighthouse and N worker jobs as separate process trees; kill, stop, resume, restart.

    with ElasticRun(log_dir, min_replicas=1) as run:      # the lighthouse on a free loopback port
        job = run.add_job("w0", ["-m", "my.job", "--index", "0"], ranks=2)
        job.start()
        ...
        job.kill()                  # kill -9 every process of the job (a lost node)
        job.kill(rank=1)            # one rank only
        job.stop(); job.cont()      # SIGSTOP / SIGCONT the whole job
        job.start()                 # a restart: a fresh process tree, a fresh store port
    # leaving the block kills whatever is still running (lighthouse included) and waits for it

A job is either ``ranks`` processes started directly (``launcher="direct"``: each gets RANK,
WORLD_SIZE, LOCAL_RANK, MASTER_ADDR / MASTER_PORT of the job's store, which its rank 0 hosts:
``ensure_job_store``), one ``torch.distributed.run`` agent (``launcher="torchrun"``) hosting the
store itself, or a launch through ``testing.prefork`` (``launcher="prefork"``: torchrun's interface,
ranks forked from the test session's warm server, so a Megatron job starts in seconds). torchrun
starts its workers in new sessions, so killing the agent's process group leaves them running
(their manager keeps heartbeating: the "dead" job stays in the quorum): ``kill`` and ``stop``
signal the agent and each worker by PID, as a lost node would. A prefork launch's launcher and
ranks are children of the server, not of the test: they are found as the processes writing to the
job's log (rank order = fork order = PID order). Every process is started in its own session;
cleanup signals each recorded PID and each session's group.

A directly launched job may run in a network namespace (``netns``, e.g. one of ``benchmarks/network.py``'s
shaped links; ``ip netns exec`` keeps the PIDs, so kill / stop act on the ranks), its store at
``host``; the lighthouse likewise (``Lighthouse(host=..., netns=...)``).

Logs: ``<log_dir>/<job>.<attempt>.rank<r>.log`` (direct) or ``<job>.<attempt>.log`` (torchrun, prefork).
"""
from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from typing import Callable, Dict, List, Optional, Sequence

from megatron_sparseloco.testing.multirank import free_port


#: runs torchft's lighthouse (the code of the ``torchft_lighthouse`` script) from its extension module
#: without importing the ``torchft`` package, which imports torch: seconds and ~0.5 GB less per start.
#: Run as a file (the lighthouse parses the process's arguments, which ``python -c`` would pollute).
_LIGHTHOUSE_BOOT = """
import glob, importlib.machinery, importlib.util, os, sys
where = importlib.util.find_spec("torchft").submodule_search_locations[0]
loader = importlib.machinery.ExtensionFileLoader("torchft._torchft", glob.glob(os.path.join(where, "_torchft*.so"))[0])
module = importlib.util.module_from_spec(importlib.util.spec_from_loader("torchft._torchft", loader))
loader.exec_module(module)
sys.argv[0] = "torchft_lighthouse"
sys.exit(module.lighthouse_main())
"""


def lighthouse_binary() -> str:
    """``torchft_lighthouse`` next to this interpreter (a venv's bin), else on PATH."""
    here = os.path.join(os.path.dirname(sys.executable), "torchft_lighthouse")
    found = here if os.access(here, os.X_OK) else shutil.which("torchft_lighthouse")
    if found is None:
        raise FileNotFoundError("torchft_lighthouse is neither beside the interpreter nor on PATH "
                                "(pip install torchft)")
    return found


def children(pid: int) -> List[int]:
    """PIDs whose parent is ``pid`` (Linux /proc)."""
    out = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                stat = f.read()
        except OSError:
            continue
        if int(stat.rsplit(")", 1)[1].split()[1]) == pid:
            out.append(int(entry))
    return out


def parent(pid: int) -> Optional[int]:
    """The parent PID of ``pid`` (None if it is gone)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return int(f.read().rsplit(")", 1)[1].split()[1])
    except (OSError, ValueError, IndexError):
        return None


def writers(path: str) -> List[int]:
    """PIDs of this user's processes whose standard error is the file ``path`` (Linux /proc)."""
    target = os.path.realpath(path)
    out = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                if os.readlink(f"/proc/{entry}/fd/2") == target:
                    out.append(int(entry))
            except OSError:
                continue
    return sorted(out)


def start_time(pid: int) -> Optional[str]:
    """The start time of process ``pid`` (field 22 of /proc/PID/stat), None if it is gone or a zombie:
    with the PID it identifies a process (a PID alone may have been reused)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except OSError:
        return None
    return None if len(fields) < 20 or fields[0] in ("Z", "X") else fields[19]


def _signal(pid: int, sig: int) -> None:
    try:
        os.kill(pid, sig)
    except ProcessLookupError:
        pass


def netns_prefix(netns: Optional[str]) -> List[str]:
    """The command prefix that runs a program in network namespace ``netns`` (none: [])."""
    return ["ip", "netns", "exec", netns] if netns else []


def _listening(host: str, port: int, netns: Optional[str]) -> bool:
    if netns is None:
        with socket.socket() as s:
            return s.connect_ex((host, port)) == 0
    probe = f"import socket; socket.create_connection(({host!r}, {port}), 1).close()"
    return subprocess.run(netns_prefix(netns) + [sys.executable, "-c", probe], capture_output=True).returncode == 0


def _wait_port(port: int, timeout: float, proc: subprocess.Popen, host: str = "127.0.0.1",
               netns: Optional[str] = None) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"the process meant to listen on port {port} exited with status {proc.returncode}")
        if _listening(host, port, netns):
            return
        time.sleep(0.05 if netns is None else 0.2)
    raise TimeoutError(f"nothing listens on {host}:{port} after {timeout} s")


def ensure_job_store():
    """In a directly launched job (not torchrun), rank 0 hosts the job's TCPStore at MASTER_PORT
    (returned: keep it referenced); under torchrun the agent hosts it (returns None)."""
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True" or int(os.environ.get("RANK", "0")) != 0:
        return None
    from torch.distributed import TCPStore
    return TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=True,
                    wait_for_workers=False)


def wait_until(predicate: Callable[[], bool], timeout: float, what: str, logs: Callable[[], str]) -> None:
    """Poll ``predicate`` every 0.1 s; past ``timeout`` seconds fail naming ``what``, with the jobs' ``logs()``."""
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}\n{logs()}")
        time.sleep(0.1)


class Lighthouse:
    """torchft's lighthouse on a free loopback port, in its own session (``binary``: through the
    ``torchft_lighthouse`` script, which imports torch first; default: the same code, started lean)."""

    def __init__(self, log_dir: str, min_replicas: int, join_timeout_ms: int = 500, heartbeat_timeout_ms: int = 2000,
                 quorum_tick_ms: int = 50, binary: bool = False, host: str = "127.0.0.1", netns: Optional[str] = None):
        self.port = free_port()
        self.url = f"http://{host}:{self.port}"
        boot = os.path.join(log_dir, "lighthouse_boot.py")
        if not binary:
            with open(boot, "w") as f:
                f.write(_LIGHTHOUSE_BOOT)
        start = netns_prefix(netns) + ([lighthouse_binary()] if binary else [sys.executable, boot])
        argv = start + ["--min_replicas", str(min_replicas), "--bind", f"{host}:{self.port}",
                        "--join_timeout_ms", str(join_timeout_ms), "--heartbeat_timeout_ms", str(heartbeat_timeout_ms),
                        "--quorum_tick_ms", str(quorum_tick_ms)]
        self.log_path = os.path.join(log_dir, "lighthouse.log")
        env = dict(os.environ, RUST_LOG=os.environ.get("RUST_LOG", "warn"))
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
        try:
            _wait_port(self.port, 120.0, self.proc, host, netns)
        except BaseException:
            self.stop()
            raise

    def stop(self) -> None:
        if self.proc.poll() is None:
            _signal(self.proc.pid, signal.SIGKILL)
        self.proc.wait()


class Job:
    """One worker job: a process tree started, signalled and restarted as a whole (module docstring)."""

    def __init__(self, name: str, argv: Sequence[str], ranks: int, log_dir: str, env: Dict[str, str],
                 launcher: str = "direct", netns: Optional[str] = None, host: str = "127.0.0.1"):
        if launcher not in ("direct", "torchrun", "prefork"):
            raise ValueError(f"launcher must be 'direct', 'torchrun' or 'prefork', got {launcher!r}")
        if netns is not None and launcher != "direct":
            raise ValueError("a job in a network namespace is launched directly (launcher='direct')")
        self.name, self.argv, self.ranks, self.launcher = name, list(argv), ranks, launcher
        #: the network namespace the job's ranks run in (``ip netns exec``: the same PIDs), and its address
        self.netns, self.host = netns, host
        self.log_dir, self.env = log_dir, env
        self.attempt = 0
        self.procs: List[subprocess.Popen] = []
        #: every process this job ever had: PID → start time (cleanup signals only those still matching)
        self.known: Dict[int, Optional[str]] = {}

    # -------------------------------------------------------------- start
    def start(self) -> "Job":
        if self.alive():
            raise RuntimeError(f"job {self.name} is still running")
        self.attempt += 1
        port = free_port()
        if self.launcher == "direct":
            self.procs = [self._popen(self._rank_env(r, port), netns_prefix(self.netns) + [sys.executable, *self.argv],
                                      f"rank{r}")
                          for r in range(self.ranks)]
        elif self.launcher == "torchrun":
            argv = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "1", "--nproc-per-node",
                    str(self.ranks), "--master-addr", "127.0.0.1", "--master-port", str(port), *self.argv]
            self.procs = [self._popen(dict(self.env), argv, None)]
        else:
            from megatron_sparseloco.testing.prefork import SOCKET_ENV, ensure_server
            env = dict(self.env, **{SOCKET_ENV: ensure_server()})
            argv = [sys.executable, "-m", "megatron_sparseloco.testing.prefork", "--nproc-per-node", str(self.ranks),
                    "--master-port", str(port), *self.argv]
            self.procs = [self._popen(env, argv, None)]
        self._remember(p.pid for p in self.procs)
        return self

    def _remember(self, pids) -> None:
        for pid in pids:
            self.known.setdefault(pid, start_time(pid))

    def _ours(self, pid: int) -> bool:
        return pid in self.known and self.known[pid] is not None and start_time(pid) == self.known[pid]

    def _rank_env(self, rank: int, port: int) -> Dict[str, str]:
        return dict(self.env, RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(self.ranks),
                    LOCAL_WORLD_SIZE=str(self.ranks), MASTER_ADDR=self.host, MASTER_PORT=str(port))

    def _popen(self, env: Dict[str, str], argv: List[str], suffix: Optional[str]) -> subprocess.Popen:
        path = self.log_path(suffix)
        with open(path, "ab") as log:
            return subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)

    def log_path(self, suffix: Optional[str] = "rank0", attempt: Optional[int] = None) -> str:
        a = self.attempt if attempt is None else attempt
        return os.path.join(self.log_dir, f"{self.name}.{a}" + (f".{suffix}" if suffix else "") + ".log")

    # -------------------------------------------------------------- processes
    def pids(self) -> List[int]:
        """The job's live processes: the ranks (direct), the agent and its workers (torchrun), or the
        client, the launcher and the ranks (prefork)."""
        pids = [p.pid for p in self.procs if p.poll() is None]
        if self.launcher == "torchrun":
            pids += [c for p in list(pids) for c in children(p)]
        elif self.launcher == "prefork":
            pids += [p for p in writers(self.log_path(None)) if p not in pids]
        self._remember(pids)
        return pids

    def rank_pid(self, rank: int) -> int:
        if self.launcher == "direct":
            return self.procs[rank].pid
        if self.launcher == "prefork":
            mine = set(writers(self.log_path(None)))
            launchers = {p for p in mine if parent(p) not in mine and p != self.procs[0].pid}
            ranks = sorted(p for p in mine if parent(p) in launchers)   # (not their own children)
            if rank >= len(ranks):
                raise LookupError(f"job {self.name}: no rank {rank} among its processes {sorted(mine)}")
            self._remember([ranks[rank]])
            return ranks[rank]
        for pid in children(self.procs[0].pid):
            with open(f"/proc/{pid}/environ", "rb") as f:
                if f"RANK={rank}".encode() in f.read().split(b"\0"):
                    return pid
        raise LookupError(f"job {self.name}: no worker with RANK={rank}")

    def alive(self) -> bool:
        return any(p.poll() is None for p in self.procs)

    def signal(self, sig: int, rank: Optional[int] = None) -> None:
        """Send ``sig`` to every process of the job (agent first), or to one rank's process."""
        for pid in ([self.rank_pid(rank)] if rank is not None else self.pids()):
            self._remember([pid])
            if self._ours(pid):
                _signal(pid, sig)

    def kill(self, rank: Optional[int] = None) -> None:
        """kill -9 the whole job (or one rank)."""
        self.signal(signal.SIGKILL, rank)

    def stop(self, rank: Optional[int] = None) -> None:
        self.signal(signal.SIGSTOP, rank)

    def cont(self, rank: Optional[int] = None) -> None:
        self.signal(signal.SIGCONT, rank)

    def wait(self, timeout: float) -> List[Optional[int]]:
        """The return codes once every started process exits (None for those still running at ``timeout``)."""
        deadline = time.monotonic() + timeout
        for p in self.procs:
            try:
                p.wait(max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                pass
        return [p.poll() for p in self.procs]

    def output(self, attempt: Optional[int] = None) -> str:
        """Every log of one attempt (default: the current one), concatenated."""
        suffixes: List[Optional[str]] = [f"rank{r}" for r in range(self.ranks)] if self.launcher == "direct" else [None]
        text = []
        for s in suffixes:
            path = self.log_path(s, attempt)
            if os.path.exists(path):
                with open(path, errors="replace") as f:
                    text.append(f.read())
        return "\n".join(text)

    def cleanup(self) -> None:
        """SIGKILL every process this job ever had that is still running (with the process group it
        leads: each was started in its own session), then reap the ones this process started."""
        self.pids()
        for pid in list(self.known):
            if self._ours(pid):
                try:
                    os.killpg(pid, signal.SIGKILL)
                except (ProcessLookupError, PermissionError):
                    pass
                _signal(pid, signal.SIGKILL)
        for p in self.procs:
            p.wait()


class ElasticRun:
    """A lighthouse plus jobs, all cleaned up on exit (module docstring)."""

    def __init__(self, log_dir: str, min_replicas: int = 1, env: Optional[Dict[str, str]] = None, **lighthouse_kw):
        os.makedirs(log_dir, exist_ok=True)
        self.log_dir = log_dir
        self.env = dict(os.environ if env is None else env)
        self.env.setdefault("RUST_LOG", "warn")
        self.env.setdefault("OMP_NUM_THREADS", "1")
        self.jobs: List[Job] = []
        self.lighthouse = Lighthouse(log_dir, min_replicas, **lighthouse_kw)

    def add_job(self, name: str, argv: Sequence[str], ranks: int = 1, launcher: str = "direct",
                env: Optional[Dict[str, str]] = None, netns: Optional[str] = None, host: str = "127.0.0.1") -> Job:
        job = Job(name, argv, ranks, self.log_dir, dict(self.env, **(env or {})), launcher, netns, host)
        self.jobs.append(job)
        return job

    def cleanup(self) -> None:
        for job in self.jobs:
            job.cleanup()
        self.lighthouse.stop()

    def __enter__(self) -> "ElasticRun":
        return self

    def __exit__(self, *exc) -> None:
        self.cleanup()


__all__ = ["ElasticRun", "Job", "Lighthouse", "children", "ensure_job_store", "free_port", "lighthouse_binary",
           "parent", "start_time", "writers"]
