"""Shared pieces of benchmarks/quality.py and benchmarks/network.py.

* Data: the offline byte-level corpus of ``megatron_sparseloco.data`` (Python stdlib sources →
  Megatron indexed dataset, split train / held-out *by file*). The ``.bin`` of a Megatron indexed
  dataset is the documents' token ids back to back, so it is read here as one uint16 stream.
* Batches: worker ``w`` reads random windows of ``seq + 1`` tokens from the train stream, drawn
  from a generator seeded by ``(seed, w)``: every method sees exactly the same tokens per worker.
* Held-out loss: a fixed set of windows evenly spaced over the held-out stream, the same for
  every method, evaluated with the bare megatron-core ``GPTModel`` forward (no DDP, no wrapper).
* Runs: :func:`train_method` trains one method on this rank (Megatron DDP, or Megatron + our
  ``OuterLoopOptimizer`` with a strategy) and returns its curve; :func:`train_torchft_diloco`
  trains the same model with PyPI torchft's ``DiLoCo`` (each worker a replica group of one rank).
"""
from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
from dataclasses import asdict, dataclass
from typing import Dict, Iterator, List, Optional, Sequence, Tuple

import numpy as np
import torch

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if REPO not in sys.path:
    sys.path.insert(0, REPO)

DATA_DIR = os.path.join(REPO, "data", "stdlib-4MB")
DATA_MAX_BYTES = 4_000_000


# ---------------------------------------------------------------------------- data
def ensure_data(out: str = DATA_DIR, corpus: Optional[str] = None, patterns: Sequence[str] = ("*.py",)) -> Dict[str, str]:
    """Build (or find up to date) the byte corpus; returns the .bin path of each split.

    Default: the Python standard-library sources. ``corpus``: any directory of text / source files
    (``patterns`` select them), built the same way (byte tokens, train / held-out split by file).
    """
    from megatron_sparseloco.data.build import build_dataset
    build_dataset(out, source=corpus, max_bytes=DATA_MAX_BYTES, patterns=tuple(patterns), log=lambda *a, **k: None)
    return {"train": os.path.join(out, "train_text_document.bin"),
            "valid": os.path.join(out, "valid_text_document.bin")}


def load_tokens(path: str) -> np.ndarray:
    return np.memmap(path, dtype=np.uint16, mode="r")


def batches(tokens: np.ndarray, seed: int, worker: int, mbs: int, seq: int) -> Iterator[Dict[str, torch.Tensor]]:
    """Endless random windows for one worker, in the dict form megatron's GPT forward takes."""
    gen = np.random.default_rng([int(seed), int(worker), 7919])
    n = len(tokens) - seq - 1
    positions = torch.arange(seq).unsqueeze(0).expand(mbs, -1).contiguous()
    while True:
        starts = gen.integers(0, n, size=mbs)
        rows = np.stack([np.asarray(tokens[s:s + seq + 1], dtype=np.int64) for s in starts])
        t = torch.from_numpy(rows)
        yield {"tokens": t[:, :-1].contiguous(), "labels": t[:, 1:].contiguous(),
               "loss_mask": torch.ones(mbs, seq, dtype=torch.float32), "attention_mask": None,
               "position_ids": positions}


def heldout_windows(tokens: np.ndarray, n: int, seq: int) -> torch.Tensor:
    """``n`` windows of ``seq + 1`` tokens evenly spaced over the held-out stream (deterministic)."""
    span = len(tokens) - seq - 1
    starts = np.linspace(0, span, n).astype(np.int64)
    return torch.from_numpy(np.stack([np.asarray(tokens[s:s + seq + 1], dtype=np.int64) for s in starts]))


@torch.no_grad()
def heldout_loss(gpt, windows: torch.Tensor, batch: int = 16) -> float:
    """Mean next-token cross-entropy (nats) of the bare GPTModel on the held-out windows."""
    was_training = gpt.training
    gpt.eval()
    total, count = 0.0, 0
    seq = windows.shape[1] - 1
    for i in range(0, windows.shape[0], batch):
        w = windows[i:i + batch]
        pos = torch.arange(seq).unsqueeze(0).expand(w.shape[0], -1)
        out = gpt(w[:, :-1].contiguous(), pos, None, labels=w[:, 1:].contiguous())
        total += float(out.float().sum())
        count += out.numel()
    if was_training:
        gpt.train()
    return total / count


def mean_model_heldout_loss(gpt, windows: torch.Tensor, workers: int) -> float:
    """Held-out loss of the workers' mean model (1/W) Σ_i θ_i, evaluated on every rank (one rank per
    worker: an all-reduce over the world), then each rank's own params are put back. Decentralised
    methods (gasloc) keep the workers apart but preserve their mean; this is the model a final
    exact average would hand the user. Measurement only: training never sees it."""
    import torch.distributed as dist

    params = [p for p in gpt.parameters()]
    saved = [p.detach().clone() for p in params]
    with torch.no_grad():
        for p in params:
            dist.all_reduce(p.data)
            p.data.div_(workers)
    try:
        return heldout_loss(gpt, windows)
    finally:
        with torch.no_grad():
            for p, s in zip(params, saved):
                p.data.copy_(s)


# ---------------------------------------------------------------------------- config
def _plugin_defaults():
    """The plugin's own config dataclasses, built with no argument: their field values are the defaults
    every benchmark run starts from (so a benchmark default is never a second copy of the plugin's)."""
    from megatron_sparseloco.outer.diloco import DiLoCoConfig
    from megatron_sparseloco.outer.gasloc import GASLoCConfig
    from megatron_sparseloco.outer.sparseloco import SparseLoCoConfig
    return DiLoCoConfig(), SparseLoCoConfig(), GASLoCConfig()


DILOCO_DEFAULT, SPARSELOCO_DEFAULT, GASLOC_DEFAULT = _plugin_defaults()


@dataclass
class ModelCfg:
    layers: int = 2
    hidden: int = 128
    heads: int = 4
    seq: int = 128
    vocab: int = 257          # 256 bytes + EOD (NullTokenizer --vocab-size 257)


def model_numel(model: ModelCfg) -> int:
    """The parameters of the benchmarks' GPT (``testing.megatron_harness.build_tiny_gpt``: learned positions, tied
    output layer, biases, FFN 4h): V·h + S·h + L·(12h² + 13h) + 2h — 446,080 for the quality model (2 × 128),
    3,258,112 for 4 × 256, 10,795,392 for 6 × 384, as the runs count them. What the outer-lr rule's size term
    gets, known before any rank builds the model."""
    h = model.hidden
    return model.vocab * h + model.seq * h + model.layers * (12 * h * h + 13 * h) + 2 * h


@dataclass
class RunCfg:
    method: str                       # ddp | diloco | sparseloco | gasloc | torchft_diloco | local (W workers, never synced)
    H: int = 15
    steps: int = 300                  # inner steps per worker
    k: Optional[int] = None           # sparseloco top-k per chunk (None: the plugin's, SparseLoCoConfig.k)
    index_coding: str = SPARSELOCO_DEFAULT.index_coding   # sparseloco: packed | entropy
    mbs: int = 8
    lr: float = 1e-3                  # inner AdamW lr (same for every method)
    weight_decay: float = 0.1
    seed: int = 1234
    data_seed: int = 0
    eval_every: int = 15              # ddp eval interval; outer methods evaluate at every outer step
    eval_windows: int = 64
    gasloc_topology: str = GASLOC_DEFAULT.topology
    gasloc_rule: str = GASLOC_DEFAULT.rule  # gasloc: ours | laplacian-momentum | mixed-nesterov (docs/gasloc.md §2)
    gasloc_compress: bool = False           # gasloc: SparseLoCo-compressed proposals (k=64 of 4096, 2-bit)
    gasloc_refresh: int = GASLOC_DEFAULT.bandwidth_refresh  # gasloc topology bandwidth: rounds between link-cost agreements
    gasloc_rounds: int = GASLOC_DEFAULT.gossip_rounds       # gasloc: mixing steps per outer round (--sparseloco-gossip-rounds)
    slow_compute: float = 1.0               # the last worker's inner steps take this many times longer (sleep)
    auto_h: bool = False                    # --sparseloco-inner-steps-per-worker auto (H_w from step times)
    outer_lr: Optional[float] = None       # None: the plugin's default for the method (and W, k: strategy_fields)
    outer_momentum: Optional[float] = None  # None: the plugin's; sparseloco: Nesterov μ when set
    chunking: str = SPARSELOCO_DEFAULT.chunking          # sparseloco: per-tensor (default) or flat
    aggregation: str = SPARSELOCO_DEFAULT.aggregation    # sparseloco: allgather | reduce-scatter | hierarchical
    owner_k: int = 0                        # reduce-scatter: values the owners keep per chunk (0: k)
    owner_value_bits: int = 0               # reduce-scatter: bits of the owners' values (0: value bits)
    owner_residual: str = "owner"           # reduce-scatter: owner | workers (where the unsent aggregate waits)
    aggregation_groups: int = 0             # hierarchical: site groups G (--sparseloco-aggregation-groups)
    reduce: str = SPARSELOCO_DEFAULT.reduce              # sparseloco: contributors | all (--sparseloco-reduce)
    ef_beta: float = SPARSELOCO_DEFAULT.ef_beta          # sparseloco: error-feedback decay β (--sparseloco-ef-decay)
    value_bits: int = SPARSELOCO_DEFAULT.value_bits      # sparseloco: bits per kept value (--sparseloco-value-bits)
    overlap_steps: int = 0                  # τ: delayed outer step (--sparseloco-overlap-steps), 0: blocking
    overlap_merge: str = "replay"           # replay | lerp (alpha 0.5)
    fragments: int = 1                      # P: Streaming-DiLoCo fragments (--sparseloco-fragments)
    # the inner lr schedule, as Megatron's flags name it (OptimizerParamScheduler): linear warmup from 0 over
    # lr_warmup_fraction of the steps, then constant or cosine decay to min_lr at the last step; clip_grad > 0:
    # the inner step clips the global gradient norm (--clip-grad); 0: off
    lr_warmup_fraction: float = 0.0
    lr_decay_style: str = "constant"
    min_lr: float = 0.0
    clip_grad: float = 0.0

    def schedule_tag(self) -> str:
        """'' for the constant inner lr without clipping; else e.g. ' warmup0.1 cosine→0.0001 clip1'."""
        tag = f" warmup{self.lr_warmup_fraction:g}" if self.lr_warmup_fraction else ""
        tag += f" {self.lr_decay_style}→{self.min_lr:g}" if self.lr_decay_style != "constant" else ""
        return tag + (f" clip{self.clip_grad:g}" if self.clip_grad else "")

    def label(self) -> str:
        if self.method == "sparseloco":
            tag = f"sparseloco k={self.k}" + ("" if self.index_coding == SPARSELOCO_DEFAULT.index_coding else f" {self.index_coding}")
            tag += "" if self.chunking == SPARSELOCO_DEFAULT.chunking else f" {self.chunking}"
            tag += "" if self.aggregation == SPARSELOCO_DEFAULT.aggregation else f" {self.aggregation}"
            tag += f" G={self.aggregation_groups}" if self.aggregation_groups else ""
            tag += f" owner-k={self.owner_k}" if self.owner_k else ""
            tag += f" owner-bits={self.owner_value_bits}" if self.owner_value_bits else ""
            tag += "" if self.owner_residual == "owner" else f" residual={self.owner_residual}"
            tag += "" if self.reduce == SPARSELOCO_DEFAULT.reduce else f" reduce={self.reduce}"
            tag += "" if self.ef_beta == SPARSELOCO_DEFAULT.ef_beta else f" beta={self.ef_beta:g}"
            tag += "" if self.value_bits == SPARSELOCO_DEFAULT.value_bits else f" bits={self.value_bits}"
        else:
            tag = self.method
        if self.method == "ddp" and self.lr != RunCfg.lr:   # DDP's own setting is its lr (a "ddp" sweep grid)
            tag += f" lr={self.lr:g}"
        if self.outer_lr is not None:
            tag += f" lr={self.outer_lr:g}" + (f" mu={self.outer_momentum:g}" if self.outer_momentum is not None else "")
        if self.method == "gasloc":
            tag += "" if self.gasloc_topology == "ring" else f" {self.gasloc_topology}"
            tag += " lap" if self.gasloc_rule == "laplacian-momentum" else ""
            tag += " mn" if self.gasloc_rule == "mixed-nesterov" else ""
            tag += f" g{self.gasloc_rounds}" if self.gasloc_rounds != 1 else ""
            tag += " c64" if self.gasloc_compress else ""
            tag += f" r{self.gasloc_refresh}" if self.gasloc_topology == "bandwidth" and self.gasloc_refresh != 8 else ""
        if self.auto_h:
            tag += " autoH"
        if self.slow_compute != 1.0:
            tag += f" slow{self.slow_compute:g}x"
        if self.overlap_steps:
            tag += f" tau={self.overlap_steps}" + ("" if self.overlap_merge == "replay" else f" {self.overlap_merge}")
        if self.fragments > 1:
            tag += f" P={self.fragments}"
        tag += self.schedule_tag()
        return tag if self.method in ("ddp", "local") else f"{tag} H={self.H}"


def strategy_fields(run: RunCfg, workers: int, numel: int = 0) -> Dict:
    """The outer strategy's config fields for a run on ``workers`` workers of a model of ``numel`` parameters:
    the run's settings, and for every setting the run leaves unset the plugin's own default, resolved as the
    Megatron integration resolves it (``SparseLoCoConfig.resolve_for_workers`` / ``resolve_for_model``: the
    outer-lr rule of W, k and N; N = 0: unknown, the rule's 3.26 M scale)."""
    if run.method in ("average", "local"):  # local: a strategy that never runs
        return dict()
    if run.method == "diloco":
        default = DILOCO_DEFAULT
        momentum = default.momentum if run.outer_momentum is None else run.outer_momentum
        return dict(lr=default.lr if run.outer_lr is None else run.outer_lr, momentum=momentum,
                    nesterov=default.nesterov and momentum > 0)   # μ = 0: plain outer SGD (Nesterov needs a momentum)
    if run.method == "sparseloco":
        fields = dict(k=SPARSELOCO_DEFAULT.k if run.k is None else run.k, chunk=SPARSELOCO_DEFAULT.chunk,
                      value_bits=run.value_bits, ef_beta=run.ef_beta, index_coding=run.index_coding,
                      chunking=run.chunking, aggregation=run.aggregation,
                      **({"owner_k": run.owner_k} if run.owner_k else {}),
                      **({"owner_value_bits": run.owner_value_bits} if run.owner_value_bits else {}),
                      **({"owner_residual": run.owner_residual} if run.owner_residual != "owner" else {}),
                      **({"aggregation_groups": run.aggregation_groups} if run.aggregation_groups else {}),
                      **({"reduce": run.reduce} if run.reduce != SPARSELOCO_DEFAULT.reduce else {}),
                      **({"momentum": run.outer_momentum, "nesterov": run.outer_momentum > 0}
                         if run.outer_momentum is not None else {}))
        if run.outer_lr is not None:
            fields["lr"] = run.outer_lr
        else:   # the plugin's rule, resolved exactly as the Megatron flags do when --sparseloco-outer-lr is unset
            from megatron_sparseloco.outer.sparseloco import SparseLoCoConfig
            config = SparseLoCoConfig(**fields)
            config.resolve_for_workers(workers, set(fields))
            if numel:
                config.resolve_for_model(workers, numel)
                fields["model_numel"] = numel
            fields["lr"] = config.lr
            fields["rule_fields"] = config.rule_fields     # as the flags record it: the lr came from the rule
        return fields
    if run.method == "gasloc":
        default = GASLOC_DEFAULT
        out = dict(topology=run.gasloc_topology,
                   proposal_lr=default.proposal_lr if run.outer_lr is None else run.outer_lr,
                   momentum=default.momentum if run.outer_momentum is None else run.outer_momentum, rule=run.gasloc_rule)
        if run.gasloc_compress:
            out.update(compress=True, chunk=default.chunk, k=default.k, value_bits=default.value_bits)
        if run.gasloc_topology == "bandwidth":
            out.update(bandwidth_refresh=run.gasloc_refresh)
        if run.gasloc_rounds != 1:
            out.update(gossip_rounds=run.gasloc_rounds)
        return out
    raise ValueError(run.method)


def outer_settings(run: RunCfg, workers: int, numel: int = 0) -> Optional[Dict]:
    """``strategy_fields`` for a run of the plugin's outer loop; None for ddp and torchft_diloco (no outer strategy
    of ours: ddp has no outer step, torchft's is its own SGD, lr 0.7, momentum 0.9, Nesterov)."""
    return None if run.method in ("ddp", "torchft_diloco") else strategy_fields(run, workers, numel)


def resolved_defaults(workers: Sequence[int], numel: int = 0) -> Dict:
    """What a run that sets no outer setting gets at each W on a model of ``numel`` parameters (for a results
    file's config block)."""
    out = {}
    for W in workers:
        out[str(W)] = {"diloco": strategy_fields(RunCfg("diloco"), W),
                       "sparseloco": strategy_fields(RunCfg("sparseloco"), W, numel),
                       "sparseloco:128": strategy_fields(RunCfg("sparseloco", k=128), W, numel),
                       "gasloc": strategy_fields(RunCfg("gasloc"), W)}
    return out


GASLOC_TOPOLOGIES = ("ring", "exponential", "random1", "random2", "complete", "bandwidth")


def _is_float(text: str) -> bool:
    try:
        float(text)
        return True
    except ValueError:
        return False


def overlap_merges(text: str) -> List[str]:
    """``--overlap-merges`` 'replay,lerp' → the merge rules (``outer.overlap.MERGES``), refused when unknown."""
    from megatron_sparseloco.outer.overlap import MERGES

    merges = [m.strip() for m in text.split(",") if m.strip()]
    bad = [m for m in merges if m not in MERGES]
    if bad or not merges:
        raise SystemExit(f"--overlap-merges: comma-separated rules among {MERGES}, got {text!r}")
    return merges


def outer_setting(tag: str) -> Optional[Tuple[str, float]]:
    """A method spec's outer-setting tag: 'lrX' → ('outer_lr', X), 'muX' → ('outer_momentum', X); else None."""
    for prefix, field in (("lr", "outer_lr"), ("mu", "outer_momentum")):
        if tag.startswith(prefix) and _is_float(tag[len(prefix):]):
            return field, float(tag[len(prefix):])
    return None


def gasloc_fields(spec: str) -> Dict:
    """'gasloc[:topology][:lap|:mn][:c][:auto][:rN][:gN]' → RunCfg fields: e.g. 'gasloc:bandwidth:lap:c:auto:r2' is
    bandwidth-aware one-peer matchings (link costs agreed every 2 rounds; default 8), the laplacian-momentum
    rule, compressed proposals and per-worker H_w from measured step times; 'mn' the mixed-nesterov rule,
    'gN' N mixing steps per outer round; 'lr0.7:mu0.6' set η and γ (default the plugin's, GASLoCConfig:
    0.7 and 0.6)."""
    parts = spec.split(":")
    if parts[0] != "gasloc":
        raise ValueError(f"not a gasloc spec: {spec!r}")
    out: Dict = {}
    for tag in parts[1:]:
        if tag == "auto":
            out["auto_h"] = True
        elif tag in GASLOC_TOPOLOGIES:
            out["gasloc_topology"] = tag
        elif tag == "lap":
            out["gasloc_rule"] = "laplacian-momentum"
        elif tag == "mn":
            out["gasloc_rule"] = "mixed-nesterov"
        elif tag[:1] == "g" and tag[1:].isdigit() and int(tag[1:]) >= 1:
            out["gasloc_rounds"] = int(tag[1:])
        elif tag == "c":
            out["gasloc_compress"] = True
        elif tag[:1] == "r" and tag[1:].isdigit() and int(tag[1:]) >= 1:
            out["gasloc_refresh"] = int(tag[1:])
        elif outer_setting(tag) is not None:       # lrX: proposal lr η, muX: momentum γ
            field, value = outer_setting(tag)
            out[field] = value
        else:
            raise SystemExit(f"gasloc method {spec!r}: unknown tag {tag!r} (topologies {GASLOC_TOPOLOGIES}, 'lap', 'c', "
                             "'mn', 'auto', 'rN' = bandwidth table agreed every N rounds, 'gN' = N mixing steps per round, 'lrX' = η, "
                             "'muX' = γ)")
    return out


# ---------------------------------------------------------------------------- training (one rank)
def _model_numel(chunks) -> int:
    return sum(p.numel() for c in chunks for p in c.parameters())


def inner_lr_scheduler(opt, run: RunCfg):
    """Megatron's own OptimizerParamScheduler over the inner optimizer for a run with a schedule (None for the
    constant lr: those runs stay bitwise what they were). Warmup from 0 over ``lr_warmup_fraction`` of the
    steps; decay over all the steps (Megatron's default --lr-decay-iters = --train-iters), to ``min_lr``."""
    if run.lr_decay_style not in ("constant", "cosine", "linear"):
        raise ValueError(f"lr_decay_style: constant, cosine or linear, got {run.lr_decay_style!r}")
    if not run.lr_warmup_fraction and run.lr_decay_style == "constant":
        return None
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler
    min_lr = run.min_lr if run.lr_decay_style != "constant" else run.lr
    for group in opt.param_groups:   # the groups' own bounds win in the scheduler (Megatron sets them from --min-lr)
        group["max_lr"], group["min_lr"] = run.lr, min_lr
    return OptimizerParamScheduler(
        opt, init_lr=0.0, max_lr=run.lr, min_lr=min_lr,
        lr_warmup_steps=int(round(run.lr_warmup_fraction * run.steps)), lr_decay_steps=run.steps,
        lr_decay_style=run.lr_decay_style, start_wd=run.weight_decay, end_wd=run.weight_decay,
        wd_incr_steps=run.steps, wd_incr_style="constant")


def train_method(rank: int, world: int, model: ModelCfg, run: RunCfg, paths: Dict[str, str],
                 time_budget_s: float = 1e9) -> Dict:
    """Train one method on this rank (one rank = one worker); return its held-out curve and counters."""
    import torch.distributed as dist
    from megatron.core import parallel_state

    from megatron_sparseloco.testing.megatron_harness import (build_tiny_gpt, init_megatron, train_step,
                                                               wrap_ddp_and_optimizer)
    W = world
    instances = 1 if run.method == "ddp" else W
    init_megatron(num_distributed_optimizer_instances=instances, seed=run.seed)
    chunks = build_tiny_gpt(num_layers=model.layers, hidden=model.hidden, heads=model.heads,
                            vocab=model.vocab, seq_len=model.seq)
    ddp, opt = wrap_ddp_and_optimizer(chunks, optimizer="adam", lr=run.lr, weight_decay=run.weight_decay,
                                      num_distributed_optimizer_instances=instances, clip_grad=run.clip_grad)
    scheduler = inner_lr_scheduler(opt, run)
    numel = _model_numel(chunks)
    outer = None
    if run.method != "ddp":  # local: the outer loop's worker-local inner steps, its round never comes
        from megatron_sparseloco.megatron.optimizer import OuterLoopConfig, OuterLoopOptimizer
        from megatron_sparseloco.outer.registry import build_outer_strategy
        fields_ = strategy_fields(run, W, numel)

        def factory(params, group, names, slices=None):
            return build_outer_strategy("average" if run.method == "local" else run.method, params, group, names=names, slices=slices, **fields_)

        outer = OuterLoopOptimizer(opt, ddp, factory, OuterLoopConfig(
            inner_steps=run.steps + 1 if run.method == "local" else run.H,
            identical_across_workers=(run.method != "gasloc"), inner_steps_per_worker="auto" if run.auto_h else None,
            overlap_steps=run.overlap_steps, overlap_merge=run.overlap_merge, fragments=run.fragments))
    stepper = outer if outer is not None else opt
    outer_times: List[float] = []
    if outer is not None:
        _orig_outer_step = outer.outer_step

        def _timed_outer_step(*a, **kw):   # (fragments: one call per fragment sync)
            t = time.perf_counter()
            stats = _orig_outer_step(*a, **kw)
            outer_times.append(time.perf_counter() - t)
            return stats

        outer.outer_step = _timed_outer_step
    worker = parallel_state.get_data_parallel_rank()
    tokens_train = load_tokens(paths["train"])
    windows = heldout_windows(load_tokens(paths["valid"]), run.eval_windows, model.seq)
    it = batches(tokens_train, run.data_seed, worker, run.mbs, model.seq)
    gpt = ddp[0].module
    tokens_per_step = W * run.mbs * model.seq
    curve = [{"step": 0, "tokens": 0, "bytes_per_worker": 0, "held_out_loss": heldout_loss(gpt, windows),
              "wall_s": 0.0}]
    train_losses: List[float] = []
    mean_model_loss: Optional[float] = None   # gasloc: the workers' mean model at the end
    sync_times: List[Dict[str, float]] = []
    wall = 0.0
    eval_every = run.eval_every if outer is None else run.H
    dense_bytes_per_step = numel * 4  # DDP: fp32 gradients handed to the reduction every step
    for step in range(1, run.steps + 1):
        t0 = time.perf_counter()
        if run.auto_h and not outer.is_inner_step_active():
            # a step this worker leaves out of the round (auto H_w): no forward/backward, no data
            outer.step()
            loss = train_losses[-1] if train_losses else float("nan")
        else:
            loss = train_step(ddp, stepper, it, seq_len=model.seq, micro_batch_size=run.mbs)
            if scheduler is not None:   # after the step, as Megatron's train loop advances it
                scheduler.step(increment=1)
            if run.slow_compute > 1.0 and worker == W - 1:  # a slower GPU: stretch this worker's step
                time.sleep((run.slow_compute - 1.0) * (time.perf_counter() - t0))
        if outer is not None and outer.outer_steps > len(sync_times):  # a round completed
            last = outer.log.last
            rec = {k: last.get(k, 0.0) for k in ("time_compress_s", "time_communicate_s", "time_apply_s",
                                                 "bytes_sent", "time_exposed_s", "time_wait_s", "time_launch_s",
                                                 "time_agree_s", "time_owner_s")}
            # the wall time the loop spent in the outer step (delayed: launch + wait + apply + merge)
            rec["outer_step_s"] = (last.get("time_exposed_s", float("nan")) if run.overlap_steps
                                   else (outer_times[-1] if outer_times else float("nan")))
            sync_times.append(rec)
        wall += time.perf_counter() - t0
        train_losses.append(loss)
        if step % eval_every == 0 or step == run.steps:
            sent = outer.log.bytes_sent if outer is not None else dense_bytes_per_step * step
            if step == run.steps and outer is not None and run.overlap_steps:
                # the round launched at the last step is still in flight: evaluate what the job
                # ends with (what a checkpoint's model holds), θ_outer,k+1, as the blocking runs do
                with outer.model_holds_outer_params():
                    loss_now = heldout_loss(gpt, windows)
            else:
                loss_now = heldout_loss(gpt, windows)
            curve.append({"step": step, "tokens": step * tokens_per_step, "bytes_per_worker": int(sent),
                          "held_out_loss": loss_now, "wall_s": wall})
            if step == run.steps and run.method == "gasloc" and W > 1:
                mean_model_loss = mean_model_heldout_loss(gpt, windows, W)
        # stop early (same step on every rank) when the budget is spent
        if time_budget_s < 1e9 and step % eval_every == 0:
            flag = torch.tensor([1.0 if wall > time_budget_s else 0.0])
            dist.all_reduce(flag, op=dist.ReduceOp.MAX)
            if flag.item() > 0:
                break
    return {"rank": rank, "numel": numel, "curve": curve, "train_losses": train_losses,
            "sync": sync_times, "bytes_sent": curve[-1]["bytes_per_worker"],
            "bytes_received": int(outer.log.bytes_received) if outer is not None else None, "wall_s": wall,
            "steps_done": curve[-1]["step"], "mean_model_loss": mean_model_loss}


# ---------------------------------------------------------------------------- torchft
def start_lighthouse(min_replicas: int):
    """A torchft lighthouse in this process (python API of the installed torchft)."""
    os.environ.setdefault("RUST_LOG", "warn")  # the lighthouse logs every quorum tick at info
    from torchft.coordination import LighthouseServer
    return LighthouseServer(bind="[::]:0", min_replicas=min_replicas, join_timeout_ms=200)


def _adamw_param_groups(gpt, wd: float):
    """Megatron's default weight-decay split: no decay for 1-D tensors and biases."""
    decay, no_decay = [], []
    for name, p in gpt.named_parameters():
        (no_decay if (p.dim() == 1 or name.endswith(".bias")) else decay).append(p)
    return [{"params": decay, "weight_decay": wd}, {"params": no_decay, "weight_decay": 0.0}]


def train_torchft_diloco(rank: int, world: int, model: ModelCfg, run: RunCfg, paths: Dict[str, str],
                         lighthouse_addr: str) -> Dict:
    """torchft's DiLoCo on the same megatron-core GPTModel, data and seeds; one replica group per rank.

    Inner: torch.optim.AdamW (the optimizer megatron-core itself uses on CPU without Apex/TE),
    same lr, betas (0.9, 0.95), eps 1e-8 and weight-decay split. Outer: SGD lr 0.7, momentum 0.9,
    Nesterov. ``should_quantize=False``: torchft all-reduces fp32 pseudo-gradients, so the bytes
    handed to its all-reduce are numel × 4 per sync.
    """
    from datetime import timedelta

    from torchft.local_sgd import DiLoCo
    from torchft.manager import Manager
    from torchft.process_group import ProcessGroupGloo

    from megatron_sparseloco.testing.megatron_harness import build_tiny_gpt, init_megatron

    init_megatron(seed=run.seed)  # TP=1: the bare GPTModel never talks to other ranks
    gpt = build_tiny_gpt(num_layers=model.layers, hidden=model.hidden, heads=model.heads,
                         vocab=model.vocab, seq_len=model.seq)[0]
    numel = sum(p.numel() for p in gpt.parameters())
    from torch.distributed import TCPStore
    from megatron_sparseloco.testing.multirank import free_port
    store_port = free_port()
    store = TCPStore("127.0.0.1", store_port, is_master=True, wait_for_workers=False)  # this replica group's store
    inner = torch.optim.AdamW(_adamw_param_groups(gpt, run.weight_decay), lr=run.lr, betas=(0.9, 0.95), eps=1e-8)
    outer_opt = torch.optim.SGD(gpt.parameters(), lr=0.7, momentum=0.9, nesterov=True)
    manager = Manager(pg=ProcessGroupGloo(timeout=timedelta(seconds=120)), min_replica_size=world,
                      load_state_dict=None, state_dict=None, use_async_quorum=False,
                      replica_id=f"worker{rank}", store_addr="127.0.0.1", store_port=store_port,
                      rank=0, world_size=1, lighthouse_addr=lighthouse_addr, hostname="127.0.0.1",
                      timeout=timedelta(seconds=120), quorum_timeout=timedelta(seconds=120),
                      connect_timeout=timedelta(seconds=60), init_sync=False)
    tokens_train = load_tokens(paths["train"])
    windows = heldout_windows(load_tokens(paths["valid"]), run.eval_windows, model.seq)
    it = batches(tokens_train, run.data_seed, rank, run.mbs, model.seq)
    tokens_per_step = world * run.mbs * model.seq
    curve = [{"step": 0, "tokens": 0, "bytes_per_worker": 0, "held_out_loss": heldout_loss(gpt, windows),
              "wall_s": 0.0}]
    train_losses, wall, syncs = [], 0.0, 0
    try:
        with DiLoCo(manager, [gpt], inner, outer_opt, sync_every=run.H, pin_memory=False) as _:
            for step in range(1, run.steps + 1):
                t0 = time.perf_counter()
                inner.zero_grad()
                batch = next(it)
                out = gpt(batch["tokens"], batch["position_ids"], None, labels=batch["labels"])
                loss = out.float().mean()
                loss.backward()
                inner.step()  # DiLoCo's hooks: every H-th step the outer sync (all-reduce + outer SGD)
                wall += time.perf_counter() - t0
                train_losses.append(float(loss))
                if step % run.H == 0:
                    syncs += 1
                    curve.append({"step": step, "tokens": step * tokens_per_step,
                                  "bytes_per_worker": syncs * numel * 4,
                                  "held_out_loss": heldout_loss(gpt, windows), "wall_s": wall})
    finally:
        manager.shutdown(wait=False)
    del store
    return {"rank": rank, "numel": numel, "curve": curve, "train_losses": train_losses, "sync": [],
            "bytes_sent": curve[-1]["bytes_per_worker"], "wall_s": wall, "steps_done": curve[-1]["step"],
            "torchft_step": manager.current_step()}


# ---------------------------------------------------------------------------- reporting helpers
def machine_info() -> Dict[str, str]:
    try:
        lscpu = subprocess.run(["lscpu"], capture_output=True, text=True, check=False).stdout
    except OSError:
        lscpu = ""
    model = next((l.split(":", 1)[1].strip() for l in lscpu.splitlines() if l.startswith("Model name:")), "unknown")
    return {"cpu": model, "cpus": str(os.cpu_count()), "torch": torch.__version__,
            "megatron_core": _distribution_version("megatron-core"), "plugin_commit": plugin_commit(),
            "python": sys.version.split()[0]}


def _distribution_version(name: str) -> str:
    """The installed distribution's version. Not ``megatron.core.__version__``: that one appends the
    ``git rev-parse HEAD`` of whatever repository holds site-packages — ours, when .venv sits in the
    checkout — so results before 2026-12-04 show this repository's commit after the ``+``."""
    from importlib import metadata
    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return "not installed"


def plugin_commit() -> str:
    """The commit of the megatron_sparseloco being benchmarked (``+dirty`` with uncommitted changes),
    or ``unknown`` when it is not a git checkout (a copy under /var/tmp, say)."""
    import megatron_sparseloco
    where = os.path.dirname(os.path.dirname(os.path.abspath(megatron_sparseloco.__file__)))
    def git(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run(["git", "-C", where, *args], capture_output=True, text=True, check=False)
    try:
        top = git("rev-parse", "--show-toplevel")
        if top.returncode != 0 or os.path.realpath(top.stdout.strip()) != os.path.realpath(where):
            return "unknown"
        head = git("rev-parse", "--short", "HEAD").stdout.strip()
        dirty = git("status", "--porcelain", "--untracked-files=no", "--", "megatron_sparseloco", "benchmarks").stdout.strip()
    except OSError:
        return "unknown"
    return head + ("+dirty" if dirty else "")


def fmt_bytes(n: float) -> str:
    for unit in ("B", "KB", "MB", "GB"):
        if abs(n) < 1000:
            return f"{n:.1f} {unit}"
        n /= 1000
    return f"{n:.1f} TB"


# ---------------------------------------------------------------------------- rank entry points
def rank_run_all(rank: int, world: int, model: ModelCfg, runs: List[RunCfg], paths: Dict[str, str],
                 time_budget_s: float = 1e9, journal=None) -> List[Dict]:
    """All megatron runs one after another in the same rank processes (start-up paid once); with a
    ``journal`` (benchmarks/journal.py) each rank records its result of each run as the run ends."""
    import torch
    torch.set_num_threads(1)
    out = []
    for run in runs:
        t0 = time.perf_counter()
        res = train_method(rank, world, model, run, paths, time_budget_s)
        res["run"] = asdict(run)
        res["elapsed_s"] = time.perf_counter() - t0
        out.append(res)
        if journal is not None:
            journal.record(model, world, rank, run, res)
        print(f"[rank {rank}] {run.label()}: held-out {res['curve'][-1]['held_out_loss']:.4f} "
              f"in {res['elapsed_s']:.1f}s ({threading.active_count()} threads, "
              f"{len(os.listdir('/proc/self/task')) if os.path.isdir('/proc/self/task') else '?'} native)", flush=True)
        release_process_groups()
    return out


def release_process_groups() -> None:
    """Destroy every process group but the world group after a run. Each run builds Megatron's parallel state
    and the outer loop's groups anew; megatron-core's ``destroy_model_parallel`` only drops its references,
    so without this the groups of every earlier run stay alive in c10d, each gloo group with its transport
    threads (about 50 threads a run here: a 27-run sweep ended with 1,500 threads per rank, half of them
    runnable, slowing every later run 3x and the whole machine)."""
    import gc

    import torch.distributed as dist
    from megatron.core import parallel_state

    if not dist.is_initialized():
        return
    dist.barrier()   # every rank is done with the run's groups
    if parallel_state.model_parallel_is_initialized():
        parallel_state.destroy_model_parallel()
    world = dist.group.WORLD
    for group in list(dist.distributed_c10d._world.pg_map):
        if group is not world:
            dist.destroy_process_group(group)
    gc.collect()
    return_freed_heap()


def return_freed_heap() -> None:
    """Give the pages glibc's main heap holds free back to the system (``malloc_trim(0)``; a no-op without
    glibc). A run's tensors of up to 32 MB come from that heap once glibc's dynamic mmap threshold has risen,
    and what they leave free stays in the heap between live blocks: in an 8-rank sweep of the 4 x 256 model
    some ranks' heaps grew by about 0.7 GB a run (others not at all) until the 24 GB machine ran short, and
    ``malloc_trim(0)`` took one such rank from 4.5 GB to 0.76 GB resident. Numerics are untouched."""
    import ctypes
    import ctypes.util

    name = ctypes.util.find_library("c")
    libc = ctypes.CDLL(name) if name else None
    if libc is not None and hasattr(libc, "malloc_trim"):
        libc.malloc_trim(0)


def rank_torchft(rank: int, world: int, model: ModelCfg, runs: List[RunCfg], paths: Dict[str, str],
                 lighthouse_addrs: List[str]) -> List[Dict]:
    import torch
    torch.set_num_threads(1)
    out = []
    for run, addr in zip(runs, lighthouse_addrs):
        t0 = time.perf_counter()
        res = train_torchft_diloco(rank, world, model, run, paths, addr)
        res["run"] = asdict(run)
        res["elapsed_s"] = time.perf_counter() - t0
        out.append(res)
    return out


# ---------------------------------------------------------------------------- markdown tables (docs/benchmarks.md)
def markdown_quality(data: Dict) -> str:
    """Mean ± spread (max − min over seeds) per setting, with bytes and the ratio to dense DiLoCo."""
    summary = data["summary"]
    dense = {(g["workers"], g["steps"]): g["bytes_sent_per_worker"] for g in summary if g["method"] == "diloco"}
    out = ["| W | steps | method | outer lr / μ | seeds | held-out loss mean | spread | bytes sent / worker | "
           "× fewer than diloco |", "|---|---|---|---|---|---|---|---|---|"]
    for g in sorted(summary, key=lambda g: (g["workers"], g["steps"], g["mean"])):
        ref = dense.get((g["workers"], g["steps"]))
        ratio = f"{ref / g['bytes_sent_per_worker']:.1f}×" if ref and g["method"] not in ("diloco", "ddp") else ""
        lr = "" if g["outer_lr"] is None else f"{g['outer_lr']:g}" + (
            "" if g["outer_momentum"] is None else f" / {g['outer_momentum']:g}")
        name = g["label"].split(" lr=")[0].replace(" H=15", "")
        out.append(f"| {g['workers']} | {g['steps']} | {name} | {lr} | {g['seeds']} | {g['mean']:.4f} | "
                   f"{g['spread']:.4f} | {fmt_bytes(g['bytes_sent_per_worker'])} | {ratio} |")
    return "\n".join(out)


def merge_quality(parts: List[Dict]) -> Dict:
    """One results document from several quality.py JSONs (e.g. one per W, run in pieces)."""
    merged = dict(parts[0])
    merged["results"] = [r for p in parts for r in p["results"]]
    merged["summary"] = [g for p in parts for g in p["summary"]]
    merged["workers"] = sorted({w for p in parts for w in p["workers"]})
    merged["commands"] = [p["command"] for p in parts]
    merged["total_wall_s"] = sum(p["total_wall_s"] for p in parts)
    merged["sweep"] = [r for p in parts for r in p.get("sweep", [])]
    return merged


def markdown_network(data: Dict, case: str) -> str:
    rows = [r for r in data["results"] if r["case"] == case]
    out = ["| method | steps | held-out loss | outer sync: communicate s | outer sync: whole outer step s | "
           "wall per step s (incl. sync) | bytes / worker | target loss | time to target s |",
           "|---|---|---|---|---|---|---|---|---|"]
    f = lambda v, d=3: "" if v is None else f"{v:.{d}f}"  # noqa: E731
    for r in rows:
        name = r["method"] + (f" k={r['k']}" if r["method"] == "sparseloco" else "") + (f" H={r['H']}" if r["H"] else "")
        out.append(f"| {name} | {r['steps']} | {r['held_out_loss']:.4f} | {f(r['sync_communicate_s'])} | "
                   f"{f(r['sync_outer_step_s'])} | {f(r['step_s'])} | {fmt_bytes(r['bytes_sent_per_worker'])} | "
                   f"{r['target_loss']:.4f} | {f(r['time_to_target_s'], 1) or 'not reached'} |")
    return "\n".join(out)
