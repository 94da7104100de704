"""The start-up block: what the outer loop will do, printed once on rank 0 before training.

After the flags are validated and the optimizer is wrapped (so the model exists), rank 0 prints the
resolved ``--sparseloco-*`` settings, which ranks form which worker (and on which site, when
``SITES`` is set), and the bytes one outer step is expected to send per worker next to what dense
fp32 DiLoCo would send. Bytes are decimal MB, as in the log line.
"""
from __future__ import annotations

import os
from typing import Dict, List, Optional

from megatron_sparseloco.megatron.metrics import format_mb


def resolved_settings(args) -> Dict[str, object]:
    """The settings the outer loop runs with, read from the configs ``validate_sparseloco_args`` built: the
    loop's, then every flagged field of the algorithm's config that applies in its mode (a field with
    ``requires`` unmet is left out); a default set from a rule of W says so, with the rule."""
    from megatron_sparseloco.outer.config_fields import flagged_fields

    loop, config = args.sparseloco_loop_config, args.sparseloco_outer_config
    W = args.sparseloco_workers
    out: Dict[str, object] = {"algorithm": args.sparseloco_algorithm, "workers W": W}
    per_worker = loop.inner_steps_per_worker
    out["inner steps H"] = f"{loop.inner_steps} (per worker {per_worker})" if per_worker else loop.inner_steps
    for flag, spec in flagged_fields(config).items():
        if any(getattr(config, other) != needed for other, needed in spec.requires.items()):
            continue
        value = getattr(config, spec.name)
        out[flag] = ("on" if value else "off") if isinstance(value, bool) else value
        if spec.name in config.rule_fields:   # a default that follows the job's W (and k, and the model's size)
            numel = getattr(config, "model_numel", 0)
            size = f" and N = {numel / 1e6:.3g} M parameters" if numel else ""
            out[flag] = f"{value} (default for W = {W}{size}: {type(config).default_rules[spec.name][0]})"
    k, chunk = getattr(config, "k", None), getattr(config, "chunk", None)
    if k is not None and chunk and "topk" in out and out.get("chunk-size"):
        out["topk"] = f"{k} of {chunk} ({100.0 * k / chunk:.2f} % density)"
    interval = loop.consistency_check_interval
    out["consistency check"] = f"every {interval} outer steps" if interval else "off"
    timeout = loop.outer_timeout_s
    out["outer timeout"] = (f"{timeout:g} s" if timeout is not None else
                            f"{getattr(args, 'distributed_timeout_minutes', 10):g} min "
                            "(Megatron's --distributed-timeout-minutes)")
    elastic = getattr(args, "sparseloco_elastic", None)
    if elastic is not None:
        from megatron_sparseloco.elastic.config import DEFAULT_OUTER_TIMEOUT_S
        out["outer timeout"] = f"{timeout if timeout is not None else DEFAULT_OUTER_TIMEOUT_S:g} s"
        out["elastic"] = (f"worker slot {elastic.worker_index} of W = {W}, lighthouse "
                          f"{elastic.lighthouse}, a round commits with >= {elastic.min_workers} contributors, "
                          f"after a round that did not commit: {elastic.after_failed_round} the local progress")
        run = getattr(args, "sparseloco_run_global_batch_size", None)
        if run is not None:
            out["batch"] = f"the run's --global-batch-size {run}, this job's {args.global_batch_size} (1/W)"
    if getattr(config, "anchor_on_cpu", False):
        out["θ_outer"] = "in pinned host memory (--sparseloco-anchor-on-cpu)"
    P, H = loop.fragments, loop.inner_steps
    if P > 1:  # (the per-outer-step numbers below are per round: the sum of the P fragment syncs)
        out["fragments P"] = f"{P}, synced at inner steps ≡ {[p * H // P for p in range(P)]} (mod {H})"
    return out


def worker_map_lines(args, world_size: int, gpus_per_node: Optional[int] = None,
                     sites: Optional[str] = None) -> List[str]:
    """``worker w: ranks ..., nodes ...`` from the layout helper (no process group needed)."""
    from megatron_sparseloco.megatron.placement.rank_layout import LayoutError, _ranges, compute_layout
    gpn = gpus_per_node or world_size
    try:
        lay = compute_layout(max(world_size // gpn, 1), gpn, tp=args.tensor_model_parallel_size,
                             pp=args.pipeline_model_parallel_size, cp=getattr(args, "context_parallel_size", 1) or 1,
                             ep=getattr(args, "expert_model_parallel_size", 1) or 1,
                             expert_tp=getattr(args, "expert_tensor_parallel_size", None),
                             workers=args.sparseloco_workers,
                             order=("tp-cp-ep-pp-dp" if getattr(args, "use_tp_pp_dp_mapping", False)
                                    else "tp-cp-ep-dp-pp"),
                             sites=sites or None)
    except (LayoutError, ValueError, TypeError) as exc:
        return [f"  (worker map unavailable: {exc})"]
    lines = []
    for w, ranks in enumerate(lay.worker_ranks):
        site = f", site {lay.worker_sites[w]}" if sites else ""
        nodes = ",".join(str(n) for n in lay.worker_nodes[w])
        lines.append(f"  worker {w}: ranks {_ranges(ranks)} (nodes {nodes}{site})")
    return lines


def expected_rank_bytes(wrapper, args) -> Optional[int]:
    """Bytes this rank sends in one outer step (None when it depends on the round, as gossip does)."""
    if args.sparseloco_workers <= 1:
        return 0
    total = 0
    for s in wrapper.strategies:
        n = s.expected_payload_bytes()
        if n is None:
            return None
        total += n
    return total


def format_startup_block(settings: Dict[str, object], worker_lines: List[str], numel_per_worker: int,
                         bytes_per_worker: Optional[float], entropy: bool = False) -> str:
    lines = [" sparseloco | start-up: flags validated; the outer loop runs with"]
    lines += [f"   {k}: {v}" for k, v in settings.items()]
    lines.append(" sparseloco | workers (ranks per worker; only the outer step crosses workers):")
    lines += ["  " + l for l in worker_lines]
    dense = numel_per_worker * 4
    if bytes_per_worker is None:
        sent = "depends on the gossip round (point-to-point)"
    else:
        sent = ("≤ " if entropy else "") + format_mb(bytes_per_worker)
        if bytes_per_worker:
            sent += f" ({dense / bytes_per_worker:.1f}x less than dense fp32)"
    lines.append(f" sparseloco | per outer step per worker: {numel_per_worker} parameters, expected to send {sent}; "
                 f"dense fp32 would send {format_mb(dense)}")
    return "\n".join(lines)


def log_startup(wrapper, args) -> None:
    """Collective over the worker's ranks (sums its shards); global rank 0 prints the block."""
    import torch
    import torch.distributed as dist

    numel = sum(s.params.numel for s in wrapper.strategies)
    mine = expected_rank_bytes(wrapper, args)
    from megatron_sparseloco.comm.collectives import collective_device

    group = None
    if dist.is_initialized():
        from megatron.core import parallel_state
        group = parallel_state.get_intra_distributed_optimizer_instance_group()
    dev = collective_device(group)  # NCCL refuses CPU tensors
    vals = torch.tensor([float(numel), float(mine if mine is not None else -1)], dtype=torch.float64, device=dev)
    if group is not None:
        if dist.get_world_size(group) > 1:
            unknown = torch.tensor([1.0 if mine is None else 0.0], dtype=torch.float64, device=dev)
            dist.all_reduce(unknown, group=group)
            dist.all_reduce(vals, group=group)
            if unknown.item():
                mine = None
    if dist.is_initialized() and dist.get_rank() != 0:
        return
    world = dist.get_world_size() if dist.is_initialized() else 1
    gpn = int(os.environ.get("LOCAL_WORLD_SIZE", world))
    # entropy-coded indices: the expected bytes are a bound (a strategy whose bytes depend on the round says None)
    entropy = getattr(args.sparseloco_outer_config, "index_coding", None) == "entropy"
    elastic = getattr(args, "sparseloco_elastic", None)
    workers = ([f"  this job (ranks 0-{world - 1}): worker slot {elastic.worker_index} of {args.sparseloco_workers}; "
                "the other workers are jobs of their own"] if elastic is not None else
               worker_map_lines(args, world, gpn, os.environ.get("SITES")))
    print(format_startup_block(resolved_settings(args), workers,
                               int(vals[0].item()), None if mine is None else vals[1].item(), entropy), flush=True)


def outer_state_skip_warning(args) -> Optional[str]:
    """The warning for a resume that will not read the checkpoint's outer state (None when it will)."""
    if not getattr(args, "load", None) and not getattr(args, "pretrained_checkpoint", None):
        return None
    why = [f for f, on in (("--no-load-optim", getattr(args, "no_load_optim", False)),
                           ("--finetune", getattr(args, "finetune", False))) if on]
    if not why:
        return None
    return (f" sparseloco | warning: {' and '.join(why)}: the checkpoint's sparseloco outer state (θ_outer, error "
            "feedback, outer momentum, each worker's own params and inner-optimizer state) is not loaded; θ_outer is "
            "anchored on the loaded params at the first step and error feedback / outer momentum start from zero")


def warn_if_outer_state_not_loaded(args) -> None:
    msg = outer_state_skip_warning(args)
    import torch.distributed as dist
    if msg and (not dist.is_initialized() or dist.get_rank() == 0):
        print(msg, flush=True)
