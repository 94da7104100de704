"""``make demo``: real Megatron pretraining on CPU with SparseLoCo, 4 ranks = 2 workers × 2.

    python -m megatron_sparseloco.demo [--algorithm sparseloco] [--train-iters N] [--verbose]

1. Builds the benchmark data if missing: a few MB of the Python standard library, byte-level
   tokens, train / held-out split by file (``megatron_sparseloco.data.build``, into ``data/``).
2. Launches ``python -m torch.distributed.run --standalone --nproc-per-node 4 -m
   megatron_sparseloco.run examples/pretrain_gpt.py <Megatron args> --sparseloco-*`` (gloo on
   CPU): a tiny GPT, Megatron's distributed optimizer, 2 SparseLoCo workers of 2 ranks each.
   Megatron's own ``iteration N/M`` and ``validation loss`` lines are streamed to the terminal;
   the full log goes to ``runs/demo/train.log``.
3. Writes ``runs/demo/sparseloco_demo_summary.json``: the final held-out loss Megatron reports,
   the bytes each worker sent in its outer steps (counted by ``OuterLoopOptimizer.log`` on every
   rank and summed over the worker's ranks), what dense fp32 DiLoCo would have sent (numel × 4
   bytes per outer step), the compression ratio, outer steps, iterations, wall time, command.

How the counters leave the training processes: when ``SPARSELOCO_SUMMARY_PATH`` is set,
``examples/pretrain_gpt.py`` calls :func:`write_outer_summary` after ``pretrain``; it reads the
``OuterLoopOptimizer`` the plugin built (``megatron_sparseloco.megatron.plugin.ACTIVE``),
all-gathers every rank's counters, and rank 0 writes them as JSON.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import re
import shlex
import subprocess
import sys
import threading
import time
from typing import Dict, List, Optional

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(REPO_ROOT, "examples", "pretrain_gpt.py")
SUMMARY_ENV = "SPARSELOCO_SUMMARY_PATH"
DEMO_RANKS, DEMO_WORKERS, DEMO_MICRO_BATCH, DEMO_SEQ = 4, 2, 4, 128

# ------------------------------------------------------------------------------------------
# In-process part (runs inside each training rank; see module docstring)
# ------------------------------------------------------------------------------------------
def _rank_counters(optimizer) -> Optional[dict]:
    import torch.distributed as dist

    from megatron_sparseloco.megatron.consistency import fingerprint

    log = getattr(optimizer, "log", None)
    if optimizer is None or log is None or not hasattr(log, "bytes_sent"):
        return None
    group = getattr(optimizer, "group", None)
    return {
        "rank": dist.get_rank(),
        "worker": dist.get_rank(group) if group is not None else 0,
        "num_workers": int(getattr(optimizer, "num_workers", 1)),
        "inner_steps": int(optimizer.config.inner_steps),
        "inner_calls": int(optimizer.inner_calls),
        "outer_steps": int(optimizer.outer_steps),
        "bytes_sent": int(log.bytes_sent),
        "bytes_received": int(log.bytes_received),
        "numel": int(log.numel),
        "last": dict(log.last),
        # exact fingerprints (megatron.consistency) of θ_outer and of this rank's fp32 main params
        "theta_outer_fingerprint": fingerprint([s.anchor for s in optimizer.strategies]),
        "main_params_fingerprint": fingerprint([t for sh in optimizer.shards for t in sh.tensors]),
    }


def summarize_counters(per_rank: List[dict]) -> dict:
    """Per-worker sums of per-rank counters and the dense-fp32 comparison (pure; unit-testable)."""
    workers: Dict[int, dict] = {}
    for c in per_rank:
        w = workers.setdefault(c["worker"], {"ranks": [], "bytes_sent": 0, "bytes_received": 0, "numel": 0,
                                             "bytes_sent_last_step": 0, "outer_steps": set()})
        w["ranks"].append(c["rank"])
        w["bytes_sent"] += c["bytes_sent"]
        w["bytes_received"] += c["bytes_received"]
        w["numel"] += c["numel"]
        w["bytes_sent_last_step"] += int(c["last"].get("bytes_sent", 0))
        w["outer_steps"].add(c["outer_steps"])
    steps = {s for w in workers.values() for s in w["outer_steps"]}
    if len(steps) != 1:
        raise RuntimeError(f"ranks disagree on the number of outer steps: {sorted(steps)}")
    outer_steps = steps.pop()
    for w in workers.values():
        w["outer_steps"] = outer_steps
        w["ranks"].sort()
    sent = [w["bytes_sent"] for w in workers.values()]
    numel = max(w["numel"] for w in workers.values())
    bytes_sent_per_worker = sum(sent) / len(sent)
    dense = numel * 4 * outer_steps
    return {
        "outer_steps": outer_steps,
        "num_workers": len(workers),
        "inner_steps": per_rank[0]["inner_steps"],
        "numel_per_worker": numel,
        "bytes_sent_per_worker": bytes_sent_per_worker,
        "bytes_sent_per_step_per_worker": sum(w["bytes_sent_last_step"] for w in workers.values()) / len(workers),
        "bytes_received_per_worker": sum(w["bytes_received"] for w in workers.values()) / len(workers),
        "dense_fp32_bytes_equivalent": dense,
        "compression_ratio_vs_fp32": (dense / bytes_sent_per_worker) if bytes_sent_per_worker else None,
        "bits_per_param_per_step": ((8.0 * bytes_sent_per_worker / (numel * outer_steps))
                                    if numel and outer_steps else None),
        "workers": {str(k): v for k, v in sorted(workers.items())},
        "per_rank": sorted(per_rank, key=lambda c: c["rank"]),
    }


def write_outer_summary(path: str) -> Optional[dict]:
    """Collective over all ranks: gather the outer-loop counters; rank 0 writes ``path``."""
    import torch.distributed as dist

    from megatron_sparseloco.megatron import plugin

    mine = _rank_counters(plugin.ACTIVE) if plugin.ACTIVE is not None else None
    gathered: List[Optional[dict]] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, mine)
    if dist.get_rank() != 0:
        return None
    present = [c for c in gathered if c is not None]
    summary = (summarize_counters(present) if present
               else {"outer_steps": 0, "note": "no OuterLoopOptimizer (plugin off?)"})
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    tmp = path + ".partial"
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump(summary, f, indent=1)
    os.replace(tmp, path)
    return summary


# ------------------------------------------------------------------------------------------
# Launcher part
# ------------------------------------------------------------------------------------------
CPU_FLAGS = ["--distributed-backend", "gloo", "--no-persist-layer-norm", "--no-gradient-accumulation-fusion",
             "--no-masked-softmax-fusion", "--no-bias-dropout-fusion", "--no-rope-fusion",
             "--use-cpu-initialization"]

_ITER_RE = re.compile(r"iteration\s+(\d+)/\s*(\d+)")
_LM_LOSS_RE = re.compile(r"lm loss:\s*([-+0-9.eE]+|nan|inf)")
_VAL_RE = re.compile(r"validation loss at (.*?)\|\s*lm loss value:\s*([-+0-9.eE]+|nan|inf)", re.IGNORECASE)


def parse_megatron_log(lines) -> dict:
    """Iterations, training losses and validation losses from Megatron's log lines."""
    iters, train_losses, val = [], [], []
    for line in lines:
        m = _ITER_RE.search(line)
        if m and "validation" not in line:
            it = int(m.group(1))
            loss = _LM_LOSS_RE.search(line)
            iters.append(it)
            if loss:
                train_losses.append((it, float(loss.group(1))))
        v = _VAL_RE.search(line)
        if v:
            where = v.group(1).strip()
            at = re.search(r"iteration\s+(\d+)", where)
            val.append({"iteration": int(at.group(1)) if at else None, "where": where,
                        "split": "test" if "test set" in where else "valid", "lm_loss": float(v.group(2))})
    return {"iterations": iters, "train_loss": train_losses, "validation": val}


def model_args(seq_length: int = 128) -> List[str]:
    return ["--num-layers", "2", "--hidden-size", "128", "--num-attention-heads", "4",
            "--seq-length", str(seq_length), "--max-position-embeddings", str(seq_length),
            "--transformer-impl", "local", "--position-embedding-type", "learned_absolute",
            "--attention-dropout", "0.0", "--hidden-dropout", "0.0"]


def build_command(data_prefixes: Dict[str, str], *, nproc: int = 4, workers: int = 2, algorithm: str = "sparseloco",
                  inner_steps: int = 10, train_iters: int = 200, eval_interval: int = 50, eval_iters: int = 4,
                  log_interval: int = 10, micro_batch_size: int = 4, seq_length: int = 128, lr: float = 2e-3,
                  seed: int = 1234, extra: Optional[List[str]] = None) -> List[str]:
    """The torch.distributed.run command line the demo (and the example test) launches."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(nproc),
           "-m", "megatron_sparseloco.run", SCRIPT]
    cmd += model_args(seq_length)
    cmd += ["--micro-batch-size", str(micro_batch_size), "--global-batch-size", str(micro_batch_size * nproc),
            "--train-iters", str(train_iters), "--lr", str(lr), "--min-lr", str(lr / 10), "--lr-decay-style", "cosine",
            "--lr-warmup-iters", str(max(1, train_iters // 20)), "--weight-decay", "0.1", "--adam-beta1", "0.9",
            "--adam-beta2", "0.95", "--clip-grad", "1.0", "--seed", str(seed),
            "--train-data-path", data_prefixes["train"], "--valid-data-path", data_prefixes["valid"],
            "--tokenizer-type", "NullTokenizer", "--vocab-size", "257",
            "--eval-interval", str(eval_interval), "--eval-iters", str(eval_iters), "--log-interval", str(log_interval),
            "--use-distributed-optimizer"]
    cmd += CPU_FLAGS
    if algorithm != "none":
        cmd += ["--sparseloco-algorithm", algorithm, "--sparseloco-workers", str(workers),
                "--sparseloco-inner-steps", str(inner_steps)]
    return cmd + list(extra or [])


def _interesting(line: str) -> bool:
    return bool(_ITER_RE.search(line) or "validation loss" in line or "Traceback" in line or "Error" in line
                or "error:" in line or line.startswith("[data]") or line.lstrip().startswith("sparseloco |")
                or ("sparseloco" in line.lower() and ("warn" in line.lower() or "fix:" in line.lower())))


def run_training(cmd: List[str], log_path: str, summary_path: str, timeout: float, verbose: bool = False,
                 echo=print) -> dict:
    """Run ``cmd`` with the summary hook on, stream interesting lines, return the parsed log + rc."""
    env = dict(os.environ)
    env.update({"OMP_NUM_THREADS": "1", "CUDA_DEVICE_MAX_CONNECTIONS": "1", SUMMARY_ENV: summary_path,
                "PYTHONUNBUFFERED": "1"})
    env["PYTHONPATH"] = REPO_ROOT + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    if os.path.exists(summary_path):
        os.remove(summary_path)
    os.makedirs(os.path.dirname(os.path.abspath(log_path)), exist_ok=True)
    lines: List[str] = []
    t0 = time.time()
    with open(log_path, "w", encoding="utf-8") as log:
        log.write("$ " + shlex.join(cmd) + "\n")
        proc = subprocess.Popen(cmd, cwd=REPO_ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                text=True, bufsize=1, start_new_session=True)

        def pump():  # a thread, so a silent hang still hits the timeout below
            assert proc.stdout is not None  # stdout=PIPE
            for line in proc.stdout:
                log.write(line)
                lines.append(line.rstrip("\n"))
                if verbose or _interesting(line):
                    echo(line.rstrip("\n"))

        reader = threading.Thread(target=pump, daemon=True)
        reader.start()
        try:
            rc: int | str = proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, 9)          # the process group we started (start_new_session)
            proc.wait()
            rc = "timeout"
        reader.join(timeout=30)
    parsed = parse_megatron_log(lines)
    parsed.update({"returncode": rc, "wall_time_s": round(time.time() - t0, 2), "log_lines": lines})
    return parsed


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m megatron_sparseloco.demo", description=__doc__.split("\n\n")[0])
    p.add_argument("--algorithm", default="sparseloco", choices=("sparseloco", "diloco", "gasloc", "average", "none"),
                   help="outer algorithm (none: plain Megatron data parallelism, for comparison)")
    p.add_argument("--train-iters", type=int, default=800, help="Megatron iterations (inner steps)")
    p.add_argument("--inner-steps", type=int, default=10, help="H: inner steps between outer steps")
    p.add_argument("--outer-lr", type=float, default=None,
                   help="--sparseloco-outer-lr (default: the plugin's, which depends on W and k)")
    p.add_argument("--eval-interval", type=int, default=200, help="iterations between held-out evaluations")
    p.add_argument("--log-interval", type=int, default=20, help="iterations between log lines")
    p.add_argument("--eval-iters", type=int, default=8, help="held-out batches per evaluation")
    p.add_argument("--data", default=os.path.join(REPO_ROOT, "data", "stdlib-4MB"),
                   help="dataset folder (built from the Python standard library if missing)")
    p.add_argument("--max-bytes", type=int, default=4_000_000, help="bytes of source text when building the dataset")
    p.add_argument("--out", default=os.path.join(REPO_ROOT, "runs", "demo"),
                   help="output folder: training log, outer counters, summary JSON")
    p.add_argument("--timeout", type=float, default=1200.0, help="seconds before the training run is stopped")
    p.add_argument("--verbose", action="store_true", help="stream every log line, not only Megatron's progress")
    a = p.parse_args(argv)

    from megatron_sparseloco.data.build import PREFIXES, build_dataset

    data = build_dataset(a.data, max_bytes=a.max_bytes, log=lambda m: print(m, flush=True))
    prefixes = {s: os.path.join(a.data, PREFIXES[s]) for s in ("train", "valid")}
    cmd = build_command(prefixes, nproc=DEMO_RANKS, workers=DEMO_WORKERS, micro_batch_size=DEMO_MICRO_BATCH,
                        seq_length=DEMO_SEQ, algorithm=a.algorithm, inner_steps=a.inner_steps,
                        train_iters=a.train_iters,
                        eval_interval=a.eval_interval, eval_iters=a.eval_iters, log_interval=a.log_interval,
                        extra=["--sparseloco-outer-lr", str(a.outer_lr)] if a.outer_lr is not None else None)
    os.makedirs(a.out, exist_ok=True)
    counters_path = os.path.join(a.out, "outer_counters.json")
    log_path = os.path.join(a.out, "train.log")
    summary_path = os.path.join(a.out, "sparseloco_demo_summary.json")
    print(f"[demo] 4 CPU ranks, {a.algorithm}, 2 workers × 2 ranks, H={a.inner_steps}, {a.train_iters} iterations; "
          f"log: {os.path.relpath(log_path)}", flush=True)
    print("$ " + shlex.join(cmd), flush=True)
    res = run_training(cmd, log_path, counters_path, a.timeout, a.verbose, echo=lambda m: print(m, flush=True))
    if res["returncode"] != 0:
        print("\n".join(res["log_lines"][-40:]), file=sys.stderr)
        print(f"[demo] training failed (rc={res['returncode']}); full log: {log_path}", file=sys.stderr)
        return 1
    counters = {}
    if os.path.exists(counters_path):
        with open(counters_path, encoding="utf-8") as f:
            counters = json.load(f)
    val = [v for v in res["validation"] if v["split"] == "valid"]
    summary = {
        "algorithm": a.algorithm,
        "held_out_loss": val[-1]["lm_loss"] if val else None,
        "held_out_loss_history": val,
        "train_loss_last": res["train_loss"][-1][1] if res["train_loss"] else None,
        "bytes_sent_per_worker": counters.get("bytes_sent_per_worker"),
        "dense_fp32_bytes_equivalent": counters.get("dense_fp32_bytes_equivalent"),
        "compression_ratio_vs_fp32": counters.get("compression_ratio_vs_fp32"),
        "bits_per_param_per_step": counters.get("bits_per_param_per_step"),
        "outer_steps": counters.get("outer_steps", 0),
        "inner_steps": a.inner_steps,
        "workers": DEMO_WORKERS,
        "ranks": DEMO_RANKS,
        "iterations": res["iterations"][-1] if res["iterations"] else 0,
        "tokens_trained": ((res["iterations"][-1] if res["iterations"] else 0)
                           * DEMO_RANKS * DEMO_MICRO_BATCH * DEMO_SEQ),
        "train_split_tokens": data.tokens("train"),
        "held_out_split_tokens": data.tokens("valid"),
        "wall_time_s": res["wall_time_s"],
        "command": shlex.join(cmd),
        "log": os.path.relpath(log_path, REPO_ROOT),
        "outer_counters": counters,
    }
    with open(summary_path, "w", encoding="utf-8") as f:
        json.dump(summary, f, indent=1)

    from megatron_sparseloco.megatron.metrics import format_mb as fmt_bytes   # same unit as the log line

    ratio = summary["compression_ratio_vs_fp32"]
    print("\n=== SparseLoCo demo summary ===")
    print(f"  held-out loss (final, Megatron)  : {summary['held_out_loss']}")
    print(f"  iterations / outer steps         : {summary['iterations']} / {summary['outer_steps']} "
          f"(H={a.inner_steps})")
    print(f"  bytes sent per worker            : {fmt_bytes(summary['bytes_sent_per_worker'])}")
    print(f"  dense fp32 DiLoCo would send     : {fmt_bytes(summary['dense_fp32_bytes_equivalent'])}")
    print(f"  compression vs fp32              : {'n/a' if ratio is None else f'{ratio:.1f}x'}")
    print(f"  wall time                        : {summary['wall_time_s']:.0f} s")
    print(f"  summary written to               : {os.path.relpath(summary_path)}")
    ok = summary["held_out_loss"] is not None and math.isfinite(summary["held_out_loss"])
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
