"""GPU codec benchmark: the torch codec against the Triton fast path, side by side, on one GPU.

    python benchmarks/codec_gpu.py [--size 2**30] [--workers 16] [--repeats 5] [--chunk 4096] [--k 64]
                                   [--value-bits 2] [--select-warps 4,8,16] [--skip-torch] [--json PATH]

Ops, each timed with CUDA events (median of ``--repeats`` after one warm-up):

* ``compress``: ``encode(x)`` of ``size`` fp32 values (Top-k per chunk, 2-bit quantiser, packing).
* ``ef+compress``: ``error_feedback_step(e, delta, beta)`` (``e = beta*e + delta``, encode, ``e -= sent``).
* ``decode+scatter-add xW``: ``out += decode(p_w)`` for ``W`` workers' payloads, in worker order.
* ``select kernel``: the Triton per-chunk Top-k kernel alone, once per ``--select-warps`` value.

Each op also checks that the two paths agree, bytes and buffers, with ``torch.equal``.

Columns: ``ms``; ``GB/s`` = dense fp32 input bytes (``4*size``) / time; ``x read`` = time / the measured
time to read ``x`` once (``x.sum()``). The spec read limit (4.8 TB/s on H200) is printed as well.
The compress target is <= 3 ms at 2^30. The torch path needs about 5x the input's size in memory,
and the script about 6x the input (x, e, a copy of e, delta, out); 2^30 fits an H200 (141 GB).
Exits with status 2 and a message when no CUDA device is present.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

import torch

SPEC_BW = {"H200": 4.8e12, "H100": 3.35e12, "A100": 2.0e12}


def parse_size(text: str) -> int:
    text = text.replace(" ", "")
    if "**" in text:
        base, exp = text.split("**")
        return int(base) ** int(exp)
    if text.lower().startswith("2^"):
        return 2 ** int(text[2:])
    return int(float(text))


def cuda_time(fn, repeats: int, setup=None) -> list[float]:
    """Milliseconds per call (warm-up first); ``setup`` runs untimed before each call."""
    times = []
    for r in range(repeats + 1):
        if setup is not None:
            setup()
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        if r:
            times.append(start.elapsed_time(end))
    return times


def _time_ef_compress(row, checks, args, cfg, size: int, gen, dense: int) -> None:
    """Times ``error_feedback_step`` on both paths and checks they agree. A function of its own so that
    e, its copy and delta (3x the input) are freed before the decode section allocates."""
    from megatron_sparseloco.compress import error_feedback_step
    from megatron_sparseloco.compress import fast_path as fp

    dev = gen.device
    err0 = torch.randn(size, device=dev, generator=gen)
    delta = torch.randn(size, device=dev, generator=gen)
    err = torch.empty_like(err0)
    reset = lambda: err.copy_(err0)  # noqa: E731
    ef_bytes = 3 * dense  # read e, read delta, write e
    if not args.skip_torch:
        row("torch", "ef+compress", cuda_time(lambda: error_feedback_step(err, delta, args.beta, cfg), args.repeats, reset),
            ef_bytes, "GB/s counts e+delta+e")
    row("triton", "ef+compress", cuda_time(lambda: fp.error_feedback_step_fast(err, delta, args.beta, cfg), args.repeats,
                                             reset), ef_bytes, "GB/s counts e+delta+e")
    assert fp.last_dispatch["error_feedback_step"] == "triton", fp.last_dispatch
    if not args.skip_torch:
        reset()
        p_ref, _ = error_feedback_step(err, delta, args.beta, cfg)
        e_ref = err.clone()
        reset()
        p_fast, _ = fp.error_feedback_step_fast(err, delta, args.beta, cfg)
        checks["ef+compress: payload bytes equal"] = torch.equal(p_ref, p_fast)
        checks["ef+compress: error buffer equal"] = torch.equal(e_ref, err)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--size", default="2**30", help="elements (fp32), e.g. 2**30, 2^28, 1000000")
    ap.add_argument("--workers", type=int, default=16)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--chunk", type=int, default=4096)
    ap.add_argument("--k", type=int, default=64)
    ap.add_argument("--value-bits", type=int, default=2)
    ap.add_argument("--beta", type=float, default=0.95)
    ap.add_argument("--select-warps", default="4,8,16", help="num_warps values to time the select kernel with")
    ap.add_argument("--skip-torch", action="store_true", help="time only the Triton path (no equality checks)")
    ap.add_argument("--json", default=None, help="write the rows here")
    args = ap.parse_args()

    if not torch.cuda.is_available():
        print("codec_gpu.py: no CUDA device visible (torch.cuda.is_available() is False). This benchmark "
              "times the Triton kernels on a GPU; run it on a GPU machine.", file=sys.stderr)
        return 2
    import os

    if os.environ.get("TRITON_INTERPRET") == "1":
        print("codec_gpu.py: TRITON_INTERPRET=1 is set; unset it to time compiled kernels", file=sys.stderr)
        return 2

    from megatron_sparseloco.compress import CodecConfig, encode, payload_nbytes
    from megatron_sparseloco.compress import fast_path as fp

    t_start = time.time()
    size = parse_size(args.size)
    cfg = CodecConfig(chunk=args.chunk, k=args.k, value_bits=args.value_bits).validate()
    reason = fp.config_unsupported_reason(cfg)
    if reason:
        print(f"codec_gpu.py: the fast path does not cover this config: {reason}", file=sys.stderr)
        return 2
    dev = torch.device("cuda")
    name = torch.cuda.get_device_name(dev)
    spec_bw = next((bw for key, bw in SPEC_BW.items() if key in name), None)
    print(f"device: {name}; torch {torch.__version__}; triton {__import__('triton').__version__}")
    print(f"size: {size} fp32 ({4 * size / 2**30:.2f} GiB); chunk={cfg.chunk} k={cfg.k} value_bits={cfg.value_bits}; "
          f"payload {payload_nbytes(size, cfg)} bytes; workers={args.workers}; repeats={args.repeats}")

    gen = torch.Generator(device=dev).manual_seed(0)
    x = torch.randn(size, device=dev, generator=gen)
    read_ms = statistics.median(cuda_time(lambda: x.sum(), args.repeats))
    spec_ms = 4 * size / spec_bw * 1e3 if spec_bw else None
    print(f"read limit: x.sum() {read_ms:.3f} ms measured"
          + (f"; {spec_ms:.3f} ms at the spec {spec_bw / 1e12:.1f} TB/s" if spec_ms else ""))

    rows = []

    def row(path, op, times, bytes_moved, note=""):
        ms = statistics.median(times)
        rows.append(dict(path=path, op=op, ms=ms, ms_min=min(times), gbps=bytes_moved / ms / 1e6,
                         x_read=ms / read_ms, note=note))

    dense = 4 * size
    checks = {}

    # ---- compress
    if not args.skip_torch:
        row("torch", "compress", cuda_time(lambda: encode(x, cfg), args.repeats), dense)
    row("triton", "compress", cuda_time(lambda: fp.encode_fast(x, cfg), args.repeats), dense)
    assert fp.last_dispatch["encode"] == "triton", fp.last_dispatch
    if not args.skip_torch:
        checks["compress: payload bytes equal"] = torch.equal(encode(x, cfg), fp.encode_fast(x, cfg))

    # ---- select kernel alone, per num_warps
    K = fp._kernels()
    geo = fp._geometry(size, cfg).layout
    vals = torch.empty(geo.total_kept, dtype=torch.float32, device=dev)
    idx = torch.empty(geo.total_kept, dtype=torch.int32, device=dev)
    psum = torch.empty(geo.n_chunks, dtype=torch.float64, device=dev)
    block = fp._next_pow2(cfg.chunk)
    for warps in [int(w) for w in args.select_warps.split(",") if w]:
        launch = lambda warps=warps: fp._launch(  # noqa: E731
            K.select_kernel, (geo.n_chunks,), x, x, vals, idx, psum, geo.n_chunks, geo.tail, cfg.k, geo.k_last,
            0.0, C=cfg.chunk, BLOCK=block, FUSE_EF=False, num_warps=warps)
        row("triton", f"select kernel (num_warps={warps})", cuda_time(launch, args.repeats), dense)

    # ---- error feedback + compress (its three size-long buffers are freed when the helper returns)
    _time_ef_compress(row, checks, args, cfg, size, gen, dense)

    # ---- decode + scatter-add of W workers
    payloads = []
    for _ in range(args.workers):
        x.normal_(generator=gen)
        payloads.append(fp.encode_fast(x, cfg))
    stacked = torch.stack(payloads)
    out = torch.zeros_like(x)
    zero = lambda: out.zero_()  # noqa: E731
    op = f"decode+scatter-add x{args.workers}"
    if not args.skip_torch:
        row("torch", op, cuda_time(lambda: fp._torch_scatter_add(payloads, out, None, None), args.repeats, zero),
            dense, "GB/s counts one dense fp32 out")
    row("triton", op, cuda_time(lambda: fp.decode_scatter_add_fast(stacked, out), args.repeats, zero), dense,
        "GB/s counts one dense fp32 out")
    assert fp.last_dispatch["decode_scatter_add"] == "triton", fp.last_dispatch
    if not args.skip_torch:
        zero()
        fp._torch_scatter_add(payloads, out, None, None)
        ref = out.clone()
        zero()
        fp.decode_scatter_add_fast(stacked, out)
        checks[f"{op}: sums equal"] = torch.equal(ref, out)

    # ---- report
    print()
    head = f"{'path':<7} {'op':<34} {'ms':>9} {'min ms':>9} {'GB/s':>8} {'x read':>7}  note"
    print(head)
    print("-" * len(head))
    for r in rows:
        print(f"{r['path']:<7} {r['op']:<34} {r['ms']:>9.3f} {r['ms_min']:>9.3f} {r['gbps']:>8.0f} {r['x_read']:>7.2f}  {r['note']}")
    print(f"\nread limit {read_ms:.3f} ms (x.sum() measured)" + (f", {spec_ms:.3f} ms (spec)" if spec_ms else "")
          + "; compress target <= 3 ms at 2^30")
    for what, ok in checks.items():
        print(f"check {what}: {'OK' if ok else 'MISMATCH'}")
    print(f"total wall time {time.time() - t_start:.0f} s")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(device=name, size=size, config=cfg.__dict__, read_ms=read_ms, spec_read_ms=spec_ms,
                           rows=rows, checks=checks), f, indent=2)
    return 0 if all(checks.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
