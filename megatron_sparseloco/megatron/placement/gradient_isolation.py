"""Make Megatron's inner steps worker-local: no gradient traffic between DiLoCo workers.

A DiLoCo worker is a distributed-optimizer instance (``num_distributed_optimizer_instances = W``).
megatron-core 0.19's bucket groups then reduce-scatter gradients inside the instance and
all-reduce the shards across instances (``_ParamAndGradBucketGroup.start_grad_sync``). We keep
the first and drop the second: each bucket group gets a copy of the DDP config that says one
instance, which is exactly Megatron's single-instance code path on the intra-instance group.

Gradient scale: DDP pre-scales gradients by 1/|DP| (all ranks) when ``average_in_collective`` is
off, because the sum over all of DP was to follow. Now the sum runs over the |DP|/W ranks of one
worker, so the scale must be 1/(|DP|/W) = W/|DP|, otherwise gradients are W× too small. With
``average_in_collective`` the intra-instance AVG already divides by the worker's size (dense) and
the expert pre-scale edp/dp then gives 1/|intra DP| as well, so nothing changes.

Lever chosen (and why): megatron-core also accepts a worker-local ``ProcessGroupCollection``.
That would make each worker a separate Megatron job, but megatron.training builds its data
sampler, global batch and logging on the global data-parallel group, so workers would then read
the *same* data. The instance split keeps Megatron's data sharding (every rank its own slice)
and its global-batch arithmetic, and gives us the cross-worker group Megatron itself would have
used (``inter_dist_opt_group``), for dense and expert buffers alike.
"""
from __future__ import annotations

import dataclasses
from typing import Sequence

import torch

from megatron_sparseloco.comm.collectives import collective_device


def _unwrap_ddp(chunk):
    """The megatron-core DistributedDataParallel inside a model chunk (Float16Module etc. unwrapped)."""
    m = chunk
    while m is not None and not hasattr(m, "bucket_groups"):
        m = getattr(m, "module", None)
    if m is None:
        raise TypeError(f"{type(chunk).__name__} is not a megatron-core DistributedDataParallel model chunk")
    return m


def num_workers(model_chunks: Sequence) -> int:
    return _unwrap_ddp(model_chunks[0]).ddp_config.num_distributed_optimizer_instances


def isolate_workers(model_chunks: Sequence) -> int:
    """Turn off the inter-instance gradient all-reduce and fix the gradient scale. Returns W.

    Idempotent: a chunk already isolated is left alone.
    """
    W = num_workers(model_chunks)
    for chunk in model_chunks:
        ddp = _unwrap_ddp(chunk)
        if getattr(ddp, "_sparseloco_isolated", False):
            continue
        cfg = ddp.ddp_config
        if cfg.num_distributed_optimizer_instances != W:
            raise ValueError("all model chunks must use the same num_distributed_optimizer_instances")
        if W > 1:
            if not cfg.use_distributed_optimizer:
                raise ValueError("DiLoCo workers need the distributed optimizer (use_distributed_optimizer=True)")
            local_cfg = dataclasses.replace(cfg, num_distributed_optimizer_instances=1)
            for bucket_group in list(ddp.bucket_groups) + list(ddp.expert_parallel_bucket_groups):
                bucket_group.ddp_config = local_cfg
                bucket_group.inter_distributed_optimizer_instance_group = None
            if not cfg.average_in_collective:
                for buffer in list(ddp.buffers) + list(ddp.expert_parallel_buffers):
                    buffer.gradient_scaling_factor *= W
                    for bucket in buffer.buckets:
                        bucket.gradient_scaling_factor *= W
        ddp._sparseloco_isolated = True
    return W


def cross_worker_group(model_chunks: Sequence):
    """The group joining this rank to the ranks at the same position in every other worker."""
    ddp = _unwrap_ddp(model_chunks[0])
    if ddp.ddp_config.num_distributed_optimizer_instances == 1:
        return None
    return ddp.inter_dist_opt_group


def intra_worker_group():
    """All ranks of this rank's worker (Megatron's intra distributed-optimizer-instance group)."""
    from megatron.core import parallel_state
    return parallel_state.get_intra_distributed_optimizer_instance_group()


def any_in_worker(flag: bool, group=None) -> bool:
    """True when ``flag`` holds on any rank of the worker (default: Megatron's intra-instance group), for
    decisions every rank of the worker must share (one all-reduce MAX; its ranks run in lockstep)."""
    import torch.distributed as dist
    group = intra_worker_group() if group is None else group
    t = torch.tensor([1.0 if flag else 0.0], device=collective_device(group))
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
    return bool(t.item())


def start_param_sync_all(model_chunks: Sequence) -> None:
    """All-gather updated param shards inside the worker, synchronously, now."""
    for chunk in model_chunks:
        _unwrap_ddp(chunk).start_param_sync(force_sync=True)
