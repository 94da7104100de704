"""Memory of the outer step per algorithm and option, measured with tensor accounting (CPU, gloo).

    python benchmarks/memory.py [--workers 2] [--json docs/results/memory.json]

W gloo ranks (one per worker) each hold the same shard: a few 2-D weights and a norm,
``--numel`` elements in all, in buckets of ``--bucket`` elements. For every row (an algorithm
with its default settings, and an option) each rank builds the strategy, runs two outer steps
(delayed application: two launch / complete rounds) on drifting params and the checkpoint save's
share of the outer state, each under ``testing.tensor_accounting.TensorAccounting``. Reported, for
rank 0:

- persistent state, bytes per shard element, on the params' device and in host memory: every
  tensor the strategy (and the overlap driver) allocated and still holds after the steps.
  On a CPU run the params' device *is* host memory: θ_outer is counted as host memory where
  ``--sparseloco-anchor-on-cpu`` puts it there (on a GPU the accounting tells the two by device);
- outer-step transient: the most bytes alive at once during one step after the non-finite guard, per
  bucket element (blocking steps: work buffers of one bucket); with delayed application the launch
  and completion of a round (the guard included), per shard element (buffers of the whole shard
  while a round is in flight);
- the non-finite guard's transient (``OuterStrategy.first_nonfinite_tensor``: ``torch.isfinite`` of
  one tensor at a time), per element of the largest shard tensor;
- checkpoint save transient: the most bytes alive at once while the shards and θ_outer trade places
  and the outer state's sharded tensors are built, in units of the largest shard tensor (before this
  version: about five fp32 states assembled as whole parameters, ~20 B per shard element).

Allocations inside collectives and file writers (C++ without an aten op) are not counted.
"""
from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

#: rows: (label, algorithm, strategy fields, overlap τ)
ROWS = [
    ("sparseloco", "sparseloco", {}, 0),
    ("sparseloco, --sparseloco-anchor-on-cpu", "sparseloco", {"anchor_on_cpu": True}, 0),
    ("sparseloco, outer momentum 0.9", "sparseloco", {"momentum": 0.9, "lr": 1.0}, 0),
    ("sparseloco, --sparseloco-aggregation reduce-scatter", "sparseloco", {"aggregation": "reduce-scatter"}, 0),
    ("sparseloco, --sparseloco-overlap-steps 1", "sparseloco", {}, 1),
    ("sparseloco, overlap 1 + anchor on cpu", "sparseloco", {"anchor_on_cpu": True}, 1),
    ("diloco (Nesterov 0.9)", "diloco", {}, 0),
    ("diloco, --sparseloco-anchor-on-cpu", "diloco", {"anchor_on_cpu": True}, 0),
    ("diloco, --sparseloco-overlap-steps 1", "diloco", {}, 1),
    ("average", "average", {}, 0),
    ("average, --sparseloco-anchor-on-cpu", "average", {"anchor_on_cpu": True}, 0),
    ("gasloc (ring)", "gasloc", {}, 0),
    ("gasloc, --sparseloco-gossip-compress", "gasloc", {"compress": True}, 0),
]


def shapes(numel: int):
    """2-D weights of 256 columns and one norm, ``numel`` elements in all."""
    rows = (numel - 256) // 256
    parts = [rows // 4, rows // 4, rows // 2, rows - rows // 4 - rows // 4 - rows // 2]
    return [(r, 256) for r in parts if r > 0] + [(256,)]


def _measure(rank: int, world: int, numel: int, bucket: int, rows):
    import torch
    import torch.distributed as dist

    from megatron_sparseloco.megatron.checkpoint import outer_state as ckpt
    from megatron_sparseloco.megatron.main_params import MainParamShards
    from megatron_sparseloco.outer import build_outer_strategy
    from megatron_sparseloco.outer.overlap import DelayedOuter, OverlapConfig
    from megatron_sparseloco.testing.tensor_accounting import TensorAccounting

    out = {}
    for label, algo, fields, tau in rows:
        shp = shapes(numel)
        g = torch.Generator().manual_seed(0)
        params = [torch.randn(*s, generator=g) for s in shp]
        n = sum(p.numel() for p in params)
        group = dist.new_group(list(range(world)))
        with TensorAccounting() as acc:
            strat = build_outer_strategy(algo, params, group, names=[f"p{i}" for i in range(len(params))],
                                         bucket_numel=bucket, **fields)
            drv = DelayedOuter(strat, OverlapConfig(steps=tau)) if tau else None
            peaks = []
            gd = torch.Generator().manual_seed(1 + rank)
            for _ in range(2):
                with torch.no_grad():
                    for p in params:
                        p.add_(torch.randn(p.shape, generator=gd) * 1e-2)
                with TensorAccounting() as guard:
                    strat.first_nonfinite_tensor()
                with TensorAccounting() as step:
                    if drv is None:
                        # the step after the non-finite guard: the round's plan, pipelined
                        strat.begin_round(strat.new_stats(), None, held=False).run_pipelined(write_back=True)
                        strat.anchor_ready()
                    else:
                        drv.launch()
                        drv.complete()
                peaks.append(step.peak["cpu"])
                guard_peak = guard.peak["cpu"]
            if drv is not None:
                drv.close()
        held = acc.live["cpu"]
        host = strat.anchor.untyped_storage().nbytes() if fields.get("anchor_on_cpu") else 0
        save_peak = None
        if strat.capabilities.identical_across_workers:
            model = [torch.nn.Parameter(torch.zeros(s)) for s in shp]
            shards = MainParamShards(optimizer=object(), tensors=params, names=[f"p{i}" for i in range(len(params))],
                                     model_params=model, ranges=[(0, m.numel()) for m in model],
                                     all_model_params=model, shard_group=None)
            from megatron.core.dist_checkpointing.mapping import ShardedTensor
            metas = {id(m): ShardedTensor.from_rank_offsets(f"p{i}", m, replica_id=0) for i, m in enumerate(model)}
            with TensorAccounting() as save:
                ckpt.exchange_outer_and_local(strat)
                ckpt.build_save_state([strat], [shards], 0, metas,
                                      ckpt.outer_in_shards_overrides([shards], [strat]), shared=True)
                ckpt.exchange_outer_and_local(strat)
            save_peak = save.peak["cpu"] / (4 * max(p.numel() for p in params))
        largest = max(p.numel() for p in params)
        out[label] = {"numel": n, "device_B_per_elt": (held - host) / n, "host_B_per_elt": host / n,
                      "guard_B_per_largest_elt": guard_peak / largest,
                      "step_peak_B": max(peaks), "step_B_per_bucket_elt": max(peaks) / min(bucket, n),
                      "step_B_per_shard_elt": max(peaks) / n, "overlap": tau,
                      "save_peak_in_largest_tensors": save_peak}
    return out


def table(res) -> str:
    """The docs table of ``res`` (label → row, or a results document's rows, each with its ``label``)."""
    if isinstance(res, list):
        res = {r["label"]: r for r in res}
    lines = ["| algorithm, option | params' device, B / shard elt | host, B / shard elt | outer step after the guard | "
             "save | non-finite guard |", "|---|---|---|---|---|---|"]
    for label, r in res.items():
        step = (f"{r['step_B_per_shard_elt']:.2f} B / shard elt (launch + complete)" if r["overlap"]
                else f"{r['step_B_per_bucket_elt']:.2f} B / bucket elt")
        save = ("—" if r["save_peak_in_largest_tensors"] is None
                else f"{r['save_peak_in_largest_tensors']:.2f} x largest tensor")
        lines.append(f"| {label} | {r['device_B_per_elt']:.2f} | {r['host_B_per_elt']:.2f} | {step} | {save} | "
                     f"{r['guard_B_per_largest_elt']:.2f} B / elt of the largest tensor |")
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--numel", type=int, default=1 << 18, help="shard elements per rank")
    p.add_argument("--bucket", type=int, default=1 << 15, help="--sparseloco-bucket-size")
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    from megatron_sparseloco.testing.multirank import run_ranks

    res = run_ranks(_measure, args.workers, (args.numel, args.bucket, ROWS), timeout=3600)[0]
    print(f"W = {args.workers}, shard {next(iter(res.values()))['numel']} elements, bucket {args.bucket}")
    print(table(res))
    if args.json:
        sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
        import schema
        rows = [{"label": label, **r} for label, r in res.items()]
        schema.write(args.json, schema.document(
            "memory", schema.command_line("memory.py", argv),
            {"workers": args.workers, "numel": args.numel, "bucket": args.bucket, "shapes": shapes(args.numel)}, rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
