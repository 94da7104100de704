"""Network benchmark: real training over gloo/TCP under a shaped link (Linux network namespaces + tc).

    sudo python benchmarks/network.py [--quick] [--smoke] [--json docs/results/network.json]

Needs root, ``ip`` and ``tc`` (iproute2; ``apt-get install iproute2``). Exits 2 with the reason when
namespaces or tc are unavailable. Everything happens in namespaces created here and deleted at
the end (also on error); no address outside them is used (docs/design.md §4).

Uniform link: one private namespace ``slb-u-<pid>``, its loopback up and shaped with
``tc qdisc replace dev lo root tbf rate 100mbit burst 512kb latency 100ms``; the W ranks run
inside it (``ip netns exec``) and talk over 127.0.0.1. All ranks share the one shaped loopback,
so 100 Mbit/s is the *aggregate* rate of all workers' traffic, not a per-worker link.
Per method: outer-sync wall time (OuterStepStats.time_communicate_s and the whole outer step:
strategy + copy to model params + in-worker param sync), training wall time and time to a
target held-out loss (target = the worst final held-out loss among the methods, so every method
reaches it; ddp, which runs a third of the steps, is not part of the target; the clock is
training + sync time, evaluation excluded).

Heterogeneous links: a hub namespace with a bridge, one namespace per worker joined to it by a
veth pair created directly between the two namespaces; worker i has 10.77.0.(i+1)/24 on its
``eth0``. Each link is shaped with tbf in both directions (worker's ``eth0`` egress, the hub-side
peer's egress): 100 Mbit/s for every worker except the last, whose link is 10× slower
(10 Mbit/s). Compares gasloc (ring gossip) against diloco (all-reduce) in time to loss.

Sites (``--sites G``): the same hub and per-worker namespaces, the W = ``--sites-workers`` workers cut
into G contiguous sites (worker w = a·g + i of site a has 10.77.a.(i+1)/16). Each worker's link is
shaped in both directions with an htb of two classes: traffic to (from) its own site's /24 at
``--lan-rate``, traffic to (from) another site's /24 at ``--wan-rate``, plus ``--wan-delay`` of netem
delay on the way out when given (one-way, so a WAN round trip pays it once; needs sch_netem, which
some container kernels lack: then the case shapes bandwidth only). Each worker has its own WAN share
(the cost model's per-worker-link assumption, docs/scaling.md). Compares the SparseLoCo aggregations
(``--sites-methods``: all-gather, ``hier`` = hierarchical in the G sites, ``rs`` = reduce-scatter) in
outer-sync time; all-gather and hierarchical must end on the same loss (bitwise the same update).
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict
from typing import Optional

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import common  # noqa: E402
import schema  # noqa: E402
from common import ModelCfg, RunCfg  # noqa: E402

HERE = os.path.abspath(__file__)
PY = sys.executable
TBF = ["burst", "512kb", "latency", "100ms"]


# ---------------------------------------------------------------------------- netns helpers
def sh(*cmd, check=True, timeout=30):
    r = subprocess.run(list(cmd), capture_output=True, text=True, timeout=timeout)
    if check and r.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed ({r.returncode}): {r.stderr.strip()}")
    return r


def capability_problem() -> str:
    """Why this machine cannot run the benchmark ('' when it can)."""
    if os.geteuid() != 0:
        return "needs root (network namespaces and tc)"
    for tool in ("ip", "tc"):
        if shutil.which(tool) is None:
            return f"'{tool}' not found: install iproute2 (apt-get install -y iproute2)"
    probe = f"slb-probe-{os.getpid()}"
    try:
        sh("ip", "netns", "add", probe)
        try:
            sh("ip", "netns", "exec", probe, "ip", "link", "set", "lo", "up")
            sh("ip", "netns", "exec", probe, "tc", "qdisc", "replace", "dev", "lo", "root", "tbf",
               "rate", "100mbit", *TBF)
        finally:
            sh("ip", "netns", "del", probe, check=False)
    except (RuntimeError, OSError, subprocess.TimeoutExpired) as exc:
        return f"network namespaces / tc tbf unavailable: {exc}"
    return ""


class Namespaces:
    """Creates namespaces and removes every one of them on exit."""

    def __init__(self):
        self.names = []

    def add(self, name):
        sh("ip", "netns", "add", name)
        self.names.append(name)
        sh("ip", "-n", name, "link", "set", "lo", "up")
        return name

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        for name in reversed(self.names):
            sh("ip", "netns", "del", name, check=False)
        self.names = []


def uniform_netns(nss: Namespaces, rate: str) -> str:
    ns = nss.add(f"slb-u-{os.getpid()}")
    sh("ip", "netns", "exec", ns, "tc", "qdisc", "replace", "dev", "lo", "root", "tbf", "rate", rate, *TBF)
    return ns


def star_netns(nss: Namespaces, addrs, prefix_len: int, shape):
    """Hub bridge + one namespace per worker, joined to it by a veth pair (worker side ``eth0`` with
    ``addrs[i]/prefix_len``, hub side ``p<i>``); ``shape(i, ns, peer, hub)`` then shapes worker i's link.
    Returns (worker namespaces, addresses)."""
    pid = os.getpid()
    hub = nss.add(f"slb-hub-{pid}")
    sh("ip", "-n", hub, "link", "add", "br0", "type", "bridge")
    sh("ip", "-n", hub, "link", "set", "br0", "up")
    names = []
    for i, addr in enumerate(addrs):
        ns = nss.add(f"slb-w{i}-{pid}")
        peer = f"p{i}"
        sh("ip", "-n", ns, "link", "add", "eth0", "type", "veth", "peer", "name", peer, "netns", hub)
        sh("ip", "-n", hub, "link", "set", peer, "master", "br0")
        sh("ip", "-n", hub, "link", "set", peer, "up")
        sh("ip", "-n", ns, "addr", "add", f"{addr}/{prefix_len}", "dev", "eth0")
        sh("ip", "-n", ns, "link", "set", "eth0", "up")
        shape(i, ns, peer, hub)
        names.append(ns)
    return names, list(addrs)


def hetero_netns(nss: Namespaces, rates):
    """Worker i on 10.77.0.(i+1)/24, its link shaped by tbf at ``rates[i]`` in both directions."""
    def shape(i, ns, peer, hub):
        sh("ip", "netns", "exec", ns, "tc", "qdisc", "replace", "dev", "eth0", "root", "tbf", "rate", rates[i], *TBF)
        sh("ip", "netns", "exec", hub, "tc", "qdisc", "replace", "dev", peer, "root", "tbf", "rate", rates[i], *TBF)
    return star_netns(nss, [f"10.77.0.{i + 1}" for i in range(len(rates))], 24, shape)


def site_of(addr: str) -> int:
    return int(addr.split(".")[2])


def sites_addresses(world: int, sites: int):
    """10.77.a.(i+1) for worker w = a·g + i of site a (g = W / G)."""
    if sites < 2 or world % sites:
        raise SystemExit(f"--sites {sites}: must be >= 2 and divide --sites-workers {world}")
    g = world // sites
    return [f"10.77.{w // g}.{w % g + 1}" for w in range(world)]


def sites_tc_commands(dev: str, addr: str, sites: int, lan_rate: str, wan_rate: str, wan_delay: str,
                      toward_worker: bool):
    """tc commands shaping one side of a worker's link: class 1:10 (its own site, LAN rate, the default)
    and 1:20 (the other sites' /24s, WAN rate; the worker's egress adds the netem delay). Matched on the
    destination on the worker's egress, on the source on the hub side (traffic toward the worker)."""
    own = site_of(addr)
    cmds = [["tc", "qdisc", "replace", "dev", dev, "root", "handle", "1:", "htb", "default", "10"],
            ["tc", "class", "add", "dev", dev, "parent", "1:", "classid", "1:10", "htb", "rate", lan_rate,
             "burst", "512k"],
            ["tc", "class", "add", "dev", dev, "parent", "1:", "classid", "1:20", "htb", "rate", wan_rate,
             "burst", "512k"]]
    if wan_delay and not toward_worker:
        cmds.append(["tc", "qdisc", "add", "dev", dev, "parent", "1:20", "handle", "20:", "netem", "delay",
                     wan_delay, "limit", "100000"])
    for b in range(sites):
        if b != own:
            cmds.append(["tc", "filter", "add", "dev", dev, "parent", "1:", "protocol", "ip", "prio", "1", "u32",
                         "match", "ip", "src" if toward_worker else "dst", f"10.77.{b}.0/24", "flowid", "1:20"])
    return cmds


def sites_netns(nss: Namespaces, world: int, sites: int, lan_rate: str, wan_rate: str, wan_delay: str):
    """One namespace per worker in G sites on a /16 (see the module docstring); returns (names, addrs)."""
    addrs = sites_addresses(world, sites)

    def shape(i, ns, peer, hub):
        for toward_worker, where, dev in ((False, ns, "eth0"), (True, hub, peer)):
            for cmd in sites_tc_commands(dev, addrs[i], sites, lan_rate, wan_rate, wan_delay, toward_worker):
                sh("ip", "netns", "exec", where, *cmd)
    return star_netns(nss, addrs, 16, shape)


# ---------------------------------------------------------------------------- jobs
def _training_spec(model, runs, paths) -> dict:
    return {"model": asdict(model), "runs": [asdict(r) for r in runs], "paths": paths}


def _write_spec(tmp, spec: dict) -> str:
    path = os.path.join(tmp, "spec.json")
    with open(path, "w") as f:
        json.dump(spec, f)
    return path


def _read_spec(path):
    with open(path) as f:
        d = json.load(f)
    return ModelCfg(**d["model"]), [RunCfg(**r) for r in d["runs"]], d["paths"]


def add_worker_arguments(ap: argparse.ArgumentParser, timeout: float) -> None:
    """The hidden arguments ``run_in_namespaces`` passes the script it starts in each namespace."""
    ap.add_argument("--_worker", default=None, help=argparse.SUPPRESS)   # the spec file
    ap.add_argument("--_rank", type=int, default=0, help=argparse.SUPPRESS)
    ap.add_argument("--_world", type=int, default=2, help=argparse.SUPPRESS)
    ap.add_argument("--_out", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--_timeout", type=float, default=timeout, help=argparse.SUPPRESS)


def join_worker_group(rank: int, world: int, timeout: float) -> None:
    """Inside a worker namespace: one intra-op thread, then the gloo group of the ranks that
    ``run_in_namespaces`` started (MASTER_ADDR / MASTER_PORT from the env)."""
    from datetime import timedelta

    import torch
    import torch.distributed as dist
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=timedelta(seconds=timeout),
                            init_method=f"tcp://{os.environ['MASTER_ADDR']}:{os.environ['MASTER_PORT']}")


def worker_main(spec, rank, world, out, timeout):
    """One training rank (``--_worker``), launched inside a worker namespace."""
    model, runs, paths = _read_spec(spec)
    join_worker_group(rank, world, timeout)
    res = common.rank_run_all(rank, world, model, runs, paths)
    with open(out, "w") as f:
        json.dump(res, f)
    os._exit(0)


def uniform_main(spec, world, out, timeout):
    """``--_uniform``: inside the shaped namespace, run every method on W ranks over 127.0.0.1."""
    from megatron_sparseloco.testing.multirank import run_ranks
    model, runs, paths = _read_spec(spec)
    res = run_ranks(common.rank_run_all, world, args=(model, runs, paths), timeout=timeout,
                    env={"OMP_NUM_THREADS": "1"})
    with open(out, "w") as f:
        json.dump(res, f)


def run_uniform(model, runs, paths, world, rate, timeout):
    with Namespaces() as nss, tempfile.TemporaryDirectory(prefix="slb-net-") as tmp:
        ns = uniform_netns(nss, rate)
        spec, out = _write_spec(tmp, _training_spec(model, runs, paths)), os.path.join(tmp, "out.json")
        cmd = ["ip", "netns", "exec", ns, PY, HERE, "--_uniform", spec, "--_world", str(world), "--_out", out,
               "--_timeout", str(timeout)]
        r = subprocess.run(cmd, timeout=timeout + 60, env=dict(os.environ, OMP_NUM_THREADS="1"))
        if r.returncode != 0 or not os.path.exists(out):
            raise RuntimeError(f"uniform job failed (exit {r.returncode})")
        with open(out) as f:
            return json.load(f)


def run_hetero(model, runs, paths, rates, timeout):
    return run_namespaced(model, runs, paths, lambda nss: hetero_netns(nss, rates), timeout)


def run_namespaced(model, runs, paths, build, timeout):
    """One training rank per worker namespace that ``build(nss)`` creates (it returns their names and
    addresses): ``common.rank_run_all`` of every run."""
    return run_in_namespaces(build, _training_spec(model, runs, paths), timeout)


def wait_ranks(procs, deadline: float) -> None:
    """Wait for every rank process until ``deadline`` (time.monotonic()); a rank past it is killed. If the wait
    itself ends early (Ctrl-C, SIGTERM turned into an exception, an error), every rank still running is killed
    before the exception goes on: the namespaces are deleted on the way out, and a rank left behind would keep
    training, orphaned, on the cores the next run needs."""
    try:
        for p in procs:
            try:
                p.wait(max(1.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait(10)
    except BaseException:
        for p in procs:
            if p.poll() is None:
                p.kill()
        for p in procs:
            try:
                p.wait(10)
            except subprocess.TimeoutExpired:
                pass
        raise


def run_in_namespaces(build, spec: dict, timeout, script=HERE):
    """``script --_worker SPEC --_rank r --_world W --_out OUT --_timeout T`` (``add_worker_arguments``) in
    each worker namespace that ``build(nss)`` creates, SPEC = ``spec`` as a JSON file; returns the ranks'
    JSON outputs (a failed rank raises, with its log)."""
    with Namespaces() as nss, tempfile.TemporaryDirectory(prefix="slb-net-") as tmp:
        names, addrs = build(nss)
        world = len(names)
        spec = _write_spec(tmp, spec)
        procs, outs = [], []
        for rank, ns in enumerate(names):
            out = os.path.join(tmp, f"rank{rank}.json")
            env = dict(os.environ, OMP_NUM_THREADS="1", MASTER_ADDR=addrs[0], MASTER_PORT="29511",
                       GLOO_SOCKET_IFNAME="eth0", RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK="0")
            log = open(os.path.join(tmp, f"rank{rank}.log"), "w")
            procs.append((subprocess.Popen(["ip", "netns", "exec", ns, PY, script, "--_worker", spec, "--_rank",
                                            str(rank), "--_world", str(world), "--_out", out, "--_timeout",
                                            str(timeout)], env=env, stdout=log, stderr=subprocess.STDOUT), log))
            outs.append(out)
        wait_ranks([p for p, _ in procs], time.monotonic() + timeout + 60)
        failed = []
        for rank, (p, log) in enumerate(procs):
            log.close()
            if p.returncode != 0 or not os.path.exists(outs[rank]):
                failed.append(rank)
        if failed:
            tails = "\n".join(f"--- rank {r} ---\n" + open(os.path.join(tmp, f"rank{r}.log")).read()[-3000:]
                              for r in failed)
            raise RuntimeError(f"namespaced job: ranks {failed} failed\n{tails}")
        res = []
        for out in outs:
            with open(out) as f:
                res.append(json.load(f))
        return res


# ---------------------------------------------------------------------------- summary
def summarise(res, world, case):
    """Rows (one per method) from per-rank results; time to target filled in by ``add_time_to_target``."""
    rows = []
    for i in range(len(res[0])):
        per_rank = [res[r][i] for r in range(world)]
        run = per_rank[0]["run"]
        curves = [p["curve"] for p in per_rank]
        curve = [{"step": c0["step"], "tokens": c0["tokens"], "bytes_per_worker": c0["bytes_per_worker"],
                  "held_out_loss": sum(c[j]["held_out_loss"] for c in curves) / world,
                  "wall_s": max(c[j]["wall_s"] for c in curves)} for j, c0 in enumerate(curves[0])]
        syncs = [p["sync"] for p in per_rank]
        n_sync = len(syncs[0])
        # per outer step, the slowest rank decides; drop the first sync (connection set-up, warm-up)
        def per_step(key):
            get = key if callable(key) else (lambda rec: rec[key])
            vals = [max(get(s[j]) for s in syncs) for j in range(n_sync)]
            steady = vals[1:] if len(vals) > 1 else vals
            return (sum(steady) / len(steady)) if steady else None
        steps = curve[-1]["step"]
        wall = max(p["wall_s"] for p in per_rank)
        row = {"case": case, "label": RunCfg(**run).label(), "method": run["method"], "k": run["k"], "H": run["H"] if run["method"] not in ("ddp", "local") else None,
               "outer": common.outer_settings(RunCfg(**run), world, per_rank[0]["numel"]),
               "workers": world, "overlap_steps": run.get("overlap_steps", 0), "fragments": run.get("fragments", 1),
               "numel": per_rank[0]["numel"], "steps": steps, "tokens": curve[-1]["tokens"],
               "held_out_loss": curve[-1]["held_out_loss"],
               "bytes_sent_per_worker": int(max(p["bytes_sent"] for p in per_rank)),
               "outer_steps": n_sync,
               "sync_communicate_s": per_step("time_communicate_s") if n_sync else None,
               "sync_outer_step_s": per_step("outer_step_s") if n_sync else None,
               "sync_compress_s": per_step("time_compress_s") if n_sync else None,
               "sync_apply_s": per_step("time_apply_s") if n_sync else None,
               # τ runs: of the exposed time, the launch (local non-finite check, Δ, payloads) and the wait
               # for the collective
               "sync_launch_s": per_step("time_launch_s") if n_sync and run.get("overlap_steps") else None,
               "sync_wait_s": per_step("time_wait_s") if n_sync and run.get("overlap_steps") else None,
               # ... and the non-finite agreement (it waits for the slowest worker; τ runs: on the comm
               # thread, hidden unless the wait shows it)
               "sync_agree_s": per_step("time_agree_s") if n_sync and run["method"] not in ("ddp", "local") else None,
               # reduce-scatter: the owners' compute inside the communicate clock (the rest is the wire)
               "sync_owner_s": per_step("time_owner_s") if n_sync and run.get("aggregation") == "reduce-scatter" else None,
               # ... per rank, communicate − owners = the collectives (waits for the slowest owner included)
               "sync_wire_s": (per_step(lambda rec: rec["time_communicate_s"] - rec.get("time_owner_s", 0.0))
                               if n_sync else None),
               "step_s": wall / max(1, steps), "wall_s": wall, "curve": curve}
        rows.append(row)
    return rows


def add_time_to_target(rows, diloco_step=None):
    """Target = the worst final held-out loss among the outer methods (ddp runs fewer steps and
    local never syncs: neither is part of the target); time = the first evaluation at or below it
    (training + sync clock)."""
    outer = [r for r in rows if r["method"] not in ("ddp", "local")] or rows
    target = max(r["held_out_loss"] for r in outer)
    # the second target: blocking DiLoCo's final loss (what GASLoC and the overlapped runs must reach)
    diloco = next((r for r in rows if r["method"] == "diloco" and not r.get("overlap_steps")
                   and r.get("fragments", 1) == 1), None)
    ref = None
    if diloco is not None:  # DiLoCo's loss at its last evaluation (or at ``diloco_step``) and the time it took
        at = [p for p in diloco["curve"] if diloco_step is None or p["step"] <= diloco_step][-1]
        ref = {"step": at["step"], "loss": at["held_out_loss"], "wall_s": at["wall_s"]}
    for r in rows:
        r["target_loss"] = target
        hit = _first_at_or_below(r["curve"], target)
        r["time_to_target_s"] = hit["wall_s"] if hit else None
        r["steps_to_target"] = hit["step"] if hit else None
        if ref is not None:
            r["diloco_ref"] = ref
            hit = _first_at_or_below(r["curve"], ref["loss"])
            r["time_to_diloco_s"] = hit["wall_s"] if hit else None
            r["steps_to_diloco"] = hit["step"] if hit else None
    return rows


def _first_at_or_below(curve, loss):
    return next((p for p in curve if p["step"] > 0 and p["held_out_loss"] <= loss), None)


#: the heterogeneous case's default methods: blocking DiLoCo and SparseLoCo, GASLoC ring (the old
#: baseline), uniform one-peer matchings, bandwidth-aware matchings (dense, compressed, laplacian rule)
HETERO_METHODS = ("diloco,sparseloco:64,gasloc,gasloc:random1,gasloc:bandwidth,gasloc:bandwidth:c,"
                  "gasloc:bandwidth:lap,gasloc:bandwidth:lap:c,gasloc:bandwidth:auto")


def outer_fields(item: str, tags) -> dict:
    """'lrX' / 'muX' tags of a diloco or sparseloco spec → the run's outer lr / momentum (every compared
    method can get the same tuning: e.g. diloco:lr0.7:mu0.6, sparseloco:64:lr1.5)."""
    out = {}
    for tag in tags:
        setting = common.outer_setting(tag)
        if setting is not None and not (setting[0] == "outer_momentum" and item.startswith("sparseloco")):
            out[setting[0]] = setting[1]
        else:
            raise SystemExit(f"--hetero-methods {item!r}: unknown tag {tag!r} (lrX = outer lr"
                             + ("" if item.startswith("sparseloco") else ", muX = outer momentum") + ")")
    return out


def aggregation_fields(item: str, tags, sites: int):
    """The sparseloco aggregation tags of a spec (``hier``: hierarchical in the ``--sites`` groups,
    ``rs``: reduce-scatter) as run fields, and the remaining tags."""
    fields, rest = {}, []
    for tag in tags:
        if tag == "hier":
            if not sites:
                raise SystemExit(f"{item!r}: 'hier' needs the sites case (--sites G)")
            fields.update(aggregation="hierarchical", aggregation_groups=sites)
        elif tag == "rs":
            fields["aggregation"] = "reduce-scatter"
        else:
            rest.append(tag)
    return fields, rest


def hetero_runs(text: str, base: dict, sites: int = 0):
    runs = []
    for item in [t.strip() for t in text.split(",") if t.strip()]:
        parts = item.split(":")
        if parts[0] == "gasloc":
            runs.append(RunCfg("gasloc", **base, **common.gasloc_fields(item)))
        elif parts[0] == "sparseloco":
            has_k = len(parts) > 1 and parts[1].isdigit()
            k, tags = (int(parts[1]), parts[2:]) if has_k else (64, parts[1:])
            agg, tags = aggregation_fields(item, tags, sites)
            runs.append(RunCfg("sparseloco", k=k, **base, **agg, **outer_fields(item, tags)))
        elif parts[0] == "diloco":
            runs.append(RunCfg("diloco", **base, **outer_fields(item, parts[1:])))
        else:
            raise SystemExit(f"--hetero-methods: unknown method {item!r}")
    return runs


def tuned_settings(path: str, workers: int, model: Optional[dict] = None) -> dict:
    """The outer settings a quality results file (benchmarks/quality.py, docs/results/quality_w*.json) chose at
    ``workers`` workers: {"diloco": (lr, mu), "sparseloco": (lr, None), "sparseloco:128": ...}. With ``model``
    (this run's ModelCfg as a dict), the file must have tuned the same model: a setting chosen on one size is not
    the tuned point of another."""
    import schema
    doc = schema.load(path)
    theirs = doc["config"].get("model")
    if model is not None and isinstance(theirs, dict) and theirs and theirs != model:
        raise SystemExit(f"--tuned {path}: tuned on the model {theirs}, this run trains {model}; pass the quality "
                         "file of this model size (or --layers / --hidden / --heads of that file)")
    per_w = (doc["config"].get("tuned_per_w") or {}).get(str(workers))
    if doc["benchmark"] != "quality" or not per_w:
        raise SystemExit(f"--tuned {path}: a quality results file with settings chosen at W = {workers} "
                         f"(it has {sorted((doc['config'].get('tuned_per_w') or {}))})")
    return {key: tuple(v) for key, v in per_w.items()}


def apply_tuned(runs, tuned: dict):
    """Runs whose spec sets no outer lr get ``tuned``'s setting for their method (sparseloco: the entry of their
    k, else k = 64's, as quality.py does); the others are left as they are."""
    out = []
    for r in runs:
        key = f"{r.method}:{r.k}" if f"{r.method}:{r.k}" in tuned else r.method
        if r.method in ("diloco", "sparseloco") and r.outer_lr is None and key in tuned:
            lr, mu = tuned[key]
            r = dataclasses.replace(r, outer_lr=lr, outer_momentum=mu if r.method == "diloco" else r.outer_momentum)
        out.append(r)
    return out


def case_runs(specs: str, base: dict, tuned: dict, taus, merges, frag_runs, local: bool = True) -> list:
    """A case's runs: the ``specs`` (``--uniform-methods`` / ``--hetero-methods``); for each τ and merge rule a
    DiLoCo and a SparseLoCo k = 64 run with the outer step delayed τ inner steps; for each (P, τ) of ``frag_runs``
    the same two synced in P fragments; then, with ``local`` and any of those, ``local`` (no outer communication:
    the tokens/s ceiling).

    Every DiLoCo / SparseLoCo run whose spec sets no lr, the overlap and fragment runs included, takes ``tuned``'s
    setting (``--tuned``): each overlap / fragment row differs from its method's blocking row in τ and P only."""
    runs = hetero_runs(specs, base)
    for t in taus:
        for m in merges:
            runs += [RunCfg("diloco", overlap_steps=t, overlap_merge=m, **base),
                     RunCfg("sparseloco", k=64, overlap_steps=t, overlap_merge=m, **base)]
    for P, t in frag_runs:
        runs += [RunCfg("diloco", overlap_steps=t, fragments=P, **base),
                 RunCfg("sparseloco", k=64, overlap_steps=t, fragments=P, **base)]
    runs = apply_tuned(runs, tuned)
    if local and (taus or frag_runs):
        runs.append(RunCfg("local", **base))
    return runs


def label(r):
    if r.get("label"):
        return r["label"]
    if r["method"] == "sparseloco":
        return f"sparseloco k={r['k']} H={r['H']}"
    return r["method"] if r["method"] == "ddp" else f"{r['method']} H={r['H']}"


def fragment_settings(text: str, taus, H: int, layers: int):
    """``--fragments 3`` with τs → [(P, 0), (P, τ) for each τ < H/P]; each 2 <= P <= min(H, layers)."""
    ps = [int(p) for p in (text or "").split(",") if p.strip()]
    if any(not 2 <= p <= min(H, layers) for p in ps):
        raise SystemExit(f"--fragments: every P must be in [2, min(H={H}, layers={layers})], got {ps}")
    return [(p, t) for p in ps for t in [0, *taus] if t * p < H]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="fewer steps")
    ap.add_argument("--smoke", action="store_true", help="tiny model, a few steps: checks the plumbing only")
    ap.add_argument("--workers", type=int, default=2, help="workers on the uniform link")
    ap.add_argument("--hetero-workers", type=int, default=4, help="workers on the heterogeneous links")
    ap.add_argument("--steps", type=int, default=None)
    ap.add_argument("--hetero-steps", type=int, default=None)
    ap.add_argument("--H", type=int, default=15)
    ap.add_argument("--rate", default="100mbit")
    ap.add_argument("--slow-rate", default="10mbit")
    ap.add_argument("--no-hetero", action="store_true")
    ap.add_argument("--no-uniform", action="store_true", help="run only the heterogeneous case")
    ap.add_argument("--diloco-target-step", type=int, default=None,
                    help="time_to_diloco_s: the time to reach blocking DiLoCo's held-out loss at this step (default: "
                         "its final one); with more steps than that, the other methods may train longer to reach it")
    ap.add_argument("--hetero-methods", default=HETERO_METHODS,
                    help="comma-separated methods of the heterogeneous case: diloco, sparseloco:K, "
                         "gasloc[:TOPOLOGY][:lap][:c][:auto] (topology bandwidth: bandwidth-aware one-peer matchings; "
                         "lap: laplacian-momentum rule; c: compressed proposals; auto: H_w from step times)")
    ap.add_argument("--uniform-methods", default="diloco,sparseloco:64,gasloc",
                    help="comma-separated methods of the uniform case, as --hetero-methods (the --overlap-steps / "
                         "--fragments rows and the no-communication row are added to them)")
    ap.add_argument("--hetero-slow-compute", type=float, default=1.0,
                    help="the last worker's inner steps take this many times longer (e.g. 2: a 2x slower GPU)")
    ap.add_argument("--overlap-merges", default="replay",
                    help="comma-separated merge rules for the --overlap-steps runs (replay, lerp): one run "
                         "per τ and rule (--sparseloco-overlap-merge)")
    ap.add_argument("--overlap-steps", default="",
                    help="comma-separated τ values (e.g. 1,7,14): extra diloco and sparseloco rows with the outer "
                         "step delayed by τ inner steps (--sparseloco-overlap-steps); each τ < H")
    ap.add_argument("--fragments", default="",
                    help="comma-separated P values (e.g. 3): extra diloco and sparseloco rows with the model synced in "
                         "P fragments (--sparseloco-fragments), blocking and with every --overlap-steps τ < H/P")
    ap.add_argument("--sites", type=int, default=0,
                    help="run the sites case: --sites-workers workers in this many sites, LAN inside, WAN between")
    ap.add_argument("--sites-workers", type=int, default=8)
    ap.add_argument("--sites-steps", type=int, default=None, help="inner steps of the sites case (default 4·H)")
    ap.add_argument("--lan-rate", default="1gbit")
    ap.add_argument("--wan-rate", default="100mbit")
    ap.add_argument("--wan-delay", default="",
                    help="one-way netem delay on every worker's WAN class, e.g. 25ms (needs the kernel's sch_netem; "
                         "default: none)")
    ap.add_argument("--sites-methods", default="sparseloco:64,sparseloco:64:hier,sparseloco:64:rs",
                    help="comma-separated methods of the sites case, as --hetero-methods, with the sparseloco "
                         "tags hier (hierarchical in the --sites groups) and rs (reduce-scatter)")
    ap.add_argument("--no-ddp", action="store_true")
    ap.add_argument("--links", choices=("shared", "per-worker"), default="shared",
                    help="the uniform case's link: 'shared' (one shaped loopback carries every worker's traffic: the "
                         "rate is the aggregate) or 'per-worker' (one namespace per worker, its own link at --rate "
                         "in both directions to a hub bridge, as the heterogeneous case with every link equal)")
    ap.add_argument("--layers", type=int, default=4, help="transformer layers (default 4: the network model)")
    ap.add_argument("--hidden", type=int, default=256, help="hidden size (default 256)")
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--eval-windows", type=int, default=None, help="held-out windows (default 32; 8 with --smoke)")
    ap.add_argument("--tuned", default=None, metavar="QUALITY_JSON",
                    help="a quality results file (docs/results/quality_w*.json): diloco / sparseloco specs without an "
                         "lr tag run at the settings it chose at this case's W (default: the plugin's defaults)")
    ap.add_argument("--json", default=None)
    ap.add_argument("--timeout", type=float, default=None)
    # internal entry points (run inside a namespace)
    add_worker_arguments(ap, timeout=600)
    ap.add_argument("--_uniform", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args._worker:
        worker_main(args._worker, args._rank, args._world, args._out, args._timeout)
        return 0
    if args._uniform:
        uniform_main(args._uniform, args._world, args._out, args._timeout)
        return 0

    problem = capability_problem()
    if problem:
        print(f"[network] cannot run: {problem}", file=sys.stderr)
        return 2

    if args.smoke:
        model = ModelCfg(layers=2 if args.fragments else 1, hidden=64, heads=4, seq=32)
        steps, H, mbs = args.steps or 4, 2, 2
    else:
        if args.layers < 1 or args.hidden < 1 or args.heads < 1 or args.hidden % args.heads:
            raise SystemExit(f"--layers / --hidden / --heads: need positive values with --heads dividing --hidden, "
                             f"got {args.layers} / {args.hidden} / {args.heads}")
        model = ModelCfg(layers=args.layers, hidden=args.hidden, heads=args.heads, seq=128)
        steps, H, mbs = args.steps or (60 if args.quick else 150), args.H, 4
    t0 = time.perf_counter()
    load_before = schema.loadavg() or ""
    machine = common.machine_info()
    paths = common.ensure_data()
    base = dict(H=H, steps=steps, mbs=mbs, eval_every=H,
                eval_windows=args.eval_windows or (8 if args.smoke else 32))
    tuned = {}
    if args.tuned:
        tuned = {"uniform": tuned_settings(args.tuned, args.workers, asdict(model))} if not args.no_uniform else {}
    taus = [int(t) for t in args.overlap_steps.split(",") if t.strip()]
    if any(not 1 <= t < H for t in taus):
        raise SystemExit(f"--overlap-steps: every τ must be in [1, H={H}), got {taus}")
    merges = common.overlap_merges(args.overlap_merges)
    frag_runs = fragment_settings(args.fragments, taus, H, model.layers)
    methods = case_runs(args.uniform_methods, base, tuned.get("uniform", {}), taus, merges, frag_runs)
    if not args.no_ddp:  # dense DDP syncs every step: a third of the steps keeps its run short
        methods.insert(0, RunCfg("ddp", **dict(base, steps=steps if args.smoke else max(H, steps // 3))))
    # one run_ranks call trains every method in turn: its budget grows with the method count
    # (a 150-step run takes 60–140 s here; the fixed 1500 s ran out at 14 methods)
    timeout = args.timeout or (240 if args.smoke else 300 * len(methods))
    config = {"model": asdict(model), "H": H, "steps": steps, "micro_batch": mbs, "eval_windows": base["eval_windows"],
              "tuned_from": args.tuned, "defaults": None}
    if not args.no_uniform:
        config["uniform"] = {"rate": args.rate, "tbf": TBF, "workers": args.workers, "links": args.links,
                             "note": ("all ranks share the shaped loopback: the rate is the aggregate of all traffic"
                                      if args.links == "shared" else
                                      "one namespace per worker, veth to a hub bridge, tbf at the rate both directions")}
    out = {"results": []}
    if args.no_uniform and args.no_hetero and not args.sites:
        raise SystemExit("--no-uniform and --no-hetero together leave nothing to run (add --sites G for the sites case)")
    if args.sites:
        sites_addresses(args.sites_workers, args.sites)   # refuses a G that does not divide W, before any run
    if not args.no_uniform:
        print(f"[network] uniform: W={args.workers}, {args.links} links tbf {args.rate}, methods "
              f"{[m.method for m in methods]}, {steps} steps, H={H}", flush=True)
        res = (run_uniform(model, methods, paths, args.workers, args.rate, timeout) if args.links == "shared" else
               run_hetero(model, methods, paths, [args.rate] * args.workers, timeout))
        rows = add_time_to_target(summarise(res, args.workers, "uniform"), args.diloco_target_step)
        out["results"] += rows
        for r in rows:
            print(f"  {label(r):34s} loss {r['held_out_loss']:.4f}  sync comm {r['sync_communicate_s']}  "
                  f"outer step {r['sync_outer_step_s']}  step {r['step_s']:.3f}s  to-target {r['time_to_target_s']}",
                  flush=True)
    if not args.no_hetero:
        Wh = args.hetero_workers
        rates = [args.rate] * (Wh - 1) + [args.slow_rate]
        out["hetero"] = config["hetero"] = {"rates": rates, "tbf": TBF, "workers": Wh,
                                            "note": "one namespace per worker, veth to a hub bridge, tbf both directions"}
        hsteps = args.hetero_steps or (steps if args.smoke else (30 if args.quick else 90))
        hbase = dict(base, steps=hsteps)
        out["hetero"]["steps"] = hsteps
        if args.hetero_slow_compute < 1.0:
            raise SystemExit(f"--hetero-slow-compute must be >= 1, got {args.hetero_slow_compute}")
        hbase["slow_compute"] = args.hetero_slow_compute
        out["hetero"]["slow_compute"] = args.hetero_slow_compute
        if args.tuned:
            tuned["hetero"] = tuned_settings(args.tuned, Wh, asdict(model))
        hmethods = case_runs(args.hetero_methods, hbase, tuned.get("hetero", {}), taus, merges, frag_runs,
                             local=False)
        print(f"[network] heterogeneous: W={Wh}, links {rates}", flush=True)
        hres = run_hetero(model, hmethods, paths, rates, args.timeout or (240 if args.smoke else 300 * len(hmethods)))
        hrows = add_time_to_target(summarise(hres, Wh, "hetero"), args.diloco_target_step)
        out["results"] += hrows
        for r in hrows:
            print(f"  {label(r):34s} loss {r['held_out_loss']:.4f}  sync comm {r['sync_communicate_s']}  "
                  f"outer step {r['sync_outer_step_s']}  to-target {r['time_to_target_s']}  "
                  f"to-diloco {r.get('time_to_diloco_s')}", flush=True)
    if args.sites:
        Ws, G = args.sites_workers, args.sites
        ssteps = args.sites_steps or (steps if args.smoke else 4 * H)
        sbase = dict(base, steps=ssteps)
        smethods = hetero_runs(args.sites_methods, sbase, sites=G)
        out["sites"] = config["sites"] = {"workers": Ws, "sites": G, "lan_rate": args.lan_rate, "wan_rate": args.wan_rate,
                        "wan_delay": args.wan_delay, "steps": ssteps,
                        "note": "one namespace per worker, veth to a hub bridge; htb per link and direction: own "
                                "site at the LAN rate, other sites at the WAN rate"
                                + (" plus the one-way netem delay" if args.wan_delay else " (no delay)")}
        print(f"[network] sites: W={Ws} in {G} sites, LAN {args.lan_rate}, WAN {args.wan_rate}"
              f"{' + ' + args.wan_delay if args.wan_delay else ''}, {ssteps} steps", flush=True)
        sres = run_namespaced(model, smethods, paths,
                              lambda nss: sites_netns(nss, Ws, G, args.lan_rate, args.wan_rate, args.wan_delay),
                              args.timeout or (240 if args.smoke else 300 * len(smethods)))
        srows = summarise(sres, Ws, "sites")
        out["results"] += srows
        for r in srows:
            print(f"  {label(r):40s} loss {r['held_out_loss']:.6f}  sync comm {r['sync_communicate_s']}  "
                  f"(owners {r['sync_owner_s']}, wire {r['sync_wire_s']})  agree {r['sync_agree_s']}  "
                  f"outer step {r['sync_outer_step_s']}  step {r['step_s']:.3f}s", flush=True)
    total = time.perf_counter() - t0
    config["tuned"] = {case: {k: list(v) for k, v in t.items()} for case, t in tuned.items()} or None
    config["defaults"] = common.resolved_defaults(sorted({r["workers"] for r in out["results"]}),
                                                  next((r["numel"] for r in out["results"] if r.get("numel")), 0))
    doc = schema.document("network", schema.command_line("network.py", argv), config, out["results"],
                          machine=machine, wall_s=total, load=load_before + " -> " + (schema.loadavg() or ""))
    if args.json:
        schema.write(args.json, doc)
        print(f"[network] wrote {args.json}")
    print(f"[network] total {total:.1f}s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
