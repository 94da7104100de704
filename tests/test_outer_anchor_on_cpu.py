"""``anchor_on_cpu`` (``--sparseloco-anchor-on-cpu``): θ_outer in host memory, bitwise the same results.

Two gloo workers run each strategy twice side by side — θ_outer on the params' device and θ_outer in
host memory (pinned when the params are on a GPU) — over the same params and the same local
progress, with several buckets per step: blocking steps, then delayed application (τ = 1) with
its merge. After every step θ_outer, the params and every per-element buffer must be bit for bit
the same. With the option the strategy's per-element state on the params' device loses θ_outer
(SparseLoCo: 8 → 4 B per shard element), and each outer step stages θ_outer there one bucket at a
time, twice per element (for Δ and for the update; tensor accounting of the step). gasloc, which updates its own θ_outer on the device inside its
gossip rounds, refuses the option.
"""
from __future__ import annotations

import pytest
import torch

from megatron_sparseloco.testing.multirank import run_ranks

CASES = {
    "sparseloco": ("sparseloco", {"bucket_numel": 64, "chunk": 64, "k": 8}),
    "sparseloco-rs-momentum": ("sparseloco", {"bucket_numel": 64, "chunk": 64, "k": 8, "aggregation": "reduce-scatter",
                                              "momentum": 0.9, "lr": 0.8}),
    "diloco": ("diloco", {"bucket_numel": 50}),
    "average": ("average", {"bucket_numel": 50}),
}


def _run(rank, world, case):
    import torch.distributed as dist
    from outer_testlib import drift, flat, make_params

    from megatron_sparseloco.outer import build_outer_strategy
    from megatron_sparseloco.outer.overlap import DelayedOuter, OverlapConfig
    from megatron_sparseloco.testing.tensor_accounting import TensorAccounting, state_bytes

    name, config = CASES[case]
    runs = {}
    for on_cpu in (False, True):
        group = dist.new_group(list(range(world)))
        params = make_params(0)
        strat = build_outer_strategy(name, params, group, names=[f"p{i}" for i in range(len(params))],
                                     anchor_on_cpu=on_cpu, **config)
        record = {"state": [], "params": [], "peak": [], "allocated": []}

        def snap():
            record["state"].append({k: v.clone() for k, v in strat.elementwise_state().items()})
            record["params"].append(flat(params).clone())

        for t in range(1, 4):                                  # blocking steps
            with torch.no_grad():
                for p, d in zip(params, drift(rank, t)):
                    p.add_(d)
            with TensorAccounting() as acc:
                strat.step()
            record["peak"].append(acc.peak["cpu"])
            record["allocated"].append(acc.allocated["cpu"])
            snap()
        drv = DelayedOuter(strat, OverlapConfig(steps=1))       # delayed application, τ = 1
        for t in range(4, 8):
            with torch.no_grad():
                for p, d in zip(params, drift(rank, t)):
                    p.add_(d)
            if t % 2 == 1:
                drv.complete()
                snap()
            else:
                drv.launch()
        drv.close()
        anchor = strat.anchor
        device_state = [v for k, v in strat.elementwise_state().items()
                        if k != "overlap_launch" and (k != "anchor" or not on_cpu)]
        record.update(numel=strat.params.numel, bucket=max(e - s for s, e in strat.buckets()),
                      anchor_place=(anchor.device.type, anchor.is_pinned()), params_place=strat.device.type,
                      device_state=sum(state_bytes(device_state).values()))
        runs[on_cpu] = record
    a, b = runs[False], runs[True]
    same = all(sa.keys() == sb.keys() and all(torch.equal(sa[k].view(torch.int32), sb[k].view(torch.int32)) for k in sa)
               for sa, sb in zip(a["state"], b["state"]))
    same_params = all(torch.equal(pa.view(torch.int32), pb.view(torch.int32)) for pa, pb in zip(a["params"], b["params"]))
    return {"same_state": same, "same_params": same_params, "steps": len(a["state"]),
            "moved": not torch.equal(a["state"][0]["anchor"], a["state"][-1]["anchor"]),
            "numel": a["numel"], "bucket": a["bucket"], "peak": (a["peak"], b["peak"]),
            "allocated": (a["allocated"], b["allocated"]),
            "device_state": (a["device_state"], b["device_state"]), "anchor_place": b["anchor_place"],
            "params_place": b["params_place"]}


def _rank(rank, world):
    return {case: _run(rank, world, case) for case in sorted(CASES)}


@pytest.mark.multirank
@pytest.mark.timeout(600)
def test_anchor_on_cpu_is_bitwise_identical_and_moves_theta_outer_off_the_device():
    res = run_ranks(_rank, 2, timeout=540)
    for by_case in res:
        for case, r in by_case.items():
            assert r["steps"] == 5 and r["moved"], (case, r)
            assert r["same_state"] and r["same_params"], (case, r)
            assert r["anchor_place"] == ("cpu", r["params_place"] == "cuda"), (case, r)   # host, pinned on a GPU
            without, with_host = r["device_state"]
            assert without - with_host == 4 * r["numel"], (case, r)                      # θ_outer left the device
            if CASES[case][0] == "sparseloco" and "momentum" not in CASES[case][1]:
                assert (without, with_host) == (8 * r["numel"], 4 * r["numel"]), (case, r)
            for p_dev, p_host in zip(*r["peak"]):      # at most one staged bucket of θ_outer alive at a time
                assert p_host - p_dev <= 4 * r["bucket"], (case, r["peak"])
            for a_dev, a_host in zip(*r["allocated"]):  # θ_outer staged twice per element: Δ, then the update
                assert a_host - a_dev == 2 * 4 * r["numel"], (case, r["allocated"])


def test_anchor_on_cpu_refused_by_gasloc_naming_the_flag(monkeypatch):
    import sys

    from megatron.training.arguments import parse_args

    from megatron_sparseloco.megatron.args import (SparseLoCoArgumentError, add_sparseloco_args,
                                                        validate_sparseloco_args)
    from megatron_sparseloco.outer import build_outer_strategy
    from megatron_sparseloco.outer.config_fields import ConfigError
    argv = ["--use-distributed-optimizer", "--sparseloco-algorithm", "gasloc", "--sparseloco-workers", "2",
            "--sparseloco-anchor-on-cpu"]
    monkeypatch.setattr(sys, "argv", ["pretrain_gpt.py", *argv])
    args = parse_args(add_sparseloco_args)
    with pytest.raises(SparseLoCoArgumentError, match=r"--sparseloco-anchor-on-cpu: gasloc .*Fix: drop it, or use "
                                                      r"--sparseloco-algorithm .*sparseloco"):
        validate_sparseloco_args(args, world_size=2)
    with pytest.raises(ConfigError, match="anchor_on_cpu"):
        build_outer_strategy("gasloc", [torch.zeros(4)], None, anchor_on_cpu=True)
