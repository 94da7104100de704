"""Value quantiser: the SparseLoCo 2-bit scheme, generalised to ``B = 2**bits`` bins.

For the ``n`` selected values ``v`` of one quantiser group (the whole tensor, or ``g`` consecutive chunks):

    shift  = fp32( mean(v) )                          # sums in fp64
    c      = v - shift                                # fp64
    sigma  = sqrt( sum(c^2) / max(n - 1, 1) )         # fp64; n == 1 → sigma = |c| = 0
    scale  = 6 * sigma / B                            # bins cover shift ± 3 sigma
    q      = clamp( round_half_even(c / scale + B/2), 0, B-1 )    # q = B/2 where scale == 0
    lookup[b] = fp32( mean(c[q == b]) )   (0 if bin b is empty)
    dequant(q) = lookup[q] + shift                    # fp32 arithmetic

For B = 4 this is exactly the reference: ``scale = 6σ/4``, ``q = clamp(round(c/scale + 2), 0, 3)``.
For 4 and 8 bits the same ±3σ range is cut into 16 / 256 bins (step 6σ/B).  Because ``lookup`` holds the
bin *means*, the dequantised group has the same mean as ``v`` up to rounding.  All-equal values give
``sigma = 0``: every code is ``B/2``, ``lookup[B/2] = 0``, and ``dequant = shift = v`` exactly.

Group sums use ``index_add_`` in fp64: exact-order on CPU; on CUDA the summation order may vary between
runs (atomics), which can move an fp32 side-info word by one ulp between two encodes of the same tensor.
What is decoded is always exactly what was sent, and the selected indices never depend on it.

Side information per group: ``[shift, lookup[0], …, lookup[B-1]]`` as ``1 + B`` fp32 words.
Raw modes (value_bits 16 / 32) send bf16 / fp32 values and no side information.
"""

from __future__ import annotations

import torch


def side_words(n_bins: int) -> int:
    """fp32 words of side information per quantiser group."""
    return 1 + n_bins if n_bins else 0


def quantise(values: torch.Tensor, group_ids: torch.Tensor, n_groups: int,
             n_bins: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantise fp32 ``values`` whose quantiser group is ``group_ids`` (int64, same length).

    Returns ``codes`` (int64 in ``[0, n_bins)``) and ``side`` (fp32 ``[n_groups, 1 + n_bins]``).
    """
    dev = values.device
    v = values.to(torch.float64)
    ones = torch.ones_like(v)
    count = torch.zeros(n_groups, dtype=torch.float64, device=dev).index_add_(0, group_ids, ones)
    total = torch.zeros(n_groups, dtype=torch.float64, device=dev).index_add_(0, group_ids, v)
    shift32 = (total / count.clamp_min(1)).to(torch.float32)
    c = v - shift32.to(torch.float64)[group_ids]
    sq = torch.zeros(n_groups, dtype=torch.float64, device=dev).index_add_(0, group_ids, c * c)
    sigma = torch.sqrt(sq / (count - 1).clamp_min(1))
    scale = 6.0 * sigma / n_bins
    scale_v = scale[group_ids]
    safe = torch.where(scale_v > 0, scale_v, torch.ones_like(scale_v))
    position = torch.where(scale_v > 0, c / safe, torch.zeros_like(c)) + n_bins / 2
    codes = torch.round(position).clamp_(0, n_bins - 1).to(torch.int64)
    slot = group_ids * n_bins + codes
    bin_sum = torch.zeros(n_groups * n_bins, dtype=torch.float64, device=dev).index_add_(0, slot, c)
    bin_cnt = torch.zeros(n_groups * n_bins, dtype=torch.float64, device=dev).index_add_(0, slot, ones)
    lookup = torch.where(bin_cnt > 0, bin_sum / bin_cnt.clamp_min(1), torch.zeros_like(bin_sum))
    side = torch.cat([shift32[:, None], lookup.to(torch.float32).view(n_groups, n_bins)], dim=1)
    return codes, side


def dequantise(codes: torch.Tensor, group_ids: torch.Tensor, side: torch.Tensor) -> torch.Tensor:
    """``lookup[group, code] + shift[group]`` in fp32."""
    n_bins = side.shape[1] - 1
    lookup = side[:, 1:].reshape(-1)
    return lookup[group_ids * n_bins + codes] + side[:, 0][group_ids]
