"""Where this rank sits among the workers, and the process group its outer step runs on.

``WorkerPlacement.build`` reads Megatron's layout once the workers are isolated
(``worker_isolation.isolate_workers``):

    num_workers     W, the distributed-optimizer instances
    group           the outer group: the ranks at this rank's shard position in every worker;
                    W = 1: a group of this rank alone (``outer_group.single_rank_group``);
                    with ``--sparseloco-outer-timeout`` or delayed application, a copy of
                    Megatron's inter-instance group with that timeout (600 s unless set;
                    ``outer_group.build_outer_group``: a dead or stalled worker fails the others
                    within it, and delayed rounds' collectives never interleave with another
                    group's); otherwise Megatron's inter-instance group itself
    worker_index    this worker's index (its rank in ``group``)
    worker_rank, worker_size    this rank's place in its worker
    watch           the arrival markers that name a worker lost in an outer step
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence

import torch.distributed as dist

from megatron_sparseloco.megatron.placement.outer_group import (OuterStepWatch, build_outer_group, single_rank_group)
from megatron_sparseloco.megatron.placement.gradient_isolation import (cross_worker_group, intra_worker_group,
                                                                       isolate_workers)


@dataclass
class WorkerPlacement:
    num_workers: int
    group: Optional[dist.ProcessGroup]
    worker_index: int
    worker_rank: int
    worker_size: int
    watch: OuterStepWatch

    @classmethod
    def build(cls, model_chunks: Sequence, group: Optional[dist.ProcessGroup], timeout_s: Optional[float],
              own_group: bool) -> "WorkerPlacement":
        """Isolate the workers' inner steps, then the placement (module docstring). ``group``: the
        cross-worker group (default: Megatron's inter-instance group); ``own_group``: copy it (with
        ``timeout_s``, 600 s when None) even without a timeout (delayed application)."""
        W = isolate_workers(model_chunks)
        if W == 1:
            rank = dist.get_rank() if dist.is_initialized() else 0
            size = dist.get_world_size() if dist.is_initialized() else 1
            return cls(1, single_rank_group(), 0, rank, size, OuterStepWatch(None, rank, timeout_s or 600.0))
        base = group if group is not None else cross_worker_group(model_chunks)
        outer = build_outer_group(base, timeout_s or 600.0) if timeout_s is not None or own_group else base
        worker_ranks = intra_worker_group()
        rank, size = dist.get_rank(worker_ranks), dist.get_world_size(worker_ranks)
        return cls(W, outer, dist.get_rank(outer), rank, size, OuterStepWatch(outer, rank, timeout_s or 600.0))


__all__ = ["WorkerPlacement"]
