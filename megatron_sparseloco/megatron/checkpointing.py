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
