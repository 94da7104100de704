"""The one results schema every benchmark writes (docs/results/*.json; docs/results.md is rendered from them).

    {"schema": 1,
     "benchmark": "quality" | "network" | "codec" | ...,
     "machine":   common.machine_info() (cpu, cpus, torch, megatron_core, plugin_commit, python),
     "commit":    the plugin's commit the numbers were produced with ("+dirty": uncommitted changes),
     "date":      UTC date the run finished (YYYY-MM-DD),
     "command":   the command line that produced the file (what `make bench` runs),
     "config":    every setting of the run, defaults resolved (so a reader never has to know a default),
     "rows":      one object per measured run / case (a list; each benchmark documents its fields),
     ... optional: "wall_s" (the command's wall time), "load" (/proc/loadavg before / after), "notes"}

``document`` builds it, ``check`` lists what is wrong with one (empty: valid), ``write`` checks then writes.
"""
from __future__ import annotations

import datetime
import json
import os
import sys
from typing import Dict, List, Optional

SCHEMA_VERSION = 1
REQUIRED = ("benchmark", "machine", "commit", "command", "config", "rows")
MACHINE_KEYS = ("cpu", "cpus", "torch", "megatron_core", "plugin_commit", "python")


def loadavg() -> Optional[str]:
    """The first three fields of /proc/loadavg (None where there is none)."""
    try:
        with open("/proc/loadavg") as f:
            return " ".join(f.read().split()[:3])
    except OSError:
        return None


def command_line(script: str, argv: Optional[List[str]]) -> str:
    """``python benchmarks/<script> <args>``: the command as a reader would type it from the repo root."""
    args = list(sys.argv[1:] if argv is None else argv)
    return " ".join(["python", f"benchmarks/{script}"] + args)


def document(benchmark: str, command: str, config: Dict, rows: List[Dict], machine: Optional[Dict] = None,
             **extra) -> Dict:
    """A results document for ``benchmark``; ``machine``: ``common.machine_info()`` taken when the run started
    (default: now)."""
    if machine is None:
        sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
        import common
        machine = common.machine_info()
    doc = {"schema": SCHEMA_VERSION, "benchmark": benchmark, "machine": machine,
           "commit": machine["plugin_commit"],
           "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d"),
           "command": command, "config": config, "rows": rows}
    doc.update(extra)
    return doc


def check(doc) -> List[str]:
    """What is wrong with ``doc`` as a results document ([] when nothing)."""
    if not isinstance(doc, dict):
        return [f"not a JSON object but {type(doc).__name__}"]
    problems = [f"missing key {k!r}" for k in REQUIRED if k not in doc]
    if doc.get("schema") != SCHEMA_VERSION:
        problems.append(f"schema is {doc.get('schema')!r}, expected {SCHEMA_VERSION}")
    if "benchmark" in doc and not (isinstance(doc["benchmark"], str) and doc["benchmark"]):
        problems.append("benchmark: not a non-empty string")
    if "command" in doc and not (isinstance(doc["command"], str) and doc["command"].startswith("python benchmarks/")):
        problems.append(f"command: not a 'python benchmarks/...' command line: {doc['command']!r}")
    if "commit" in doc and not (isinstance(doc["commit"], str) and doc["commit"]):
        problems.append("commit: not a non-empty string")
    machine = doc.get("machine")
    if "machine" in doc:
        if not isinstance(machine, dict):
            problems.append("machine: not an object")
        else:
            problems += [f"machine: missing {k!r}" for k in MACHINE_KEYS if k not in machine]
    if "config" in doc and not isinstance(doc["config"], dict):
        problems.append("config: not an object")
    rows = doc.get("rows")
    if "rows" in doc:
        if not isinstance(rows, list) or not rows:
            problems.append("rows: not a non-empty list")
        elif not all(isinstance(r, dict) for r in rows):
            problems.append("rows: every row must be an object")
    return problems


def load(path: str) -> Dict:
    """Read and check one results file (ValueError naming the file and the problems)."""
    with open(path) as f:
        doc = json.load(f)
    problems = check(doc)
    if problems:
        raise ValueError(f"{path}: not a results document: " + "; ".join(problems))
    return doc


def write(path: str, doc: Dict) -> None:
    problems = check(doc)
    if problems:
        raise ValueError(f"refusing to write {path}: " + "; ".join(problems))
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as f:
        json.dump(doc, f, indent=1)
        f.write("\n")
