"""A run journal: each rank's result of each finished benchmark run, on disk, so a killed benchmark resumes.

A quality sweep makes tens of runs in one multi-rank launch (hours at W = 8 on 2 cores); the rows are built
only when the launch returns. With a journal, every rank writes its result of a run as soon as the run ends,
to ``DIR/<key>-rank<r>.json`` (written to a temporary name, then renamed: a file is whole or absent). A run
is *done* when all W ranks' files are there; the next launch with the same journal takes done runs from it
and makes only the others.

The key is a hash of everything a run's result depends on that the benchmark controls: the model, the
world size W, the run configuration, the data files and the CPU model (runs are deterministic per CPU model,
docs/benchmarks.md). The code is not in the key: each entry records the plugin commit it was made at, and a
benchmark that takes entries from the journal names those commits in its results file's notes. A journal
takes only the runs made on its own CPU model unless it is given ``other_cpus``: then it also takes those
made on the CPU models named there, and marks each such result with ``journal_cpu`` (a long sweep carried on
on a machine of another model; its rows then say which CPU made them).

``python benchmarks/journal.py DIR`` prints what a journal holds: per run, how many ranks recorded it, the
held-out loss at its last evaluation (rank 0's), the wall time and the commit, so the progress of a long
sweep can be read after its log is gone.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import sys
from dataclasses import asdict
from typing import Dict, List, Optional, Sequence


def run_key(model, world: int, run, cpu: str, data: str = "") -> str:
    """Hex digest identifying one run of ``run`` (a RunCfg) with ``model`` (a ModelCfg) on W = ``world``, on
    the data ``data`` names (its files' paths)."""
    ident = json.dumps({"model": asdict(model), "world": world, "run": asdict(run), "cpu": cpu, "data": data},
                       sort_keys=True)
    return hashlib.sha256(ident.encode()).hexdigest()[:24]


class RunJournal:
    """Per-rank results of finished runs under one directory (see the module docstring)."""

    def __init__(self, directory: str, cpu: str, commit: str, data: str = "", other_cpus: Sequence[str] = ()):
        self.directory = directory
        self.cpu = cpu
        self.commit = commit
        self.data = data
        self.other_cpus = [c for c in other_cpus if c != cpu]

    def _path(self, key: str, rank: int) -> str:
        return os.path.join(self.directory, f"{key}-rank{rank}.json")

    def record(self, model, world: int, rank: int, run, result: Dict) -> None:
        """Write rank ``rank``'s ``result`` of ``run`` (atomically)."""
        os.makedirs(self.directory, exist_ok=True)
        path = self._path(run_key(model, world, run, self.cpu, self.data), rank)
        tmp = f"{path}.tmp{os.getpid()}"
        with open(tmp, "w") as f:
            json.dump({"commit": self.commit, "result": result}, f)
        os.replace(tmp, path)

    def done(self, model, world: int, run) -> Optional[List[Dict]]:
        """The W per-rank results of ``run`` (each with ``journal_commit`` added, and ``journal_cpu`` where
        another CPU model made it), or None unless all W are recorded (on this CPU model, else on one of
        ``other_cpus``, in their order)."""
        for cpu in [self.cpu] + self.other_cpus:
            key = run_key(model, world, run, cpu, self.data)
            paths = [self._path(key, r) for r in range(world)]
            if all(os.path.exists(p) for p in paths):
                break
        else:
            return None
        mark = {} if cpu == self.cpu else {"journal_cpu": cpu}
        out = []
        for p in paths:
            with open(p) as f:
                entry = json.load(f)
            out.append(dict(entry["result"], journal_commit=entry["commit"], **mark))
        return out

    def split(self, model, world: int, runs: Sequence) -> tuple:
        """(index → per-rank results of the runs already done, the runs still to make, in order)."""
        done, todo = {}, []
        for i, run in enumerate(runs):
            results = self.done(model, world, run)
            if results is None:
                todo.append(run)
            else:
                done[i] = results
        return done, todo

    def clear(self) -> None:
        """Remove the journal's entries (after the benchmark wrote its results file)."""
        if not os.path.isdir(self.directory):
            return
        for name in os.listdir(self.directory):
            if name.endswith(".json") or ".json.tmp" in name:
                os.remove(os.path.join(self.directory, name))
        if not os.listdir(self.directory):
            os.rmdir(self.directory)


def summary(directory: str) -> List[Dict]:
    """One row per journal key: ``{key, ranks, run, held_out_loss, elapsed_s, commit}`` (the loss, time and
    commit are rank 0's, None where rank 0 has not recorded the run), in the order the runs ended."""
    by_key: Dict[str, Dict] = {}
    for name in sorted(os.listdir(directory)):
        if not name.endswith(".json") or "-rank" not in name:
            continue
        key, rank = name[:-5].rsplit("-rank", 1)
        path = os.path.join(directory, name)
        row = by_key.setdefault(key, {"key": key, "ranks": 0, "run": None, "held_out_loss": None,
                                      "elapsed_s": None, "commit": None, "mtime": 0.0})
        row["ranks"] += 1
        row["mtime"] = max(row["mtime"], os.path.getmtime(path))
        with open(path) as f:
            entry = json.load(f)
        row["run"] = row["run"] or entry["result"].get("run")
        if int(rank) == 0:
            curve = entry["result"].get("curve") or [{}]
            row.update(held_out_loss=curve[-1].get("held_out_loss"), elapsed_s=entry["result"].get("elapsed_s"),
                       commit=entry["commit"])
    rows = sorted(by_key.values(), key=lambda r: r["mtime"])
    for r in rows:
        del r["mtime"]
    return rows


def _describe(run: Optional[Dict]) -> str:
    """The run's label as the results files write it (``common.RunCfg.label``), with its seed."""
    if not run:
        return "?"
    from common import RunCfg   # torch comes with it: only the command line needs it
    return f"{RunCfg(**run).label()} seed={run['seed']}"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description="Print what a run journal holds (see benchmarks/journal.py).")
    ap.add_argument("directory")
    args = ap.parse_args(argv)
    if not os.path.isdir(args.directory):
        print(f"{args.directory}: no such journal directory", file=sys.stderr)
        return 2
    for r in summary(args.directory):
        loss = "-" if r["held_out_loss"] is None else f"{r['held_out_loss']:.4f}"
        secs = "-" if r["elapsed_s"] is None else f"{r['elapsed_s']:.0f} s"
        print(f"{_describe(r['run']):44s} ranks {r['ranks']:2d}  held-out {loss:>7s}  {secs:>7s}  {r['commit'] or '-'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
