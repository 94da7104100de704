"""The test launcher that forks ranks from a warm process (megatron_sparseloco.testing.prefork).

It stands in for torchrun in the real-loop tests, so it must give a rank what torchrun gives:
the environment of the caller plus the rank variables, a working gloo rendezvous, the caller's
output pipe, a Python process's signal state (SIGPIPE ignored: a write to a dead peer's socket
raises, it does not kill the rank), torchrun's exit status, and no rank left running when one fails
or the caller dies.
"""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest

from megatron_sparseloco.testing.prefork import ensure_server

SCRIPT = r'''
import os, sys, time
import torch, torch.distributed as dist
rank = int(os.environ["RANK"])
open(os.path.join(sys.argv[1], f"pid{rank}"), "w").write(str(os.getpid()))
mode = sys.argv[2]
if mode == "sum":
    dist.init_process_group("gloo")
    t = torch.tensor([float(rank + 1)])
    dist.all_reduce(t)
    r, w = os.pipe()
    os.close(r)
    try:   # a write nobody reads (a dead peer's socket): a Python process gets EPIPE, it is not killed
        os.write(w, b"x")
        pipe = "written"
    except BrokenPipeError:
        pipe = "EPIPE"
    os.write(1, (f"rank {rank}/{os.environ['WORLD_SIZE']} local {os.environ['LOCAL_RANK']} sum {t.item():.0f} "
                 f"client {os.environ.get('PREFORK_TEST_CLIENT_ONLY')} argv {sys.argv[3:]} path0 {sys.path[0]} "
                 f"pipe {pipe}\n").encode())
    dist.destroy_process_group()
elif mode == "fail":
    if rank == 1:
        sys.exit(3)
    time.sleep(120)
elif mode == "hang":
    time.sleep(120)
'''


def _client(tmp_path, nproc, *args, env=None):
    script = tmp_path / "job.py"
    script.write_text(SCRIPT)
    cmd = [sys.executable, "-m", "megatron_sparseloco.testing.prefork", "--standalone", "--nproc-per-node",
           str(nproc), str(script), str(tmp_path), *args]
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env={**os.environ, **(env or {})}, cwd=str(tmp_path))


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    with open(f"/proc/{pid}/stat") as f:  # a zombie is dead
        return f.read().split()[2] != "Z"


def _pids(tmp_path, n):
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        try:
            return [int((tmp_path / f"pid{r}").read_text()) for r in range(n)]
        except (FileNotFoundError, ValueError):
            time.sleep(0.1)
    raise AssertionError("ranks did not start")


@pytest.fixture(scope="module", autouse=True)
def _server():
    ensure_server()


def test_ranks_get_the_callers_environment_and_a_working_rendezvous(tmp_path):
    p = _client(tmp_path, 3, "sum", "x", "--y", env={"PREFORK_TEST_CLIENT_ONLY": "seen"})
    out, _ = p.communicate(timeout=120)
    assert p.returncode == 0, out
    lines = sorted(line for line in out.splitlines() if line.startswith("rank "))
    assert len(lines) == 3, out
    for r, line in enumerate(lines):
        assert line == f"rank {r}/3 local {r} sum 6 client seen argv ['x', '--y'] path0 {tmp_path} pipe EPIPE", line


def test_a_failing_rank_stops_the_others_and_the_launch_fails(tmp_path):
    t0 = time.monotonic()
    p = _client(tmp_path, 2, "fail")
    out, _ = p.communicate(timeout=60)
    assert p.returncode == 1, out
    assert "rank 1 exited with code 3" in out, out
    assert time.monotonic() - t0 < 30            # rank 0 would sleep 120 s
    assert not any(_alive(pid) for pid in _pids(tmp_path, 2))


def test_ranks_die_with_a_killed_client(tmp_path):
    p = _client(tmp_path, 2, "hang")
    pids = _pids(tmp_path, 2)
    assert all(_alive(pid) for pid in pids)
    p.send_signal(signal.SIGKILL)
    p.wait(timeout=10)
    deadline = time.monotonic() + 10
    while any(_alive(pid) for pid in pids) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not any(_alive(pid) for pid in pids)
