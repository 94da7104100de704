"""Quality benchmark: held-out loss and bytes sent per worker, every method on the same model and data.

    python benchmarks/quality.py [--quick] [--steps N] [--workers W] [--json docs/results/quality.json]
                                 [--plots docs/results]

Model: a megatron-core GPTModel (local layer spec, CPU, gloo), byte vocabulary 257, trained on the
Python standard-library sources (megatron_sparseloco.data, split train / held-out by file).
Every method runs W workers × 1 rank with the same seeds, the same per-worker token streams, the
same inner AdamW (lr 1e-3, betas 0.9/0.95, wd 0.1, constant lr, no clipping) and the same number
of inner steps (so the same tokens):

  ddp             plain Megatron DDP + distributed optimizer, all W ranks one data-parallel group
  diloco          OuterLoopOptimizer + diloco, outer Nesterov SGD lr 0.7, momentum 0.9
  sparseloco      k ∈ {32, 64, 128} of C = 4096, 2-bit values, EF β 0.95, outer lr 1 (+ one k=64
                  row with entropy-coded indices)
  gasloc          ring gossip, η 1.0, γ 0.9 (the plugin's defaults)
  torchft_diloco  PyPI torchft's DiLoCo (Manager + LighthouseServer, ProcessGroupGloo), inner
                  torch AdamW with the same settings, outer SGD lr 0.7 momentum 0.9 Nesterov

Held-out loss: mean token cross-entropy (nats) of the bare GPTModel on a fixed set of held-out
windows. diloco / sparseloco / torchft: the synced model (after the last outer step every worker
holds θ_outer; the value is the same on every worker). gasloc: workers legitimately differ, the
reported value is the mean over workers of each worker's held-out loss. ddp: the (identical)
model of every rank. The number of steps is a multiple of every H, so every run ends on a sync.

Bytes sent per worker: outer methods, the strategies' own counters (real bytes handed to
collectives, headers and the 4-byte non-finite flag included); ddp, numel × 4 per step (fp32
gradients into the reduction; a ring all-reduce moves ≈ 2(W−1)/W of that on the wire);
torchft, numel × 4 per sync (``should_quantize=False``: fp32 pseudo-gradients all-reduced).
"""
from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from dataclasses import asdict

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import common  # noqa: E402
from common import ModelCfg, RunCfg  # noqa: E402


def build_runs(args):
    Hs = [15] if args.quick else [15, 30]
    ks = [32, 64, 128]
    steps = args.steps or (60 if args.quick else 900)
    if any(steps % H for H in Hs):
        raise SystemExit(f"--steps {steps} must be a multiple of every H in {Hs}")
    base = dict(steps=steps, mbs=args.mbs, lr=args.lr, eval_windows=args.eval_windows)
    runs = [RunCfg("ddp", H=Hs[0], **base)]
    for H in Hs:
        runs.append(RunCfg("diloco", H=H, **base))
        for k in ks:
            runs.append(RunCfg("sparseloco", H=H, k=k, **base))
        if H == Hs[0]:
            runs.append(RunCfg("sparseloco", H=H, k=64, index_coding="entropy", **base))
        runs.append(RunCfg("gasloc", H=H, **base))
    ft_runs = [RunCfg("torchft_diloco", H=H, **base) for H in Hs]
    return runs, ft_runs


def row_of(results, W):
    """One JSON row from the per-rank results of one run."""
    run = results[0]["run"]
    curves = [r["curve"] for r in results]
    points = []
    for i, p0 in enumerate(curves[0]):
        losses = [c[i]["held_out_loss"] for c in curves]
        points.append({"step": p0["step"], "tokens": p0["tokens"], "bytes_per_worker": p0["bytes_per_worker"],
                       "held_out_loss": sum(losses) / len(losses), "wall_s": max(c[i]["wall_s"] for c in curves)})
    final = points[-1]
    per_worker_final = [c[-1]["held_out_loss"] for c in curves]
    return {
        "method": run["method"],
        "k": run["k"],
        "index_coding": run["index_coding"] if run["method"] == "sparseloco" else None,
        "H": run["H"] if run["method"] != "ddp" else None,
        "workers": W,
        "held_out_loss": final["held_out_loss"],
        "held_out_loss_per_worker": per_worker_final,
        "bytes_sent_per_worker": int(max(r["bytes_sent"] for r in results)),
        "tokens": final["tokens"],
        "steps": final["step"],
        "numel": results[0]["numel"],
        "wall_s": max(r["wall_s"] for r in results),
        "final_train_loss": sum(sum(r["train_losses"][-10:]) / len(r["train_losses"][-10:]) for r in results) / W,
        "curve": points,
    }


def label(row):
    if row["method"] == "ddp":
        return "ddp"
    if row["method"] == "sparseloco":
        extra = "" if row["index_coding"] == "packed" else f" {row['index_coding']}"
        return f"sparseloco k={row['k']}{extra} H={row['H']}"
    return f"{row['method']} H={row['H']}"


def plot(rows, out_dir):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    os.makedirs(out_dir, exist_ok=True)
    paths = []
    cmap = plt.get_cmap("tab20")
    colors = {label(row): cmap(i % 20) for i, row in enumerate(rows)}
    for xkey, fname, xlabel, logx in (("tokens", "quality_loss_vs_tokens.png", "training tokens (all workers)", False),
                                      ("bytes_per_worker", "quality_loss_vs_bytes.png",
                                       "bytes sent per worker (cumulative)", True)):
        fig, ax = plt.subplots(figsize=(8, 5))
        for row in rows:
            pts = [p for p in row["curve"] if not (logx and p[xkey] <= 0)]
            style = "--" if (row["H"] or 0) >= 30 else "-"
            ax.plot([p[xkey] for p in pts], [p["held_out_loss"] for p in pts], style, marker=".", markersize=3,
                    color=colors[label(row)], label=label(row))
        if logx:
            ax.set_xscale("log")
        ax.set_xlabel(xlabel)
        ax.set_ylabel("held-out loss (nats/byte)")
        ax.set_title(f"tiny megatron-core GPT on stdlib bytes, W={rows[0]['workers']}")
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=7)
        fig.tight_layout()
        path = os.path.join(out_dir, fname)
        fig.savefig(path, dpi=110)
        plt.close(fig)
        paths.append(path)
    return paths


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="H=15 only, 60 steps, a smaller model")
    ap.add_argument("--steps", type=int, default=None, help="inner steps per worker (multiple of every H)")
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--mbs", type=int, default=None)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--eval-windows", type=int, default=None)
    ap.add_argument("--no-torchft", action="store_true", help="leave the torchft row out")
    ap.add_argument("--json", default=None)
    ap.add_argument("--plots", default=None, help="directory for the PNG plots")
    ap.add_argument("--timeout", type=float, default=None, help="per-launch timeout in seconds")
    ap.add_argument("--replot", default=None, metavar="JSON", help="only redraw the plots of a results JSON")
    args = ap.parse_args(argv)
    if args.replot:
        with open(args.replot) as f:
            rows = json.load(f)["results"]
        for p in plot(rows, args.plots or os.path.dirname(os.path.abspath(args.replot))):
            print(f"[quality] wrote {p}")
        return 0
    args.mbs = args.mbs or 4
    args.eval_windows = args.eval_windows or (16 if args.quick else 64)
    model = ModelCfg(layers=2, hidden=64 if args.quick else 128, heads=4, seq=64 if args.quick else 128)
    W = args.workers

    from megatron_sparseloco.testing.multirank import run_ranks

    t_start = time.perf_counter()
    paths = common.ensure_data()
    runs, ft_runs = build_runs(args)
    env = {"OMP_NUM_THREADS": "1"}
    timeout = args.timeout or (300 if args.quick else 3000)
    print(f"[quality] {len(runs)} megatron runs + {0 if args.no_torchft else len(ft_runs)} torchft runs, "
          f"W={W}, model {asdict(model)}", flush=True)
    res = run_ranks(common.rank_run_all, W, args=(model, runs, paths), timeout=timeout, env=env)
    rows = [row_of([res[r][i] for r in range(W)], W) for i in range(len(runs))]
    notes = []
    if not args.no_torchft:
        lighthouses = []
        try:
            lighthouses = [common.start_lighthouse(W) for _ in ft_runs]
            ft = run_ranks(common.rank_torchft, W, args=(model, ft_runs, paths, [l.address() for l in lighthouses]),
                           timeout=timeout, env=env)
            rows += [row_of([ft[r][i] for r in range(W)], W) for i in range(len(ft_runs))]
        except Exception as exc:  # report, don't fake: the row is left out with the reason
            msg = f"torchft_diloco failed: {type(exc).__name__}: {str(exc)[:3000]}"
            print(msg, file=sys.stderr)
            notes.append(msg)
        finally:
            for l in lighthouses:
                l.shutdown()
    total = time.perf_counter() - t_start
    for row in rows:
        print(f"{label(row):34s} held-out {row['held_out_loss']:.4f}  bytes/worker "
              f"{common.fmt_bytes(row['bytes_sent_per_worker']):>10s}  tokens {row['tokens']}  wall {row['wall_s']:.1f}s")
    out = {"benchmark": "quality", "quick": args.quick, "workers": W, "model": asdict(model),
           "inner": {"optimizer": "AdamW", "lr": args.lr, "betas": [0.9, 0.95], "weight_decay": 0.1,
                     "schedule": "constant", "clip_grad": None, "micro_batch": args.mbs},
           "machine": common.machine_info(), "total_wall_s": total, "notes": notes, "results": rows}
    if args.json:
        os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)
        print(f"[quality] wrote {args.json}")
    if args.plots:
        for p in plot(rows, args.plots):
            print(f"[quality] wrote {p}")
    print(f"[quality] total {total:.1f}s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
