"""Entropy coding of per-chunk index sets: Rice-coded gaps between sorted indices.

Each chunk ``c`` sends ``k_c`` distinct compact local indices ``0 <= l_0 < l_1 < … < l_{k-1} < n_c``.
Gaps ``d_0 = l_0``, ``d_i = l_i - l_{i-1} - 1`` are >= 0.  With Rice parameter ``r`` a gap costs
``(d >> r) + 1`` unary bits (``d >> r`` ones, then a zero) plus ``r`` remainder bits (``d mod 2**r``):

    cost_r(c) = sum_i (d_i >> r) + k_c * (1 + r)

The encoder picks, per chunk, the cheapest ``r in 0..r_max`` (``r_max = min(14, bits(n - 1))``, first
minimum on ties).  ``r = 0`` *is* a bitmap: its unary stream is the chunk's bitmap (bits inverted) cut
after the last kept element, costing ``l_{k-1} + 1 <= n_c`` bits — so dense chunks never cost more than a
bitmap and no separate bitmap mode is needed.  For ``k = 64`` of ``4096`` uniformly random positions the
gaps are ≈ geometric with mean 63; ``r = 5`` or ``6`` costs ≈ 7.55 bits/index against the floor
``log2 binom(4096, 64) / 64 = 7.36``, plus 4 bits of parameter per chunk (0.06 bits/index).

Index section layout (bit order as in :mod:`.bitpack`; every stream starts on a byte boundary):

    u64  unary_bits U                      little-endian
    ceil(n_chunks / 2) bytes               per-chunk Rice parameter, one nibble each (0..14)
    ceil(U / 8) bytes                      unary stream, all values in chunk order
    ceil(sum_c k_c * r_c / 8) bytes        remainder stream, same order, r_c bits each

Decoding is vectorised: the ``i``-th zero of the unary stream ends codeword ``i``, so the quotients are
the differences of the zero positions; remainders are gathered at ``cumsum(r)`` offsets; a segmented
cumulative sum of ``d + 1`` gives the indices back.
"""

from __future__ import annotations

import struct

import torch

from megatron_sparseloco.compress.bitpack import bits_to_bytes, bytes_to_bits, pack_bits, unpack_bits
from megatron_sparseloco.compress.errors import PayloadError

MAX_RICE_PARAM = 14
_U64 = struct.Struct("<Q")


def max_rice_param(space: int) -> int:
    return min(MAX_RICE_PARAM, (space - 1).bit_length())


def _chunk_starts(chunk_ids: torch.Tensor) -> torch.Tensor:
    first = torch.ones_like(chunk_ids, dtype=torch.bool)
    first[1:] = chunk_ids[1:] != chunk_ids[:-1]
    return first


def encode_indices(local: torch.Tensor, chunk_ids: torch.Tensor, kept: torch.Tensor, space: int) -> torch.Tensor:
    """Rice-code sorted compact local indices (chunk-major, ascending inside a chunk) → uint8 section."""
    dev = local.device
    n_chunks = kept.numel()
    prev = torch.cat([local.new_full((1,), -1), local[:-1]])
    gaps = torch.where(_chunk_starts(chunk_ids), local, local - prev - 1)
    r_max = max_rice_param(space)
    costs = []
    for r in range(r_max + 1):  # a handful of parameters; everything inside is vectorised
        unary = torch.zeros(n_chunks, dtype=torch.int64, device=dev).index_add_(0, chunk_ids, gaps >> r)
        costs.append(unary + kept * (1 + r))
    param = torch.argmin(torch.stack(costs, dim=1), dim=1)
    value_r = param[chunk_ids]
    quotient = gaps >> value_r
    # unary stream: `quotient` ones then a zero, per value
    ends = torch.cumsum(quotient + 1, 0) - 1
    n_unary = int(ends[-1].item()) + 1 if ends.numel() else 0
    unary_bits = torch.ones(n_unary, dtype=torch.uint8, device=dev)
    unary_bits[ends] = 0
    # remainder stream: the low r bits of each gap, LSB first, concatenated
    remainder = gaps & ((1 << value_r) - 1)
    j = torch.arange(int(param.max()) if n_chunks else 0, dtype=torch.int64, device=dev)  # widest remainder
    rem_bits = ((remainder[:, None] >> j) & 1)[j[None, :] < value_r[:, None]]
    head = torch.frombuffer(bytearray(_U64.pack(n_unary)), dtype=torch.uint8).to(dev)
    return torch.cat([head, pack_bits(param, 4), bits_to_bytes(unary_bits), bits_to_bytes(rem_bits)])


def decode_indices(section: torch.Tensor, chunk_ids: torch.Tensor, kept: torch.Tensor, space: int) -> torch.Tensor:
    """Inverse of :func:`encode_indices`; validates the section's structure, raises :class:`PayloadError`.

    Returned indices ascend strictly inside each chunk by construction; the caller checks ``< n_c``.
    """
    dev = section.device
    n_chunks = kept.numel()
    n_values = chunk_ids.numel()
    pos = _U64.size
    n_param_bytes = (n_chunks + 1) // 2
    if section.numel() < pos + n_param_bytes:
        raise PayloadError(
            f"entropy index section has {section.numel()} bytes, fewer than its length field and "
            f"{n_chunks} parameter nibbles ({pos + n_param_bytes} bytes)"
        )
    n_unary = _U64.unpack(section[:pos].cpu().numpy().tobytes())[0]
    param = unpack_bits(section[pos : pos + n_param_bytes], 4, n_chunks)
    pos += n_param_bytes
    r_max = max_rice_param(space)
    bad = param > r_max
    if bool(bad.any()):
        c = int(torch.nonzero(bad)[0])
        raise PayloadError(f"entropy index section: Rice parameter {int(param[c])} > {r_max} for chunk {c}")
    value_r = param[chunk_ids]
    n_rem = int(value_r.sum().item())
    sizes = ((n_unary + 7) // 8, (n_rem + 7) // 8)
    if section.numel() != pos + sum(sizes):
        raise PayloadError(
            f"entropy index section holds {section.numel()} bytes but its fields need {pos + sum(sizes)} "
            f"({pos} head, unary {sizes[0]}, remainder {sizes[1]})"
        )
    unary_bytes = section[pos : pos + sizes[0]]
    rem_bytes = section[pos + sizes[0] :]

    zeros = torch.nonzero(bytes_to_bits(unary_bytes, n_unary) == 0).reshape(-1)
    if zeros.numel() != n_values or (n_values and int(zeros[-1]) != n_unary - 1) or (not n_values and n_unary):
        raise PayloadError(
            f"entropy index section: unary stream of {n_unary} bits holds {zeros.numel()} codewords, "
            f"expected {n_values}"
        )
    quotient = torch.diff(zeros, prepend=zeros.new_full((1,), -1)) - 1
    rem_all = bytes_to_bits(rem_bytes, n_rem).to(torch.int64)
    offsets = torch.cumsum(value_r, 0) - value_r
    j = torch.arange(int(param.max()) if n_chunks else 0, dtype=torch.int64, device=dev)  # widest remainder
    take = j[None, :] < value_r[:, None]
    at = torch.where(take, offsets[:, None] + j, torch.zeros_like(offsets)[:, None])
    rem_matrix = rem_all[at] * take if n_rem else torch.zeros_like(at)
    gaps = (quotient << value_r) + (rem_matrix << j).sum(dim=1)
    steps = gaps + 1
    inclusive = torch.cumsum(steps, 0)
    exclusive = inclusive - steps
    first_of_chunk = torch.cummax(
        torch.where(_chunk_starts(chunk_ids), torch.arange(n_values, device=dev), torch.zeros_like(chunk_ids)), 0
    ).values
    return inclusive - exclusive[first_of_chunk] - 1
