"""Held-out loss against bytes received per worker and outer step, from quality.py result files.

    python benchmarks/support_frontier.py RESULTS.json [...] --json frontier.json --plot frontier.png

Reads the ``rows`` (``results`` in pre-schema files) of one or more ``benchmarks/quality.py --json`` files (the same W, steps
and H: the rows must be comparable), and for every SparseLoCo row computes

    received per outer step = bytes_received_per_worker / (steps / H)
    support per chunk        = the most values per chunk one round's update can carry:
                               all-gather W·k, reduce-scatter owner_k (k when not set)

then prints and plots loss against received bytes, one series per aggregation. It answers one
question: at a given number of bytes a worker receives per round, which aggregation gives the lower
loss (docs/scaling.md, "The loss follows the support").
"""
from __future__ import annotations

import argparse
import json
import re
import sys


def owner_k(label: str, k: int) -> int:
    m = re.search(r"owner-k=(\d+)", label)
    return int(m.group(1)) if m else k


def frontier_rows(rows):
    """One dict per SparseLoCo row with its per-round received bytes and per-round support."""
    rows = [r for r in rows if r.get("method") == "sparseloco"]
    keys = {(r["workers"], r["steps"], r["H"]) for r in rows}
    if len(keys) > 1:
        raise SystemExit(f"rows from different (W, steps, H) runs: {sorted(keys)}")
    out = []
    for r in rows:
        if r.get("bytes_received_per_worker") is None:
            raise SystemExit(f"{r['label']!r}: no bytes_received_per_worker (rerun it with this quality.py)")
        rounds = r["steps"] // r["H"]
        rs = "reduce-scatter" in r["label"]
        out.append({"label": r["label"], "aggregation": "reduce-scatter" if rs else
                    ("hierarchical" if "hierarchical" in r["label"] else "allgather"),
                    "k": r["k"], "workers": r["workers"], "seed": r["seed"], "held_out_loss": r["held_out_loss"],
                    "received_per_round": r["bytes_received_per_worker"] / rounds,
                    "sent_per_round": r["bytes_sent_per_worker"] / rounds,
                    "support_per_chunk": owner_k(r["label"], r["k"]) if rs else r["workers"] * r["k"]})
    return sorted(out, key=lambda x: (x["aggregation"], x["received_per_round"]))


def plot(rows, path):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    for agg, marker in (("allgather", "o"), ("reduce-scatter", "s"), ("hierarchical", "^")):
        pts = [r for r in rows if r["aggregation"] == agg]
        if not pts:
            continue
        ax.plot([p["received_per_round"] / 1e3 for p in pts], [p["held_out_loss"] for p in pts], marker=marker,
                label=agg)
        for p in pts:
            ax.annotate(p["label"].split(" lr=")[0].replace("sparseloco ", "").replace(" reduce-scatter", ""),
                        (p["received_per_round"] / 1e3, p["held_out_loss"]), fontsize=6,
                        textcoords="offset points", xytext=(3, 3))
    ax.set_xscale("log")
    ax.set_xlabel("bytes received per worker per outer step (kB)")
    ax.set_ylabel("held-out loss")
    ax.set_title(f"W = {rows[0]['workers']}: loss against received bytes")
    ax.grid(True, alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("results", nargs="+", help="quality.py --json files")
    ap.add_argument("--json", default=None)
    ap.add_argument("--plot", default=None)
    args = ap.parse_args(argv)
    rows = []
    for path in args.results:
        with open(path) as f:
            doc = json.load(f)
        rows += doc["rows"] if "rows" in doc else doc["results"]   # the schema, or a pre-schema file (docs/archive/)
    out = frontier_rows(rows)
    print("| run | aggregation | support / chunk | received / round | held-out |")
    print("|---|---|---:|---:|---:|")
    for r in out:
        print(f"| {r['label']} | {r['aggregation']} | {r['support_per_chunk']} | "
              f"{r['received_per_round'] / 1e3:.1f} kB | {r['held_out_loss']:.4f} |")
    if args.json:
        import schema
        schema.write(args.json, schema.document("support_frontier", schema.command_line("support_frontier.py", argv),
                                                {"inputs": args.results}, out))
    if args.plot:
        plot(out, args.plot)
    return 0


if __name__ == "__main__":
    sys.exit(main())
