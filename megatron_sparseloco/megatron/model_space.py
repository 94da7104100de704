"""Per-element optimizer state in model space: whole parameters, not a rank's flat shard.

A worker's distributed optimizer splits every parameter's elements between its data-parallel
ranks; rank r holds the flat range ``[start_r, end_r)`` of parameter p (``MainParamShards.ranges``).
Any per-element state that follows those shards — θ_outer, error feedback, outer momentum, the
fp32 main params, Adam moments — is therefore laid out by the worker's data-parallel size. To
store it independently of that size, we reassemble each state into whole parameters:

    full_p[start_r:end_r] = piece_r          for every rank r of the worker's shard group

in one collective per (optimizer, state): every rank writes its pieces into a zero buffer over all
the optimizer's parameters and the group sums the buffers *as bytes* (uint8). The ranges are
disjoint and cover each parameter, so at every byte exactly one rank contributes a non-zero value
and the sum is a bit-exact copy (no float rounding, −0.0 and NaN payloads kept).

Loading is the inverse and needs no communication: a rank reads the whole parameters it holds a
piece of and slices ``full_p.view(-1)[start:end]`` — for whatever ranges the *new* layout gives it.
"""
from __future__ import annotations

from typing import Dict, List, Sequence

import torch
import torch.distributed as dist

from megatron_sparseloco.megatron.main_params import MainParamShards


def assemble_whole_params(shards: MainParamShards, pieces: Sequence[torch.Tensor],
                          dtype: torch.dtype) -> Dict[int, torch.Tensor]:
    """``{id(model_param): whole tensor shaped like the param}`` for every param the optimizer updates.

    ``pieces[i]`` holds this rank's elements ``shards.ranges[i]`` of ``shards.model_params[i]``
    (any shape with that many elements, all ``dtype``; none when this rank holds no piece).
    Collective over ``shards.shard_group``: every rank of the group calls it, with the same dtype.
    """
    if len(pieces) != len(shards.model_params):
        raise ValueError(f"{len(pieces)} pieces for {len(shards.model_params)} shards")
    params = shards.all_model_params
    offsets = [0]
    for p in params:
        offsets.append(offsets[-1] + p.numel())
    where = {id(p): offsets[i] for i, p in enumerate(params)}
    device = pieces[0].device if pieces else (params[0].device if params else torch.device("cpu"))
    whole = torch.zeros(offsets[-1], dtype=dtype, device=device)
    for p, (start, end), piece in zip(shards.model_params, shards.ranges, pieces):
        if piece.dtype != dtype or piece.numel() != end - start:
            raise ValueError(f"piece of {piece.numel()} {piece.dtype} for range [{start}, {end}) ({dtype} expected)")
        base = where[id(p)]
        whole[base + start:base + end].copy_(piece.reshape(-1))
    group = shards.shard_group
    if group is not None and dist.is_initialized() and dist.get_world_size(group) > 1:
        dist.all_reduce(whole.view(torch.uint8), op=dist.ReduceOp.SUM, group=group)
    return {id(p): whole[offsets[i]:offsets[i + 1]].view(p.shape) for i, p in enumerate(params)}


def owned_piece(whole: torch.Tensor, start: int, end: int) -> torch.Tensor:
    """This rank's elements of a whole parameter (a view)."""
    return whole.reshape(-1)[start:end]


def shard_group_rank(shards: MainParamShards) -> int:
    group = shards.shard_group
    if group is None or not dist.is_initialized():
        return 0
    return dist.get_rank(group)


def first_holders(shards: MainParamShards) -> List[bool]:
    """For each of this rank's shards: is this rank the lowest of its shard group holding a piece
    of that param? (The one that counts as the main reader when the whole param is loaded;
    dist_checkpointing wants exactly one.) One small object all-gather within the group."""
    group = shards.shard_group
    if group is None or not dist.is_initialized() or dist.get_world_size(group) == 1:
        return [True] * len(shards.model_params)
    index = {id(p): i for i, p in enumerate(shards.all_model_params)}
    mine = [index[id(p)] for p in shards.model_params]
    held: List[List[int]] = [None] * dist.get_world_size(group)  # type: ignore[list-item]
    dist.all_gather_object(held, mine, group=group)
    first: Dict[int, int] = {}
    for r, indices in enumerate(held):
        for i in indices:
            first.setdefault(i, r)
    me = dist.get_rank(group)
    return [first[i] == me for i in mine]


__all__: List[str] = ["assemble_whole_params", "owned_piece", "shard_group_rank", "first_holders"]
