"""Quality benchmark: held-out loss and bytes sent per worker, every method on the same model and data.

    python benchmarks/quality.py --sweep --workers W --steps 900 --seeds 3 --methods diloco,sparseloco:64,sparseloco:128 \
        --json docs/results/quality_wW.json          # the protocol (docs/benchmarks.md), one W per file
    python benchmarks/quality.py --quick             # plumbing check

Writes the results schema (benchmarks/schema.py): rows = every run once; a sweep row has ``sweep``
true, a row of the seeds at the chosen settings has ``seed_run`` true (a seed-0 sweep run at the chosen
setting is both). docs/results.md and its plots are rendered from the file by benchmarks/render_results.py.

Model: a megatron-core GPTModel (local layer spec, CPU, gloo), byte vocabulary 257, trained on the
Python standard-library sources (megatron_sparseloco.data, split train / held-out by file).
Every method runs W workers × 1 rank with the same seeds, the same per-worker token streams, the
same inner AdamW (lr 1e-3, betas 0.9/0.95, wd 0.1; constant lr, no clipping unless Megatron's schedule flags
--lr-warmup-fraction / --lr-decay-style / --min-lr / --clip-grad are given) and the same number
of inner steps (so the same tokens):

  ddp             plain Megatron DDP + distributed optimizer, all W ranks one data-parallel group
  diloco          OuterLoopOptimizer + diloco, outer Nesterov SGD
  sparseloco      Top-k of each 4096-chunk (k from the spec), 2-bit values, EF β 0.95 (tags change these)
  gasloc          gossip (topology and rule from the spec)
  torchft_diloco  PyPI torchft's DiLoCo (Manager + LighthouseServer, ProcessGroupGloo), inner
                  torch AdamW with the same settings, outer SGD lr 0.7 momentum 0.9 Nesterov

DDP's one setting is its lr: the shared inner lr unless the sweep grid has a "ddp" key, whose points are
[inner lr, null] (``--sweep-grid '{"ddp": [[0.000707, null], [0.001, null], [0.00141, null]]}'``); the
chosen lr is then DDP's ``tuned_per_w`` entry, and its seeds run at it. The outer-loop methods keep the shared
inner lr: their tuning is the outer lr (and DiLoCo's momentum).

Every outer setting a run does not set (outer lr / momentum: --sweep or --tuned set them) is the plugin's
default, resolved for the run's W (common.strategy_fields): DiLoCo 0.7 / 0.9, SparseLoCo's lr rule
s(N)/√(W·k/C) (``default_outer_lr``, N the model's parameters), GASLoC η 0.7, γ 0.6.

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
import dataclasses
import json
import re
import os
import sys
import time
from dataclasses import asdict

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import common  # noqa: E402
import schema  # noqa: E402
from journal import RunJournal  # noqa: E402
from common import ModelCfg, RunCfg  # noqa: E402


METHODS_DEFAULT = "ddp,average,diloco,sparseloco:64,sparseloco:128,sparseloco:64:flat"
#: The outer-lr sweep: every compared method tuned on its own grid with the same spacing, on seed 0 at each W.
#: DiLoCo: lr × μ, lr in steps of about √2 around the plugin's 0.7 (1.0 added when 0.7 / 0.8 won at W = 4),
#: μ ∈ {0.6, 0.8, 0.9} (the plugin's 0.9).
#: SparseLoCo: lr in steps of √2, 0.53 … 3.0: the values of the plugin's default rule (``default_outer_lr``:
#: 1.5 / 1.06 / 0.75 at W = 2 / 4 / 8 for k = 64, 1.06 / 0.75 / 0.53 for k = 128), the earlier rule's one step
#: higher, and one step beyond them; k = 128 is tuned on its own. A winner on an edge of its grid is
#: flagged by the results page (``render_results.py``): widen the grid then (``--sweep-grid``).
SWEEP_SPARSELOCO_LRS = (0.53, 0.75, 1.06, 1.5, 2.12, 3.0)
SWEEP = {
    "diloco": [(lr, mu) for lr in (0.35, 0.5, 0.7, 1.0) for mu in (0.6, 0.8, 0.9)],
    "sparseloco": [(lr, None) for lr in SWEEP_SPARSELOCO_LRS],
    "sparseloco:128": [(lr, None) for lr in SWEEP_SPARSELOCO_LRS],
}


# the sparseloco tags with a value; parse_methods refuses any tag that is none of these nor flat / entropy / all
EF_TAG = re.compile(r"ef(\d*\.?\d+)")                  # 'ef0.9': error-feedback decay β
VALUE_BITS_TAG = re.compile(r"vb(\d+)")                 # 'vb4': --sparseloco-value-bits 4
SITES_TAG = re.compile(r"h(\d+)")                       # 'h2': hierarchical in 2 site groups
OWNER_TAG = re.compile(r"rs(\d*)(?:b(\d+))?(w?)(a?)")    # reduce-scatter and its owner codec, see owner_codec
SPARSELOCO_TAG = re.compile("|".join(["flat", "entropy", "all"] + [t.pattern for t in (EF_TAG, VALUE_BITS_TAG,
                                                                                   SITES_TAG, OWNER_TAG)]))


def parse_methods(text: str):
    """'ddp,diloco,sparseloco:64,sparseloco:64:flat,sparseloco:64:entropy,sparseloco:64:rs' → [(method, k, extra)]
    (``efX``: error-feedback decay β = X; ``vbN``: N bits per kept value; ``all``: --sparseloco-reduce all; ``rs``: --sparseloco-aggregation reduce-scatter; ``rsN`` / ``rsNbB``: with the owners keeping N values
    per chunk, quantised to B bits; ``hG``: --sparseloco-aggregation hierarchical in G site groups)."""
    out = []
    for item in text.split(","):
        parts = item.strip().split(":")
        if parts[0] == "gasloc":  # gasloc[:topology][:lap][:c], see common.gasloc_fields
            common.gasloc_fields(item.strip())
            out.append(("gasloc", None, item.strip()))
            continue
        method, k = parts[0], (int(parts[1]) if len(parts) > 1 else None)
        extra = parts[2] if len(parts) > 2 else None
        if method not in ("ddp", "average", "diloco", "sparseloco", "gasloc", "torchft_diloco"):
            raise SystemExit(f"--methods: unknown method {method!r}")
        if method == "sparseloco" and k is None:
            raise SystemExit("--methods: sparseloco needs its k, e.g. sparseloco:64")
        if method == "sparseloco" and extra is not None and not SPARSELOCO_TAG.fullmatch(extra):
            raise SystemExit(f"--methods: unknown sparseloco tag {extra!r} in {item.strip()!r} "
                             "(one of flat, entropy, all, efX, vbN, hG, rs[N][bB][w][a])")
        if method != "sparseloco" and extra is not None:
            raise SystemExit(f"--methods: {method} takes no tag, got {item.strip()!r}")
        out.append((method, k, extra))
    return out


def owner_codec(extra):
    """'rs' → {}, 'rs256' → {owner_k: 256}, 'rs256b8' → {owner_k: 256, owner_value_bits: 8}; a trailing
    'w' ('rsw', 'rs128w') → owner_residual 'workers'; then 'a' → reduce 'all' (mean over all W)."""
    m = OWNER_TAG.fullmatch(extra or "")
    if m is None:
        return {}
    return {**({"owner_k": int(m.group(1))} if m.group(1) else {}),
            **({"owner_value_bits": int(m.group(2))} if m.group(2) else {}),
            **({"owner_residual": "workers"} if m.group(3) else {}),
            **({"reduce": "all"} if m.group(4) else {})}


def tuned_setting(tuned, method, k):
    """(outer lr, momentum) for ``method`` at Top-k ``k``: the ``"sparseloco:K"`` entry when the sweep tuned
    that k on its own, else the method's entry, else (None, None) (the plugin's defaults). For ddp the pair is
    (inner lr, None): None keeps the shared inner lr."""
    return tuned.get(f"{method}:{k}", tuned.get(method, (None, None)))


def make_run(method, k, extra, H, seed, base, tuned):
    """One RunCfg; ``tuned`` maps method (or ``sparseloco:K``) → (outer lr, momentum) chosen by the sweep."""
    lr, mu = tuned_setting(tuned, method, k)
    fields = dict(base, H=H, seed=1234 + seed, data_seed=seed)
    if method == "sparseloco":
        ef, bits = EF_TAG.fullmatch(extra or ""), VALUE_BITS_TAG.fullmatch(extra or "")
        if ef:
            fields["ef_beta"] = float(ef.group(1))
        if bits:
            fields["value_bits"] = int(bits.group(1))
        if extra == "all":   # --sparseloco-reduce all: S / W, the paper's mean (default: over contributors)
            fields["reduce"] = "all"
        sites = SITES_TAG.fullmatch(extra or "")
        if sites:
            fields["aggregation_groups"] = int(sites.group(1))
        return RunCfg("sparseloco", k=k, outer_lr=lr, outer_momentum=mu, index_coding="entropy" if extra == "entropy" else "packed",
                      chunking="flat" if extra == "flat" else "tensor",
                      aggregation="reduce-scatter" if (extra or "").startswith("rs") else
                      "hierarchical" if sites else "allgather",
                      **owner_codec(extra), **fields)
    if method == "diloco":
        return RunCfg("diloco", outer_lr=lr, outer_momentum=mu, **fields)
    if method == "gasloc":  # η, γ: the spec's lrX / muX, else the tuned ones, else the plugin's defaults
        spec = common.gasloc_fields(extra) if extra else {}
        spec.setdefault("outer_lr", lr)
        spec.setdefault("outer_momentum", mu)
        return RunCfg("gasloc", **fields, **spec)
    if method == "ddp" and lr is not None:   # DDP's tuned setting is its (inner) lr
        fields["lr"] = lr
    return RunCfg(method, **fields)


def schedule_fields(args):
    """The inner schedule's RunCfg fields from Megatron's flag names (--lr-warmup-fraction, --lr-decay-style,
    --min-lr, --clip-grad); all unset: the constant lr without clipping every earlier result ran."""
    return {"lr_warmup_fraction": getattr(args, "lr_warmup_fraction", 0.0),
            "lr_decay_style": getattr(args, "lr_decay_style", "constant"), "min_lr": getattr(args, "min_lr", 0.0),
            "clip_grad": getattr(args, "clip_grad", 0.0)}


def inner_config(args, model):
    """The results file's ``config.inner``: the inner optimizer and its schedule, as every run used them."""
    schedule = ("constant" if args.lr_decay_style == "constant" and not args.lr_warmup_fraction else
                f"linear warmup over {args.lr_warmup_fraction:g} of the steps from 0, then {args.lr_decay_style}"
                + (f" decay to {args.min_lr:g} at the last step" if args.lr_decay_style != "constant" else ""))
    return {"optimizer": "AdamW", "lr": args.lr, "betas": [0.9, 0.95], "eps": 1e-8, "weight_decay": 0.1,
            "schedule": schedule, "lr_warmup_fraction": args.lr_warmup_fraction,
            "lr_decay_style": args.lr_decay_style, "min_lr": args.min_lr,
            "clip_grad": args.clip_grad or None, "micro_batch": args.mbs, "seq": model.seq}


def build_runs(args, tuned, seeds, steps):
    base = dict(steps=steps, mbs=args.mbs, lr=args.lr, eval_windows=args.eval_windows, **schedule_fields(args))
    merges = common.overlap_merges(args.overlap_merges)
    runs, ft_runs = [], []
    for seed in seeds:
        for method, k, extra in parse_methods(args.methods):
            run = make_run(method, k, extra, args.H, seed, base, tuned)
            (ft_runs if method == "torchft_diloco" else runs).append(run)
            if method in ("diloco", "sparseloco"):   # the loss cost of delaying the outer step
                for tau in overlap_steps(args):
                    for merge in merges:
                        runs.append(dataclasses.replace(run, overlap_steps=tau, overlap_merge=merge))
                for P, tau in fragment_settings(args):  # ... and of syncing it in fragments
                    runs.append(dataclasses.replace(run, fragments=P, overlap_steps=tau))
    return runs, ft_runs


def overlap_steps(args):
    """``--overlap-steps 1,7`` → [1, 7] (each in [1, H))."""
    taus = [int(t) for t in (args.overlap_steps or "").split(",") if t.strip()]
    if any(not 1 <= t < args.H for t in taus):
        raise SystemExit(f"--overlap-steps: every τ must be in [1, H={args.H}), got {taus}")
    return taus


def fragment_settings(args):
    """``--fragments 3`` → [(3, 0), (3, τ) for each --overlap-steps τ < H/P]; each 2 <= P <= H."""
    ps = [int(p) for p in (getattr(args, "fragments", "") or "").split(",") if p.strip()]
    if any(not 2 <= p <= args.H for p in ps):
        raise SystemExit(f"--fragments: every P must be in [2, H={args.H}] (and at most the model's layers), got {ps}")
    return [(p, t) for p in ps for t in [0, *overlap_steps(args)] if t * p < args.H]


def sweep_grid(text):
    """``--sweep-grid``: a JSON object (inline or a file path) {method: [[lr, mu], ...]} replacing SWEEP's
    points for the methods it names; empty → SWEEP. Key ``"ddp"``: DDP's inner lr, ``[[lr, null], ...]``
    (the default sweep has none: DDP then runs at the shared inner lr)."""
    if not text:
        return SWEEP
    if os.path.exists(text):
        with open(text) as f:
            text = f.read()
    try:
        grid = json.loads(text)
    except json.JSONDecodeError as e:
        raise SystemExit(f"--sweep-grid: not JSON ({e}); e.g. '{{\"sparseloco\": [[2.0, null]]}}'")
    if not isinstance(grid, dict) or not grid or not all(_grid_key(m) for m in grid):
        raise SystemExit(f"--sweep-grid: an object whose keys are among {sorted(SWEEP) + ['ddp']} or 'sparseloco:K' "
                         f"(K a positive integer: tune that Top-k on its own), got {text!r}")
    bad = [pt for pt in grid.get("ddp", []) if not (isinstance(pt, list) and len(pt) == 2 and pt[1] is None
                                                    and isinstance(pt[0], (int, float)) and pt[0] > 0)]
    if bad:
        raise SystemExit(f"--sweep-grid: a \"ddp\" point is [inner lr > 0, null] (DDP has no momentum to tune), "
                         f"got {bad}")
    return {m: [tuple(pt) for pt in pts] for m, pts in grid.items()}


def _grid_key(key):
    return key in SWEEP or key == "ddp" or re.fullmatch(r"sparseloco:[1-9]\d*", str(key)) is not None


def sweep_runs(args, steps):
    base = dict(steps=steps, mbs=args.mbs, lr=args.lr, eval_windows=args.eval_windows, H=args.H, seed=1234, data_seed=0,
                **schedule_fields(args))
    grid = sweep_grid(args.sweep_grid)
    runs = [RunCfg("diloco", outer_lr=lr, outer_momentum=mu, **base) for lr, mu in grid.get("diloco", [])]
    runs += [RunCfg("sparseloco", k=64, outer_lr=lr, **base) for lr, _ in grid.get("sparseloco", [])]
    runs += [RunCfg("ddp", **dict(base, lr=lr)) for lr, _ in grid.get("ddp", [])]
    for key in sorted(k for k in grid if k.startswith("sparseloco:")):   # a Top-k tuned on its own
        runs += [RunCfg("sparseloco", k=int(key.split(":")[1]), outer_lr=lr, **base) for lr, _ in grid[key]]
    return runs


def strip_option(argv, option):
    """``argv`` without ``option`` and its value (either ``--opt v`` or ``--opt=v``)."""
    out, skip = [], False
    for a in argv:
        if skip:
            skip = False
        elif a == option:
            skip = True
        elif not a.startswith(option + "="):
            out.append(a)
    return out


def _run_key(cfg):
    """Identity of a run's configuration (a sweep run and a seed-0 run with equal keys give the same row)."""
    return json.dumps(asdict(cfg), sort_keys=True)


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
        "label": common.RunCfg(**run).label(),
        "seed": run["data_seed"],
        "outer_lr": run["outer_lr"],
        "outer_momentum": run["outer_momentum"],
        # the outer strategy's settings as run: the run's own, the plugin's defaults for the rest (resolved at W)
        "outer": common.outer_settings(common.RunCfg(**run), W, results[0]["numel"]),
        "chunking": run["chunking"] if run["method"] == "sparseloco" else None,
        "k": run["k"],
        "index_coding": run["index_coding"] if run["method"] == "sparseloco" else None,
        "H": run["H"] if run["method"] != "ddp" else None,
        "workers": W,
        "held_out_loss": final["held_out_loss"],
        "held_out_loss_per_worker": per_worker_final,
        # gasloc: the loss of the workers' mean model (what a final exact average would give)
        "held_out_loss_mean_model": results[0].get("mean_model_loss"),
        "bytes_sent_per_worker": int(max(r["bytes_sent"] for r in results)),
        # the most any worker received over the run (None where the run has no outer step)
        "bytes_received_per_worker": (None if results[0].get("bytes_received") is None
                                      else int(max(r["bytes_received"] for r in results))),
        "tokens": final["tokens"],
        "steps": final["step"],
        "numel": results[0]["numel"],
        "wall_s": max(r["wall_s"] for r in results),
        "final_train_loss": sum(sum(r["train_losses"][-10:]) / len(r["train_losses"][-10:]) for r in results) / W,
        "curve": points,
        "run": run,   # the whole run configuration (what --reuse matches on)
    }


def label(row):
    return row.get("label") or row["method"]


def summarise(rows):
    """Mean and spread (max − min over seeds) per (label, workers, steps)."""
    groups = {}
    for r in rows:
        groups.setdefault((r["label"], r["workers"], r["steps"]), []).append(r)
    out = []
    for (lab, W, steps), rs in groups.items():
        losses = [r["held_out_loss"] for r in rs]
        out.append({"label": lab, "method": rs[0]["method"], "k": rs[0]["k"], "workers": W, "steps": steps,
                    "seeds": len(rs), "mean": sum(losses) / len(losses), "spread": max(losses) - min(losses),
                    "losses": losses, "bytes_sent_per_worker": max(r["bytes_sent_per_worker"] for r in rs),
                    "bytes_received_per_worker": max((r.get("bytes_received_per_worker") or 0) for r in rs) or None,
                    "outer_lr": rs[0]["outer_lr"], "outer_momentum": rs[0]["outer_momentum"],
                    "chunking": rs[0].get("chunking")})
    return out


def reuse_index(paths, model, machine):
    """(W, run key) → row from earlier quality results files of the same model on the same CPU model: runs are
    deterministic there (docs/benchmarks.md), so a run made before is taken instead of made again."""
    index, used = {}, []
    for path in [p for p in (paths or "").split(",") if p.strip()]:
        doc = schema.load(path)
        if doc["benchmark"] != "quality" or doc["config"]["model"] != asdict(model):
            raise SystemExit(f"--reuse {path}: not a quality results file of this model ({asdict(model)})")
        if doc["machine"]["cpu"] != machine["cpu"]:
            raise SystemExit(f"--reuse {path}: made on {doc['machine']['cpu']!r}, this is {machine['cpu']!r}: "
                             "SparseLoCo runs differ between CPU models; run them here")
        n = 0
        for row in doc["rows"]:
            run = row.get("run") or _run_of_plain_row(row, doc["config"])
            if run is not None:
                index[(row["workers"], _run_key(RunCfg(**run)))] = dict(
                    row, reused_from=row.get("reused_from") or f"{path} ({doc['commit']}, {doc.get('date')})")
                n += 1
        used.append({"file": path, "commit": doc["commit"], "date": doc.get("date"), "rows": n})
    return index, used


def _run_of_plain_row(row, config):
    """The run configuration of a row written before rows carried it (``run``): rebuilt from the row and the
    file's config, for a diloco / sparseloco row with no tag (the label of the rebuilt run must equal the row's,
    else None: such a row is not reused)."""
    if row.get("method") not in ("diloco", "sparseloco"):
        return None
    run = RunCfg(row["method"], H=row["H"], steps=row["steps"], mbs=config["inner"]["micro_batch"],
                 lr=config["inner"]["lr"], eval_windows=config["eval_windows"], seed=1234 + row["seed"],
                 data_seed=row["seed"], outer_lr=row["outer_lr"], outer_momentum=row["outer_momentum"],
                 **({"k": row["k"]} if row["method"] == "sparseloco" else {}))
    return asdict(run) if run.label() == row["label"] else None


REUSE: dict = {}   # filled by main() from --reuse
JOURNAL: dict = {}   # {"journal": RunJournal} while main() runs with a journal (--journal)


def data_identity(paths):
    """The data part of a journal key: the data files' paths, relative to the repository where they lie in it
    (the default corpus, data/), so that a journal resumes from a checkout at another place."""
    def rel(path):
        inside = os.path.abspath(path).startswith(common.REPO + os.sep)
        return os.path.relpath(path, common.REPO) if inside else os.path.abspath(path)
    return json.dumps({split: rel(path) for split, path in paths.items()}, sort_keys=True)


def run_rows(W, model, runs, ft_runs, paths, timeout, env, notes):
    """One row per run: those in REUSE are taken from there (marked ``reused_from``), those the run journal
    holds from it (marked ``resumed_from_journal``: the commits they were made at, and ``made_on_cpu`` where
    another CPU model made them, --journal-cpu); the rest are made."""
    known = {i: REUSE[(W, _run_key(r))] for i, r in enumerate(runs) if (W, _run_key(r)) in REUSE}
    journal = JOURNAL.get("journal")
    if journal is not None:
        left = [i for i in range(len(runs)) if i not in known]
        done, _ = journal.split(model, W, [runs[i] for i in left])
        for j, results in done.items():
            known[left[j]] = dict(row_of(results, W),
                                  resumed_from_journal=sorted({r["journal_commit"] for r in results}))
            if results[0].get("journal_cpu"):
                known[left[j]]["made_on_cpu"] = results[0]["journal_cpu"]
    todo = [r for i, r in enumerate(runs) if i not in known]
    made = iter(_run_rows(W, model, todo, ft_runs, paths, timeout, env, notes) if todo or ft_runs else [])
    rows = [dict(known[i]) if i in known else next(made) for i in range(len(runs))]
    return rows + list(made)   # (+ the torchft rows)


def _run_rows(W, model, runs, ft_runs, paths, timeout, env, notes):
    from megatron_sparseloco.testing.multirank import run_ranks

    rows = []
    if runs:
        res = run_ranks(common.rank_run_all, W, args=(model, runs, paths, 1e9, JOURNAL.get("journal")),
                        timeout=timeout, env=env)
        rows = [row_of([res[r][i] for r in range(W)], W) for i in range(len(runs))]
    if ft_runs:
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
    for row in rows:
        print(f"W={W} {label(row):40s} seed {row['seed']} held-out {row['held_out_loss']:.4f}  bytes/worker "
              f"{common.fmt_bytes(row['bytes_sent_per_worker']):>10s}  steps {row['steps']}  wall {row['wall_s']:.1f}s"
              + (f"  mean model {row['held_out_loss_mean_model']:.4f}" if row.get("held_out_loss_mean_model") else ""),
              flush=True)
    return rows


def pick_tuned(sweep_rows):
    """Tuned key → (outer lr, momentum) with the lowest held-out loss in the sweep. The key is the method
    (sparseloco: at k=64), or ``sparseloco:K`` for any other swept Top-k (tuned on its own); ddp's pair is
    (inner lr, None)."""
    best = {}
    for r in sweep_rows:
        key = f"sparseloco:{r['k']}" if r["method"] == "sparseloco" and r["k"] != 64 else r["method"]
        if _grid_key(key) and (key not in best or r["held_out_loss"] < best[key]["held_out_loss"]):
            best[key] = r
    return {key: ((r["run"]["lr"], None) if key == "ddp" else (r["outer_lr"], r["outer_momentum"]))
            for key, r in best.items()}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="60 steps, a smaller model (plumbing check)")
    ap.add_argument("--steps", type=int, default=None, help="inner steps per worker (a multiple of H; default 900)")
    ap.add_argument("--H", type=int, default=15, help="inner steps per outer step")
    ap.add_argument("--workers", default="2", help="comma-separated worker counts, e.g. 2,4,8")
    ap.add_argument("--seeds", type=int, default=1, help="seeds per setting (model init and data order)")
    ap.add_argument("--first-seed", type=int, default=0, help="run seeds FIRST .. FIRST + SEEDS - 1 (to add seeds)")
    ap.add_argument("--methods", default=METHODS_DEFAULT,
                    help="comma-separated: ddp, average, diloco, gasloc[:TOPOLOGY][:lap][:c][:auto], torchft_diloco, "
                         "sparseloco:K[:flat|:entropy|:all|:efX|:rs|:rsN|:rsNbB|:hG]")
    ap.add_argument("--sweep", action="store_true",
                    help="first sweep the outer lr of diloco and sparseloco k=64 and k=128 (W = first of --workers, or "
                         "every W with --sweep-each-w; seed 0, --sweep-steps), then run every method at the best "
                         "setting")
    ap.add_argument("--sweep-each-w", action="store_true",
                    help="with --sweep: sweep at every W of --workers (seed 0) and run each W at its own chosen "
                         "settings (the best outer step moves with W); a seed-0 run that equals a sweep run is "
                         "not run twice")
    ap.add_argument("--sweep-steps", type=int, default=None, help="steps of each sweep run (default --steps)")
    ap.add_argument("--sweep-grid", default="",
                    help="JSON (inline or a file) {method: [[lr, mu], ...]} replacing the sweep's points for the "
                         "methods it names (only those are swept)")
    ap.add_argument("--tuned", default=None, help="JSON with {'diloco': [lr, mu], 'sparseloco': [lr, null]} (and optionally "
                         "'sparseloco:K': [lr, null] for a Top-k tuned on its own): skip the sweep")
    ap.add_argument("--long", type=int, default=0, metavar="FACTOR",
                    help="also one run FACTOR x longer at the first W for diloco and sparseloco k=64 (seed 0)")
    ap.add_argument("--corpus", default=None, help="directory of text / source files (default: the Python stdlib)")
    ap.add_argument("--corpus-patterns", default="*.py", help="comma-separated file patterns for --corpus")
    ap.add_argument("--layers", type=int, default=None, help="transformer layers (default 2): a scale check")
    ap.add_argument("--hidden", type=int, default=None, help="hidden size (default 128; 64 with --quick)")
    ap.add_argument("--heads", type=int, default=4, help="attention heads (must divide --hidden)")
    ap.add_argument("--mbs", type=int, default=None)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--eval-windows", type=int, default=None)
    ap.add_argument("--lr-warmup-fraction", type=float, default=0.0,
                    help="inner lr: linear warmup from 0 over this share of the steps (Megatron's flag; default 0)")
    ap.add_argument("--lr-decay-style", default="constant", choices=("constant", "cosine", "linear"),
                    help="inner lr after the warmup (Megatron's flag; decays over all the steps, to --min-lr)")
    ap.add_argument("--min-lr", type=float, default=0.0, help="inner lr at the last step with a decay (Megatron's flag)")
    ap.add_argument("--clip-grad", type=float, default=0.0,
                    help="inner step: clip the global gradient norm to this (Megatron's flag; default 0: off)")
    ap.add_argument("--overlap-steps", default="",
                    help="comma-separated τ values: for every diloco / sparseloco method also a run with its outer "
                         "step delayed by τ inner steps (--sparseloco-overlap-steps, replay merge)")
    ap.add_argument("--overlap-merges", default="replay",
                    help="comma-separated merge rules for the --overlap-steps runs (replay, lerp)")
    ap.add_argument("--fragments", default="",
                    help="comma-separated P values: for every diloco / sparseloco method also runs with the model "
                         "synced in P fragments (--sparseloco-fragments), blocking and with every --overlap-steps "
                         "τ < H/P")
    ap.add_argument("--reuse", default="",
                    help="comma-separated quality results files: a run whose configuration (model, W, every run "
                         "setting) is in one of them, made on this CPU model, is taken from there instead of made "
                         "again (runs are deterministic per machine); not part of the recorded command, the file "
                         "lists what it reused")
    ap.add_argument("--journal", default=None, metavar="DIR",
                    help="keep each finished run's per-rank results in DIR, and take the runs already there instead "
                         "of making them again: a killed benchmark rerun with the same command resumes "
                         "(benchmarks/journal.py). Default with --json: data/journal/<name of the --json file>, "
                         "removed once the results file is written; 'none' turns it off. Not part of the recorded "
                         "command; the file's notes say which runs came from the journal")
    ap.add_argument("--journal-cpu", default="", metavar="MODEL[;MODEL]",
                    help="also take the journal's runs made on these CPU models (';'-separated, as the results "
                         "files' machine.cpu spells them), for a sweep carried on on another machine: runs are "
                         "deterministic per CPU model, so those rows are marked made_on_cpu and the notes and the "
                         "results page say how many; not part of the recorded command")
    ap.add_argument("--json", default=None)
    ap.add_argument("--timeout", type=float, default=None, help="per-launch timeout in seconds")
    args = ap.parse_args(argv)
    args.mbs = args.mbs or 4
    args.eval_windows = args.eval_windows or (16 if args.quick else 64)
    model = ModelCfg(layers=2 if args.layers is None else args.layers,
                     hidden=(64 if args.quick else 128) if args.hidden is None else args.hidden, heads=args.heads,
                     seq=64 if args.quick else 128)
    if model.layers < 1 or model.hidden < 1 or model.heads < 1 or model.hidden % model.heads:
        raise SystemExit(f"--layers / --hidden / --heads: need positive values with --heads dividing --hidden, "
                         f"got {model.layers} / {model.hidden} / {model.heads}")
    workers = [int(w) for w in args.workers.split(",")]
    if any(P > model.layers for P, _ in fragment_settings(args)):
        raise SystemExit(f"--fragments: at most the model's {model.layers} layers")
    steps = args.steps or (60 if args.quick else 900)
    if steps % args.H:
        raise SystemExit(f"--steps {steps} must be a multiple of H = {args.H}")

    t_start = time.perf_counter()
    load_before = schema.loadavg() or ""
    machine = common.machine_info()   # the commit as the run starts (the tree may move while it runs)
    REUSE.clear()
    reuse_index_, reused_files = reuse_index(args.reuse, model, machine)
    REUSE.update(reuse_index_)
    if args.corpus:
        tag = "corpus-" + "".join(c if c.isalnum() else "_" for c in os.path.abspath(args.corpus))[-40:]
        paths = common.ensure_data(os.path.join(common.REPO, "data", tag), corpus=args.corpus,
                                   patterns=args.corpus_patterns.split(","))
    else:
        paths = common.ensure_data()
    JOURNAL.clear()
    journal_dir = args.journal or (os.path.join(common.REPO, "data", "journal",
                                                os.path.splitext(os.path.basename(args.json))[0])
                                   if args.json else None)
    if journal_dir and journal_dir != "none":
        JOURNAL["journal"] = RunJournal(journal_dir, machine["cpu"], machine["plugin_commit"],
                                        data=data_identity(paths),
                                        other_cpus=[c.strip() for c in args.journal_cpu.split(";") if c.strip()])
        print(f"[quality] run journal: {journal_dir}", flush=True)
    env = {"OMP_NUM_THREADS": "1"}
    timeout = args.timeout or (600 if args.quick else 7200)
    notes, rows, sweep_rows = [], [], []
    tuned, tuned_per_w, swept = {}, {}, {}
    if args.sweep_each_w and (args.tuned or not args.sweep):
        raise SystemExit("--sweep-each-w: only with --sweep (and without --tuned): it chooses the settings per W")
    if args.tuned:
        with open(args.tuned) as f:
            tuned = {k: tuple(v) for k, v in json.load(f).items()}
    elif args.sweep:
        for W in (workers if args.sweep_each_w else workers[:1]):
            sw = sweep_runs(args, args.sweep_steps or steps)
            print(f"[quality] sweep: {len(sw)} runs at W={W}", flush=True)
            rows_w = run_rows(W, model, sw, [], paths, timeout, env, notes)
            for row in rows_w:
                row.update(sweep=True, seed_run=False)
            sweep_rows += rows_w
            swept[W] = {_run_key(cfg): row for cfg, row in zip(sw, rows_w)}
            tuned_per_w[W] = pick_tuned(rows_w)
            print(f"[quality] chosen outer settings at W={W}: {tuned_per_w[W]}", flush=True)
        tuned = tuned_per_w[workers[0]]
    seeds = list(range(args.first_seed, args.first_seed + args.seeds))
    for W in workers:
        tuned_w = tuned_per_w.get(W, tuned)
        runs, ft_runs = build_runs(args, tuned_w, seeds, steps)
        if args.long and W == workers[0]:
            base = dict(steps=steps * args.long, mbs=args.mbs, lr=args.lr, eval_windows=args.eval_windows,
                        **schedule_fields(args))
            runs += [make_run(m, k, None, args.H, 0, base, tuned_w) for m, k in (("diloco", None), ("sparseloco", 64))]
        known, reused, to_run = swept.get(W, {}), [], []
        for r in runs:   # a run the sweep already made at this W gives its row, not a second run
            row = known.get(_run_key(r))
            (to_run.append(r) if row is None else reused.append(row))
        for row in reused:
            row["seed_run"] = True
        runs = to_run
        print(f"[quality] W={W}: {len(runs)} megatron runs + {len(ft_runs)} torchft runs "
              f"({len(reused)} taken from the sweep), model {asdict(model)}", flush=True)
        new_rows = run_rows(W, model, runs, ft_runs, paths, timeout, env, notes)
        for row in new_rows:
            row.update(sweep=False, seed_run=True)
        rows += new_rows
    total = time.perf_counter() - t_start
    rows = sweep_rows + rows
    summary = summarise([r for r in rows if r["seed_run"]])
    for g in sorted(summary, key=lambda g: (g["workers"], g["steps"], g["mean"])):
        print(f"W={g['workers']} steps {g['steps']} {g['label']:40s} mean {g['mean']:.4f} spread {g['spread']:.4f} "
              f"({g['seeds']} seeds)")
    config = {"model": asdict(model), "numel": rows[0].get("numel") if rows else None,
              "corpus": args.corpus or "python stdlib", "steps": steps, "H": args.H, "workers": workers,
              "seeds": seeds, "methods": args.methods, "eval_windows": args.eval_windows,
              "inner": inner_config(args, model),
              "sweep": ({"grid": {m: [list(p) for p in pts] for m, pts in sweep_grid(args.sweep_grid).items()},
                         "seed": 0, "steps": args.sweep_steps or steps, "each_w": args.sweep_each_w}
                        if args.sweep else None),
              # the outer settings each W ran at (the sweep's choice, or the --tuned file; unset: the plugin's)
              "tuned_per_w": {str(W): {k: list(v) for k, v in tuned_per_w.get(W, tuned).items()} for W in workers},
              "defaults": common.resolved_defaults(workers, rows[0].get("numel") or 0 if rows else 0)}
    recorded = argv if argv is not None else sys.argv[1:]
    for option in ("--reuse", "--journal", "--journal-cpu"):   # how this launch found runs, not what it measured
        recorded = strip_option(recorded, option)
    command = schema.command_line("quality.py", recorded)
    resumed = [r for r in rows if r.get("resumed_from_journal") and not r.get("reused_from")]
    if resumed:
        notes.append(f"{len(resumed)} runs taken from the run journal of an interrupted launch of this command, "
                     f"made at commit(s) {sorted({c for r in resumed for c in r['resumed_from_journal']})}")
        for cpu in sorted({r["made_on_cpu"] for r in resumed if r.get("made_on_cpu")}):
            notes.append(f"{sum(1 for r in resumed if r.get('made_on_cpu') == cpu)} of those runs were made on "
                         f"another CPU model, {cpu} (--journal-cpu; runs are deterministic per CPU model)")
    if reused_files:
        notes.append(f"{sum(1 for r in rows if r.get('reused_from'))} runs taken from earlier files (--reuse): "
                     f"{reused_files}")
    out = schema.document("quality", command, config, rows, machine=machine,
                          wall_s=total, load=load_before + " -> " + (schema.loadavg() or ""), notes=notes)
    if args.json:
        schema.write(args.json, out)
        print(f"[quality] wrote {args.json}")
        if "journal" in JOURNAL and not args.journal:
            JOURNAL["journal"].clear()
    print(f"[quality] total {total:.1f}s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
