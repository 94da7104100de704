"""N, the whole model's parameter count, from the model chunks of one rank (the outer lr rule's size term).

A rank holds a share of the model: its pipeline stage(s), its tensor-parallel slices, its experts.
Summed over the model-parallel group (tensor × pipeline ranks) with each parameter counted once:

    N = Σ_{ranks of the model-parallel group} Σ_{params p of the rank} n(p)
    n(p) = 0                        the last stage's copy of tied word embeddings (``p.shared`` and
                                    not the first stage: Megatron's duplicate of the first stage's)
         = 0                        a parameter replicated across tensor-parallel ranks (not
                                    ``tensor_model_parallel``), on every tensor-parallel rank but 0
         = numel(p) · EP            an expert parameter (``allreduce`` False): each expert-parallel
                                    rank holds other experts of the same size
         = numel(p)                 otherwise

Every rank of every worker gets the same N (one all-reduce of one integer over the model-parallel
group; data-parallel replicas hold the same parameters and are not summed).
"""
from __future__ import annotations

from typing import Iterable

import torch
import torch.distributed as dist

from megatron_sparseloco.comm.collectives import collective_device


def _local_count(model_chunks: Iterable[torch.nn.Module], tp_rank: int, ep_size: int) -> int:
    n = 0
    for chunk in model_chunks:
        for p in chunk.parameters():
            if getattr(p, "shared", False) and getattr(p, "shared_embedding", False):
                continue   # the last stage's copy of the tied embedding
            if tp_rank != 0 and not getattr(p, "tensor_model_parallel", False):
                continue   # replicated on every tensor-parallel rank: counted on rank 0
            n += p.numel() * (ep_size if getattr(p, "allreduce", True) is False else 1)
    return n


def model_parameter_count(model_chunks: Iterable[torch.nn.Module]) -> int:
    """N over the whole model (module docstring); without megatron-core's parallel state, this rank's count."""
    from megatron.core import parallel_state as ps

    if not (dist.is_initialized() and ps.model_parallel_is_initialized()):
        return _local_count(model_chunks, 0, 1)
    n = _local_count(model_chunks, ps.get_tensor_model_parallel_rank(), ps.get_expert_model_parallel_world_size())
    group = ps.get_model_parallel_group()
    if dist.get_world_size(group) == 1:
        return n
    total = torch.tensor([n], dtype=torch.int64, device=collective_device())
    dist.all_reduce(total, group=group)
    return int(total.item())


__all__ = ["model_parameter_count"]
