"""Per-element optimizer state in model space: pieces of whole parameters, not a rank's flat shard.

A worker's distributed optimizer splits every parameter's elements between the ranks of its
data-parallel group; rank r holds the flat range ``[start_r, end_r)`` of parameter p
(``MainParamShards.ranges``). Any per-element state that follows those shards — θ_outer, error
feedback, outer momentum, the fp32 main params, Adam moments — is therefore laid out by the
worker's data-parallel size. To store it independently of that size it is written in the
parameter's own coordinates:

    [start_r, end_r) of a row-major tensor of shape (d_0, …, d_{n−1})
        = at most 2·(n − 1) + 1 boxes, each a contiguous run of the range  (``flat_range_boxes``)

e.g. a partial first row, a block of whole rows, a partial last row for a matrix. Each box is a
view of the rank's live state (no copy, no message) and goes into the checkpoint as one chunk of
the parameter-shaped tensor at its offset; the ranks' boxes tile the parameter exactly, so the
checkpoint holds every element once, bit for bit (−0.0, NaN payloads included).

Loading reads by coordinates, whatever chunks were written: a rank reads the whole parameters it
holds a piece of and slices ``whole_p.view(-1)[start:end]`` — for whatever ranges the *new* layout
gives it (``owned_piece``); ``piece_table`` names each parameter's owner (the holder of its first
element), the main reader.
"""
from __future__ import annotations

import math
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


Box = Tuple[Tuple[int, ...], Tuple[int, ...], int, int]


def flat_range_boxes(shape: Sequence[int], start: int, end: int) -> List[Box]:
    """The flat range ``[start, end)`` of a row-major tensor of ``shape`` as boxes ``(offset, size,
    flat start, flat end)``, in order, each a contiguous run of the range (module docstring)."""
    shape = tuple(int(d) for d in shape)
    if not 0 <= start <= end <= math.prod(shape):
        raise ValueError(f"range [{start}, {end}) is not inside a tensor of shape {shape}")
    if start == end:
        return []
    if len(shape) <= 1:
        return [((start,) if shape else (), (end - start,) if shape else (), start, end)]
    inner = math.prod(shape[1:])
    first, last = start // inner, (end - 1) // inner     # rows holding the first / last element
    out: List[Box] = []

    def within(row: int, lo: int, hi: int) -> None:      # [lo, hi) inside one row
        for off, size, a, b in flat_range_boxes(shape[1:], lo - row * inner, hi - row * inner):
            out.append(((row,) + off, (1,) + size, a + row * inner, b + row * inner))

    if first == last and (start % inner or end % inner):
        within(first, start, end)
        return out
    lo_row = first if start % inner == 0 else first + 1
    hi_row = last + 1 if end % inner == 0 else last
    if start % inner:
        within(first, start, lo_row * inner)
    if hi_row > lo_row:
        out.append(((lo_row,) + (0,) * (len(shape) - 1), (hi_row - lo_row,) + shape[1:], lo_row * inner,
                    hi_row * inner))
    if end % inner:
        within(last, hi_row * inner, end)
    return out


def owned_piece(whole: torch.Tensor, start: int, end: int) -> torch.Tensor:
    """This rank's elements of a whole parameter (a view)."""
    return whole.reshape(-1)[start:end]


__all__: List[str] = ["PieceTable", "piece_table", "flat_range_boxes", "owned_piece"]
