"""Codec benchmark: real payload sizes and encode / decode throughput against a memcpy of the same buffer.

    python benchmarks/codec.py [--quick] [--json PATH] [--device cpu|cuda] [--numel N] [--threads 1,0]
    python benchmarks/codec.py --llama-1b [--json PATH]     # per-tensor payload of a 1B Llama's tensors

One row per (threads, k, index coding) with C = 4096 and 2-bit values (plus a tile-mode row):
payload_bytes (real, header and side info included), bits_per_param, ratio_vs_fp32, bits_per_index
(index section only), encode/decode/memcpy elements per second (median of several runs).
``--threads 0`` means torch's default thread count.
"""

from __future__ import annotations

import argparse
import math
import os
import platform
import statistics
import struct
import subprocess
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import common  # noqa: E402
import schema  # noqa: E402
from megatron_sparseloco.compress import CodecConfig, analytic_bits_per_param, decode, encode, payload_nbytes
from megatron_sparseloco.compress.segments import TensorSlice, bucket_payload_nbytes, encode_bucket, plan_buckets

#: the tensor shapes of a 1B Llama (Llama-3.2-1B: hidden 2048, 16 layers, 32 query / 8 KV heads of 64,
#: SwiGLU FFN 8192, vocabulary 128256, tied embeddings), as Megatron holds them (fused QKV and fc1)
LLAMA_1B = (
    [("embedding.word_embeddings.weight", (128256, 2048))]
    + [item for i in range(16) for item in (
        (f"layers.{i}.input_layernorm.weight", (2048,)),
        (f"layers.{i}.self_attention.linear_qkv.weight", (2048 + 2 * 512, 2048)),
        (f"layers.{i}.self_attention.linear_proj.weight", (2048, 2048)),
        (f"layers.{i}.pre_mlp_layernorm.weight", (2048,)),
        (f"layers.{i}.mlp.linear_fc1.weight", (2 * 8192, 2048)),
        (f"layers.{i}.mlp.linear_fc2.weight", (2048, 8192)),
    )]
    + [("final_layernorm.weight", (2048,))]
)


def llama_payloads(k: int = 64, chunk: int = 4096, codings=("packed", "entropy")) -> dict:
    """Real per-tensor payload bytes (packed and / or entropy-coded indices, 2-bit values, 1-D dense) of the
    Llama-1B tensor set, one whole tensor per rank; values torch.randn with a per-tensor fixed seed."""
    numel = sum(math.prod(s) for _, s in LLAMA_1B)
    out = {"model": "llama-1b shapes", "numel": numel, "k": k, "chunk": chunk, "tensors": len(LLAMA_1B)}
    for coding in codings:
        cfg = CodecConfig(chunk=chunk, k=k, index_coding=coding)
        total = formula = 0
        t0 = time.perf_counter()
        for i, (name, shape) in enumerate(LLAMA_1B):
            n = math.prod(shape)
            (plan,) = plan_buckets([TensorSlice(shape, 0, n)], cfg, 1 << 31, True, [name])
            x = torch.randn(n, generator=torch.Generator().manual_seed(i))
            size = encode_bucket(x, plan, name).numel()
            if coding == "packed" and size != bucket_payload_nbytes(plan):
                raise AssertionError(f"{name}: payload {size} B, formula {bucket_payload_nbytes(plan)} B")
            total += size
            formula += bucket_payload_nbytes(plan)
        out[coding] = {"payload_bytes": total, "bits_per_param": 8 * total / numel,
                       "ratio_vs_fp32": 4 * numel / total, "encode_s": time.perf_counter() - t0,
                       "size_formula_bytes": formula}
        print(f"llama-1b {coding:8s} k={k}/{chunk}: {total} B, {8 * total / numel:.4f} bits/param, "
              f"{4 * numel / total:.1f}x fewer than fp32", flush=True)
    return out


def cpu_model() -> str:
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True, check=False).stdout
        for line in out.splitlines():
            if line.startswith("Model name:"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def timed(fn, device: torch.device, repeats: int) -> tuple[float, float]:
    """Median wall seconds and median process CPU seconds of ``fn()`` over ``repeats`` runs, after a warm-up.

    CPU seconds (all threads of this process) are reported because the benchmark machine is shared:
    with one thread, CPU time is close to what the wall time would be on an idle core.
    """
    fn()
    wall, cpu = [], []
    for _ in range(repeats):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        start, start_cpu = time.perf_counter(), time.process_time()
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        wall.append(time.perf_counter() - start)
        cpu.append(time.process_time() - start_cpu)
    return statistics.median(wall), statistics.median(cpu)


def log2_binomial(n: int, k: int) -> float:
    return (math.lgamma(n + 1) - math.lgamma(k + 1) - math.lgamma(n - k + 1)) / math.log(2)


def configurations(quick: bool) -> list[CodecConfig]:
    cfgs = [CodecConfig(k=k, index_coding=coding) for k in (32, 64, 128) for coding in ("packed", "entropy")]
    if not quick:
        cfgs.append(CodecConfig(k=64, chunk_mode="tile"))
    return cfgs


def bench_row(x: torch.Tensor, cfg: CodecConfig, device: torch.device, repeats: int, threads: int) -> dict:
    numel = x.numel()
    shape = tuple(x.shape)
    payload = encode(x, cfg)
    nbytes = payload.numel()
    index_bytes = struct.unpack_from("<Q", bytes(payload[56:64].cpu().tolist()))[0]
    kept = decode(payload).indices.numel()
    t_enc, cpu_enc = timed(lambda: encode(x, cfg), device, repeats)
    t_dec, cpu_dec = timed(lambda: decode(payload), device, repeats)
    t_copy, cpu_copy = timed(lambda: x.clone(), device, repeats)
    return {
        "device": device.type,
        "threads": threads,
        "numel": numel,
        "shape": list(shape),
        "chunk": cfg.chunk,
        "k": cfg.k,
        "value_bits": cfg.value_bits,
        "index_coding": cfg.index_coding,
        "chunk_mode": cfg.chunk_mode,
        "payload_bytes": nbytes,
        "payload_nbytes_formula": payload_nbytes(numel, cfg, shape),
        "analytic_bits_per_param": analytic_bits_per_param(cfg, numel, shape),
        "bits_per_param": 8 * nbytes / numel,
        "ratio_vs_fp32": 32 * numel / (8 * nbytes),
        "bits_per_index": 8 * index_bytes / kept,
        "bits_per_index_floor": log2_binomial(cfg.chunk, cfg.k) / cfg.k,
        "encode_s": t_enc,
        "decode_s": t_dec,
        "memcpy_s": t_copy,
        "encode_elems_per_s": numel / t_enc,
        "decode_elems_per_s": numel / t_dec,
        "memcpy_elems_per_s": numel / t_copy,
        "encode_vs_memcpy": t_copy / t_enc,
        "encode_cpu_s": cpu_enc,
        "decode_cpu_s": cpu_dec,
        "memcpy_cpu_s": cpu_copy,
        "encode_vs_memcpy_cpu": cpu_copy / cpu_enc if cpu_enc > 0 else None,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="2**22 elements, 2 repeats, main configurations only")
    parser.add_argument("--json", type=Path, help="write the results (benchmarks/schema.py) here")
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    parser.add_argument("--numel", type=int, help="buffer size (default 2**24, or 2**22 with --quick)")
    parser.add_argument("--threads", default="0", help="comma list of torch thread counts; 0 = torch default")
    parser.add_argument("--repeats", type=int, help="timed runs per measurement (median reported)")
    parser.add_argument("--llama-1b", action="store_true", help="only the per-tensor payload size of a 1B Llama's tensors")
    parser.add_argument("--index-codings", default="packed",
                        help="with --llama-1b: packed (the plugin's default) and / or entropy (slow on CPU: ~45 min)")
    args = parser.parse_args(argv)
    if args.llama_1b:
        codings = [c.strip() for c in args.index_codings.split(",") if c.strip()]
        if not codings or any(c not in ("packed", "entropy") for c in codings):
            parser.error(f"--index-codings: packed and / or entropy, got {args.index_codings!r}")
        from megatron_sparseloco.outer.sparseloco import SparseLoCoConfig
        default = SparseLoCoConfig()   # the plugin's codec defaults: k, C, value bits
        machine = common.machine_info()
        result = llama_payloads(k=default.k, chunk=default.chunk, codings=codings)
        rows = [dict(index_coding=c, **result[c]) for c in codings]
        config = {"model": result["model"], "numel": result["numel"], "tensors": result["tensors"], "k": result["k"],
                  "chunk": result["chunk"], "value_bits": default.value_bits, "chunking": "tensor", "dense_1d": default.dense_1d,
                  "shapes": "Llama-3.2-1B as Megatron holds them (fused QKV and fc1), tied embeddings",
                  "values": "torch.randn, a fixed seed per tensor"}
        if args.json:
            schema.write(str(args.json), schema.document("codec_llama1b", schema.command_line("codec.py", argv),
                                                         config, rows, machine=machine))
            print(f"wrote {args.json}")
        return 0
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda: torch.cuda.is_available() is False on this machine")
    device = torch.device(args.device)
    machine = common.machine_info()
    numel = args.numel or (2**22 if args.quick else 2**24)
    repeats = args.repeats or (2 if args.quick else 5)
    default_threads = torch.get_num_threads()
    gen = torch.Generator().manual_seed(0)
    x_flat = torch.randn(numel, generator=gen).to(device)
    rows = []
    for threads in [int(t) for t in args.threads.split(",")]:
        torch.set_num_threads(threads or default_threads)
        for cfg in configurations(args.quick):
            x = x_flat
            if cfg.chunk_mode == "tile":
                side = int(math.isqrt(numel))
                x = x_flat[: side * side].view(side, side)
            row = bench_row(x, cfg, device, repeats, torch.get_num_threads())
            rows.append(row)
            print(
                f"threads={row['threads']} k={row['k']:4d} {row['index_coding']:8s} {row['chunk_mode']:5s} "
                f"bytes={row['payload_bytes']:9d} bits/param={row['bits_per_param']:.4f} "
                f"ratio={row['ratio_vs_fp32']:7.2f}x bits/index={row['bits_per_index']:.3f} "
                f"enc={row['encode_elems_per_s'] / 1e6:7.1f}M/s dec={row['decode_elems_per_s'] / 1e6:7.1f}M/s "
                f"memcpy={row['memcpy_elems_per_s'] / 1e6:7.1f}M/s enc/memcpy={row['encode_vs_memcpy']:.3f} "
                f"(cpu-time enc/memcpy={row['encode_vs_memcpy_cpu'] or float('nan'):.3f})",
                flush=True,
            )
    torch.set_num_threads(default_threads)
    meta = {
        "command": " ".join(["python", "benchmarks/codec.py", *(argv if argv is not None else sys.argv[1:])]),
        "torch": torch.__version__,
        "python": platform.python_version(),
        "cpu": cpu_model(),
        "torch_default_threads": default_threads,
        "load_average_at_start": list(os.getloadavg()),
        "cuda_device": torch.cuda.get_device_name(device) if device.type == "cuda" else None,
        "numel": numel,
        "repeats": repeats,
        "input": "torch.randn (seed 0), fp32",
    }
    if args.json:
        command = meta.pop("command")
        schema.write(str(args.json), schema.document("codec", command, meta, rows, machine=machine))
        print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
