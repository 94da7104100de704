"""Test-only stand-in for ``torch.distributed.run`` on one node: ranks forked from a warm process.

    python -m megatron_sparseloco.testing.prefork serve SOCKET          # the warm process (conftest starts it)
    python -m megatron_sparseloco.testing.prefork [--standalone] --nproc-per-node N [--master-port P]
                                                  [--nnodes M --node-rank R] [-m] TARGET ARGS...
                                                  # a launch, as torchrun's CLI

Why: on the 2-core CI machine a real-loop test spends most of its time importing. Each rank of a
torchrun launch imports torch and megatron (about 7 CPU-seconds, so 14 s of wall time for 4 ranks
on 2 cores), and torchrun itself imports torch first; the training itself takes 1–3 s. The server
imports torch and megatron once per test session and then only ``fork()``s, so a launch pays the
training, not the imports. Nothing of ours is imported in the server (the plugin patches megatron
when it installs; a plain-Megatron run in the same session must not see that), and the server
never computes anything, so no OpenMP pool or thread exists when it forks.

What a rank gets is what torchrun gives it: its own process; the client's stdin/stdout/stderr (the
file descriptors themselves, passed over the unix socket); the client's environment and working
directory, plus ``RANK``, ``LOCAL_RANK``, ``WORLD_SIZE``, ``LOCAL_WORLD_SIZE``, ``GROUP_RANK``,
``MASTER_ADDR``/``MASTER_PORT`` (a free loopback port unless ``--master-port``) with the rendezvous
store hosted by the launcher (``TORCHELASTIC_USE_AGENT_STORE``, as torchrun's agent); ``sys.path`` as
``python -m TARGET`` (working directory first) or ``python TARGET`` (the script's directory first)
would set it, with the client's ``PYTHONPATH``; ``sys.argv``; fresh numpy / Python RNG state.
Several nodes (``--nnodes M --node-rank R --master-port P``, one client per node, as torchrun
with a static rendezvous): node R's ranks are global ranks R·N … R·N + N − 1, node 0's launcher
hosts the store on P, and each launcher stops only its own ranks on a failure (a lost node).
One difference, for speed: megatron's dist-checkpoint write-results queue is an in-process
``queue.Queue`` (megatron creates a spawn-context ``Manager``, a server process that re-imports the
pretrain script at the first save); enough for synchronous saves, and an ``--async-save`` run fails
to pickle it (no test uses async saves).
Failure handling follows torchrun: when a rank exits non-zero the others get SIGTERM (SIGKILL
after 10 s) and the launch returns 1; when the client goes away (a test's timeout killed it) every
rank is killed at once. Without ``SPARSELOCO_PREFORK_SOCKET`` in the environment the client simply
execs ``torch.distributed.run`` with the same arguments.

Tests that are about the launcher itself (the recipes, the bad-flag-under-torchrun test, the
example-script test) keep launching through torchrun.
"""
from __future__ import annotations

import argparse
import io
import json
import os
import select
import signal
import socket
import sys
import time

SOCKET_ENV = "SPARSELOCO_PREFORK_SOCKET"
#: imported once by the server; third-party only (see the module docstring)
PRELOAD = ("torch", "torch.distributed", "torch.distributed.checkpoint", "numpy", "megatron.core",
           "megatron.core.dist_checkpointing.strategies.filesystem_async",
           "megatron.training", "megatron.training.training", "megatron.core.models.gpt",
           "megatron.core.models.gpt.gpt_layer_specs", "megatron.core.datasets.gpt_dataset",
           "megatron.core.datasets.blended_megatron_dataset_builder", "megatron.training.arguments")
KILL_GRACE_S = 10.0


_server = None


def ensure_server() -> str:
    """Start this test process's server (once; it stops with this process) and export its socket."""
    global _server
    if _server is None or _server.poll() is not None:
        import atexit
        import subprocess
        import tempfile
        d = tempfile.mkdtemp(prefix="sparseloco-prefork-")
        path = os.path.join(d, "launch.sock")
        env = dict(os.environ, OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1"))
        log = open(os.path.join(d, "server.log"), "w")
        _server = subprocess.Popen([sys.executable, "-m", "megatron_sparseloco.testing.prefork", "serve", path],
                                   env=env, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT)
        atexit.register(_server.terminate)
        os.environ[SOCKET_ENV] = path
    return os.environ[SOCKET_ENV]


def use_prefork(cmd):
    """``cmd`` (a ``python -m torch.distributed.run ...`` argv) launched through this module instead
    (the server started if this process has none)."""
    ensure_server()
    cmd = list(cmd)
    i = cmd.index("torch.distributed.run")
    cmd[i] = "megatron_sparseloco.testing.prefork"
    return cmd


# ------------------------------------------------------------------------------------------ client
def _parse_launch(argv):
    p = argparse.ArgumentParser(prog="python -m megatron_sparseloco.testing.prefork", allow_abbrev=False)
    p.add_argument("--standalone", action="store_true")
    p.add_argument("--nproc-per-node", "--nproc_per_node", type=int, required=True)
    p.add_argument("--nnodes", type=int, default=1)
    p.add_argument("--node-rank", "--node_rank", type=int, default=0)
    p.add_argument("--master-port", "--master_port", type=int, default=None)
    p.add_argument("-m", dest="module", action="store_true")
    p.add_argument("target")
    p.add_argument("args", nargs=argparse.REMAINDER)
    a = p.parse_args(argv)
    if a.nnodes > 1 and a.master_port is None:
        p.error("--nnodes > 1 needs --master-port (the node-0 launcher hosts the store there)")
    if not 0 <= a.node_rank < a.nnodes:
        p.error(f"--node-rank {a.node_rank} is outside 0..{a.nnodes - 1}")
    return a


def client(argv) -> int:
    path = os.environ.get(SOCKET_ENV)
    if not path:
        os.execv(sys.executable, [sys.executable, "-m", "torch.distributed.run", *argv])
    a = _parse_launch(argv)
    deadline = time.monotonic() + 120
    while not os.path.exists(path):      # the server may still be importing
        if time.monotonic() > deadline:
            sys.exit(f"prefork: no server socket at {path} after 120 s")
        time.sleep(0.1)
    job = {"nproc": a.nproc_per_node, "nnodes": a.nnodes, "node_rank": a.node_rank, "master_port": a.master_port,
           "module": a.module, "target": a.target, "args": a.args, "env": dict(os.environ), "cwd": os.getcwd()}
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.connect(path)
    data = json.dumps(job).encode()
    socket.send_fds(s, [len(data).to_bytes(8, "big") + data], [0, 1, 2])
    reply = b""
    while chunk := s.recv(4096):
        reply += chunk
    if not reply:
        print("prefork: the launcher died without an exit code", file=sys.stderr)
        return 1
    return int(json.loads(reply)["rc"])


# ------------------------------------------------------------------------------------------ server
def serve(path: str) -> None:
    parent = os.getppid()                                  # before the imports: it may die meanwhile
    import importlib
    import warnings
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for name in PRELOAD:
            importlib.import_module(name)
    signal.signal(signal.SIGCHLD, signal.SIG_IGN)          # launchers are reaped by the kernel
    if os.path.exists(path):
        os.remove(path)
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(path + ".tmp")
    listener.listen(16)
    os.rename(path + ".tmp", path)                         # clients wait for this name: ready
    listener.settimeout(1.0)
    while os.getppid() == parent:                          # the test session is gone: stop
        try:
            conn, _ = listener.accept()
        except socket.timeout:
            continue
        conn.settimeout(None)
        if os.fork() == 0:
            os.setsid()     # the launcher and its ranks: one process group, killed as one at the end
            listener.close()
            signal.signal(signal.SIGCHLD, signal.SIG_DFL)
            try:
                rc = _launch(conn)
            except BaseException:                          # noqa: BLE001 - report, never leave the client waiting
                import traceback
                traceback.print_exc()
                rc = 1
            try:
                conn.sendall(json.dumps({"rc": rc}).encode())
                conn.close()
            finally:
                # anything a rank left behind (a process it started) holds the client's output
                # pipe open: the launcher's process group goes, the launcher with it
                os.killpg(os.getpgid(0), signal.SIGKILL)
                os._exit(0)
        conn.close()
    os.remove(path)


def _recv_job(conn):
    """The job (8-byte length, then JSON) and the client's three descriptors, sent with its first bytes."""
    data, fds = b"", []
    while len(data) < 8 or len(data) < 8 + int.from_bytes(data[:8], "big"):
        msg, got, _flags, _addr = socket.recv_fds(conn, 1 << 20, 3)
        if not msg:
            raise ConnectionError("prefork: the client closed the connection before sending its job")
        fds += got
        data += msg
    return json.loads(data[8:]), fds


def _launch(conn) -> int:
    """One torchrun-like launch: fork the ranks, wait, stop the rest on the first failure."""
    from megatron_sparseloco.testing.multirank import free_port
    job, fds = _recv_job(conn)
    os.dup2(fds[2], 2)                                     # the launcher's own messages: to the client
    port = job["master_port"] or free_port()
    n = job["nproc"]
    nnodes, node = job.get("nnodes", 1), job.get("node_rank", 0)
    pids = {}
    for rank in range(n):
        pid = os.fork()
        if pid == 0:
            _rank_main(job, fds, rank, n, port, node, nnodes)   # never returns
        pids[pid] = rank
    for fd in fds:
        os.close(fd)
    # the rendezvous store, hosted here as torchrun's agent hosts it (created after the forks: the
    # ranks retry until it listens), so that a rank that exits first does not take it away
    import datetime

    import torch.distributed as dist
    if node == 0:   # the other nodes' ranks connect to node 0's store, as with torchrun's static rendezvous
        store = dist.TCPStore("127.0.0.1", port, n * nnodes, is_master=True, wait_for_workers=False,  # noqa: F841
                              timeout=datetime.timedelta(seconds=1800))
    codes: dict[int, int] = {}  # rank -> exit code
    failed_at: float | None = None
    while len(codes) < n:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            break
        if pid:
            code = os.waitstatus_to_exitcode(status)
            codes[pids[pid]] = code
            if code != 0 and failed_at is None:
                failed_at = time.monotonic()
                print(f"prefork: rank {pids[pid]} exited with code {code}; stopping the other ranks",
                      file=sys.stderr, flush=True)
                _signal_alive(pids, codes, signal.SIGTERM)
                _signal_alive(pids, codes, signal.SIGCONT)  # a stopped rank must see the SIGTERM
            continue
        if select.select([conn], [], [], 0.05)[0] and not conn.recv(1, socket.MSG_PEEK):
            _signal_alive(pids, codes, signal.SIGKILL)     # the client is gone (a test's timeout)
            failed_at = failed_at or time.monotonic()
        if failed_at is not None and time.monotonic() - failed_at > KILL_GRACE_S:
            _signal_alive(pids, codes, signal.SIGKILL)
    return 0 if all(c == 0 for c in codes.values()) and len(codes) == n else 1


def _signal_alive(pids, codes, sig) -> None:
    for pid, rank in pids.items():
        if rank not in codes:
            try:
                os.kill(pid, sig)
            except ProcessLookupError:
                pass


def _rank_main(job, fds, rank: int, world: int, port: int, node: int = 0, nnodes: int = 1) -> None:
    code = 1
    try:
        for i, fd in enumerate(fds):
            os.dup2(fd, i)
            os.close(fd)
        for sig in (signal.SIGCHLD, signal.SIGTERM):
            signal.signal(sig, signal.SIG_DFL)
        # as any Python process torchrun starts: SIGPIPE ignored (CPython's start-up does it), so a write
        # to a socket a dead peer closed raises (gloo: "Connection closed by peer") instead of killing the rank
        signal.signal(signal.SIGPIPE, signal.SIG_IGN)
        signal.signal(signal.SIGINT, signal.default_int_handler)
        env = dict(job["env"])
        local, rank, world = rank, node * world + rank, world * nnodes
        env.update({"RANK": str(rank), "LOCAL_RANK": str(local), "WORLD_SIZE": str(world),
                    "LOCAL_WORLD_SIZE": str(world // nnodes), "GROUP_RANK": str(node), "ROLE_RANK": str(rank),
                    "ROLE_WORLD_SIZE": str(world), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
                    "TORCHELASTIC_USE_AGENT_STORE": "True",
                    "TORCHELASTIC_RESTART_COUNT": "0", "TORCHELASTIC_MAX_RESTARTS": "0"})
        os.environ.clear()
        os.environ.update(env)
        os.chdir(job["cwd"])
        unbuffered = bool(env.get("PYTHONUNBUFFERED"))
        for stream in (sys.stdout, sys.stderr):
            assert isinstance(stream, io.TextIOWrapper), "the server is a python process of its own (ensure_server)"
            stream.reconfigure(line_buffering=True, write_through=unbuffered)
        _fresh_process_state(env)
        target = job["target"]
        first = os.getcwd() if job["module"] else os.path.dirname(os.path.abspath(target))
        extra = [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
        sys.path[:] = [first] + extra + [p for p in sys.path[1:] if p not in extra]
        import runpy
        sys.argv = [target] + list(job["args"])
        try:
            if job["module"]:
                runpy.run_module(target, run_name="__main__", alter_sys=True)
            else:
                runpy.run_path(target, run_name="__main__")
            code = 0
        except SystemExit as e:
            if e.code is None or isinstance(e.code, int):
                code = e.code or 0
            else:
                print(e.code, file=sys.stderr)
                code = 1
        except BaseException:                              # noqa: BLE001 - a rank's traceback, as python prints it
            import traceback
            traceback.print_exc()
            code = 1
        import atexit
        atexit._run_exitfuncs()
    finally:
        try:
            sys.stdout.flush()
            sys.stderr.flush()
        finally:
            os._exit(code)


def _fresh_process_state(env) -> None:
    """What a fresh interpreter would have and the fork copied from the server instead."""
    import numpy as np
    import torch
    np.random.seed()                                       # Python's random reseeds itself after fork
    if env.get("OMP_NUM_THREADS"):
        torch.set_num_threads(int(env["OMP_NUM_THREADS"]))
    # dist-checkpointing's write-results queue: megatron makes a spawn-context Manager at the first
    # save, a server process that re-imports the pretrain script (7 CPU-seconds per rank) and
    # outlives a killed rank. A sync save (every test's) puts and gets in this process.
    import queue
    from megatron.core.dist_checkpointing.strategies import filesystem_async
    if getattr(filesystem_async, "_results_queue", "absent") is None:
        filesystem_async._results_queue = queue.Queue()
    import megatron.training.training as mtt               # its start-up clock started at import
    now = time.time()
    for name in ("_TRAIN_START_TIME", "_LEGACY_TRAIN_START_TIME"):
        if hasattr(mtt, name):
            setattr(mtt, name, now)


def main(argv=None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["serve"]:
        serve(argv[1])
        return
    sys.exit(client(argv))


if __name__ == "__main__":
    main()
