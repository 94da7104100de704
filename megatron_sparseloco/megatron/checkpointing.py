"""Outer state in Megatron checkpoints.

``torch_dist``: the wrapper's ``sharded_state_dict`` adds one ``ShardedObject`` per rank under
``optimizer.sparseloco.outer_state`` with global shape (world size,) and offset (global rank,),
replica id 0 — every rank writes its own copy, so nothing is deduplicated as a data-parallel
replica. That matters: the error-feedback buffer differs per worker (and for GASLoC θ_outer too).
The object holds θ_outer, the strategy's buffers (EF, momentum), the inner-call counter (so a
resume in the middle of an inner loop runs the outer step at the same iteration) and cumulative
byte counters.

Layout: the shard each rank owns depends on TP / PP / EP / intra-worker DP. Resuming with another
layout raises ``OuterStateLayoutError`` naming the mismatch (the inner Megatron state reshards;
our flat shard state does not yet). A checkpoint without outer state (e.g. a plain Megatron run
that now continues with SparseLoCo) re-anchors θ_outer on the loaded params and starts with zero
EF / momentum, and says so in the log.

``torch`` format: Megatron saves ``optimizer.state_dict()`` only from data-parallel rank 0, which
would drop the other workers' EF; the wrapper refuses it with a clear error (use torch_dist).
"""
from __future__ import annotations

import torch.distributed as dist

OUTER_KEY = "sparseloco"
SHARDED_KEY = "optimizer.sparseloco.outer_state"


class OuterStateLayoutError(ValueError):
    """A checkpoint's outer state does not fit this run's layout."""


def outer_sharded_object(outer_state: dict):
    from megatron.core.dist_checkpointing.mapping import ShardedObject

    world = dist.get_world_size() if dist.is_initialized() else 1
    rank = dist.get_rank() if dist.is_initialized() else 0
    return ShardedObject(SHARDED_KEY, outer_state, (world,), (rank,), replica_id=0)


def layout_signature(strategies) -> list:
    return [(s.name, s.params.numel) for s in strategies]


def check_layout(saved: dict, strategies) -> None:
    mine = layout_signature(strategies)
    theirs = [(s["name"], int(s["numel"])) for s in saved["strategies"]]
    if mine != theirs:
        raise OuterStateLayoutError(
            f"checkpoint outer state covers {theirs} (strategy, elements) on this rank but this run owns {mine}. "
            "Fix: resume with the same --sparseloco-algorithm, workers, TP/PP/EP and intra-worker data-parallel size "
            "as the run that saved it")


def ensure_adam_step_state(members) -> int:
    """Give torch Adam states a placeholder ``step`` before a checkpoint load; returns how many.

    megatron-core 0.19.2 without Apex / Transformer Engine: ``DistributedOptimizer.state_dict``
    (called while building the sharded state dict for a *load*) asserts that every torch Adam
    param state has a ``step``, but torch creates ``step`` only at the optimizer's first step and
    Megatron's ``init_state_fn`` creates just ``exp_avg`` / ``exp_avg_sq``. So resuming into a
    fresh optimizer fails on any machine without Apex/TE (GPU or CPU). ``load_state_dict`` then
    overwrites ``step`` with the checkpoint's value, so a 0 placeholder is exact.
    tests/test_checkpoint_resume.py checks that the workaround is still needed.
    """
    import torch

    added = 0
    for m in members:
        inner = getattr(m, "optimizer", None)
        if inner is None or not isinstance(inner, torch.optim.Optimizer):
            continue
        init_state_fn = getattr(m, "init_state_fn", None)
        for group in inner.param_groups:
            for p in group["params"]:
                state = inner.state[p]
                if not state and init_state_fn is not None:
                    init_state_fn(inner, getattr(m, "config", None))
                if "exp_avg" in state and "step" not in state:
                    state["step"] = torch.tensor(0.0)
                    added += 1
    return added


def capture_worker_local_state(shards_list) -> list:
    """This rank's fp32 main-param shard and its inner-optimizer state (Adam moments, step).

    Megatron's checkpoints treat data-parallel replicas and distributed-optimizer instances as
    identical copies and keep one (worker 0's). DiLoCo workers are not replicas: between outer
    steps their params and inner-optimizer states differ (and the inner state always does). So
    each rank stores its own copy in its per-rank outer-state object; ``restore`` puts it back
    over the deduplicated one Megatron loaded.
    """
    out = []
    for shards in shards_list:
        inner = getattr(shards.optimizer, "optimizer", None)
        states = []
        for t in shards.tensors:
            st = inner.state.get(t, {}) if inner is not None else {}
            states.append({k: (v.detach().clone() if hasattr(v, "detach") else v) for k, v in st.items()})
        out.append({"main": [t.detach().clone() for t in shards.tensors], "state": states})
    return out


def restore_worker_local_state(shards_list, saved: list) -> None:
    import torch

    if len(saved) != len(shards_list):
        raise OuterStateLayoutError(f"checkpoint holds worker-local state for {len(saved)} optimizers, this run has "
                                    f"{len(shards_list)}. Fix: resume with the same model and parallel layout")
    for shards, entry in zip(shards_list, saved):
        if [tuple(t.shape) for t in shards.tensors] != [tuple(t.shape) for t in entry["main"]]:
            raise OuterStateLayoutError("checkpoint's worker-local main-param shards do not match this rank's. "
                                        "Fix: resume with the same TP/PP/EP and intra-worker data-parallel size")
        inner = getattr(shards.optimizer, "optimizer", None)
        with torch.no_grad():
            for t, main, state in zip(shards.tensors, entry["main"], entry["state"]):
                t.copy_(main)
                if inner is None:
                    continue
                dst = inner.state[t]
                for k, v in state.items():
                    # Fresh tensors, never copy_ into what is there: megatron-core 0.19.2's load
                    # (no Apex/TE) gives every param state the *same* ``step`` tensor, which
                    # torch's foreach Adam then increments once per param per step.
                    dst[k] = v.clone() if hasattr(v, "clone") else v
