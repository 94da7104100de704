"""The fixed 64-byte payload header (all integers little-endian).

| offset | size | field              | meaning                                                         |
|-------:|-----:|--------------------|-----------------------------------------------------------------|
| 0      | 4    | magic              | ``b"SLCO"``                                                     |
| 4      | 1    | version            | ``1``                                                           |
| 5      | 1    | value_bits         | 2, 4, 8 (quantised), 16 (bf16), 32 (fp32)                       |
| 6      | 1    | index_coding       | 0 = packed, 1 = entropy                                         |
| 7      | 1    | geometry           | 0 = flat, 1 = tile (2-D), 2 = tile (1-D fallback)               |
| 8      | 1    | source dtype       | 0 = float32, 1 = bfloat16, 2 = float16                          |
| 9      | 1    | flags              | bit 0: dense (k == chunk, index section empty); others zero     |
| 10     | 2    | reserved           | zero                                                            |
| 12     | 4    | chunk              | C                                                               |
| 16     | 4    | k                  | values kept per full chunk                                      |
| 20     | 4    | tile               | tile edge                                                       |
| 24     | 4    | quant_group_chunks | 0 = one quantiser group per tensor                              |
| 28     | 4    | reserved           | zero                                                            |
| 32     | 8    | numel              | elements of the encoded tensor                                  |
| 40     | 8    | rows               | tile 2-D: ``prod(shape[:-1])``; otherwise 0                     |
| 48     | 8    | cols               | tile 2-D: ``shape[-1]``; otherwise 0                            |
| 56     | 8    | index_bytes        | length of the index section                                     |
"""

from __future__ import annotations

import struct
import sys
from dataclasses import dataclass

import torch

from megatron_sparseloco.compress.config import CodecConfig
from megatron_sparseloco.compress.errors import CodecConfigError, PayloadError

MAGIC = b"SLCO"
VERSION = 1
HEADER = struct.Struct("<4sBBBBBBHIIIIIQQQQ")
HEADER_BYTES = HEADER.size  # 64
FLAG_DENSE = 1

INDEX_CODING_IDS = {"packed": 0, "entropy": 1}
GEOMETRY_IDS = {"flat": 0, "tile2d": 1, "tile1d": 2}
DTYPE_IDS = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}
_ID_TO_CODING = {v: k for k, v in INDEX_CODING_IDS.items()}
_ID_TO_GEOMETRY = {v: k for k, v in GEOMETRY_IDS.items()}
_ID_TO_DTYPE = {v: k for k, v in DTYPE_IDS.items()}

assert HEADER_BYTES == 64
if sys.byteorder != "little":  # fp32/bf16 sections are written with tensor.view(torch.uint8)
    raise ImportError("megatron_sparseloco.compress writes little-endian payloads and needs a little-endian host")


@dataclass(frozen=True)
class Header:
    config: CodecConfig
    geometry: str
    dtype: torch.dtype
    dense: bool
    numel: int
    rows: int
    cols: int
    index_bytes: int

    def pack(self) -> bytes:
        c = self.config
        return HEADER.pack(
            MAGIC, VERSION, c.value_bits, INDEX_CODING_IDS[c.index_coding], GEOMETRY_IDS[self.geometry],
            DTYPE_IDS[self.dtype], FLAG_DENSE if self.dense else 0, 0,
            c.chunk, c.k, c.tile, c.quant_group_chunks, 0,
            self.numel, self.rows, self.cols, self.index_bytes,
        )  # fmt: skip

    @staticmethod
    def unpack(raw: bytes) -> "Header":
        if len(raw) < HEADER_BYTES:
            raise PayloadError(f"payload has {len(raw)} bytes, fewer than the {HEADER_BYTES}-byte header")
        (magic, version, value_bits, coding, geometry, dtype, flags, reserved0,
         chunk, k, tile, groups, reserved1,
         numel, rows, cols, index_bytes) = HEADER.unpack(raw[:HEADER_BYTES])  # fmt: skip
        if magic != MAGIC:
            raise PayloadError(f"payload magic is {magic!r}, expected {MAGIC!r}: not a SparseLoCo codec payload")
        if version != VERSION:
            raise PayloadError(
                f"payload format version {version} is not supported (this codec reads version {VERSION})")
        if coding not in _ID_TO_CODING:
            raise PayloadError(f"payload header: unknown index coding id {coding}")
        if geometry not in _ID_TO_GEOMETRY:
            raise PayloadError(f"payload header: unknown geometry id {geometry}")
        if dtype not in _ID_TO_DTYPE:
            raise PayloadError(f"payload header: unknown source dtype id {dtype}")
        if flags & ~FLAG_DENSE or reserved0 or reserved1:
            raise PayloadError("payload header: reserved bits are set")
        geometry_name = _ID_TO_GEOMETRY[geometry]
        try:
            cfg = CodecConfig(
                chunk=chunk, k=k, value_bits=value_bits, index_coding=_ID_TO_CODING[coding],
                chunk_mode="flat" if geometry_name == "flat" else "tile", tile=tile, quant_group_chunks=groups,
            ).validate()  # fmt: skip
        except CodecConfigError as err:
            raise PayloadError(f"payload header holds an invalid codec configuration: {err}") from err
        dense = bool(flags & FLAG_DENSE)
        if dense != cfg.is_dense:
            raise PayloadError(f"payload header: dense flag {dense} contradicts k={k}, chunk={chunk}")
        if geometry_name == "tile2d":
            if rows * cols != numel:
                raise PayloadError(f"payload header: rows*cols = {rows}*{cols} != numel = {numel}")
        elif rows or cols:
            raise PayloadError(f"payload header: rows/cols must be 0 outside 2-D tile geometry, got {rows}, {cols}")
        return Header(cfg, geometry_name, _ID_TO_DTYPE[dtype], dense, numel, rows, cols, index_bytes)
