"""GPU fast path for per-tensor bucket payloads (:mod:`.segments`): the Triton kernels per segment.

    payload, sent = error_feedback_step_bucket_fast(err, delta, beta, plan, name)  # == error_feedback_step_bucket
    decode_scatter_add_bucket_fast(payloads, plan, out, counts)                   # out += Σ_w decode_bucket(p_w)

Each segment takes the kernels of :mod:`.fast_path` when they cover it, else the torch codec, and the
segments' bodies are assembled into the same payload :func:`segments.encode_bucket` writes:

* ``flat`` segments: the flat kernels on the segment as it lies in the bucket.
* ``tile2d`` segments whose rows and cols are multiples of the tile edge ``t`` (every LLM weight
  with dims divisible by 64): the slice is gathered tile by tile into a contiguous
  ``[n_tiles, t*t]`` buffer, which *is* a flat tensor with chunk ``t*t`` — same chunks, same
  per-chunk order (row-major inside a tile, the torch tile path's padded = compact position for
  full tiles), so the flat kernels select, quantise and pack the same bytes. The EF update runs
  on the gathered buffer and is scattered back (elementwise, exact); decoded positions are mapped
  back to the slice's row-major positions.
* ``dense`` segments (1-D tensors sent whole), edge tiles, and configurations outside the kernels
  (entropy indices, 8/16/32-bit values): the torch codec on that segment. The first time a reason
  is met it is logged once (``logger.info``), and ``last_dispatch`` holds the last bucket's
  per-geometry choices.

Bytes: as :mod:`.fast_path` says, identical to the torch codec except for the ~1e-9-per-word chance
that a tree-summed fp64 side word rounds one ulp differently; what is decoded is always what was
sent, so the EF identity ``e_new = s − decode(P)`` holds bit for bit.
"""

from __future__ import annotations

import logging
from typing import Optional, Sequence

import torch

from megatron_sparseloco.compress import fast_path as fp
from megatron_sparseloco.compress.checks import prefixed
from megatron_sparseloco.compress.codec import Decoded, body_nbytes, decode_body, encode_body
from megatron_sparseloco.compress.header import HEADER_BYTES
from megatron_sparseloco.compress.segments import (
    BUCKET_HEADER_BYTES,
    SEGMENT_ENTRY_BYTES,
    BucketPlan,
    Segment,
    pack_bucket_header,
    read_bucket_table,
    decode_bucket,
    segment_config,
    segment_layout,
    tile_edge,
)
from megatron_sparseloco.compress.config import CodecConfig
from megatron_sparseloco.compress.errors import PayloadError

logger = logging.getLogger(__name__)

#: geometry → "triton" or the reason of the last fallback (last bucket handled)
last_dispatch: dict[str, str] = {}
_LOGGED: set = set()


def _flat_config(seg: Segment, base: CodecConfig) -> CodecConfig:
    """The flat codec the kernels run for a segment (chunk t*t for gathered tiles)."""
    cfg = segment_config(base, seg.geometry)
    if seg.geometry == "tile2d":
        return CodecConfig(chunk=cfg.tile * cfg.tile, k=cfg.k, value_bits=cfg.value_bits, index_coding=cfg.index_coding)
    return cfg


def segment_unsupported_reason(seg: Segment, base: CodecConfig, device: torch.device) -> Optional[str]:
    """Why a segment takes the torch codec, or None when the kernels encode it."""
    if seg.geometry == "dense":
        return "dense segment (1-D tensor sent whole: nothing to select)"
    if seg.geometry == "tile2d":
        t = tile_edge(base.chunk)
        rows = seg.numel // seg.cols
        if rows % t or seg.cols % t:
            return f"tile2d segment {rows}x{seg.cols} has edge tiles (kernels: rows and cols multiples of {t})"
    reason = fp.config_unsupported_reason(_flat_config(seg, base))
    return reason or fp.device_unsupported_reason(device)


def _note(geometry: str, reason: Optional[str]) -> None:
    last_dispatch[geometry] = reason or "triton"
    if reason and reason not in _LOGGED:
        _LOGGED.add(reason)
        logger.info("sparseloco codec: %s takes the torch path (%s)", geometry, reason)


# ------------------------------------------------------------------ tile gather / scatter
def _tile_view(x: torch.Tensor, rows: int, cols: int, t: int) -> torch.Tensor:
    """``x`` (rows*cols, row-major) as [tile rows, tile cols, t, t]: a strided view, no copy."""
    return x.view(rows // t, t, cols // t, t).permute(0, 2, 1, 3)


def _gather_tiles(x: torch.Tensor, rows: int, cols: int, t: int) -> torch.Tensor:
    """A new contiguous [n_tiles * t * t] copy of ``x`` in tile-major order."""
    out = torch.empty(x.numel(), dtype=x.dtype, device=x.device)
    out.view(rows // t, cols // t, t, t).copy_(_tile_view(x, rows, cols, t))
    return out


def _tiled_to_positions(indices: torch.Tensor, rows: int, cols: int, t: int) -> torch.Tensor:
    """Positions in the gathered [n_tiles, t*t] buffer → row-major positions in the slice."""
    tc = cols // t
    chunk, local = indices // (t * t), indices % (t * t)
    r, c = local // t, local % t
    return ((chunk // tc) * t + r) * cols + (chunk % tc) * t + c


# ------------------------------------------------------------------ encode + error feedback
def _segment_ef(err: torch.Tensor, delta: torch.Tensor, beta: float, seg: Segment, base: CodecConfig,
                name: str):
    """EF step of one segment → (body parts, index bytes, positions in the segment, values)."""
    reason = segment_unsupported_reason(seg, base, err.device)
    _note(seg.geometry, reason)
    if reason:  # torch: same math as error_feedback.error_feedback_step_bucket, one segment
        err.mul_(beta)
        err.add_(delta)
        cfg, layout = segment_config(base, seg.geometry), segment_layout(seg, base)
        body = encode_body(err.view(seg.shape), cfg, name=name, layout=layout)
        packed = torch.cat(body.parts())
        idx, val = decode_body(packed, 0, layout, cfg, body.index.numel())
        err[idx] = err[idx] - val
        return body.parts(), body.index.numel(), idx, val
    cfg = _flat_config(seg, base)
    if seg.geometry == "tile2d":
        t = tile_edge(base.chunk)
        rows = seg.numel // seg.cols
        e_tiles, d_tiles = _gather_tiles(err, rows, seg.cols, t), _gather_tiles(delta, rows, seg.cols, t)
        payload, dec = fp._encode_kernels(e_tiles, cfg, name, delta_flat=d_tiles, beta=beta)
        _tile_view(err, rows, seg.cols, t).copy_(e_tiles.view(rows // t, seg.cols // t, t, t))
        idx = _tiled_to_positions(dec.indices, rows, seg.cols, t)
    else:
        payload, dec = fp._encode_kernels(err, cfg, name, delta_flat=delta, beta=beta)
        idx = dec.indices
    body = payload[HEADER_BYTES:]
    layout = segment_layout(seg, base)
    index_bytes = body.numel() - body_nbytes(layout, segment_config(base, seg.geometry), 0)
    return [body], index_bytes, idx, dec.values


def error_feedback_step_bucket_fast(error: torch.Tensor, delta: torch.Tensor, beta: float, plan: BucketPlan,
                                    name: str = "bucket") -> tuple[torch.Tensor, Decoded]:
    """:func:`error_feedback.error_feedback_step_bucket` with the Triton kernels where they apply."""
    if error.dtype != torch.float32 or error.dim() != 1 or not error.is_contiguous() or error.shape != delta.shape \
            or delta.dtype != torch.float32 or not delta.is_contiguous():
        raise ValueError(f"error_feedback_step_bucket_fast({name!r}): error and delta must be 1-D contiguous fp32 "
                         f"tensors of {plan.numel} elements")
    parts, lengths, indices, values = [], [], [], []
    for seg in plan.segments:
        sl = slice(seg.offset, seg.offset + seg.numel)
        p, n, idx, val = _segment_ef(error[sl], delta[sl], beta, seg, plan.codec, f"{name}: {seg.name}")
        parts += p
        lengths.append(n)
        indices.append(idx + seg.offset)
        values.append(val)
    head = torch.frombuffer(bytearray(pack_bucket_header(plan, lengths)), dtype=torch.uint8).to(error.device)
    payload = torch.cat([head] + parts)
    return payload, Decoded(plan.numel, torch.cat(indices), torch.cat(values), plan.codec)


# ------------------------------------------------------------------ decode + scatter-add
def decode_scatter_add_bucket_fast(payloads: Sequence[torch.Tensor], plan: BucketPlan, out: torch.Tensor,
                                   counts: Optional[torch.Tensor] = None, skip: Optional[int] = None,
                                   skip_decoded: Optional[Decoded] = None) -> torch.Tensor:
    """``out += Σ_w decode_bucket(p_w)`` in worker order, ``counts += 1`` where sent; bit-identical to
    the torch loop ``for w: d = decode_bucket(p_w, plan); out.index_add_(0, d.indices, d.values)``.

    ``out`` must be zero on entry where the kernels write per segment (the outer step's fresh
    accumulator): a kernel segment's sum is formed in a scratch buffer in worker order and copied.
    ``skip`` / ``skip_decoded``: worker ``skip``'s payload is already decoded (the EF step's own).
    Every payload is validated (header, table, lengths, indices) before anything is written.
    """
    W = len(payloads)
    lengths = {}
    for w, p in enumerate(payloads):  # validation of every header and table first (host, tiny)
        if w == skip:
            continue
        try:
            with prefixed(f"payload {w}"):
                lengths[w] = read_bucket_table(p, plan)
        except PayloadError as exc:
            raise PayloadError(f"payload {w}: {exc}") from exc
    # each segment body's byte offset per payload, computed once; the whole length is checked
    # before any kernel runs
    fixed = [(segment_layout(s, plan.codec), segment_config(plan.codec, s.geometry)) for s in plan.segments]
    offsets = {}
    for w in lengths:
        offsets[w] = [BUCKET_HEADER_BYTES + SEGMENT_ENTRY_BYTES * len(plan.segments)]
        for (layout, cfg), n in zip(fixed, lengths[w]):
            offsets[w].append(offsets[w][-1] + body_nbytes(layout, cfg, n))
        if payloads[w].numel() != offsets[w][-1]:
            raise PayloadError(f"payload {w}: {payloads[w].numel()} bytes, its table describes {offsets[w][-1]}")
    kernel_segs = [segment_unsupported_reason(s, plan.codec, out.device) is None for s in plan.segments]
    if not any(kernel_segs) or W == 0:
        return _torch_bucket_scatter(payloads, plan, out, counts, skip, skip_decoded)
    for i, (seg, use_kernel) in enumerate(zip(plan.segments, kernel_segs)):
        sl = slice(seg.offset, seg.offset + seg.numel)
        layout, cfg = fixed[i]
        if not use_kernel:
            for w in range(W):
                if w == skip:
                    assert skip_decoded is not None, "skip names a worker whose decode skip_decoded must give"
                    m = (skip_decoded.indices >= seg.offset) & (skip_decoded.indices < seg.offset + seg.numel)
                    idx, val = skip_decoded.indices[m] - seg.offset, skip_decoded.values[m]
                else:
                    idx, val = decode_body(payloads[w], offsets[w][i], layout, cfg, lengths[w][i])
                out[sl].index_add_(0, idx, val)
                if counts is not None:
                    counts[sl].index_add_(0, idx, torch.ones_like(idx, dtype=counts.dtype))
            continue
        fcfg = _flat_config(seg, plan.codec)
        head = fp._header_tensor(seg.numel, fcfg, fp._geometry(seg.numel, fcfg), out.device)
        # the skipped worker's values come from its decode (None here), the others' as flat payloads
        rows = [None if w == skip else torch.cat([head, payloads[w][offsets[w][i]:offsets[w][i + 1]]])
                for w in range(W)]
        scratch = torch.zeros(seg.numel, dtype=torch.float32, device=out.device)
        c_scratch = torch.zeros(seg.numel, dtype=counts.dtype, device=out.device) if counts is not None else None
        _scatter_in_order(rows, fcfg, scratch, c_scratch, seg, skip_decoded, plan)
        if seg.geometry == "tile2d":
            t = tile_edge(plan.codec.chunk)
            r = seg.numel // seg.cols
            _tile_view(out[sl], r, seg.cols, t).copy_(scratch.view(r // t, seg.cols // t, t, t))
            if counts is not None:
                assert c_scratch is not None  # allocated above exactly when counts is given
                _tile_view(counts[sl], r, seg.cols, t).copy_(c_scratch.view(r // t, seg.cols // t, t, t))
        else:
            out[sl].copy_(scratch)
            if counts is not None:
                assert c_scratch is not None  # allocated above exactly when counts is given
                counts[sl].copy_(c_scratch)
    last_dispatch["decode_scatter_add"] = "triton" if all(kernel_segs) else "mixed"
    return out


def _scatter_in_order(rows, fcfg, scratch, c_scratch, seg, skip_decoded, plan):
    """Worker by worker into the (tile-major for tile2d) scratch: runs of kernel payloads, and the
    skipped worker's own decoded values added with index_add_ at its turn (same order, same sums)."""
    run: list = []

    def flush():
        if run:
            fp._scatter_kernels(torch.stack(run).contiguous(), fcfg, scratch, None, c_scratch)
            run.clear()

    for row in rows:
        if row is not None:
            run.append(row)
            continue
        flush()
        m = (skip_decoded.indices >= seg.offset) & (skip_decoded.indices < seg.offset + seg.numel)
        idx = skip_decoded.indices[m] - seg.offset
        if seg.geometry == "tile2d":
            idx = _positions_to_tiled(idx, seg.numel // seg.cols, seg.cols, tile_edge(plan.codec.chunk))
        scratch.index_add_(0, idx, skip_decoded.values[m])
        if c_scratch is not None:
            c_scratch.index_add_(0, idx, torch.ones_like(idx, dtype=c_scratch.dtype))
    flush()


def _positions_to_tiled(positions: torch.Tensor, rows: int, cols: int, t: int) -> torch.Tensor:
    """Row-major positions in the slice → positions in the gathered [n_tiles, t*t] buffer."""
    r, c = positions // cols, positions % cols
    return ((r // t) * (cols // t) + c // t) * (t * t) + (r % t) * t + c % t


def _torch_bucket_scatter(payloads, plan, out, counts, skip, skip_decoded):
    last_dispatch["decode_scatter_add"] = "torch"
    for w, p in enumerate(payloads):
        d = skip_decoded if w == skip else decode_bucket(p, plan, device=out.device)
        out.index_add_(0, d.indices, d.values)
        if counts is not None:
            counts.index_add_(0, d.indices, torch.ones_like(d.indices, dtype=counts.dtype))
    return out
