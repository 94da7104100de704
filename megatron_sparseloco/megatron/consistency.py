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


def check_identical_across_workers(tensors: Sequence[torch.Tensor], group: Optional[dist.ProcessGroup],
                                   what: str, fix: str) -> Optional[int]:
    """All-gather the fingerprint over ``group``; raise ``DivergenceError`` naming the odd workers.

    Returns the fingerprint every worker agreed on (None for a group of one: nothing compared).
    """
    if group is None or dist.get_world_size(group) == 1:
        return None
    device = tensors[0].device if tensors else torch.device("cpu")
    if device.type == "cpu" and dist.get_backend(group) == "nccl":  # host tensors (θ_outer with anchor_on_cpu)
        device = torch.device("cuda", torch.cuda.current_device())
    mine = torch.tensor([fingerprint(tensors), sum(t.numel() for t in tensors)], dtype=torch.int64, device=device)
    world = dist.get_world_size(group)
    gathered = [torch.empty_like(mine) for _ in range(world)]
    dist.all_gather(gathered, mine, group=group)
    values = [tuple(int(v) for v in g.tolist()) for g in gathered]
    if len(set(values)) == 1:
        return values[0][0]
    counts = {v: values.count(v) for v in values}
    majority = max(counts, key=counts.get)
    odd = [w for w, v in enumerate(values) if v != majority]
    raise DivergenceError(f"{what} differ across workers: worker(s) {odd} disagree with the majority "
                          f"(fingerprints {values}); global ranks {[dist.get_global_rank(group, w) for w in odd]}. Fix: {fix}")
