"""Fixed-width bit packing: ``n`` unsigned integers of ``width`` bits ↔ ``ceil(n * width / 8)`` bytes.

Bit order is little-endian throughout: value ``i`` occupies stream bits ``[i*width, (i+1)*width)``,
least significant bit first, and stream bit ``j`` is bit ``j mod 8`` of byte ``j // 8``.  So 2-bit codes
sit four to a byte (code 0 in the low two bits) and two 12-bit indices fill three bytes.
The trailing pad bits of the last byte are zero (``unpack_bits`` does not check them).

Vectorised: values → ``[n, width]`` bit matrix → ``[-1, 8]`` → bytes by a weighted sum, and back.
"""

from __future__ import annotations

import torch

_BYTE_WEIGHTS = {}


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
    shifts = torch.arange(width, dtype=torch.int64, device=v.device)
    bits = (v[:, None] >> shifts) & 1
    return bits_to_bytes(bits.reshape(-1))


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
    bits = bytes_to_bits(d, count * width).to(torch.int64).view(count, width)
    shifts = torch.arange(width, dtype=torch.int64, device=d.device)
    return (bits << shifts).sum(dim=1)
