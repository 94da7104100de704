"""Cross-worker consistency: a cheap exact fingerprint of fp32 tensors compared across workers.

fingerprint(x) = Σ_i bits(x_i) · w_i  (mod 2^64, wrapping int64 arithmetic)
with bits the int32 view of each fp32 element and w_i = ((i · 2654435761) mod 2^31) | 1 an odd
position weight, so a permutation or a single flipped bit changes it. Equal tensors give equal
fingerprints on every device; the converse holds up to a ~2^-64 collision chance.
"""
from __future__ import annotations

from typing import Optional, Sequence

import torch
import torch.distributed as dist

from megatron_sparseloco.comm.process_group import as_outer_comm
from megatron_sparseloco.outer.base import OuterGroup

_CHUNK = 1 << 22


class DivergenceError(RuntimeError):
    """Workers hold different values where they must be identical."""


def fingerprint(tensors: Sequence[torch.Tensor]) -> int:
    total = torch.zeros((), dtype=torch.int64)
    offset = 0
    for t in tensors:
        flat = t.detach().reshape(-1)
        if flat.dtype != torch.float32:
            flat = flat.float()
        for s in range(0, flat.numel(), _CHUNK):
            part = flat[s:s + _CHUNK].contiguous().view(torch.int32).to(torch.int64)
            idx = torch.arange(offset + s, offset + s + part.numel(), dtype=torch.int64, device=part.device)
            w = ((idx * 2654435761) % (1 << 31)) | 1
            total = total + (part * w).sum().cpu()
        offset += flat.numel()
    return int(total.item())


def check_identical_across_workers(tensors: Sequence[torch.Tensor], group: OuterGroup,
                                   what: str, fix: str) -> Optional[int]:
    """All-gather the fingerprint over the outer group (a c10d group or any ``OuterComm``); raise
    ``DivergenceError`` naming the odd workers (and, on a c10d group, their global ranks).

    Returns the fingerprint every worker agreed on (None for a group of one: nothing compared).
    A c10d group is wrapped with a counter of its own: the check's bytes are not the outer step's.
    """
    if group is None:
        return None
    comm = as_outer_comm(group)
    if comm.size == 1:
        return None
    mine = torch.tensor([fingerprint(tensors), sum(t.numel() for t in tensors)], dtype=torch.int64)
    gathered = comm.all_gather_payloads(mine.to(comm.device).view(torch.uint8), equal_sizes=True)
    values = [tuple(int(v) for v in g.cpu().view(torch.int64).tolist()) for g in gathered]
    if len(set(values)) == 1:
        return values[0][0]
    counts = {v: values.count(v) for v in values}
    majority = max(counts, key=lambda v: counts[v])
    odd = [w for w, v in enumerate(values) if v != majority]
    c10d = getattr(comm, "group", None)
    ranks = f"; global ranks {[dist.get_global_rank(c10d, w) for w in odd]}" if c10d is not None else ""
    raise DivergenceError(f"{what} differ across workers: worker(s) {odd} disagree with the majority "
                          f"(fingerprints {values}){ranks}. Fix: {fix}")


def check_outer(strategies: Sequence, group, outer_steps: int, num_workers: int) -> None:
    """θ_outer of every strategy compared across the workers (each over its own outer group, or
    ``group`` where its comm is a c10d group's); raise ``DivergenceError``; global rank 0 prints a pass line."""
    fps = [check_identical_across_workers([s.anchor], s.comm if s.group is None else group,
                                          what=f"θ_outer ({s.name})",
                                          fix="restart from the last checkpoint; a worker's params were altered")
           for s in strategies]
    if fps and None not in fps and (not dist.is_initialized() or dist.get_rank() == 0):
        print(f" sparseloco | consistency check passed at outer step {outer_steps}: θ_outer identical on "
              f"all {num_workers} workers (rank 0's shard fingerprint "
              f"{', '.join(f'{fp & (2**64 - 1):016x}' for fp in fps if fp is not None)})", flush=True)
