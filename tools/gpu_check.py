"""The GPU check (one H200, under 8 minutes): kernels, timings, single-rank NCCL training.

    bash tools/gpu_check.sh            # installs carried wheels from .whl/ if present, then runs this

Writes ``$OUT/gpu_check.json`` (or ./gpu_check.json) and prints a summary:

1. ``tests/test_compress_triton.py`` and ``tests/test_compress_triton_segments.py``: on CUDA the
   compiled kernels against the torch codec (bytes, EF buffers, sums).
2. ``benchmarks/codec_gpu.py --size 2**30 --workers 16``: compress + EF and decode + scatter-add
   timings against the read-bandwidth limit.
3. ``megatron.training`` on one rank over NCCL with the plugin (W = 1), for sparseloco, diloco and
   average: the ``sparseloco |`` log lines and TensorBoard scalars are present, a checkpoint saved
   mid-round and resumed ends bitwise where the uninterrupted run ends, and
   ``torch.cuda.max_memory_allocated`` is recorded.
"""
from __future__ import annotations

import glob
import json
import os
import subprocess
import sys
import tempfile
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)
OUT = os.environ.get("OUT", REPO)


def run(cmd, timeout, env=None):
    t0 = time.perf_counter()
    p = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=timeout, env={**os.environ, **(env or {})})
    return {"cmd": " ".join(cmd), "rc": p.returncode, "wall_s": time.perf_counter() - t0,
            "tail": (p.stdout + p.stderr)[-4000:]}


def training(tmp, algo, data):
    from megatron_sparseloco.demo import CPU_FLAGS, build_command, run_training
    H, iters, save_at = 5, 12, 7
    gpu_flags = [f for f in CPU_FLAGS if f not in ("gloo", "--use-cpu-initialization")]
    gpu_flags[gpu_flags.index("--distributed-backend") + 1:gpu_flags.index("--distributed-backend") + 1] = ["nccl"]

    def cmd(name, extra):
        c = build_command(data, nproc=1, workers=1, algorithm=algo, inner_steps=H, train_iters=iters,
                          eval_interval=100, eval_iters=1, log_interval=1, micro_batch_size=4, seq_length=256,
                          extra=["--num-layers", "4", "--hidden-size", "512", "--num-attention-heads", "8", "--bf16",
                                 "--ckpt-format", "torch_dist", "--tensorboard-dir", os.path.join(tmp, algo, "tb")]
                          + extra)
        c = [x for x in c if x not in CPU_FLAGS or x in gpu_flags]
        i = c.index("megatron_sparseloco.run")
        c[i - 1:i + 1] = [os.path.join(REPO, "tools", "gpu_launch.py")]
        return c, os.path.join(tmp, algo, name)

    os.makedirs(os.path.join(tmp, algo), exist_ok=True)
    ck = os.path.join(tmp, algo, "ckpt")
    out = {}
    for name, extra in (("a", ["--save", ck, "--save-interval", str(save_at)]), ("b", ["--load", ck])):
        if name == "b":
            with open(os.path.join(ck, "latest_checkpointed_iteration.txt"), "w") as f:
                f.write(str(save_at))
        c, base = cmd(name, extra)
        res = run_training(c, base + ".log", base + ".json", timeout=240, echo=lambda *_: None)
        summary = json.load(open(base + ".json")) if os.path.exists(base + ".json") else {}
        out[name] = {"rc": res["returncode"], "log_lines": [l for l in res["log_lines"] if "sparseloco |" in l][-3:],
                     "per_rank": summary.get("per_rank"), "tail": res["log_lines"][-20:]}
    a, b = out["a"].get("per_rank") or [{}], out["b"].get("per_rank") or [{}]
    out["bitwise_resume"] = bool(a[0]) and a[0].get("theta_outer_fingerprint") == b[0].get("theta_outer_fingerprint") \
        and a[0].get("main_params_fingerprint") == b[0].get("main_params_fingerprint")
    out["tensorboard_files"] = len(glob.glob(os.path.join(tmp, algo, "tb", "*")))
    return out


def main() -> int:
    import torch
    report = {"torch": torch.__version__, "cuda": torch.cuda.is_available(),
              "device": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None}
    if not torch.cuda.is_available():
        print("gpu_check: no CUDA device", file=sys.stderr)
        return 2
    py = sys.executable
    report["kernel_tests"] = run([py, "-m", "pytest", "-q", "tests/test_compress_triton.py",
                                  "tests/test_compress_triton_segments.py"], 240)
    report["codec_gpu"] = run([py, "benchmarks/codec_gpu.py", "--size", "2**30", "--workers", "16",
                               "--json", os.path.join(OUT, "codec_gpu.json")], 240)
    from megatron_sparseloco.data.build import build_dataset
    with tempfile.TemporaryDirectory() as tmp:
        data = build_dataset(os.path.join(tmp, "data"), max_bytes=2_000_000, log=lambda *_: None)
        prefixes = {"train": data.prefix("train"), "valid": data.prefix("valid")}
        report["training"] = {a: training(tmp, a, prefixes) for a in ("sparseloco", "diloco", "average")}
    path = os.path.join(OUT, "gpu_check.json")
    with open(path, "w") as f:
        json.dump(report, f, indent=1)
    print(f"kernel tests rc={report['kernel_tests']['rc']}: {report['kernel_tests']['tail'][-300:]}")
    print(f"codec_gpu rc={report['codec_gpu']['rc']}:\n{report['codec_gpu']['tail'][-2500:]}")
    for a, r in report["training"].items():
        print(f"{a}: rc {r['a']['rc']}/{r['b']['rc']}, bitwise resume {r['bitwise_resume']}, "
              f"tensorboard files {r['tensorboard_files']}, last log {r['a']['log_lines'][-1:] }")
    print(f"wrote {path}")
    ok = report["kernel_tests"]["rc"] == 0 and report["codec_gpu"]["rc"] == 0 and all(
        r["a"]["rc"] == 0 and r["b"]["rc"] == 0 and r["bitwise_resume"] for r in report["training"].values())
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
