"""Fixed-width bit packing: ``n`` unsigned integers of ``width`` bits ↔ ``ceil(n * width / 8)`` bytes.

Bit order is little-endian throughout: value ``i`` occupies stream bits ``[i*width, (i+1)*width)``,
least significant bit first, and stream bit ``j`` is bit ``j mod 8`` of byte ``j // 8``.  So 2-bit codes
sit four to a byte (code 0 in the low two bits) and two 12-bit indices fill three bytes.
The trailing pad bits of the last byte are zero (``unpack_bits`` does not check them).

Vectorised. Widths 1, 2, 4 and 8 shift whole values into bytes. Other widths up to 56 (12-bit
indices, the common case) work by byte windows: value ``i`` starts at bit ``s = i·width``, inside
byte ``s >> 3`` at shift ``s & 7``, and spans at most ``m = ceil((width + 7) / 8)`` bytes, so

    pack:    byte[(s >> 3) + j] += ((v << (s & 7)) >> 8j) & 0xFF      for j < m   (fields are disjoint: + is |)
    unpack:  v = (Σ_j byte[(s >> 3) + j] << 8j  >> (s & 7)) & (2^width − 1)

with ``m`` int64 gathers / scatter-adds instead of a ``[n, width]`` bit matrix (about ``width / m``
times less work). Widths above 56 go through the bit matrix (values → ``[n, width]`` bits → bytes by a
weighted sum, and back). Both give the same bytes (tests/test_compress_bitpack.py).
"""

from __future__ import annotations

import torch

_BYTE_WEIGHTS: dict[torch.device, torch.Tensor] = {}


def _weights(device: torch.device) -> torch.Tensor:
    w = _BYTE_WEIGHTS.get(device)
    if w is None:
        w = _BYTE_WEIGHTS[device] = (1 << torch.arange(8, dtype=torch.int32, device=device)).to(torch.uint8)
    return w


def packed_nbytes(count: int, width: int) -> int:
    """Bytes taken by ``count`` values of ``width`` bits."""
    return (count * width + 7) // 8


def bits_to_bytes(bits: torch.Tensor) -> torch.Tensor:
    """1-D tensor of 0/1 (any integer dtype or bool) → uint8 bytes, LSB first, zero padded."""
    n = bits.numel()
    pad = (-n) % 8
    b = bits.to(torch.uint8)
    if pad:
        b = torch.cat([b, b.new_zeros(pad)])
    return (b.view(-1, 8) * _weights(b.device)).sum(dim=1, dtype=torch.uint8)


def bytes_to_bits(data: torch.Tensor, n_bits: int | None = None) -> torch.Tensor:
    """uint8 bytes → uint8 tensor of 0/1 bits (LSB first), truncated to ``n_bits``."""
    bits = (data[:, None] >> torch.arange(8, dtype=torch.uint8, device=data.device)) & 1
    bits = bits.reshape(-1)
    return bits if n_bits is None else bits[:n_bits]


def pack_bits(values: torch.Tensor, width: int) -> torch.Tensor:
    """Pack non-negative integers ``< 2**width`` into bytes; returns uint8 of ``packed_nbytes(n, width)``.

    ``width`` in [0, 63].  Values are not range-checked (callers produce them); high bits are dropped.
    """
    if width == 0 or values.numel() == 0:
        return torch.zeros(packed_nbytes(values.numel(), width), dtype=torch.uint8, device=values.device)
    v = values.to(torch.int64).reshape(-1)
    if width == 8:
        return v.to(torch.uint8)
    if width in (1, 2, 4):
        # several values per byte: shift each into place and add (no carries: fields are disjoint)
        per_byte = 8 // width
        pad = (-v.numel()) % per_byte
        if pad:
            v = torch.cat([v, v.new_zeros(pad)])
        shifts = torch.arange(0, 8, width, dtype=torch.int64, device=v.device)
        return (v.view(-1, per_byte) << shifts).sum(dim=1).to(torch.uint8)
    if width <= _WINDOW_MAX_WIDTH:
        return _pack_windows(v, width)
    return _pack_bit_matrix(v, width)


def unpack_bits(data: torch.Tensor, width: int, count: int) -> torch.Tensor:
    """Inverse of :func:`pack_bits`: ``count`` int64 values from ``data`` (needs ``packed_nbytes`` bytes)."""
    need = packed_nbytes(count, width)
    if data.numel() < need:
        raise ValueError(f"unpack_bits needs {need} bytes for {count} values of {width} bits, got {data.numel()}")
    if width == 0 or count == 0:
        return torch.zeros(count, dtype=torch.int64, device=data.device)
    d = data[:need]
    if width == 8:
        return d.to(torch.int64)
    if width in (1, 2, 4):
        shifts = torch.arange(0, 8, width, dtype=torch.int64, device=d.device)
        v = (d.to(torch.int64)[:, None] >> shifts) & ((1 << width) - 1)
        return v.reshape(-1)[:count]
    if width <= _WINDOW_MAX_WIDTH:
        return _unpack_windows(d, width, count)
    return _unpack_bit_matrix(d, width, count)


#: the widest value whose byte window (shift ≤ 7 plus the value) fits an int64 without the sign bit
_WINDOW_MAX_WIDTH = 56


def _windows(count: int, width: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor, int]:
    """(first byte, bit shift) of each value, and the bytes ``m`` a window spans."""
    start = torch.arange(count, dtype=torch.int64, device=device) * width
    return start >> 3, start & 7, (width + 7 + 7) // 8


def _pack_windows(v: torch.Tensor, width: int) -> torch.Tensor:
    n = v.numel()
    first, shift, m = _windows(n, width, v.device)
    placed = (v & ((1 << width) - 1)) << shift
    out = torch.zeros(packed_nbytes(n, width) + m, dtype=torch.int64, device=v.device)
    for j in range(m):
        out.index_add_(0, first + j, (placed >> (8 * j)) & 0xFF)
    return out[:packed_nbytes(n, width)].to(torch.uint8)


def _unpack_windows(d: torch.Tensor, width: int, count: int) -> torch.Tensor:
    first, shift, m = _windows(count, width, d.device)
    padded = torch.cat([d.to(torch.int64), d.new_zeros(m, dtype=torch.int64)])
    acc = padded[first]
    for j in range(1, m):
        acc |= padded[first + j] << (8 * j)
    return (acc >> shift) & ((1 << width) - 1)


def _pack_bit_matrix(v: torch.Tensor, width: int) -> torch.Tensor:
    shifts = torch.arange(width, dtype=torch.int64, device=v.device)
    bits = (v[:, None] >> shifts) & 1
    return bits_to_bytes(bits.reshape(-1))


def _unpack_bit_matrix(d: torch.Tensor, width: int, count: int) -> torch.Tensor:
    bits = bytes_to_bits(d, count * width).to(torch.int64).view(count, width)
    shifts = torch.arange(width, dtype=torch.int64, device=d.device)
    return (bits << shifts).sum(dim=1)
