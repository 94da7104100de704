"""Triton kernels for the codec's GPU fast path (see :mod:`.fast_path`, which is the only importer).

Imported lazily: on CUDA when triton is installed, or on CPU tensors under ``TRITON_INTERPRET=1``
(tests). ``@triton.jit`` reads ``TRITON_INTERPRET`` when this module is imported, so
:func:`megatron_sparseloco.compress.fast_path._kernels` reloads the module when the mode changes.

The kernels reproduce the torch codec (:mod:`.codec`) exactly for flat chunks, packed indices and
2-/4-bit values:

* ``select_kernel``: one program per chunk of ``C <= 4096`` values, all in registers. It optionally
  fuses the error-feedback update ``s = beta*e + delta`` (written back to ``e``). ``mag = bits(|x|)``
  is the int32 pattern with the sign bit cleared, the same order the torch path uses. A radix select
  finds ``lo``, the k-th largest ``mag``: a bit-by-bit descent over bits 30..0. Each step counts
  ``mag >= lo | 1<<bit`` and stops early once exactly ``k_c`` values are ``>= lo``. The chunk then
  keeps every ``mag > lo`` plus the ``need = k_c - #(mag > lo)`` *lowest-position* values with
  ``mag == lo``. One inclusive scan of ``(gt << 16) | eq`` gives each kept value its output slot,
  ``#gt before + min(#eq before, need)``, so indices come out ascending, as the torch path emits them.
  It also stores a per-chunk fp64 partial sum of the kept values (quantiser mean).
* ``sumsq_kernel`` / ``quant_kernel``: the quantiser's fp64 sum of squares, then codes
  (round half to even, clamp) and per-bin partial sums / counts. The host side adds the partials
  with torch, as tiny reductions.
* ``pack_kernel``: LSB-first fixed-width bit packing (any width 1..16). One byte per lane gathers
  the <= ``7 // W + 2`` values that overlap it.
* ``ef_apply_kernel``: ``e[g] = s[g] - (lookup[q] + shift)`` on the sent positions, and the
  ``Decoded`` tensors (global index, dequantised value).
* ``validate_kernel`` / ``scatter_add_kernel``: decoding of ``W`` same-layout payloads. Validation
  checks that indices ascend strictly and lie in range, before anything is written. The scatter runs
  one program per chunk and loops over workers in order, with a barrier between workers, so
  ``out[g] = ((out[g] + v_0) + v_1) + ...`` in worker order. That is bit-identical to the torch loop
  ``for w: out.index_add_(0, idx_w, val_w)``.

Every launch passes ``enable_fp_fusion=False``: a contracted ``beta*e + delta`` or
``out + val*scale`` (FMA) would differ from torch's two roundings.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def _chunk_extent(pid, n_chunks, k, k_last, tail, C: tl.constexpr):
    """(values kept, values held) of chunk ``pid``: the last chunk is ragged (``tail`` values, ``k_last`` kept)."""
    is_last = pid == n_chunks - 1
    return tl.where(is_last, k_last, k), tl.where(is_last, tail, C)


@triton.jit
def _payload_slots(pid, n_chunks, k, k_last, tail, C: tl.constexpr, KB: tl.constexpr):
    """The kept-value slots of chunk ``pid`` in a payload's value / index streams: lanes ``j < KB``, of
    which ``j < kept`` are in use (mask), at stream position ``i = pid·k + j`` (every chunk before the
    ragged last one keeps ``k``); also the chunk's ``n_valid`` (an index must lie below it)."""
    j = tl.arange(0, KB)
    kc, n_valid = _chunk_extent(pid, n_chunks, k, k_last, tail, C)
    return j, j < kc, pid.to(tl.int64) * k + j, n_valid


@triton.jit
def select_kernel(
    x_ptr, delta_ptr, vals_ptr, idx_ptr, psum_ptr,
    n_chunks, tail, k, k_last, beta,
    C: tl.constexpr, BLOCK: tl.constexpr, FUSE_EF: tl.constexpr,
):  # fmt: skip
    pid = tl.program_id(0)
    offs = tl.arange(0, BLOCK)
    kc, n_valid = _chunk_extent(pid, n_chunks, k, k_last, tail, C)
    mask = offs < n_valid
    base = pid.to(tl.int64) * C
    x = tl.load(x_ptr + base + offs, mask=mask, other=0.0)
    if FUSE_EF:
        d = tl.load(delta_ptr + base + offs, mask=mask, other=0.0)
        x = x * beta
        x = x + d
        tl.store(x_ptr + base + offs, x, mask=mask)
    mag = tl.where(mask, x.to(tl.int32, bitcast=True) & 0x7FFFFFFF, -1)

    # radix select: lo = largest value with #(mag >= lo) >= kc (stop early when the count is exactly kc)
    lo = tl.zeros([], dtype=tl.int32)
    cnt = n_valid.to(tl.int32)
    bit = tl.full([], 30, dtype=tl.int32)
    while (bit >= 0) & (cnt != kc):
        cand = lo | (tl.full([], 1, dtype=tl.int32) << bit)
        c = tl.sum((mag >= cand).to(tl.int32), axis=0)
        take = c >= kc
        lo = tl.where(take, cand, lo)
        cnt = tl.where(take, c, cnt)
        bit = bit - 1

    gt = mag > lo
    eq = mag == lo
    packed = (gt.to(tl.int32) << 16) | eq.to(tl.int32)
    incl = tl.cumsum(packed, axis=0)
    excl = incl - packed
    total = tl.sum(packed, axis=0)
    need = kc - (total >> 16)
    eq_before = excl & 0xFFFF
    sel = gt | (eq & (eq_before < need))
    slot = (excl >> 16) + tl.minimum(eq_before, need)
    out = pid.to(tl.int64) * k + slot
    tl.store(idx_ptr + out, offs, mask=sel)
    tl.store(vals_ptr + out, x, mask=sel)
    psum = tl.sum(tl.where(sel, x.to(tl.float64), 0.0), axis=0)
    tl.store(psum_ptr + pid, psum)


@triton.jit
def sumsq_kernel(vals_ptr, stats_ptr, part_ptr, K, BLOCK: tl.constexpr):
    pid = tl.program_id(0)
    offs = pid.to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    m = offs < K
    v = tl.load(vals_ptr + offs, mask=m, other=0.0).to(tl.float64)
    shift = tl.load(stats_ptr)
    c = tl.where(m, v - shift, 0.0)
    tl.store(part_ptr + pid, tl.sum(c * c, axis=0))


@triton.jit
def quant_kernel(vals_ptr, stats_ptr, codes_ptr, bsum_ptr, bcnt_ptr, K, N_BINS: tl.constexpr, BLOCK: tl.constexpr):
    pid = tl.program_id(0)
    offs = pid.to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    m = offs < K
    v = tl.load(vals_ptr + offs, mask=m, other=0.0).to(tl.float64)
    shift = tl.load(stats_ptr)
    scale = tl.load(stats_ptr + 1)
    c = v - shift
    safe = tl.where(scale > 0, scale, 1.0)
    pos = tl.where(scale > 0, c / safe, 0.0) + (N_BINS // 2) * 1.0
    # round half to even; clamping to [-1, B] first keeps the result of the final clamp unchanged
    pos = tl.minimum(tl.maximum(pos, -1.0), N_BINS * 1.0)
    f = tl.floor(pos)
    frac = pos - f
    fi = f.to(tl.int32)
    up = (frac > 0.5) | ((frac == 0.5) & ((fi & 1) == 1))
    q = tl.minimum(tl.maximum(fi + up.to(tl.int32), 0), N_BINS - 1)
    tl.store(codes_ptr + offs, q.to(tl.uint8), mask=m)
    for b in tl.static_range(N_BINS):
        hit = m & (q == b)
        tl.store(bsum_ptr + pid * N_BINS + b, tl.sum(tl.where(hit, c, 0.0), axis=0))
        tl.store(bcnt_ptr + pid * N_BINS + b, tl.sum(hit.to(tl.int32), axis=0))


@triton.jit
def pack_kernel(src_ptr, dst_ptr, count, n_bytes, W: tl.constexpr, NV: tl.constexpr, BLOCK: tl.constexpr):
    pid = tl.program_id(0)
    j = pid.to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    m = j < n_bytes
    bit0 = j * 8
    first = bit0 // W
    acc = tl.zeros([BLOCK], dtype=tl.int64)
    for t in tl.static_range(NV):
        i = first + t
        v = tl.load(src_ptr + i, mask=m & (i < count), other=0).to(tl.int64)
        s = i * W - bit0
        left = v << tl.maximum(s, 0)
        right = v >> tl.maximum(-s, 0)
        acc = acc | tl.where(s >= 0, left, right)
    tl.store(dst_ptr + j, (acc & 0xFF).to(tl.uint8), mask=m)


@triton.jit
def ef_apply_kernel(
    vals_ptr, idx_ptr, codes_ptr, side_ptr, err_ptr, dec_idx_ptr, dec_val_ptr, K, k,
    C: tl.constexpr, UPDATE_ERR: tl.constexpr, BLOCK: tl.constexpr,
):  # fmt: skip
    pid = tl.program_id(0)
    i = pid.to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    m = i < K
    local = tl.load(idx_ptr + i, mask=m, other=0).to(tl.int64)
    g = (i // k) * C + local  # the ragged chunk is the last one, so i // k is the chunk id
    q = tl.load(codes_ptr + i, mask=m, other=0).to(tl.int32)
    deq = tl.load(side_ptr + 1 + q, mask=m, other=0.0) + tl.load(side_ptr)
    if UPDATE_ERR:
        s = tl.load(vals_ptr + i, mask=m, other=0.0)
        tl.store(err_ptr + g, s - deq, mask=m)
    tl.store(dec_idx_ptr + i, g, mask=m)
    tl.store(dec_val_ptr + i, deq, mask=m)


@triton.jit
def _unpack(base_ptr, bitoff, limit, m, WIDTH: tl.constexpr, NBYTES: tl.constexpr):
    """WIDTH-bit LSB-first values at stream bit ``bitoff`` (int64) of a section of ``limit`` bytes."""
    byte = bitoff >> 3
    sh = (bitoff & 7).to(tl.int32)
    word = tl.load(base_ptr + byte, mask=m & (byte < limit), other=0).to(tl.int32)
    if NBYTES > 1:
        word = word | (tl.load(base_ptr + byte + 1, mask=m & (byte + 1 < limit), other=0).to(tl.int32) << 8)
    if NBYTES > 2:
        word = word | (tl.load(base_ptr + byte + 2, mask=m & (byte + 2 < limit), other=0).to(tl.int32) << 16)
    return (word >> sh) & ((1 << WIDTH) - 1)


@triton.jit
def validate_kernel(
    pay_ptr, row_stride, bad_ptr, n_chunks, tail, k, k_last, index_at, index_bytes,
    C: tl.constexpr, KB: tl.constexpr, WI: tl.constexpr, NBI: tl.constexpr,
):  # fmt: skip
    pid = tl.program_id(0)
    w = tl.program_id(1)
    j, m, i, n_valid = _payload_slots(pid, n_chunks, k, k_last, tail, C, KB)
    sec = pay_ptr + w.to(tl.int64) * row_stride + index_at
    local = _unpack(sec, i * WI, index_bytes, m, WI, NBI)
    prev = _unpack(sec, (i - 1) * WI, index_bytes, m & (j > 0), WI, NBI)
    bad = m & ((local >= n_valid) | ((j > 0) & (local <= prev)))
    tl.store(bad_ptr + w.to(tl.int64) * n_chunks + pid, tl.max(bad.to(tl.int32), axis=0).to(tl.uint8))


@triton.jit
def scatter_add_kernel(
    pay_ptr, row_stride, side_ptr, scale_ptr, out_ptr, cnt_ptr,
    n_workers, n_chunks, tail, k, k_last, values_at, value_bytes, index_at, index_bytes,
    C: tl.constexpr, KB: tl.constexpr, WI: tl.constexpr, NBI: tl.constexpr, VB: tl.constexpr,
    N_BINS: tl.constexpr, HAS_SCALE: tl.constexpr, HAS_COUNT: tl.constexpr,
):  # fmt: skip
    pid = tl.program_id(0)
    _, m_read, i, n_valid = _payload_slots(pid, n_chunks, k, k_last, tail, C, KB)
    for w in range(n_workers):
        row = pay_ptr + (tl.zeros([], dtype=tl.int64) + w) * row_stride
        local = _unpack(row + index_at, i * WI, index_bytes, m_read, WI, NBI)
        m = m_read & (local < n_valid)   # valid payloads: every index (checks deferred: never out of bounds)
        q = _unpack(row + values_at, i * VB, value_bytes, m, VB, 1)
        side = side_ptr + w * (1 + N_BINS)
        val = tl.load(side + 1 + q, mask=m, other=0.0) + tl.load(side)
        if HAS_SCALE:
            val = val * tl.load(scale_ptr + w)
        g = pid.to(tl.int64) * C + local
        o = tl.load(out_ptr + g, mask=m, other=0.0)
        tl.store(out_ptr + g, o + val, mask=m)
        if HAS_COUNT:
            n = tl.load(cnt_ptr + g, mask=m)
            tl.store(cnt_ptr + g, n + 1, mask=m)
        tl.debug_barrier()  # worker w's stores are visible to every thread before worker w+1 reads
