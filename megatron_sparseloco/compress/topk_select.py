"""Deterministic per-chunk Top-k by magnitude: ties in |x| go to the lower position, on every device.

``torch.topk`` does not specify which of several equal values it returns, so on its own two devices could
send different index sets for the same tensor.  The selection here is unique by definition:

    chunk c keeps the k_c slots with the largest (|x|, -position) in lexicographic order.

Fast path: ``topk(bits(|x|), k + 1)`` per chunk.  Let ``m`` be the smallest of the ``k + 1`` candidates.
If ``m`` occurs once among them, the ``k``-th and ``(k+1)``-th largest magnitudes differ, so the top-k
*set* is unique whatever order or tie choice ``topk`` made: keep the ``k`` candidates other than ``m``.
Exact path (rows where ``m`` repeats — a tie across the boundary — and ragged / edge chunks that keep
``k_c < k``): unique int64 keys ``key = (bits(|x|) << S) + (space - 1 - p)`` with ``S = bits(space - 1)``,
``topk`` on those, the ``k_c`` largest keys kept.  Random data almost never takes the exact path for full
chunks; all-zero or constant chunks always do.
"""

from __future__ import annotations

import torch


def select_top_positions(mags: torch.Tensor, k_full: int, kept: torch.Tensor) -> torch.Tensor:
    """Padded positions kept per chunk, ascending, with ``space`` in dropped slots.

    mags:   ``[n_chunks, space]`` int32 from :meth:`ChunkLayout.magnitudes` (-1 = padding).
    k_full: values kept by a full chunk.  kept: int64 ``[n_chunks]`` ``k_c <= k_full``.
    Returns int64 ``[n_chunks, k_full]``: row ``c`` holds its ``k_c`` positions ascending, then ``space``.
    """
    n_chunks, space = mags.shape
    dev = mags.device
    positions = torch.full((n_chunks, k_full), space, dtype=torch.int64, device=dev)
    if n_chunks == 0:
        return positions
    if k_full < space:
        cand = torch.topk(mags, k_full + 1, dim=1, largest=True, sorted=False)
        smallest = cand.values.min(dim=1, keepdim=True).values
        is_smallest = cand.values == smallest
        unique_boundary = (is_smallest.sum(dim=1) == 1) & (kept == k_full)
        fast_rows = torch.nonzero(unique_boundary).reshape(-1)
        fast_keep = ~is_smallest[fast_rows]
        positions[fast_rows] = cand.indices[fast_rows][fast_keep].view(-1, k_full).to(torch.int64)
        slow_rows = torch.nonzero(~unique_boundary).reshape(-1)
    else:
        slow_rows = torch.arange(n_chunks, device=dev)
    if slow_rows.numel():
        shift = (space - 1).bit_length()
        reverse = torch.arange(space - 1, -1, -1, dtype=torch.int64, device=dev)
        keys = (mags[slow_rows].to(torch.int64) << shift) + reverse  # padding: (-1 << S) + rev < 0
        top = torch.topk(keys, k_full, dim=1, largest=True, sorted=True).values
        rank_ok = torch.arange(k_full, device=dev)[None, :] < kept[slow_rows][:, None]
        slot = (space - 1) - (top & ((1 << shift) - 1))
        positions[slow_rows] = torch.where(rank_ok, slot, space)
    return torch.sort(positions, dim=1).values
