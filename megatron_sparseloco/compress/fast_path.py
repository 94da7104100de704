"""GPU fast path for the codec: Triton kernels where they apply, the torch codec everywhere else.

    payload = encode_fast(x, cfg, name)                              # == codec.encode(x, cfg, name)
    payload, dec = error_feedback_step_fast(err, delta, beta, cfg)   # == error_feedback_step(...)
    decode_scatter_add_fast(payloads, out, scales=None, counts=None) # out += sum_w decode(payload_w)

The Triton path runs when :func:`unsupported_reason` returns ``None``:

* triton is importable, and the tensors are on CUDA. CPU tensors also qualify under
  ``TRITON_INTERPRET=1`` together with ``SPARSELOCO_INTERPRET_KERNELS=1``, which is how the kernel
  tests run them without a GPU (elsewhere the interpreter would only slow CPU runs down).
  ``SPARSELOCO_TRITON=0`` turns the kernels off everywhere.
* ``chunk_mode="flat"``, ``index_coding="packed"``, ``value_bits`` 2 or 4, ``quant_group_chunks=0``
  (one quantiser per tensor), ``2 <= chunk <= 4096``, ``k < chunk`` (not dense).
* fp32, contiguous input with at least one element (``delta`` also fp32 for the EF step).

Otherwise each function calls the torch codec. ``last_dispatch[op]`` holds ``"triton"`` or the
reason for the fallback (``op`` is ``"encode"``, ``"error_feedback_step"`` or
``"decode_scatter_add"``).

**Bytes.** Selection, codes, indices and the packing are bit-exact with the torch path: same ties,
same order, same rounding. The side info, however, comes from fp64 sums (mean, Σc², bin sums). The
kernels add them in a tree and the torch path on CPU adds them in sequence, so the two fp64 results
can differ in their last bits. The payloads differ only if that moves an fp32 side word (or a code
at an exact bin edge) by one ulp. The probability is ~1e-9 per word for random data, and it is 0 where
the sums are exact (e.g. small integers). The torch path on CUDA has the same caveat (``index_add_``
atomics, see :mod:`.quantizer`). Whatever the side info, the decoded values are exactly what
``decode`` reads from the payload, so the error-feedback identity ``e_new == s - decode_dense(P)``
holds bit for bit.
"""

from __future__ import annotations

import importlib
import os
from typing import Callable, Sequence

import torch

from megatron_sparseloco.compress import codec as _codec
from megatron_sparseloco.compress.checks import deferring, require
from megatron_sparseloco.compress.codec import Decoded
from megatron_sparseloco.compress.config import CodecConfig
from megatron_sparseloco.compress.error_feedback import error_feedback_step
from megatron_sparseloco.compress.errors import NonFiniteInputError, PayloadError
from megatron_sparseloco.compress.header import HEADER_BYTES, Header
from megatron_sparseloco.compress.sizing import PayloadGeometry

MAX_FAST_CHUNK = 4096
FAST_VALUE_BITS = (2, 4)

#: op -> "triton" or the reason the last call fell back to the torch codec
last_dispatch: dict[str, str] = {}

_TRITON_IMPORT_ERROR: str | None = None


def _interpret() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def _triton_error() -> str | None:
    """None if triton imports, else why not (cached)."""
    global _TRITON_IMPORT_ERROR
    if _TRITON_IMPORT_ERROR is None:
        try:
            import triton  # noqa: F401

            _TRITON_IMPORT_ERROR = ""
        except Exception as err:  # pragma: no cover - depends on the install
            _TRITON_IMPORT_ERROR = f"triton is not importable ({type(err).__name__}: {err})"
    return _TRITON_IMPORT_ERROR or None


def _triton_interpreted() -> bool:
    """True if triton was imported under ``TRITON_INTERPRET=1``.

    ``triton.language``'s own ``@jit`` helpers (``tl.sum``, ``tl.cumsum``, ...) are built once, when
    triton is first imported, so the mode is fixed then. The interpreter needs the variable set
    before that import.
    """
    import triton.language as tl

    return type(tl.sum).__name__ == "InterpretedFunction"


def _kernels():
    """The kernels module, built in the mode triton itself was imported in (compiled or interpreted)."""
    want = _triton_interpreted()
    saved = os.environ.get("TRITON_INTERPRET")
    os.environ["TRITON_INTERPRET"] = "1" if want else "0"  # @triton.jit reads it at decoration time
    try:
        from megatron_sparseloco.compress import triton_kernels

        if _triton_jit_mode(triton_kernels) != want:
            triton_kernels = importlib.reload(triton_kernels)
    finally:
        if saved is None:
            os.environ.pop("TRITON_INTERPRET", None)
        else:
            os.environ["TRITON_INTERPRET"] = saved
    return triton_kernels


def _triton_jit_mode(module) -> bool:
    """True if ``module``'s kernels were built as interpreted functions."""
    return type(module.select_kernel).__name__ == "InterpretedFunction"


def config_unsupported_reason(cfg: CodecConfig) -> str | None:
    """Why ``cfg`` is outside the fast path, or None."""
    cfg.validate()
    if cfg.chunk_mode != "flat":
        return f"chunk_mode={cfg.chunk_mode!r} (fast path: 'flat')"
    if cfg.index_coding != "packed":
        return f"index_coding={cfg.index_coding!r} (fast path: 'packed')"
    if cfg.value_bits not in FAST_VALUE_BITS:
        return f"value_bits={cfg.value_bits} (fast path: {FAST_VALUE_BITS})"
    if cfg.quant_group_chunks != 0:
        return f"quant_group_chunks={cfg.quant_group_chunks} (fast path: 0, one quantiser per tensor)"
    if not 2 <= cfg.chunk <= MAX_FAST_CHUNK:
        return f"chunk={cfg.chunk} (fast path: 2..{MAX_FAST_CHUNK})"
    if cfg.is_dense:
        return f"k == chunk = {cfg.chunk} (dense; fast path needs k < chunk)"
    return None


#: ``SPARSELOCO_TRITON=0`` turns the kernels off everywhere (the torch codec, same bytes);
#: ``SPARSELOCO_INTERPRET_KERNELS=1`` is needed for CPU tensors to take them in the Triton interpreter
#: (the kernel tests set it; elsewhere the interpreter would only make CPU runs slow).
TRITON_SWITCH = "SPARSELOCO_TRITON"
INTERPRETER_SWITCH = "SPARSELOCO_INTERPRET_KERNELS"


def device_unsupported_reason(device: torch.device) -> str | None:
    """Why tensors on ``device`` cannot take the Triton path, or None."""
    if os.environ.get(TRITON_SWITCH, "1") == "0":
        return f"{TRITON_SWITCH}=0"
    err = _triton_error()
    if err:
        return err
    if device.type == "cuda":
        if _interpret() or _triton_interpreted():
            return "TRITON_INTERPRET=1 (now or when triton was imported) but the tensor is on CUDA"
        return None
    if device.type == "cpu" and _interpret():
        if os.environ.get(INTERPRETER_SWITCH, "0") != "1":
            return (f"CPU tensor under TRITON_INTERPRET=1 without {INTERPRETER_SWITCH}=1 "
                    "(interpreted kernels are for tests)")
        if not _triton_interpreted():
            return "TRITON_INTERPRET=1 was set after triton was imported; set it before the first import"
        return None
    return f"tensor on {device} (the Triton path needs CUDA, or TRITON_INTERPRET=1 for CPU tensors)"


def unsupported_reason(cfg: CodecConfig, x: torch.Tensor) -> str | None:
    """Why ``encode_fast(x, cfg)`` would fall back to the torch codec, or None if it runs the kernels."""
    reason = config_unsupported_reason(cfg)
    if reason:
        return reason
    if not isinstance(x, torch.Tensor):
        return f"input is a {type(x).__name__}, not a tensor"
    if x.dtype != torch.float32:
        return f"dtype {x.dtype} (fast path: float32)"
    if not x.is_contiguous():
        return "input is not contiguous"
    if x.numel() == 0:
        return "empty tensor"
    return device_unsupported_reason(x.device)


def _launch(kernel, grid, *args, **kw):
    kernel[grid](*args, enable_fp_fusion=False, **kw)


def _index_error(bad: torch.Tensor, stacked: torch.Tensor) -> Callable[[], PayloadError]:
    """The error of a failed index validation (``bad``: workers x chunks, nonzero where a chunk's indices are
    out of range or not ascending). Checked at once: the torch path's precise error for the first bad payload.
    Deferred (kept until the round's end): built from the first bad worker and chunk, taken on the device,
    without holding the bucket's payloads."""
    if not deferring():
        def precise() -> PayloadError:
            w = int(torch.nonzero(bad.any(1))[0])
            try:
                _codec.decode(stacked[w])
            except PayloadError as exc:
                return exc
            return PayloadError(f"payload {w}: indices are not strictly ascending / in range")  # pragma: no cover
        return precise
    flags = bad != 0
    worker = _codec.first_true(flags.any(1))
    evidence = torch.cat([worker, flags.index_select(0, worker).to(torch.uint8).argmax(1)])

    def deferred() -> PayloadError:
        w, chunk = evidence.tolist()
        return PayloadError(f"payload {w}: the indices of chunk {chunk} are out of range or not strictly ascending")
    return deferred


def _next_pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


#: num_warps of the per-chunk select kernel; None = 8 for chunks >= 2048, else 4 (untuned: no GPU yet)
SELECT_NUM_WARPS: int | None = None


def _warps(block: int) -> int:
    if SELECT_NUM_WARPS is not None:
        return SELECT_NUM_WARPS
    return 8 if block >= 2048 else 4


def _geometry(numel: int, cfg: CodecConfig) -> PayloadGeometry:
    """The flat payload geometry of ``numel`` elements (what ``codec.decode`` and ``payload_nbytes`` read);
    the kernels take its python ints: ``layout.n_chunks / tail / k_last``, ``values_at``, ``index_at`` ..."""
    return PayloadGeometry.for_tensor(numel, cfg)


_HEADERS: dict = {}


def _header_tensor(numel: int, cfg: CodecConfig, geo: PayloadGeometry, device: torch.device) -> torch.Tensor:
    key = (numel, cfg, str(device))
    head = _HEADERS.get(key)
    if head is None:
        raw = Header(cfg, "flat", torch.float32, False, numel, 0, 0, geo.index_bytes).pack()
        head = torch.frombuffer(bytearray(raw), dtype=torch.uint8).to(device)
        if len(_HEADERS) > 256:
            _HEADERS.clear()
        _HEADERS[key] = head
    return head


def _encode_kernels(x_flat, cfg, name, delta_flat=None, beta=0.0, error_out=None):
    """Run the compress kernels. Returns ``(payload, Decoded or None)``.

    With ``delta_flat``, ``x_flat`` is the error buffer: it becomes ``s = beta*x + delta`` and then,
    after a successful encode, ``s - decoded`` on the sent positions.
    """
    K = _kernels()
    dev = x_flat.device
    geo = _geometry(x_flat.numel(), cfg)
    lay = geo.layout
    n_chunks, kept = lay.n_chunks, lay.total_kept
    vals = torch.empty(kept, dtype=torch.float32, device=dev)
    idx = torch.empty(kept, dtype=torch.int32, device=dev)
    psum = torch.empty(n_chunks, dtype=torch.float64, device=dev)
    block = _next_pow2(cfg.chunk)
    fuse = delta_flat is not None
    _launch(
        K.select_kernel, (n_chunks,), x_flat, delta_flat if fuse else x_flat, vals, idx, psum,
        n_chunks, lay.tail, cfg.k, lay.k_last, float(beta),
        C=cfg.chunk, BLOCK=block, FUSE_EF=fuse, num_warps=_warps(block),
    )  # fmt: skip

    # quantiser statistics (see quantizer.quantise); the partial sums are added with torch
    n_bins = cfg.n_bins
    total = psum.sum()
    shift32 = (total / kept).to(torch.float32)
    stats = torch.empty(2, dtype=torch.float64, device=dev)
    stats[0] = shift32.to(torch.float64)
    vblock = 1024
    n_vblocks = -(-kept // vblock)
    part = torch.empty(n_vblocks, dtype=torch.float64, device=dev)
    _launch(K.sumsq_kernel, (n_vblocks,), vals, stats, part, kept, BLOCK=vblock, num_warps=4)
    sigma = torch.sqrt(part.sum() / float(max(kept - 1, 1)))
    stats[1] = 6.0 * sigma / n_bins
    codes = torch.empty(kept, dtype=torch.uint8, device=dev)
    bsum = torch.empty(n_vblocks * n_bins, dtype=torch.float64, device=dev)
    bcnt = torch.empty(n_vblocks * n_bins, dtype=torch.int32, device=dev)
    _launch(K.quant_kernel, (n_vblocks,), vals, stats, codes, bsum, bcnt, kept,
            N_BINS=n_bins, BLOCK=vblock, num_warps=4)
    bin_sum = bsum.view(n_vblocks, n_bins).sum(0)
    bin_cnt = bcnt.view(n_vblocks, n_bins).sum(0, dtype=torch.int64).to(torch.float64)
    lookup = torch.where(bin_cnt > 0, bin_sum / bin_cnt.clamp_min(1), torch.zeros_like(bin_sum))
    side = torch.cat([shift32.view(1), lookup.to(torch.float32)])

    payload = torch.empty(geo.nbytes, dtype=torch.uint8, device=dev)
    payload[:HEADER_BYTES].copy_(_header_tensor(lay.numel, cfg, geo, dev))
    payload[HEADER_BYTES : geo.values_at].view(torch.float32).copy_(side)
    pblock = 1024
    vb = cfg.value_bits
    _launch(
        K.pack_kernel, (-(-geo.value_bytes // pblock),), codes, payload[geo.values_at : geo.index_at],
        kept, geo.value_bytes, W=vb, NV=7 // vb + 2, BLOCK=pblock, num_warps=4,
    )  # fmt: skip
    wi = geo.index_width
    _launch(
        K.pack_kernel, (-(-geo.index_bytes // pblock),), idx, payload[geo.index_at :],
        kept, geo.index_bytes, W=wi, NV=7 // wi + 2, BLOCK=pblock, num_warps=4,
    )  # fmt: skip

    # the selected values are all finite iff their fp64 sum is (it cannot overflow)
    require(~torch.isfinite(total),
            lambda: NonFiniteInputError(f"encode: tensor {name!r} holds NaN or Inf; refusing to send it"))
    if not fuse and error_out is None:
        return payload, None
    dec_idx = torch.empty(kept, dtype=torch.int64, device=dev)
    dec_val = torch.empty(kept, dtype=torch.float32, device=dev)
    _launch(
        K.ef_apply_kernel, (n_vblocks,), vals, idx, codes, side, x_flat, dec_idx, dec_val, kept, cfg.k,
        C=cfg.chunk, UPDATE_ERR=fuse, BLOCK=vblock, num_warps=4,
    )  # fmt: skip
    return payload, Decoded(lay.numel, dec_idx, dec_val, cfg)


def encode_fast(x: torch.Tensor, cfg: CodecConfig, name: str = "tensor") -> torch.Tensor:
    """:func:`codec.encode` with the Triton kernels where supported (see the module doc); same bytes."""
    reason = unsupported_reason(cfg, x)
    last_dispatch["encode"] = reason or "triton"
    if reason:
        return _codec.encode(x, cfg, name=name)
    return _encode_kernels(x.reshape(-1), cfg, name)[0]


def error_feedback_step_fast(
    error: torch.Tensor, delta: torch.Tensor, beta: float, cfg: CodecConfig, name: str = "tensor"
) -> tuple[torch.Tensor, Decoded]:
    """:func:`error_feedback_step` with one fused kernel for ``s = beta*e + delta`` and the Top-k.

    Same contract: ``error`` is updated in place to ``s - decode_dense(payload)``, and the function returns
    ``(payload, Decoded)``. ``Decoded.indices`` / ``.values`` equal ``decode(payload)``'s.
    """
    reason = unsupported_reason(cfg, error)
    if reason is None and isinstance(delta, torch.Tensor):
        if delta.dtype != torch.float32:
            reason = f"delta dtype {delta.dtype} (fast path: float32)"
        elif not delta.is_contiguous():
            reason = "delta is not contiguous"
        elif delta.numel() != error.numel() or delta.device != error.device:
            reason = "delta does not match error (the torch path reports the details)"
    last_dispatch["error_feedback_step"] = reason or "triton"
    if reason:
        return error_feedback_step(error, delta, beta, cfg, name=name)
    payload, dec = _encode_kernels(error.view(-1), cfg, name, delta_flat=delta.reshape(-1), beta=beta)
    return payload, dec


def _torch_scatter_add(payloads, out, scales, counts):
    for w, p in enumerate(payloads):
        d = _codec.decode(p, device=out.device)
        if d.numel != out.numel():
            raise PayloadError(f"payload {w} describes {d.numel} elements, out has {out.numel()}")
        values = d.values if scales is None else d.values * scales[w]
        out.index_add_(0, d.indices, values)
        if counts is not None:
            counts.index_add_(0, d.indices, torch.ones_like(d.indices, dtype=counts.dtype))
    return out


def decode_scatter_add_fast(
    payloads: Sequence[torch.Tensor] | torch.Tensor,
    out: torch.Tensor,
    scales: torch.Tensor | None = None,
    counts: torch.Tensor | None = None,
) -> torch.Tensor:
    """``out += decode_dense(p_w) [* scales[w]]`` for each payload ``w`` in order; ``counts += 1`` where sent.

    Bit-identical to the torch loop ``for w: d = decode(p_w); out.index_add_(0, d.indices, d.values)``.
    ``payloads`` is a sequence of 1-D uint8 tensors or a ``[W, nbytes]`` uint8 tensor (an all-gather
    buffer). ``out`` is a 1-D fp32 tensor of the encoded ``numel``. ``scales`` is optional fp32 ``[W]``,
    and ``counts`` is optional 1-D, same length as ``out``. Payloads are validated before anything is
    written: a bad payload raises :class:`PayloadError` with ``out`` unchanged.
    """
    if not isinstance(out, torch.Tensor) or out.dtype != torch.float32 or out.dim() != 1:
        raise ValueError("decode_scatter_add_fast: out must be a 1-D float32 tensor")
    rows = (list(payloads) if not isinstance(payloads, torch.Tensor)
            else list(payloads.unbind(0)) if payloads.dim() == 2 else None)
    if rows is None:
        raise ValueError("decode_scatter_add_fast: payloads must be a list of 1-D uint8 tensors or a 2-D uint8 tensor")
    reason = _scatter_reason(rows, out, scales, counts)
    if reason is None:
        heads = _read_heads(payloads, rows, out.device)
        reason = heads if isinstance(heads, str) else None
    last_dispatch["decode_scatter_add"] = reason or "triton"
    if reason:
        return _torch_scatter_add(rows, out, scales, counts)
    cfg, stacked = heads
    return _scatter_kernels(stacked, cfg, out, scales, counts)


def _scatter_reason(rows, out, scales, counts) -> str | None:
    if not rows:
        return "no payloads"
    reason = device_unsupported_reason(out.device)
    if reason:
        return reason
    if not out.is_contiguous():
        return "out is not contiguous"
    if out.numel() == 0:
        return "empty out"
    for p in rows:
        if not isinstance(p, torch.Tensor) or p.dtype != torch.uint8 or p.dim() != 1:
            return "a payload is not a 1-D uint8 tensor (the torch path reports the details)"
        if p.device != out.device:
            return f"a payload is on {p.device}, out on {out.device}"
        if p.numel() != rows[0].numel():
            return "payloads differ in length"
        if p.numel() < HEADER_BYTES:
            return "a payload is shorter than the header (the torch path reports the details)"
    if scales is not None and (scales.dtype != torch.float32 or scales.device != out.device
                               or scales.numel() != len(rows)):
        return "scales is not a float32 tensor of one value per payload on out's device"
    if counts is not None and (counts.shape != out.shape or counts.device != out.device or not counts.is_contiguous()):
        return "counts does not match out"
    return None


def _read_heads(payloads, rows, device):
    """Parse and check every header on the host (one copy); returns ``(cfg, [W, nbytes] tensor)`` or a reason."""
    stacked = payloads if isinstance(payloads, torch.Tensor) else torch.stack(rows)
    stacked = stacked.contiguous()
    host = stacked[:, :HEADER_BYTES].cpu()
    cfg = None
    for w in range(host.shape[0]):
        raw = host[w].numpy().tobytes()
        try:
            head = Header.unpack(raw)
        except PayloadError:
            return "a header is invalid (the torch path reports the details)"
        if head.geometry != "flat":
            return f"payload {w} has geometry {head.geometry!r}"
        reason = config_unsupported_reason(head.config)
        if reason:
            return f"payload {w}: {reason}"
        if cfg is not None and head.config != cfg:
            return "payloads use different codec configurations"
        cfg = head.config
        geo = _geometry(head.numel, cfg)
        if head.index_bytes != geo.index_bytes:
            return "a header has an inconsistent index length (the torch path reports the details)"
        if stacked.shape[1] != geo.nbytes:
            return "a payload length does not match its header (the torch path reports the details)"
        if w == 0:
            numel0 = head.numel
        elif head.numel != numel0:
            return "payloads describe different numel"
    return cfg, stacked


def _scatter_kernels(stacked, cfg, out, scales, counts):
    """Validate then scatter-add W same-layout flat payloads (rows of ``stacked``) into ``out``.

    While checks are deferred (``compress.checks``) the headers are the caller's (known to match
    ``out``), and the validity flags are recorded rather than read: the scatter then skips any
    index outside its chunk, so nothing is written out of bounds."""
    K = _kernels()
    n_workers = stacked.shape[0]
    numel = out.numel()
    if not deferring():
        head0 = Header.unpack(stacked[0, :HEADER_BYTES].cpu().numpy().tobytes())
        if head0.numel != numel:
            raise PayloadError(f"payloads describe {head0.numel} elements, out has {numel}")
    geo = _geometry(numel, cfg)
    lay = geo.layout
    # reshape(-1) copies unless one row (then a view at a 4-byte offset): view as fp32 works for any row length
    side = stacked[:, HEADER_BYTES : geo.values_at].reshape(-1).view(torch.float32).view(n_workers, -1)
    finite = torch.isfinite(side).all(1)

    def side_error() -> PayloadError:
        w = int(torch.nonzero(~finite)[0])
        return PayloadError(f"payload {w}: side info (quantiser shift / centroids) holds NaN or Inf")

    require(~finite, side_error)
    kb = _next_pow2(cfg.k)
    wi = geo.index_width
    nbi = (wi + 14) // 8
    bad = torch.empty(n_workers * lay.n_chunks, dtype=torch.uint8, device=out.device)
    _launch(
        K.validate_kernel, (lay.n_chunks, n_workers), stacked, stacked.stride(0), bad,
        lay.n_chunks, lay.tail, cfg.k, lay.k_last, geo.index_at, geo.index_bytes,
        C=cfg.chunk, KB=kb, WI=wi, NBI=nbi, num_warps=1 if kb <= 64 else 4,
    )  # fmt: skip
    require(bad != 0, _index_error(bad.view(n_workers, -1), stacked))
    _launch(
        K.scatter_add_kernel, (lay.n_chunks,), stacked, stacked.stride(0), side,
        scales if scales is not None else side, out, counts if counts is not None else out,
        n_workers, lay.n_chunks, lay.tail, cfg.k, lay.k_last, geo.values_at, geo.value_bytes, geo.index_at,
        geo.index_bytes,
        C=cfg.chunk, KB=kb, WI=wi, NBI=nbi, VB=cfg.value_bits, N_BINS=cfg.n_bins,
        HAS_SCALE=scales is not None, HAS_COUNT=counts is not None, num_warps=1 if kb <= 64 else 4,
    )  # fmt: skip
    return out
