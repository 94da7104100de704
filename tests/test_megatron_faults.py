"""Fault injection on real megatron-core workers (CPU, gloo): a dead worker, a diverged worker, and the arrival
barrier that names a lost worker before any outer collective (unit, and the real megatron.training loop)."""
from __future__ import annotations

import os
import re
import signal
import subprocess
import time

import pytest

from megatron_sparseloco.testing.multirank import free_port, run_ranks

SEQ, MBS, VOCAB = 32, 2, 128


def _build(W, H, algorithm="diloco", timeout_s=None, check_interval=0, **fields):
    from megatron.core import parallel_state

    from megatron_sparseloco.megatron.optimizer import OuterLoopConfig, OuterLoopOptimizer
    from megatron_sparseloco.outer.registry import build_outer_strategy
    from megatron_sparseloco.testing.megatron_harness import (build_tiny_gpt, init_megatron, synthetic_batches,
                                                               wrap_ddp_and_optimizer)
    init_megatron(num_distributed_optimizer_instances=W)
    ddp, opt = wrap_ddp_and_optimizer(build_tiny_gpt(seq_len=SEQ, vocab=VOCAB), num_distributed_optimizer_instances=W)
    batches = synthetic_batches(3, MBS, SEQ, VOCAB, parallel_state.get_data_parallel_rank())

    def factory(params, group, names, slices=None):
        return build_outer_strategy(algorithm, params, group, names=names, slices=slices, **fields)

    cfg = OuterLoopConfig(inner_steps=H, outer_timeout_s=timeout_s, consistency_check_interval=check_interval)
    return ddp, OuterLoopOptimizer(opt, ddp, factory, cfg), batches


def _dead_worker_rank(rank, world, H, timeout_s):
    from megatron_sparseloco.megatron.placement.outer_group import WorkerLostError
    from megatron_sparseloco.testing.megatron_harness import train_step
    ddp, outer, batches = _build(2, H, timeout_s=timeout_s)
    if rank == 1:
        outer.outer_step = lambda: os._exit(3)  # worker 1 crashes right before its first outer step
    t0 = None
    try:
        for i in range(3 * H):
            if outer.inner_calls == H - 1:
                t0 = time.monotonic()
            train_step(ddp, outer, batches, seq_len=SEQ, micro_batch_size=MBS)
    except WorkerLostError as exc:
        return {"error": str(exc), "waited_s": time.monotonic() - t0, "inner_calls": outer.inner_calls}
    return {"error": None}


def test_dead_worker_fails_the_others_with_its_name():
    timeout_s = 6.0
    res = run_ranks(_dead_worker_rank, 2, args=(3, timeout_s), timeout=180, expect_dead=(1,))
    assert res[1] is None
    err = res[0]["error"]
    assert err is not None, "the surviving worker did not notice the dead one"
    assert "worker(s) [1]" in err and "outer step 1" in err and "--sparseloco-outer-timeout" in err, err
    assert res[0]["waited_s"] < timeout_s + 15, res[0]["waited_s"]


def _divergence_rank(rank, world, H):
    from megatron_sparseloco.megatron.consistency import DivergenceError
    from megatron_sparseloco.testing.megatron_harness import train_step
    ddp, outer, batches = _build(2, H, check_interval=1)
    outcome = {"outer_steps_ok": 0, "error": None}
    try:
        for _ in range(3 * H):
            train_step(ddp, outer, batches, seq_len=SEQ, micro_batch_size=MBS)
            if outer.inner_calls == H:
                outcome["outer_steps_ok"] = outer.outer_steps
                if rank == 1:  # a silent fault: one element of worker 1's θ_outer is altered
                    anchor = outer.strategies[0].anchor
                    anchor[17] = anchor[17] + 1e-3
    except DivergenceError as exc:
        outcome["error"] = str(exc)
        outcome["failed_at"] = outer.outer_steps
    return outcome


def test_consistency_check_catches_altered_worker():
    res = run_ranks(_divergence_rank, 2, args=(2,), timeout=180)
    for r in res:
        assert r["outer_steps_ok"] == 1  # the first outer step's check passed
        assert r["error"] is not None and "θ_outer" in r["error"] and "worker(s) [1]" in r["error"], r
        assert r["failed_at"] == 2


def _identical_start_rank(rank, world):
    import torch
    from megatron_sparseloco.megatron.consistency import DivergenceError
    from megatron_sparseloco.megatron.optimizer import OuterLoopConfig, OuterLoopOptimizer
    from megatron_sparseloco.outer.registry import build_outer_strategy
    from megatron_sparseloco.testing.megatron_harness import build_tiny_gpt, init_megatron, wrap_ddp_and_optimizer
    init_megatron(num_distributed_optimizer_instances=2)
    ddp, opt = wrap_ddp_and_optimizer(build_tiny_gpt(seq_len=SEQ, vocab=VOCAB), num_distributed_optimizer_instances=2)
    if rank == 1:
        with torch.no_grad():
            opt.chained_optimizers[0].shard_fp32_groups[0][0].add_(1.0) if hasattr(opt, "chained_optimizers") else \
                opt.shard_fp32_groups[0][0].add_(1.0)
    try:
        OuterLoopOptimizer(opt, ddp, lambda p, g, n, sl: build_outer_strategy("average", p, g, names=n, slices=sl), OuterLoopConfig(inner_steps=2))
    except DivergenceError as exc:
        return str(exc)
    return None


def test_workers_must_start_identical():
    res = run_ranks(_identical_start_rank, 2, timeout=180)
    assert all(r is not None and "initial parameters" in r for r in res), res


def _arrival_barrier_rank(rank, world, timeout_s):
    """2 workers x 2 shard positions (worker = rank // 2). Steps 1-3: everyone arrives (at step 2 the
    ranks of position 1 only arrive, as ranks without a collective in a delayed round do, and do not
    wait); step 4: rank 3 (worker 1, position 1) never does."""
    import torch.distributed as dist

    from megatron_sparseloco.megatron.placement.outer_group import OuterStepWatch, WorkerLostError
    from megatron_sparseloco.testing.collective_spy import CollectiveSpy
    group, _ = dist.new_subgroups_by_enumeration([[0, 2], [1, 3]])
    watch = OuterStepWatch(group, rank // 2, timeout_s)
    for step in (1, 2, 3):
        if step == 2 and rank % 2 == 1:
            watch.arrive(step)
        else:
            watch.barrier(step)
    dist.barrier()   # every rank has passed step 3: its deletions are done
    names = [f"rank{r}" for r in range(world)] + ["arrived", "all"]
    left = {step: [n for n in names if watch.store.check([watch.key(step, n)])] for step in (1, 2, 3)}
    dist.barrier()   # everyone has looked before step 4's arrivals delete step 3's keys
    out = {"left": left, "worker_of": watch.worker_of, "error": None}
    if rank == 3:
        return out
    t0 = time.monotonic()
    with CollectiveSpy() as spy:
        try:
            watch.barrier(4)
        except WorkerLostError as exc:
            out["error"] = str(exc)
        waited = time.monotonic() - t0
        try:   # a second strategy of the round asks again: the same error at once
            watch.wait_all(4)
        except WorkerLostError as exc:
            out["again"] = (str(exc) == out["error"], time.monotonic() - t0 - waited)
    out.update(waited_s=waited, collectives=list(spy.calls), state=watch.store_state(4), prefix=watch.prefix)
    return out


def test_arrival_barrier_names_missing_worker_on_every_rank_before_any_collective():
    """Every surviving rank — the missing rank's own worker-mate and the other worker's ranks at both
    shard positions — raises WorkerLostError naming worker 1 and global rank 3 after the timeout,
    with no collective issued, and raises it again at once when asked again; ranks that only arrive
    let the others pass; the store keeps only the last step's keys."""
    timeout_s = 3.0
    res = run_ranks(_arrival_barrier_rank, 4, args=(timeout_s,), timeout=120)
    for rank, r in enumerate(res):
        assert r["worker_of"] == [0, 0, 1, 1]
        assert r["left"][1] == [] and r["left"][2] == [], r["left"]   # old steps' keys deleted
        assert r["left"][3] == [f"rank{q}" for q in range(4)] + ["arrived", "all"]
        if rank == 3:
            continue
        err = r["error"]
        assert err is not None and "worker(s) [1] (global rank(s) [3]) never reached outer step 4" in err, err
        assert f"global rank {rank}, worker {rank // 2}" in err and "--sparseloco-outer-timeout" in err, err
        assert "before issuing any collective" in err and "Fix:" in err, err
        assert r["collectives"] == []
        assert timeout_s - 0.5 <= r["waited_s"] < timeout_s + 10, r["waited_s"]
        assert r["again"][0] and r["again"][1] < 1.0, r["again"]
        # step 3 stays complete (no step-4 completer deleted it); rank 3 alone never moved on from it
        assert r["state"] == (f"{r['prefix']} at the timeout: step 3: arrived 4 of 4, all set, ranks [3]; "
                              "step 4: arrived 3 of 4, all unset, ranks [0, 1, 2]; "
                              "step 5: arrived 0 of 4, all unset, ranks []"), r["state"]



def _second_loop_rank(rank, world, timeout_s):
    """Two outer loops one after the other in one job (a benchmark's runs): the first completes steps
    1 and 2; in the second, rank 1 arrives at step 1 only. Returns rank 0's error at step 2, if any."""
    import torch.distributed as dist

    from megatron_sparseloco.megatron.placement.outer_group import OuterStepWatch, WorkerLostError
    group = dist.new_group([0, 1])
    first = OuterStepWatch(group, 0, timeout_s)
    for step in (1, 2):
        first.barrier(step)
    dist.barrier()
    second = OuterStepWatch(group, 0, timeout_s)
    second.barrier(1)
    out = {"prefixes": (first.prefix, second.prefix), "error": None}
    if rank == 0:
        try:
            second.barrier(2)
        except WorkerLostError as exc:
            out["error"] = str(exc)
    dist.barrier()
    return out


def test_a_second_outer_loop_in_the_same_job_waits_at_the_step_the_first_ended_on():
    """The first loop's last step stays complete in the store; the second loop's barrier at that step
    must still wait for every rank (its keys are its own), so rank 0 names rank 1 after the timeout."""
    res = run_ranks(_second_loop_rank, 2, args=(2.0,), timeout=120)
    assert res[0]["prefixes"] == res[1]["prefixes"], res
    first, second = res[0]["prefixes"]
    assert first != second, res
    err = res[0]["error"]
    assert err is not None and "worker(s) [1] (global rank(s) [1]) never reached outer step 2" in err, err

#: what examples/slurm/sparseloco.sbatch exports: NCCL's watchdog takes a process down when a collective
#: fails or times out (TORCH_NCCL_ASYNC_ERROR_HANDLING=1); semantics_launcher's WATCHDOG=1 does the same on gloo
SBATCH_ENV = {"TORCH_NCCL_ASYNC_ERROR_HANDLING": "1", "CUDA_DEVICE_MAX_CONNECTIONS": "1", "NCCL_DEBUG": "WARN",
              "WATCHDOG": "1"}


def _launch_two_nodes(tmp_path, env, timeout_s, H, extra=(), grace_s=3.0):
    """The real megatron.training loop (tests/semantics_launcher.py) on two "nodes", one launcher and
    one rank each (worker w = node w), as a two-node torchrun with a static rendezvous: a lost rank
    stops only its own node. When node 0 has ended, node 1 is stopped as srun --kill-on-bad-exit does.
    Returns ({node: exit code}, {node: output})."""
    from megatron_sparseloco.demo import REPO_ROOT, build_command
    from megatron_sparseloco.testing.prefork import use_prefork
    launcher = os.path.join(os.path.dirname(os.path.abspath(__file__)), "semantics_launcher.py")
    cmd = build_command({"train": "unused", "valid": "unused"}, nproc=2, workers=2, algorithm="diloco",
                        inner_steps=H, train_iters=400, eval_interval=1000, eval_iters=1, log_interval=1,
                        micro_batch_size=2, seq_length=32,
                        extra=["--num-layers", "2", "--hidden-size", "64", "--mock-data", "--split", "98,1,1",
                               "--sparseloco-outer-timeout", str(timeout_s)] + list(extra))
    i = cmd.index("--train-data-path")
    del cmd[i:i + 4]
    i = cmd.index("megatron_sparseloco.run")
    cmd[i - 1:i + 1] = [launcher]
    cmd = use_prefork(cmd)
    i = cmd.index("--standalone")
    port = free_port()
    run_env = {**os.environ, **env, "SEMANTICS_OUT": str(tmp_path / "out"), "OMP_NUM_THREADS": "1",
               "PYTHONUNBUFFERED": "1", "PYTHONPATH": REPO_ROOT + os.pathsep + os.environ.get("PYTHONPATH", "")}
    procs, logs = {}, {}
    for node in (0, 1):
        node_cmd = cmd[:i] + ["--nnodes", "2", "--node-rank", str(node), "--master-port", str(port),
                              "--nproc-per-node", "1"] + cmd[i + 3:]
        logs[node] = open(tmp_path / f"node{node}.log", "w+")
        procs[node] = subprocess.Popen(node_cmd, cwd=REPO_ROOT, env=run_env, stdout=logs[node],
                                       stderr=subprocess.STDOUT, start_new_session=True)
    codes = {}
    try:
        codes[0] = procs[0].wait(timeout=240)
        try:
            codes[1] = procs[1].wait(timeout=grace_s)
        except subprocess.TimeoutExpired:
            os.killpg(procs[1].pid, signal.SIGKILL)
            codes[1] = procs[1].wait()
    finally:
        for p in procs.values():
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait()
    out = {}
    for node, f in logs.items():
        f.seek(0)
        out[node] = f.read()
        f.close()
    return codes, out


@pytest.mark.multirank
@pytest.mark.megatron
@pytest.mark.timeout(300)
@pytest.mark.parametrize("fault,tau", [("KILL", 0), ("STOP", 0), ("KILL", 1)])
def test_arrival_barrier_names_lost_worker_in_megatron_loop_before_any_collective(tmp_path, fault, tau):
    """Worker 1 (rank 1, node 1) is killed (SIGKILL: its sockets close) or stopped (SIGSTOP: they stay
    open) at iteration 3 of a 5-iteration round, under the sbatch's watchdog settings. Worker 0 runs
    its inner steps, waits at the first outer step's arrival barrier for --sparseloco-outer-timeout,
    names worker 1 and global rank 1 and exits non-zero having issued no collective of the step (a
    collective with the lost peer would have fired the watchdog, unnamed). With
    --sparseloco-overlap-steps 1 the wait runs on the comm thread before the round's first
    collective, and the error is raised at the round's completion, one inner step later."""
    timeout_s = 8
    extra = ["--sparseloco-overlap-steps", str(tau)] if tau else []
    codes, out = _launch_two_nodes(tmp_path, {**SBATCH_ENV, "STALL_RANK": "1", "STALL_AT_ITER": "3",
                                              "STALL_SIGNAL": fault}, timeout_s, H=5, extra=extra)
    log0 = out[0]
    assert codes[0] != 0 and codes[1] != 0, (codes, log0[-3000:], out[1][-2000:])
    stall = re.search(rf"rank 1 stalls \(SIG{fault}\) at iteration 3", out[1])
    failed = re.search(r"semantics_launcher: rank 0 failed t=[0-9.]+: WorkerLostError: (.*)", log0)
    assert stall and failed, (log0[-3000:], out[1][-2000:])
    message = failed.group(1)
    assert "worker(s) [1] (global rank(s) [1]) never reached outer step 1" in message, message
    assert "--sparseloco-outer-timeout" in message and "Fix:" in message, message
    assert "semantics_launcher: watchdog" not in log0, log0[-3000:]
    if tau:
        return
    spent = re.search(r"semantics_launcher: rank 0 issued 0 collective\(s\) in the failed outer step 1, which raised "
                      r"after ([0-9.]+) s", log0)
    assert spent, log0[-3000:]
    assert timeout_s <= float(spent.group(1)) < timeout_s + 10, spent.group(0)   # the barrier's wait, then out
