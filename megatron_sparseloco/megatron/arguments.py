"""The ``--sparseloco-*`` flags: an argparse group in Megatron's style, and their validation.

Usage with megatron.training (what ``python -m megatron_sparseloco.run`` does for an unmodified
pretrain script)::

    args = parse_and_validate_args(extra_args_provider=add_sparseloco_args)
    validate_sparseloco_args(args)           # after Megatron's validate_args (needs world size)

``validate_sparseloco_args`` runs before any model is built. Every bad value or combination raises
``SparseLoCoArgumentError`` whose message names the flag and the fix. It also resolves the
algorithm-dependent defaults (outer lr / momentum / Nesterov) in place and maps
``--sparseloco-workers W`` onto Megatron's ``--num-distributed-optimizer-instances W``: a DiLoCo
worker *is* a distributed-optimizer instance (see ``megatron_sparseloco.megatron.optimizer``).
"""
from __future__ import annotations

import argparse
from typing import List, Optional

ALGORITHMS = ("sparseloco", "diloco", "gasloc", "average")
VALUE_BITS = (2, 4, 8, 16, 32)
REDUCE_MODES = ("contributors", "all")
INDEX_CODINGS = ("packed", "entropy")
TOPOLOGIES = ("ring", "exponential", "random1", "random2", "complete")
NONFINITE_POLICIES = ("skip", "abort")
COMM_DTYPES = ("fp32", "bf16")
CHUNKINGS = ("tensor", "flat")
AGGREGATIONS = ("allgather", "reduce-scatter")

#: algorithm → (outer lr, outer momentum, nesterov); from the papers (docs/design.md §1).
ALGORITHM_DEFAULTS = {
    "sparseloco": (1.5, 0.0, False),   # EF plays momentum's role; reference α = 1, our sweep chose
                                       # 1.5 of {0.8, 1, 1.2, 1.5} (docs/benchmarks.md)
    "diloco": (0.7, 0.9, True),        # DiLoCo paper
    "gasloc": (1.0, 0.9, False),       # heavy-ball on the gossip-mixed increment
    "average": (1.0, 0.0, False),      # plain model averaging
}


#: value of every flag left unset (None on the parser, so "given" and "default" can be told apart).
FLAG_DEFAULTS = {
    "sparseloco_inner_steps": 15,             # reference code; Covenant-72B used 30
    "sparseloco_topk": 64,
    "sparseloco_chunk_size": 4096,
    "sparseloco_value_bits": 2,
    "sparseloco_ef_decay": 0.95,
    "sparseloco_reduce": "contributors",
    "sparseloco_index_coding": "packed",
    "sparseloco_chunking": "tensor",
    "sparseloco_aggregation": "allgather",
    "sparseloco_dense_1d": True,
    "sparseloco_bucket_size": 1 << 24,
    "sparseloco_diloco_comm_dtype": "fp32",
    "sparseloco_nonfinite_policy": "skip",
    "sparseloco_consistency_check_interval": 0,
    "sparseloco_outer_timeout": 600.0,
    "sparseloco_gossip_compress": False,
}

#: gasloc-only flags and the values they take when unset with gasloc
GOSSIP_DEFAULTS = {
    "sparseloco_gossip_topology": "ring",
    "sparseloco_gossip_seed": 0,
    "sparseloco_gossip_proposal_lr": 1.0,
    "sparseloco_gossip_step": 0.05,
}
#: flags of the SparseLoCo codec (sparseloco, and gasloc with --sparseloco-gossip-compress)
CODEC_FLAGS = ("sparseloco_topk", "sparseloco_chunk_size", "sparseloco_value_bits", "sparseloco_ef_decay",
               "sparseloco_index_coding")
#: flags that only gasloc reads
GOSSIP_FLAGS = ("sparseloco_gossip_topology", "sparseloco_gossip_seed", "sparseloco_gossip_proposal_lr",
                "sparseloco_gossip_compress", "sparseloco_gossip_step")


class SparseLoCoArgumentError(ValueError):
    """A bad ``--sparseloco-*`` value or combination; the message names the flag and the fix."""


def add_sparseloco_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Add the ``--sparseloco-*`` group to a Megatron argument parser (an ``extra_args_provider``).

    Idempotent: a parser that already has the group (the installed plugin adds it) is returned as is.
    """
    if any(a.dest == "sparseloco_algorithm" for a in parser._actions):
        return parser
    g = parser.add_argument_group(title="sparseloco", description="DiLoCo / SparseLoCo / GASLoC outer steps across data-parallel workers")
    g.add_argument("--sparseloco-algorithm", choices=ALGORITHMS, default=None,
                   help="Outer algorithm. Unset: the plugin is off and Megatron trains as usual.")
    g.add_argument("--sparseloco-workers", type=int, default=None,
                   help="Number of workers W; a worker is one distributed-optimizer instance "
                        "(sets --num-distributed-optimizer-instances) and must divide the data-parallel size.")
    g.add_argument("--sparseloco-inner-steps", type=int, default=None,
                   help="Inner optimizer steps H between outer steps (reference code 15; Covenant-72B 30).")
    g.add_argument("--sparseloco-inner-steps-per-worker", type=str, default=None,
                   help="Comma-separated inner steps H_w per worker: a round lasts max(H_w) iterations, worker w "
                        "steps on the first H_w (a slower worker does fewer steps instead of stalling the others).")
    g.add_argument("--sparseloco-outer-lr", type=float, default=None,
                   help="Outer learning rate (average: fixed at 1).")
    g.add_argument("--sparseloco-outer-momentum", type=float, default=None,
                   help="Outer momentum in [0, 1) (average: fixed at 0).")
    g.add_argument("--sparseloco-outer-nesterov", action=argparse.BooleanOptionalAction, default=None,
                   help="Nesterov outer momentum (needs a non-zero outer momentum).")
    g.add_argument("--sparseloco-topk", type=int, default=None, help="Values kept per chunk (k; density k/C).")
    g.add_argument("--sparseloco-chunk-size", type=int, default=None, help="Chunk size C (elements per Top-k chunk).")
    g.add_argument("--sparseloco-value-bits", type=int, choices=VALUE_BITS, default=None,
                   help="Bits per kept value: 2/4/8 quantised, 16 bf16, 32 fp32.")
    g.add_argument("--sparseloco-ef-decay", type=float, default=None, help="Error-feedback decay β in [0, 1).")
    g.add_argument("--sparseloco-reduce", choices=REDUCE_MODES, default=None,
                   help="Aggregate: mean over the workers that sent a coordinate (reference) or over all workers.")
    g.add_argument("--sparseloco-index-coding", choices=INDEX_CODINGS, default=None,
                   help="Index wire format: packed ceil(log2 C)-bit, or entropy-coded (Golomb-Rice).")
    g.add_argument("--sparseloco-chunking", choices=CHUNKINGS, default=None,
                   help="sparseloco only: 'tensor' (default, as the reference) compresses every parameter on its "
                        "own (own quantiser, 64x64 tiles for 2-D weights); 'flat' chunks the shard's flat range "
                        "across parameters with one quantiser per bucket (kept for comparison).")
    g.add_argument("--sparseloco-aggregation", choices=AGGREGATIONS, default=None,
                   help="sparseloco only: 'allgather' (default) sends every worker's payload to every worker "
                        "(W-1 payloads received); 'reduce-scatter' sends each bucket range's owner only that "
                        "range, owners re-encode the mean and all-gather it (about 2 payloads received; needs "
                        "--sparseloco-chunking tensor and packed indices; docs/scaling.md).")
    g.add_argument("--sparseloco-dense-1d", action=argparse.BooleanOptionalAction, default=None,
                   help="sparseloco with --sparseloco-chunking tensor: send 1-D tensors (norms, biases) whole, "
                        "2-bit quantised (default on, as the reference); off: Top-k like the rest.")
    g.add_argument("--sparseloco-bucket-size", type=int, default=None,
                   help="Elements per outer-step bucket (bounds the outer step's extra memory).")
    g.add_argument("--sparseloco-diloco-comm-dtype", choices=COMM_DTYPES, default=None,
                   help="DiLoCo / average: dtype of the pseudo-gradient all-reduce.")
    g.add_argument("--sparseloco-nonfinite-policy", choices=NONFINITE_POLICIES, default=None,
                   help="NaN/Inf pseudo-gradient on any worker: skip the outer step on all workers, or abort.")
    g.add_argument("--sparseloco-consistency-check-interval", type=int, default=None,
                   help="Every N outer steps compare a hash of θ_outer across workers (0: off).")
    g.add_argument("--sparseloco-outer-timeout", type=float, default=None,
                   help="Seconds an outer step may wait for the other workers before failing.")
    g.add_argument("--sparseloco-gossip-topology", choices=TOPOLOGIES, default=None,
                   help="Gossip graph (exponential needs a power-of-two W).")
    g.add_argument("--sparseloco-gossip-seed", type=int, default=None,
                   help="Seed shared by all workers for the random matchings.")
    g.add_argument("--sparseloco-gossip-proposal-lr", type=float, default=None,
                   help="Proposal step η in y = θ0 − η·Δ.")
    g.add_argument("--sparseloco-gossip-step", type=float, default=None,
                   help="With --sparseloco-gossip-compress: step ξ on the public-copy differences (1 diverges at "
                        "k=64/4096, see docs/gasloc.md).")
    g.add_argument("--sparseloco-gossip-compress", action="store_true", default=None,
                   help="Send proposals SparseLoCo-compressed (pairwise public copies); enables the codec flags.")
    _add_overlap_args(g)
    return parser


def _flag(dest: str) -> str:
    return "--" + dest.replace("_", "-")


def _fail(dest: str, problem: str, fix: str) -> None:
    raise SparseLoCoArgumentError(f"{_flag(dest)}: {problem}. Fix: {fix}")


def _flags_only(dests) -> str:
    """``--a only applies`` / ``--a, --b only apply`` (the start of a stray-flags message)."""
    return f"{', '.join(_flag(d) for d in dests)} only {'applies' if len(dests) == 1 else 'apply'}"


def _explicitly_set(args: argparse.Namespace, dest: str) -> bool:
    """True when the user gave the flag (every flag but the algorithm defaults to None on the parser)."""
    return getattr(args, dest, None) is not None


def _all_flags() -> List[str]:
    p = add_sparseloco_args(argparse.ArgumentParser(add_help=False))
    return [a.dest for a in p._actions if a.dest.startswith("sparseloco_")]


def parse_per_worker_steps(text: str, workers: int) -> List[int]:
    try:
        steps = [int(x) for x in text.split(",") if x.strip() != ""]
    except ValueError:
        _fail("sparseloco_inner_steps_per_worker", f"{text!r} is not a comma-separated list of integers",
              "give one integer per worker, e.g. 30,30,15,30")
    if len(steps) != workers:
        _fail("sparseloco_inner_steps_per_worker", f"has {len(steps)} entries for {workers} workers",
              f"give exactly {workers} comma-separated values")
    if any(s < 1 for s in steps):
        _fail("sparseloco_inner_steps_per_worker", f"{steps} has a value < 1", "every worker needs at least one inner step")
    return steps


def resolve_workers(args: argparse.Namespace) -> None:
    """Map ``--sparseloco-workers`` onto ``--num-distributed-optimizer-instances`` (before Megatron's validation)."""
    if getattr(args, "sparseloco_algorithm", None) is None:
        return
    instances = getattr(args, "num_distributed_optimizer_instances", 1)
    if args.sparseloco_workers is None:
        args.sparseloco_workers = instances
    elif instances not in (1, args.sparseloco_workers):
        _fail("sparseloco_workers",
              f"{args.sparseloco_workers} disagrees with --num-distributed-optimizer-instances {instances}",
              "give only one of them, or the same value to both")
    if args.sparseloco_workers < 1:
        _fail("sparseloco_workers", f"must be >= 1, got {args.sparseloco_workers}", "use a positive number of workers")
    args.num_distributed_optimizer_instances = args.sparseloco_workers


def validate_sparseloco_args(args: argparse.Namespace, world_size: Optional[int] = None) -> argparse.Namespace:
    """Check every ``--sparseloco-*`` value and combination; resolve defaults in place.

    ``world_size`` defaults to ``args.world_size`` (set by Megatron's ``validate_args``).
    """
    algo = getattr(args, "sparseloco_algorithm", None)
    if algo is None:
        stray = [d for d in _all_flags() if d != "sparseloco_algorithm" and _explicitly_set(args, d)]
        if stray:
            raise SparseLoCoArgumentError(
                f"{', '.join(_flag(d) for d in stray)} given without --sparseloco-algorithm, so it would be ignored. "
                f"Fix: add --sparseloco-algorithm {{{','.join(ALGORITHMS)}}} or drop those flags")
        return args

    resolve_workers(args)
    W = args.sparseloco_workers
    given = {d for d in _all_flags() if _explicitly_set(args, d)}
    for dest, value in FLAG_DEFAULTS.items():
        if getattr(args, dest, None) is None:
            setattr(args, dest, value)

    # --- world layout -------------------------------------------------------------------
    world_size = world_size if world_size is not None else getattr(args, "world_size", None)
    if world_size is not None:
        tp = getattr(args, "tensor_model_parallel_size", 1) or 1
        pp = getattr(args, "pipeline_model_parallel_size", 1) or 1
        cp = getattr(args, "context_parallel_size", 1) or 1
        mp = tp * pp * cp
        if world_size % mp != 0:
            raise SparseLoCoArgumentError(
                f"world size {world_size} is not divisible by TP×PP×CP = {mp}. Fix: launch a multiple of {mp} ranks")
        dp = world_size // mp
        if dp % W != 0:
            _fail("sparseloco_workers", f"{W} workers do not divide the data-parallel size {dp} "
                  f"(world {world_size} / TP×PP×CP {mp})", f"choose W among the divisors of {dp}")
        ep = getattr(args, "expert_model_parallel_size", 1) or 1
        etp = getattr(args, "expert_tensor_parallel_size", None) or tp
        if getattr(args, "num_experts", None) and ((world_size // W) % (ep * etp * pp) != 0):
            _fail("sparseloco_workers", f"a worker of {world_size // W} ranks cannot hold whole expert-parallel "
                  f"groups (EP {ep} × expert-TP {etp} × PP {pp})", "choose W so that each worker holds whole EP groups")
    if W > 1 and not getattr(args, "use_distributed_optimizer", False):
        _fail("sparseloco_workers", f"{W} workers need Megatron's distributed optimizer (a worker is a "
              "distributed-optimizer instance)", "add --use-distributed-optimizer")
    if algo == "gasloc" and W < 2:
        _fail("sparseloco_workers", f"gasloc gossips between workers and needs W >= 2, got {W}",
              "use --sparseloco-workers 2 or more, or another --sparseloco-algorithm")

    # --- Megatron options we cannot combine with --------------------------------------------
    for dest, why in (
        ("use_megatron_fsdp", "Megatron-FSDP shards parameters differently from the distributed optimizer"),
        ("use_torch_fsdp2", "torch FSDP2 is not the distributed optimizer the outer step works on"),
        ("overlap_param_gather_with_optimizer_step", "the outer step rewrites params after the optimizer step"),
        ("calculate_per_token_loss", "per-token loss normalisation all-reduces token counts across all workers"),
        ("moe_router_enable_expert_bias", "the expert-bias update all-reduces token counts across all workers every step"),
        ("use_precision_aware_optimizer", "its fp32 master params live in the optimizer state, where the outer step "
         "cannot read or write them (the workers would never sync)"),
        ("optimizer_cpu_offload", "its fp32 master params live in the offloaded optimizer state, where the outer step "
         "cannot read or write them (the workers would never sync)"),
    ):
        if getattr(args, dest, False):
            raise SparseLoCoArgumentError(f"--{dest.replace('_', '-')} cannot be combined with --sparseloco-algorithm "
                                          f"({why}). Fix: drop --{dest.replace('_', '-')}")

    fmt = getattr(args, "ckpt_format", "torch_dist")
    if (getattr(args, "save", None) or getattr(args, "load", None)) and fmt != "torch_dist":
        raise SparseLoCoArgumentError(
            f"--ckpt-format {fmt} cannot hold the per-worker outer state (Megatron saves that format's optimizer "
            "only from data-parallel rank 0, losing the other workers' error feedback). Fix: --ckpt-format torch_dist")

    # --- inner loop -----------------------------------------------------------------------
    if args.sparseloco_inner_steps < 1:
        _fail("sparseloco_inner_steps", f"must be >= 1, got {args.sparseloco_inner_steps}", "use H >= 1 (e.g. 15)")
    if args.sparseloco_inner_steps_per_worker is not None:
        if algo != "gasloc":
            _fail("sparseloco_inner_steps_per_worker", f"only gasloc supports per-worker step counts, not {algo}",
                  "drop the flag or use --sparseloco-algorithm gasloc")
        if "sparseloco_inner_steps" in given:
            _fail("sparseloco_inner_steps", "is replaced by --sparseloco-inner-steps-per-worker when that is given",
                  "give only one of them")
        args.sparseloco_inner_steps_per_worker = parse_per_worker_steps(args.sparseloco_inner_steps_per_worker, W)
        args.sparseloco_inner_steps = max(args.sparseloco_inner_steps_per_worker)

    # --- outer optimiser ---------------------------------------------------------------------
    lr0, mom0, nest0 = ALGORITHM_DEFAULTS[algo]
    if args.sparseloco_outer_lr is None:
        args.sparseloco_outer_lr = lr0
    if args.sparseloco_outer_momentum is None:
        args.sparseloco_outer_momentum = mom0
    if args.sparseloco_outer_nesterov is None:
        args.sparseloco_outer_nesterov = nest0
    if not (args.sparseloco_outer_lr > 0):
        _fail("sparseloco_outer_lr", f"must be > 0, got {args.sparseloco_outer_lr}", f"use a positive value (default {lr0})")
    if not (0.0 <= args.sparseloco_outer_momentum < 1.0):
        _fail("sparseloco_outer_momentum", f"must be in [0, 1), got {args.sparseloco_outer_momentum}", "use e.g. 0.9")
    if algo == "average" and (args.sparseloco_outer_momentum != 0.0 or args.sparseloco_outer_lr != 1.0):
        raise SparseLoCoArgumentError(
            "--sparseloco-algorithm average is plain averaging and takes no --sparseloco-outer-lr/--sparseloco-outer-momentum. "
            "Fix: drop them, or use --sparseloco-algorithm diloco for an outer optimiser")
    if args.sparseloco_outer_nesterov and args.sparseloco_outer_momentum == 0.0:
        _fail("sparseloco_outer_nesterov", "Nesterov needs a non-zero momentum",
              "add --sparseloco-outer-momentum 0.9 or --no-sparseloco-outer-nesterov")

    # --- codec (sparseloco, compressed gossip) -----------------------------------------------
    uses_codec = algo == "sparseloco" or (algo == "gasloc" and args.sparseloco_gossip_compress)
    codec_flags = CODEC_FLAGS
    if algo == "gasloc" and "sparseloco_ef_decay" in given:
        _fail("sparseloco_ef_decay", "compressed gossip keeps the residual in its public copies (CHOCO-style) "
              "and has no decaying error-feedback buffer", "drop it")
    if not uses_codec:
        stray = [d for d in codec_flags if d in given]
        if stray:
            raise SparseLoCoArgumentError(
                f"{_flags_only(stray)} to the sparseloco codec, which {algo} "
                f"does not use here. Fix: drop them" + (" or add --sparseloco-gossip-compress" if algo == "gasloc" else ""))
    for dest in ("sparseloco_reduce", "sparseloco_chunking", "sparseloco_dense_1d", "sparseloco_aggregation"):
        if algo != "sparseloco" and dest in given:
            _fail(dest, f"only applies to sparseloco, not {algo}", "drop it")
    if args.sparseloco_aggregation == "reduce-scatter" and algo == "sparseloco":
        if args.sparseloco_chunking != "tensor":
            _fail("sparseloco_aggregation", "reduce-scatter needs per-tensor segments", "use --sparseloco-chunking tensor")
        if args.sparseloco_index_coding != "packed":
            _fail("sparseloco_aggregation", "reduce-scatter needs piece sizes known up front",
                  "use --sparseloco-index-coding packed")
    if args.sparseloco_chunking == "flat" and "sparseloco_dense_1d" in given:
        _fail("sparseloco_dense_1d", "only applies to --sparseloco-chunking tensor (flat chunking does not see "
              "tensors)", "drop it or use --sparseloco-chunking tensor")
    if args.sparseloco_chunk_size < 1:
        _fail("sparseloco_chunk_size", f"must be >= 1, got {args.sparseloco_chunk_size}", "use e.g. 4096")
    if not (1 <= args.sparseloco_topk <= args.sparseloco_chunk_size):
        _fail("sparseloco_topk", f"must be in [1, chunk size {args.sparseloco_chunk_size}], got {args.sparseloco_topk}",
              "use e.g. 64 of 4096 (1.56 %% density)".replace("%%", "%"))
    if not (0.0 <= args.sparseloco_ef_decay < 1.0):
        _fail("sparseloco_ef_decay", f"must be in [0, 1), got {args.sparseloco_ef_decay}", "use e.g. 0.95")
    if args.sparseloco_bucket_size < args.sparseloco_chunk_size:
        _fail("sparseloco_bucket_size", f"{args.sparseloco_bucket_size} is smaller than one chunk "
              f"({args.sparseloco_chunk_size})", "use a multiple of the chunk size, e.g. 16777216")
    if algo not in ("diloco", "average") and "sparseloco_diloco_comm_dtype" in given:
        _fail("sparseloco_diloco_comm_dtype", f"only applies to diloco/average, not {algo}", "drop it")

    # --- reliability ------------------------------------------------------------------------
    if args.sparseloco_consistency_check_interval < 0:
        _fail("sparseloco_consistency_check_interval", f"must be >= 0, got {args.sparseloco_consistency_check_interval}",
              "use 0 (off) or a number of outer steps")
    if algo == "gasloc" and args.sparseloco_consistency_check_interval > 0:
        _fail("sparseloco_consistency_check_interval", "gasloc workers legitimately differ between rounds, "
              "so θ_outer hashes never agree", "use 0 with gasloc")
    if not (args.sparseloco_outer_timeout > 0):
        _fail("sparseloco_outer_timeout", f"must be > 0 seconds, got {args.sparseloco_outer_timeout}", "use e.g. 600")

    # --- gossip -----------------------------------------------------------------------------
    gossip = GOSSIP_FLAGS
    if algo != "gasloc":
        stray = [d for d in gossip if d in given]
        if stray:
            raise SparseLoCoArgumentError(f"{_flags_only(stray)} to gasloc, not {algo}. "
                                          "Fix: drop them or use --sparseloco-algorithm gasloc")
    else:
        for dest in ("sparseloco_gossip_topology", "sparseloco_gossip_seed", "sparseloco_gossip_proposal_lr"):
            if getattr(args, dest) is None:
                setattr(args, dest, GOSSIP_DEFAULTS[dest])
        if not (args.sparseloco_gossip_proposal_lr > 0):
            _fail("sparseloco_gossip_proposal_lr", f"must be > 0, got {args.sparseloco_gossip_proposal_lr}", "use e.g. 1.0")
        if "sparseloco_gossip_step" in given and not args.sparseloco_gossip_compress:
            _fail("sparseloco_gossip_step", "only applies to compressed gossip", "add --sparseloco-gossip-compress or drop it")
        if args.sparseloco_gossip_step is None:
            args.sparseloco_gossip_step = GOSSIP_DEFAULTS["sparseloco_gossip_step"]
        if not (0 < args.sparseloco_gossip_step <= 1):
            _fail("sparseloco_gossip_step", f"must be in (0, 1], got {args.sparseloco_gossip_step}", "use e.g. 0.05")
        if args.sparseloco_gossip_topology == "exponential" and W & (W - 1):
            _fail("sparseloco_gossip_topology", f"exponential graph needs a power-of-two number of workers, got {W}",
                  "use ring or random1/random2, or a power-of-two W")
    _validate_overlap_args(args, algo, given)
    return args


# ============================================================================ overlapped outer sync
# (issue 18; kept in one block: flags, defaults, validation)
OVERLAP_MERGES = ("replay", "lerp")
OVERLAP_DEFAULTS = {"sparseloco_overlap_steps": 0, "sparseloco_overlap_merge": "replay", "sparseloco_overlap_alpha": 0.5}
#: algorithms whose outer step can be delayed (gasloc's gossip rounds cannot, yet)
OVERLAP_ALGORITHMS = ("sparseloco", "diloco", "average")


def _add_overlap_args(g) -> None:
    g.add_argument("--sparseloco-overlap-steps", type=int, default=None,
                   help="Delayed application τ (0: blocking outer step). 1 <= τ < H: the outer collective is "
                        "launched at the end of a round and runs while the next τ inner steps compute; its "
                        "result is merged τ steps later (see --sparseloco-overlap-merge; outer/overlap.py).")
    g.add_argument("--sparseloco-overlap-merge", choices=OVERLAP_MERGES, default=None,
                   help="With --sparseloco-overlap-steps: 'replay' (default) puts the τ steps of local progress "
                        "on the new global point, θ ← θ_outer + (θ_now − θ_launch); 'lerp' is torchft's "
                        "Streaming DiLoCo θ ← lerp(θ_outer, θ_now, α).")
    g.add_argument("--sparseloco-overlap-alpha", type=float, default=None,
                   help="With --sparseloco-overlap-merge lerp: the weight α in [0, 1] of the local params "
                        "(0: discard the τ local steps, 1: keep them and ignore the global point). Default 0.5.")


def _validate_overlap_args(args: argparse.Namespace, algo: str, given) -> None:
    """``--sparseloco-overlap-*``: ranges and combinations, defaults resolved in place."""
    for dest, value in OVERLAP_DEFAULTS.items():
        if getattr(args, dest, None) is None:
            setattr(args, dest, value)
    tau, H = args.sparseloco_overlap_steps, args.sparseloco_inner_steps
    if tau < 0:
        _fail("sparseloco_overlap_steps", f"must be >= 0, got {tau}", "use 0 (blocking) or 1 <= τ < H")
    if tau > 0 and tau >= H:
        _fail("sparseloco_overlap_steps", f"τ={tau} must be < --sparseloco-inner-steps H={H} (one round in flight "
              "at a time)", f"use 1 <= τ <= {H - 1}, or raise --sparseloco-inner-steps")
    if tau > 0 and algo not in OVERLAP_ALGORITHMS:
        _fail("sparseloco_overlap_steps", f"{algo} cannot delay its outer step (its gossip rounds are not split "
              "into launch / complete)", f"use 0 with {algo}, or --sparseloco-algorithm {'/'.join(OVERLAP_ALGORITHMS)}")
    if tau == 0:
        stray = [d for d in ("sparseloco_overlap_merge", "sparseloco_overlap_alpha") if d in given]
        if stray:
            raise SparseLoCoArgumentError(f"{_flags_only(stray)} with --sparseloco-overlap-steps >= 1. "
                                          "Fix: add --sparseloco-overlap-steps τ or drop them")
    if "sparseloco_overlap_alpha" in given and args.sparseloco_overlap_merge != "lerp":
        _fail("sparseloco_overlap_alpha", f"only applies to --sparseloco-overlap-merge lerp, not "
              f"{args.sparseloco_overlap_merge}", "add --sparseloco-overlap-merge lerp or drop it")
    if not (0.0 <= args.sparseloco_overlap_alpha <= 1.0):
        _fail("sparseloco_overlap_alpha", f"must be in [0, 1], got {args.sparseloco_overlap_alpha}", "use e.g. 0.5")
