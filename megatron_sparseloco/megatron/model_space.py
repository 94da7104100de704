"""Per-element optimizer state in model space: whole parameters, not a rank's flat shard.

A worker's distributed optimizer splits every parameter's elements between the ranks of its
data-parallel group; rank r holds the flat range ``[start_r, end_r)`` of parameter p
(``MainParamShards.ranges``). Any per-element state that follows those shards — θ_outer, error
feedback, outer momentum, the fp32 main params, Adam moments — is therefore laid out by the
worker's data-parallel size. To store it independently of that size we reassemble whole params:

    owner(p) = the rank holding p's first element
    whole_p[start_r:end_r] = piece_r         sent by every other holder r to owner(p)

Only params that cross a shard boundary need messages (point-to-point, one batch per state);
most params have a single holder. Each rank ends up with the whole params it owns — about its
own share of the state, so memory stays balanced — and writes them: a parallel save. The copy is
exact (no arithmetic), so −0.0, NaN payloads and every bit survive.

Loading needs no communication: a rank reads the whole params it holds a piece of and slices
``whole_p.view(-1)[start:end]`` — for whatever ranges the *new* layout gives it.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, List, Sequence, Tuple

import torch
import torch.distributed as dist

from megatron_sparseloco.megatron.main_params import MainParamShards


def _split(shards: MainParamShards) -> bool:
    g = shards.shard_group
    return g is not None and dist.is_initialized() and dist.get_world_size(g) > 1


@dataclass
class PieceTable:
    """Which rank of the shard group holds which range of each param (index into ``all_model_params``)."""

    holders: Dict[int, List[Tuple[int, int, int]]]   # param index -> [(group rank, start, end)] by start
    me: int
    index: Dict[int, int]                            # id(model param) -> param index

    def owner(self, j: int) -> int:
        return self.holders[j][0][0]

    def owner_of(self, param: torch.Tensor) -> int:
        return self.owner(self.index[id(param)])


def piece_table(shards: MainParamShards) -> PieceTable:
    """One small object all-gather within the shard group; checks that the pieces tile every param."""
    index = {id(p): j for j, p in enumerate(shards.all_model_params)}
    mine = [(index[id(p)], a, b) for p, (a, b) in zip(shards.model_params, shards.ranges)]
    if not _split(shards):
        return PieceTable({j: [(0, a, b)] for j, a, b in mine}, 0, index)
    group = shards.shard_group
    gathered: List[list] = [mine] * dist.get_world_size(group)  # placeholders: all_gather_object overwrites them
    dist.all_gather_object(gathered, mine, group=group)
    holders: Dict[int, List[Tuple[int, int, int]]] = {}
    for r, entries in enumerate(gathered):
        for j, a, b in entries:
            holders.setdefault(j, []).append((r, a, b))
    for j, hs in holders.items():
        hs.sort(key=lambda h: h[1])
        ends = [0] + [b for _, _, b in hs]
        if [a for _, a, _ in hs] != ends[:-1] or ends[-1] != shards.all_model_params[j].numel():
            raise AssertionError(f"param #{j}: the ranks' ranges {[(a, b) for _, a, b in hs]} do not tile "
                                 f"its {shards.all_model_params[j].numel()} elements")
    return PieceTable(holders, dist.get_rank(group), index)


def gather_owned_whole_params(shards: MainParamShards, table: PieceTable,
                              pieces: Sequence[torch.Tensor]) -> Dict[int, torch.Tensor]:
    """``{param index: whole tensor}`` for the params this rank owns; the other holders send it their pieces.

    ``pieces[i]`` holds this rank's elements ``shards.ranges[i]`` of ``shards.model_params[i]``.
    Point-to-point within ``shards.shard_group``: every rank holding a piece of an owned-elsewhere
    param must call it (with the same state) — i.e. all ranks of the group, in the same order.
    """
    if len(pieces) != len(shards.model_params):
        raise ValueError(f"{len(pieces)} pieces for {len(shards.model_params)} shards")
    my_piece: Dict[int, torch.Tensor] = {}
    for p, (a, b), piece in zip(shards.model_params, shards.ranges, pieces):
        if piece.numel() != b - a:
            raise ValueError(f"piece of {piece.numel()} elements for range [{a}, {b})")
        my_piece[table.index[id(p)]] = piece.reshape(-1)
    dtypes = {t.dtype for t in my_piece.values()}
    if len(dtypes) > 1:
        raise ValueError(f"pieces of one state in several dtypes: {sorted(map(str, dtypes))}")
    group = shards.shard_group
    out: Dict[int, torch.Tensor] = {}
    ops = []
    for j in sorted(my_piece):
        hs, p = table.holders[j], shards.all_model_params[j]
        if table.owner(j) == table.me:
            whole = torch.empty(p.numel(), dtype=my_piece[j].dtype, device=my_piece[j].device)
            for r, a, b in hs:
                if r == table.me:
                    whole[a:b].copy_(my_piece[j])
                else:
                    assert group is not None  # another rank holds a piece: the params are split over it
                    ops.append(dist.P2POp(dist.irecv, whole[a:b], dist.get_global_rank(group, r), group))
            out[j] = whole.view(p.shape)
        else:
            assert group is not None  # another rank owns it: the params are split over the group
            peer = dist.get_global_rank(group, table.owner(j))
            ops.append(dist.P2POp(dist.isend, my_piece[j].contiguous(), peer, group))
    if ops:
        for req in dist.batch_isend_irecv(ops):
            req.wait()
    return out


def owned_piece(whole: torch.Tensor, start: int, end: int) -> torch.Tensor:
    """This rank's elements of a whole parameter (a view)."""
    return whole.reshape(-1)[start:end]


__all__: List[str] = ["PieceTable", "piece_table", "gather_owned_whole_params", "owned_piece"]
