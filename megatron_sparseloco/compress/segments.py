"""Per-tensor segments: one payload for a bucket that holds slices of many tensors.

A rank's shard of Megatron's distributed optimizer is a concatenation of parameter *slices*: the
elements ``[start, end)`` of the flattened parameter of shape ``S``. The SparseLoCo reference code
compresses every tensor on its own; a flat bucket that runs chunks across tensor boundaries and
shares one quantiser between them lets the largest tensor set the quantiser's σ and starves the
others (docs/codec.md, "Why per tensor"). Here every slice is a **segment** with its own chunks and
its own quantiser, and a bucket's segments still travel as **one** payload (one collective).

Geometry of a slice, decided from ``S``, ``[start, end)`` and the codec config (:func:`slice_geometry`):

* ``dense``  — ``len(S) <= 1`` (norms, biases) and ``dense_1d``: every element is sent, quantised
  with the segment's own quantiser (the reference chunks 1-D tensors in 64-element chunks with
  top-64, i.e. sends them whole).
* ``tile2d`` — ``len(S) >= 2``, the slice holds whole rows of the ``prod(S[:-1]) x S[-1]`` matrix
  and ``C = t²`` is a perfect square: ``t x t`` tiles of the slice (64x64 for C = 4096, the
  reference geometry), Top-k per tile.
* ``flat``   — anything else (a slice that starts or ends mid-row, 1-D tensors with
  ``dense_1d=False``, C not a square): flat chunks of ``C`` inside the slice, the last one ragged.

A slice larger than the bucket is split into pieces at tile-row (``t * cols``) or chunk (``C``)
boundaries, so the chunks are those of the unsplit slice; each piece has its own quantiser, which
for huge tensors (> ``bucket_numel`` elements) deviates from the reference's one per tensor.

Wire format (all integers little-endian)::

    header   32 B   magic b"SLCS" | version u8 | value_bits u8 | index_coding u8 | reserved u8
                    | chunk u32 | k u32 | tile u32 (0: no tiling) | n_segments u32 | numel u64
    table    24 B per segment: geometry u8 | flags u8 (bit 0 dense) | reserved u16 | cols u32
                    | numel u64 | index_bytes u64
    bodies   per segment, in table order: side info | values | indices   (:func:`codec.encode_body`)

The receiver checks every field against the plan it computed itself (the same shard layout on every
worker), so a payload from a worker whose shards do not line up is refused, naming the segment.
"""

from __future__ import annotations

import functools
import math
import struct
from dataclasses import dataclass
from typing import Optional, Sequence

import torch

from megatron_sparseloco.compress.checks import deferring, require
from megatron_sparseloco.compress.codec import (
    Decoded,
    body_nbytes,
    check_index_bytes,
    decode_body,
    encode_body,
)
from megatron_sparseloco.compress.config import CodecConfig
from megatron_sparseloco.compress.errors import CodecConfigError, PayloadError
from megatron_sparseloco.compress.header import HEADER_BYTES, INDEX_CODING_IDS
from megatron_sparseloco.compress.layout import ChunkLayout
from megatron_sparseloco.compress.sizing import PayloadGeometry, payload_nbytes

MAGIC = b"SLCS"
VERSION = 1
BUCKET_HEADER = struct.Struct("<4sBBBBIIIIQ")
BUCKET_HEADER_BYTES = BUCKET_HEADER.size  # 32
SEGMENT_ENTRY = struct.Struct("<BBHIQQ")
SEGMENT_ENTRY_BYTES = SEGMENT_ENTRY.size  # 24
GEOMETRIES = ("flat", "tile2d", "dense")
_GEOMETRY_IDS = {g: i for i, g in enumerate(GEOMETRIES)}
_ID_TO_CODING = {v: k for k, v in INDEX_CODING_IDS.items()}
FLAG_DENSE = 1

assert BUCKET_HEADER_BYTES == 32 and SEGMENT_ENTRY_BYTES == 24


class FlatRange:
    """Elements ``[start, end)`` of a flat vector (a mixin of the dataclasses below, which declare them)."""

    start: int
    end: int

    @property
    def numel(self) -> int:
        return self.end - self.start


@dataclass(frozen=True)
class TensorSlice(FlatRange):
    """Elements ``[start, end)`` of a flattened tensor of ``shape`` (a rank's piece of a parameter)."""

    shape: tuple
    start: int
    end: int

    @staticmethod
    def whole(t: torch.Tensor) -> "TensorSlice":
        return TensorSlice(tuple(t.shape), 0, t.numel())


@dataclass(frozen=True)
class Segment:
    """One codec tensor inside a bucket: ``numel`` elements from bucket offset ``offset``."""

    offset: int
    numel: int
    geometry: str  # "flat" | "tile2d" | "dense"
    cols: int = 0  # tile2d: row length of the slice
    name: str = ""

    @property
    def shape(self) -> tuple:
        return (self.numel // self.cols, self.cols) if self.geometry == "tile2d" else (self.numel,)


def tile_edge(chunk: int) -> int:
    """``t`` with ``t * t == chunk``, or 0 when ``chunk`` is not a perfect square (no tiling)."""
    t = math.isqrt(chunk)
    return t if t * t == chunk else 0


def segment_config(base: CodecConfig, geometry: str) -> CodecConfig:
    """The codec configuration of one segment (quantiser per segment: ``quant_group_chunks=0``)."""
    make = functools.partial(CodecConfig, value_bits=base.value_bits, index_coding=base.index_coding)
    if geometry == "tile2d":
        t = tile_edge(base.chunk)
        return make(chunk=base.chunk, k=base.k, chunk_mode="tile", tile=t)
    if geometry == "dense":
        return make(chunk=base.chunk, k=base.chunk, chunk_mode="flat")
    return make(chunk=base.chunk, k=base.k, chunk_mode="flat")


def segment_layout(seg: Segment, base: CodecConfig) -> ChunkLayout:
    cfg = segment_config(base, seg.geometry)
    return ChunkLayout.for_tensor(seg.numel, cfg, seg.shape if seg.geometry == "tile2d" else None)


def slice_geometry(sl: TensorSlice, base: CodecConfig, dense_1d: bool) -> tuple[str, int]:
    """(geometry, cols) of a slice; see the module docstring."""
    if len(sl.shape) <= 1:
        return ("dense", 0) if dense_1d else ("flat", 0)
    cols = int(sl.shape[-1])
    if tile_edge(base.chunk) and cols > 0 and sl.start % cols == 0 and sl.end % cols == 0:
        return "tile2d", cols
    return "flat", 0


@dataclass(frozen=True)
class BucketPlan(FlatRange):
    """A bucket ``[start, end)`` of the flat shard and the segments that cover it, in order."""

    start: int
    end: int
    segments: tuple
    codec: CodecConfig

    def describe(self) -> str:
        names = [s.name for s in self.segments]
        span = names[0] if len(set(names)) == 1 else f"{names[0]}..{names[-1]}"
        return f"bucket [{self.start}:{self.end}) ({span})"


def _split(offset: int, numel: int, geometry: str, cols: int, base: CodecConfig, limit: int, name: str):
    """Pieces of at most ``limit`` elements (at least one alignment unit), at tile-row / chunk boundaries."""
    unit = tile_edge(base.chunk) * cols if geometry == "tile2d" else base.chunk
    piece = max(unit, (limit // unit) * unit)
    out = []
    for s in range(0, numel, piece):
        out.append(Segment(offset + s, min(piece, numel - s), geometry, cols, name))
    return out


def plan_buckets(slices: Sequence[TensorSlice], base: CodecConfig, bucket_numel: int, dense_1d: bool,
                 names: Optional[Sequence[str]] = None) -> list[BucketPlan]:
    """Group the slices (in shard order) into buckets of at most ``bucket_numel`` elements.

    Whole segments are packed greedily; a slice larger than ``bucket_numel`` is split first
    (see the module docstring). Every element of the shard belongs to exactly one segment.
    """
    base.validate()
    if bucket_numel < 1:
        raise CodecConfigError(f"bucket_numel must be >= 1, got {bucket_numel}")
    names = list(names) if names is not None else [f"tensor{i}" for i in range(len(slices))]
    segments: list[Segment] = []
    offset = 0
    for sl, name in zip(slices, names):
        if sl.numel <= 0:
            continue
        geometry, cols = slice_geometry(sl, base, dense_1d)
        segments.extend(_split(offset, sl.numel, geometry, cols, base, bucket_numel, name))
        offset += sl.numel
    plans: list[BucketPlan] = []
    current: list[Segment] = []
    for seg in segments:
        size = sum(s.numel for s in current)
        if current and size + seg.numel > bucket_numel:
            plans.append(_bucket(current, base))
            current = []
        current.append(seg)
    if current:
        plans.append(_bucket(current, base))
    return plans


def _bucket(segs: list[Segment], base: CodecConfig) -> BucketPlan:
    start = segs[0].offset
    rebased = tuple(Segment(s.offset - start, s.numel, s.geometry, s.cols, s.name) for s in segs)
    return BucketPlan(start, segs[-1].offset + segs[-1].numel, rebased, base)


# ---------------------------------------------------------------------------------- sizes
def bucket_payload_nbytes(plan: BucketPlan) -> int:
    """Size of :func:`encode_bucket`'s payload: exact for packed indices, an upper bound for entropy."""
    total = BUCKET_HEADER_BYTES + SEGMENT_ENTRY_BYTES * len(plan.segments)
    for seg in plan.segments:
        cfg = segment_config(plan.codec, seg.geometry)
        total += payload_nbytes(seg.numel, cfg, seg.shape if seg.geometry == "tile2d" else None) - HEADER_BYTES
    return total


# ---------------------------------------------------------------------------------- encode / decode
def pack_bucket_header(plan: BucketPlan, index_lengths: Sequence[int]) -> bytes:
    c = plan.codec
    head = BUCKET_HEADER.pack(MAGIC, VERSION, c.value_bits, INDEX_CODING_IDS[c.index_coding], 0,
                              c.chunk, c.k, tile_edge(c.chunk), len(plan.segments), plan.numel)
    table = b"".join(
        SEGMENT_ENTRY.pack(_GEOMETRY_IDS[s.geometry], FLAG_DENSE if s.geometry == "dense" else 0, 0, s.cols,
                           s.numel, n)
        for s, n in zip(plan.segments, index_lengths))
    return head + table


def encode_bucket(x: torch.Tensor, plan: BucketPlan, name: str = "bucket") -> torch.Tensor:
    """Encode the flat fp32 bucket ``x`` (``plan.numel`` elements) segment by segment → 1-D uint8."""
    if x.dim() != 1 or x.numel() != plan.numel:
        raise ValueError(f"encode_bucket({name!r}): expected a 1-D tensor of {plan.numel} elements, "
                         f"got shape {tuple(x.shape)}")
    bodies = []
    for seg in plan.segments:
        cfg = segment_config(plan.codec, seg.geometry)
        part = x[seg.offset:seg.offset + seg.numel].view(seg.shape)
        bodies.append(encode_body(part, cfg, name=f"{name}: {seg.name}"))
    head = pack_bucket_header(plan, [b.index.numel() for b in bodies])
    head_t = torch.frombuffer(bytearray(head), dtype=torch.uint8).to(x.device)
    return torch.cat([head_t] + [p for b in bodies for p in b.parts()])


def packed_index_lengths(plan: BucketPlan) -> list[int]:
    """Each segment's index section length under packed indices (fixed by the plan; 0 for dense)."""
    out = []
    for seg in plan.segments:
        cfg = segment_config(plan.codec, seg.geometry)
        out.append(0 if cfg.is_dense else PayloadGeometry.of(segment_layout(seg, plan.codec), cfg).index_bytes)
    return out


_EXPECTED_HEADS: dict = {}


def expected_bucket_head(plan: BucketPlan, device: torch.device) -> torch.Tensor:
    """The header and segment table every packed payload of ``plan`` carries, on ``device`` (cached)."""
    key = (plan, str(device))
    head = _EXPECTED_HEADS.get(key)
    if head is None:
        raw = pack_bucket_header(plan, packed_index_lengths(plan))
        head = _EXPECTED_HEADS[key] = torch.frombuffer(bytearray(raw), dtype=torch.uint8).to(device)
    return head


def read_bucket_table(payload: torch.Tensor, plan: BucketPlan) -> list[int]:
    """Check the header and table against ``plan``; return each segment's index length.

    With packed indices while checks are deferred (``compress.checks``) the header and table are
    compared with the plan's on the device (no host read; a mismatch is reported later, with this
    function's message) and the lengths come from the plan."""
    if plan.codec.index_coding == "packed" and deferring():
        head = expected_bucket_head(plan, payload.device)
        if payload.numel() < head.numel():
            raise PayloadError(f"bucket payload has {payload.numel()} bytes, its header and table need "
                               f"{head.numel()}")
        received = payload[:head.numel()]
        # the error is built from a copy of the header and table only (a deferred check keeps it to the round's end)
        evidence = received.clone()
        require(received != head, lambda: _header_error(evidence, plan))
        return packed_index_lengths(plan)
    return _read_bucket_table(payload, plan)


def _header_error(payload: torch.Tensor, plan: BucketPlan) -> Exception:
    """The host check's precise error for a payload whose header or table differs from the plan's."""
    try:
        _read_bucket_table(payload, plan)
    except PayloadError as exc:
        return exc
    return PayloadError("bucket payload header or table differs from the plan's")


def _read_bucket_table(payload: torch.Tensor, plan: BucketPlan) -> list[int]:
    if payload.numel() < BUCKET_HEADER_BYTES:
        raise PayloadError(
            f"bucket payload has {payload.numel()} bytes, fewer than the {BUCKET_HEADER_BYTES}-byte header")
    raw = payload[:BUCKET_HEADER_BYTES].cpu().numpy().tobytes()
    magic, version, value_bits, coding, reserved, chunk, k, tile, n_seg, numel = BUCKET_HEADER.unpack(raw)
    if magic != MAGIC:
        raise PayloadError(f"bucket payload magic is {magic!r}, expected {MAGIC!r}: not a per-tensor SparseLoCo "
                           "payload (do all workers use the same --sparseloco-chunking?)")
    if version != VERSION:
        raise PayloadError(f"bucket payload format version {version} is not supported (this codec reads {VERSION})")
    c = plan.codec
    want = (value_bits, _ID_TO_CODING.get(coding), chunk, k, tile, reserved)
    have = (c.value_bits, c.index_coding, c.chunk, c.k, tile_edge(c.chunk), 0)
    if want != have:
        raise PayloadError(f"bucket payload codec (value_bits, index_coding, chunk, k, tile, reserved) = {want}, "
                           f"expected {have}")
    if n_seg != len(plan.segments) or numel != plan.numel:
        raise PayloadError(f"bucket payload holds {n_seg} segments / {numel} elements, expected "
                           f"{len(plan.segments)} / {plan.numel}: the workers' shards do not line up")
    table_end = BUCKET_HEADER_BYTES + SEGMENT_ENTRY_BYTES * n_seg
    if payload.numel() < table_end:
        raise PayloadError(f"bucket payload has {payload.numel()} bytes, its segment table needs {table_end}")
    table = payload[BUCKET_HEADER_BYTES:table_end].cpu().numpy().tobytes()
    lengths = []
    for i, seg in enumerate(plan.segments):
        geo, flags, res, cols, n, index_bytes = SEGMENT_ENTRY.unpack_from(table, i * SEGMENT_ENTRY_BYTES)
        expect = (_GEOMETRY_IDS[seg.geometry], FLAG_DENSE if seg.geometry == "dense" else 0, 0, seg.cols, seg.numel)
        if (geo, flags, res, cols, n) != expect:
            raise PayloadError(f"bucket payload segment {i} ({seg.name}): (geometry, flags, reserved, cols, numel) = "
                               f"{(geo, flags, res, cols, n)}, expected {expect}")
        check_index_bytes(segment_layout(seg, c), segment_config(c, seg.geometry), index_bytes)
        lengths.append(index_bytes)
    return lengths


def decode_bucket(payload: torch.Tensor, plan: BucketPlan, device: torch.device | str | None = None) -> Decoded:
    """Validate a bucket payload against ``plan`` and return its values at bucket positions.

    ``indices`` are positions in the flat bucket (segment offset + position inside the segment),
    segment by segment in table order. Raises :class:`PayloadError` on any defect, before anything
    is returned; never reads out of bounds.
    """
    if not isinstance(payload, torch.Tensor) or payload.dtype != torch.uint8 or payload.dim() != 1:
        raise PayloadError("decode_bucket: payload must be a 1-D torch.uint8 tensor")
    if device is not None:
        payload = payload.to(device)
    lengths = read_bucket_table(payload, plan)
    at = BUCKET_HEADER_BYTES + SEGMENT_ENTRY_BYTES * len(plan.segments)
    layouts = [segment_layout(s, plan.codec) for s in plan.segments]
    cfgs = [segment_config(plan.codec, s.geometry) for s in plan.segments]
    total = at + sum(body_nbytes(lay, cfg, n) for lay, cfg, n in zip(layouts, cfgs, lengths))
    if payload.numel() != total:
        raise PayloadError(f"bucket payload has {payload.numel()} bytes but its table describes {total}"
                           + ("; truncated?" if payload.numel() < total else "; trailing bytes?"))
    indices, values = [], []
    for seg, lay, cfg, n in zip(plan.segments, layouts, cfgs, lengths):
        try:
            idx, val = decode_body(payload, at, lay, cfg, n)
        except PayloadError as exc:
            raise PayloadError(f"segment {seg.name}: {exc}") from exc
        indices.append(idx + seg.offset)
        values.append(val)
        at += body_nbytes(lay, cfg, n)
    return Decoded(plan.numel, torch.cat(indices), torch.cat(values), plan.codec)
