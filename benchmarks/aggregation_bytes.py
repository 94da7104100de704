"""Bytes received per worker per outer step, all-gather against reduce-scatter, measured on CPU (gloo).

    python benchmarks/aggregation_bytes.py --worlds 2,4,8,16 --json aggregation_bytes.json --plot aggregation_bytes.png

One spawn of W gloo ranks per W (one rank per worker); every rank holds the same shard (a few
Llama-like 2-D weights and norms, 1.44 M elements), runs one SparseLoCo outer step with each
aggregation, and reports its counted bytes (``OuterStepStats``) and its own payload size. Printed
per W: received / own payload for both modes (targets at W = 16: reduce-scatter ≤ 3, all-gather
= W − 1 = 15 plus the 4-byte flag). ``--owner-codecs 256b8,512b2`` adds reduce-scatter rows whose
owners keep N values per chunk at B bits (``owner_k`` / ``owner_value_bits``; default: the
workers' k = 64 and 2 bits). ``--site-groups 2,4`` adds ``hierarchical G=…`` rows for every G that
divides W (``--sparseloco-aggregation hierarchical``), with the bytes its rail exchange moves over the
WAN (``wan_bytes_received``): per worker, and summed over the g workers of a site.
"""
from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

SHAPES = [("qkv", (768, 512)), ("ln1", (512,)), ("proj", (512, 512)), ("fc1", (1024, 512)), ("ln2", (512,)),
          ("fc2", (512, 512))]


def parse_owner_codec(text: str):
    """'256b8' → (256, 8); '256' → (256, 0) (0: the workers' value bits)."""
    k, _, bits = text.partition("b")
    return int(k), int(bits or 0)


def modes(owner_codecs: str, world: int = 0, site_groups: str = ""):
    """[(label, strategy fields)]: all-gather, reduce-scatter, one reduce-scatter per owner codec, then
    one hierarchical row per site-group count G that divides ``world`` (G < W: at G = W it is all-gather
    through p2p)."""
    out = [("allgather", {"aggregation": "allgather"}), ("reduce-scatter", {"aggregation": "reduce-scatter"})]
    for G in [int(t) for t in site_groups.split(",") if t]:
        if 1 < G < world and world % G == 0:
            out.append((f"hierarchical G={G}", {"aggregation": "hierarchical", "aggregation_groups": G}))
    for text in [t for t in owner_codecs.split(",") if t]:
        k, bits = parse_owner_codec(text)
        out.append((f"reduce-scatter owner {text}",
                    {"aggregation": "reduce-scatter", "owner_k": k, **({"owner_value_bits": bits} if bits else {})}))
    return out


def one_step(rank: int, world: int, owner_codecs: str = "", site_groups: str = ""):
    import torch

    from megatron_sparseloco.outer import build_outer_strategy

    out = {}
    for mode, fields in modes(owner_codecs, world, site_groups):
        g = torch.Generator().manual_seed(rank)
        params = [torch.randn(*s, generator=g) for _, s in SHAPES]
        strat = build_outer_strategy("sparseloco", params, None, names=[n for n, _ in SHAPES], **fields)
        with torch.no_grad():
            for p in params:
                p.add_(torch.randn(p.shape, generator=g) * 1e-2)
        st = strat.step().as_dict()
        out[mode] = {k: st[k] for k in ("bytes_sent", "bytes_received", "payload_bytes", "wan_bytes_received")
                     if k in st}
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--worlds", default="2,4,8,16")
    p.add_argument("--json", default=None)
    p.add_argument("--plot", default=None)
    p.add_argument("--owner-codecs", default="", help="extra reduce-scatter rows, e.g. 256b8,512 (owner k, bits)")
    p.add_argument("--site-groups", default="", help="extra hierarchical rows, e.g. 2,4 (site groups G dividing W)")
    args = p.parse_args(argv)
    from megatron_sparseloco.testing.multirank import run_ranks

    rows = []
    for w in [int(x) for x in args.worlds.split(",") if x]:
        res = run_ranks(one_step, w, (args.owner_codecs, args.site_groups), timeout=1800)
        for mode, fields in modes(args.owner_codecs, w, args.site_groups):
            recv = max(r[mode]["bytes_received"] for r in res)
            own = res[0][mode]["payload_bytes"]
            row = {"W": w, "mode": mode, "bytes_received_max": recv, "payload_bytes": own,
                   "received_over_payload": recv / own, "per_rank": [r[mode] for r in res]}
            wan = ""
            if mode.startswith("hierarchical"):
                G = fields["aggregation_groups"]
                g = w // G
                worker_in = max(r[mode]["wan_bytes_received"] for r in res)
                site_in = sum(r[mode]["wan_bytes_received"] for r in res[:g])   # site 0 = workers 0 .. g-1
                # all-gather counted per worker: each of a site's g workers receives the (W - g) remote payloads
                ag_site_in = g * (w - g) * own
                row.update(worker_wan_received=worker_in, site_wan_received=site_in,
                           allgather_site_wan_received=ag_site_in)
                wan = (f"; WAN in: per worker {worker_in / own:5.2f} x, per site {site_in / own:6.2f} x payload "
                       f"(all-gather {(w - g) * own / own:5.2f} x / {ag_site_in / own:6.2f} x)")
            rows.append(row)
            print(f"W={w:3d} {mode:28s} received {recv:10d} B = {recv / own:6.2f} x own payload ({own} B){wan}",
                  flush=True)
    if args.json:
        import schema
        config = {"shapes": SHAPES, "worlds": args.worlds, "owner_codecs": args.owner_codecs,
                  "site_groups": args.site_groups}
        schema.write(args.json, schema.document("aggregation_bytes", schema.command_line("aggregation_bytes.py", argv),
                                                config, rows))
    if args.plot:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(figsize=(5, 3.5))
        for mode in dict.fromkeys(r["mode"] for r in rows):
            pts = [(r["W"], r["received_over_payload"]) for r in rows if r["mode"] == mode]
            ax.plot([x for x, _ in pts], [y for _, y in pts], marker="o", label=mode)
        ax.set_xlabel("workers W")
        ax.set_ylabel("bytes received per worker / own payload")
        ax.grid(alpha=0.3)
        ax.legend()
        fig.tight_layout()
        fig.savefig(args.plot, dpi=120)
    return 0


if __name__ == "__main__":
    sys.exit(main())
