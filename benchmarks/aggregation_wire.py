"""Wire time of SparseLoCo's aggregations on emulated sites, with no training around them.

    sudo python benchmarks/aggregation_wire.py --workers 4 --sites 2 --lan-rate 1gbit --wan-rate 5mbit \
        [--rounds 6] [--modes allgather,hierarchical,reduce-scatter] [--json out.json]

``network.py --sites`` times whole training runs. On a VM with fewer cores than ranks its clocks mix
the network with CPU time: ranks reach each collective at different moments (the skew shows up in
the non-finite agreement), and reduce-scatter's communicate clock holds its owners' decode and
re-encode (``time_owner_s``). This benchmark takes the network out on its own. The same namespaces
are used (``network.sites_netns``: per-worker links, an htb with a LAN class for the own site and
a WAN class for the others; needs root, ``ip`` and ``tc``; exits 2 with the reason otherwise).

Each rank builds a SparseLoCo strategy (``--k`` of 4096, 2-bit, tensor chunking, the plugin's
defaults otherwise) over GPT-shaped fp32 tensors: the network model of docs/benchmarks.md, word and
position embeddings, per layer the QKV / projection / two MLP weights and their biases and the two
norms, then the final norm (3,258,112 elements for 4 layers, hidden 256, seq 128, vocab 257; seeded
normal values). Before each round every worker adds its own seeded drift (the stand-in for H inner
steps), then calls ``step()``. Every collective that the aggregation issues
(``ProcessGroupComm.exchange_pieces`` / ``all_gather_payloads``) is preceded by a barrier of the group and timed
alone, so a rank's ``wire_s`` is the network time of its collectives, not the wait for a
descheduled peer. Per mode and round the slowest rank counts; round 0 (connection set-up) is
dropped. Reported per mode: wire_s and each of its collectives (``wire_calls_s``), collectives per round, the strategy's compress / communicate /
owner / apply clocks, the bytes each worker hands over and receives per round (hierarchical: the WAN
share), a checksum of θ_outer after the last round (all-gather and hierarchical must agree to
the bit), and the cost model's wire time and received bytes for the same shapes and rates
(``model_wire_s``, ``model_bytes_received``: ``megatron_sparseloco.costmodel``, no latency).
"""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import sys
import time
from dataclasses import asdict

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import common  # noqa: E402
import schema  # noqa: E402
import network  # noqa: E402
from common import ModelCfg  # noqa: E402

HERE = os.path.abspath(__file__)
MODES = ("allgather", "hierarchical", "reduce-scatter")


def gpt_shapes(model: ModelCfg):
    """(name, shape) of a Megatron GPT's parameters (untied output layer left out: it is tied here)."""
    h, f = model.hidden, 4 * model.hidden
    out = [("embedding.word", (model.vocab, h)), ("embedding.position", (model.seq, h))]
    for i in range(model.layers):
        p = f"layers.{i}."
        out += [(p + "input_norm.weight", (h,)), (p + "input_norm.bias", (h,)),
                (p + "qkv.weight", (3 * h, h)), (p + "qkv.bias", (3 * h,)),
                (p + "proj.weight", (h, h)), (p + "proj.bias", (h,)),
                (p + "mlp_norm.weight", (h,)), (p + "mlp_norm.bias", (h,)),
                (p + "fc1.weight", (f, h)), (p + "fc1.bias", (f,)),
                (p + "fc2.weight", (h, f)), (p + "fc2.bias", (h,))]
    return out + [("final_norm.weight", (h,)), ("final_norm.bias", (h,))]


class WireClock:
    """Wraps the aggregation's collectives (the ``ProcessGroupComm`` methods every strategy calls): a
    barrier of the group, then the collective timed alone (an asynchronous all-gather is waited for at
    once); ``take()`` returns (seconds, the seconds of each collective in call order) since the last call."""

    def __init__(self):
        from megatron_sparseloco.comm.pending import Pending
        from megatron_sparseloco.comm.process_group import ProcessGroupComm
        self.calls = []
        for name in ("exchange_pieces", "all_gather_payloads"):
            setattr(ProcessGroupComm, name, self._timed(getattr(ProcessGroupComm, name)))
        gather = ProcessGroupComm.all_gather_payloads
        ProcessGroupComm.start_all_gather_payloads = \
            lambda comm, payload, equal_sizes=False: Pending.completed(gather(comm, payload, equal_sizes))

    def _timed(self, fn):
        import torch.distributed as dist

        def run(comm, *args, **kwargs):
            dist.barrier(group=comm.group)
            t0 = time.perf_counter()
            out = fn(comm, *args, **kwargs)
            self.calls.append(time.perf_counter() - t0)
            return out
        return run

    def take(self):
        calls, self.calls = self.calls, []
        return sum(calls), calls


def worker_main(spec_path, rank, world, out, timeout):
    """One rank (``--_worker``) inside its namespace: every mode, ``rounds`` outer steps each."""
    import torch
    import torch.distributed as dist

    from megatron_sparseloco.outer.registry import build_outer_strategy
    with open(spec_path) as f:
        spec = json.load(f)
    network.join_worker_group(rank, world, timeout)
    clock = WireClock()
    shapes = gpt_shapes(ModelCfg(**spec["model"]))
    res = {}
    for mode in spec["modes"]:
        g = torch.Generator().manual_seed(0)
        params = [torch.randn(*s, generator=g) for _, s in shapes]
        fields = dict(k=spec["k"], aggregation=mode)
        if mode == "hierarchical":
            fields["aggregation_groups"] = spec["sites"]
        strat = build_outer_strategy("sparseloco", params, None, names=[n for n, _ in shapes], **fields)
        drift = torch.Generator().manual_seed(1000 + rank)
        rounds = []
        clock.take()
        for _ in range(spec["rounds"]):
            with torch.no_grad():
                for p in params:
                    p.add_(torch.randn(p.shape, generator=drift), alpha=1e-2)
            dist.barrier()
            t0 = time.perf_counter()
            st = strat.step().as_dict()
            step_s = time.perf_counter() - t0
            wire_s, calls = clock.take()
            rounds.append({"wire_s": wire_s, "collectives_timed": len(calls), "wire_calls_s": calls, "step_s": step_s,
                           **{k: st.get(k, 0.0) for k in ("time_compress_s", "time_communicate_s", "time_apply_s",
                                                          "time_owner_s", "time_agree_s", "bytes_sent",
                                                          "bytes_received", "wan_bytes_sent", "wan_bytes_received")}})
        res[mode] = {"rounds": rounds, "numel": strat.params.numel,
                     "anchor_sha256": hashlib.sha256(strat.anchor.numpy().tobytes()).hexdigest()}
    dist.barrier()
    with open(out, "w") as f:
        json.dump(res, f)
    os._exit(0)


def summarise(per_rank, modes):
    """One row per mode: per round the slowest rank's value of each clock (mean over rounds ≥ 1), the
    bytes of rank 0 (every rank's are the same up to the owner ranges), θ_outer agreement across ranks."""
    rows = []
    for mode in modes:
        ranks = [r[mode] for r in per_rank]
        n = len(ranks[0]["rounds"])
        steady = range(1, n) if n > 1 else range(n)

        def slowest(key):
            return sum(max(r["rounds"][j][key] for r in ranks) for j in steady) / len(steady)
        row = {"mode": mode, "numel": ranks[0]["numel"], "rounds": n,
               **{k: slowest(k) for k in ("wire_s", "time_compress_s", "time_communicate_s", "time_owner_s",
                                          "time_apply_s", "step_s")},
               "collectives_per_round": ranks[0]["rounds"][-1]["collectives_timed"],
               # per collective of a round, in call order (hierarchical, one bucket: the WAN rail exchange,
               # then the LAN site gather; reduce-scatter: the piece exchange, then the owners' all-gather)
               "wire_calls_s": [sum(max(r["rounds"][j]["wire_calls_s"][c] for r in ranks) for j in steady)
                                / len(steady) for c in range(ranks[0]["rounds"][-1]["collectives_timed"])],
               **{k: int(max(r["rounds"][-1][k] for r in ranks))
                  for k in ("bytes_sent", "bytes_received", "wan_bytes_sent", "wan_bytes_received")},
               "anchor_identical_across_ranks": len({r["anchor_sha256"] for r in ranks}) == 1,
               "anchor_sha256": ranks[0]["anchor_sha256"]}
        rows.append(row)
    return rows


def rate_bps(rate: str) -> float:
    """A tc rate (``5mbit``, ``1gbit``, ``800kbit``; tc's units are powers of 10) in bit/s."""
    units = {"gbit": 1e9, "mbit": 1e6, "kbit": 1e3, "bit": 1.0}
    for unit, scale in units.items():
        if rate.endswith(unit):
            return float(rate[:-len(unit)]) * scale
    raise SystemExit(f"rate {rate!r}: expected a number with kbit, mbit or gbit")


def add_cost_model(rows, model: ModelCfg, workers: int, sites: int, k: int, lan_rate: str, wan_rate: str):
    """Each row gains ``model_wire_s`` / ``model_bytes_received``: the cost model's time on a link of the
    WAN rate with no latency (the LAN rate for hierarchical's site gather) and its received bytes
    (megatron_sparseloco.costmodel; the same GPT shapes as one worker of one rank)."""
    from megatron_sparseloco import costmodel as cm
    shapes = gpt_shapes(model)
    ranks = cm.worker_ranks(cm.Model("network", tuple(cm.Param(n, s, None, 0) for n, s in shapes), 1), 1, 1, 1,
                            cm.SparseSettings(k=k))
    link = cm.Link(rate_bps(wan_rate), 0.0, lan_bandwidth_bps=rate_bps(lan_rate), lan_latency_s=0.0)
    for r in rows:
        c = cm.mode_cost(r["mode"], ranks, workers, link, 1.0, sites=sites)
        r["model_wire_s"], r["model_bytes_received"] = c.time_s, c.bytes_received


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--workers", type=int, default=4)
    ap.add_argument("--sites", type=int, default=2)
    ap.add_argument("--lan-rate", default="1gbit")
    ap.add_argument("--wan-rate", default="5mbit")
    ap.add_argument("--wan-delay", default="", help="one-way netem delay on the WAN class (needs sch_netem)")
    ap.add_argument("--rounds", type=int, default=6, help="outer steps per mode (the first is dropped)")
    ap.add_argument("--k", type=int, default=64)
    ap.add_argument("--modes", default=",".join(MODES))
    ap.add_argument("--smoke", action="store_true", help="a 1-layer hidden-64 model: checks the plumbing only")
    ap.add_argument("--json", default=None)
    ap.add_argument("--timeout", type=float, default=300)
    network.add_worker_arguments(ap, timeout=300)
    args = ap.parse_args(argv)
    if args._worker:
        worker_main(args._worker, args._rank, args._world, args._out, args._timeout)
        return 0
    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    bad = [m for m in modes if m not in MODES]
    if bad or not modes:
        raise SystemExit(f"--modes: unknown {bad or modes}; choose from {', '.join(MODES)}")
    if args.rounds < 1:
        raise SystemExit(f"--rounds must be >= 1, got {args.rounds}")
    network.sites_addresses(args.workers, args.sites)   # refuses a G that does not divide W
    problem = network.capability_problem()
    if problem:
        print(f"[aggregation_wire] cannot run: {problem}", file=sys.stderr)
        return 2
    model = (ModelCfg(layers=1, hidden=64, heads=4, seq=32) if args.smoke
             else ModelCfg(layers=4, hidden=256, heads=4, seq=128))
    spec = {"model": asdict(model), "modes": modes, "rounds": args.rounds, "k": args.k, "sites": args.sites}
    t0 = time.perf_counter()
    machine, load_before = common.machine_info(), schema.loadavg() or ""
    res = network.run_in_namespaces(
        lambda nss: network.sites_netns(nss, args.workers, args.sites, args.lan_rate, args.wan_rate, args.wan_delay),
        spec, args.timeout, script=HERE)
    rows = summarise(res, modes)
    add_cost_model(rows, model, args.workers, args.sites, args.k, args.lan_rate, args.wan_rate)
    print(f"[aggregation_wire] W={args.workers} in {args.sites} sites, LAN {args.lan_rate}, WAN {args.wan_rate}"
          f"{' + ' + args.wan_delay if args.wan_delay else ''}, k={args.k}, {args.rounds} rounds")
    for r in rows:
        print(f"  {r['mode']:15s} wire {r['wire_s']:.3f}s ({' + '.join(f'{t:.3f}' for t in r['wire_calls_s'])}; "
              f"cost model {r['model_wire_s']:.3f}s)  "
              f"owners {r['time_owner_s']:.3f}s  compress {r['time_compress_s']:.3f}s  apply {r['time_apply_s']:.3f}s  "
              f"sent {r['bytes_sent']} B  received {r['bytes_received']} B  WAN sent {r['wan_bytes_sent']} B  "
              f"θ identical {r['anchor_identical_across_ranks']}", flush=True)
    same = {r["mode"]: r["anchor_sha256"] for r in rows}
    if "allgather" in same and "hierarchical" in same:
        print(f"  hierarchical θ_outer == all-gather's: {same['allgather'] == same['hierarchical']}")
    config = {"model": asdict(model), "workers": args.workers, "sites": args.sites, "lan_rate": args.lan_rate,
              "wan_rate": args.wan_rate, "wan_delay": args.wan_delay, "k": args.k, "rounds": args.rounds, "modes": modes}
    out = schema.document("aggregation_wire", schema.command_line("aggregation_wire.py", argv), config, rows,
                          machine=machine, wall_s=time.perf_counter() - t0,
                          load=load_before + " -> " + (schema.loadavg() or ""))
    if args.json:
        schema.write(args.json, out)
        print(f"[aggregation_wire] wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
