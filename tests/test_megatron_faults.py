"""Fault injection on real megatron-core workers (CPU, gloo): a dead worker, a diverged worker."""
from __future__ import annotations

import os
import time

from megatron_sparseloco.testing.multirank import run_ranks

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
    from megatron_sparseloco.megatron.outer_group import WorkerLostError
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
    timeout_s = 20.0
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
