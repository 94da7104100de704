"""Streaming rounds in elastic mode on shaped links: exposed outer time with τ and P, goodput under a kill,
and a slow job with and without the straggler grace.

    python benchmarks/elastic_streaming.py [--quick] [--json docs/results/elastic_streaming.json]   (root)
    python benchmarks/elastic_streaming.py --render docs/results/elastic_streaming.json

Needs root, ``ip`` and ``tc`` (network namespaces; ``benchmarks/network.py``'s checks): exits 2 with the
reason otherwise. W = 3 workers, each its own Megatron job in the real ``megatron.training`` loop
(``examples/pretrain_gpt.py`` through ``megatron_sparseloco.testing.elastic_launcher``, which writes one
record per round), one rank each, each in its own network namespace of ``network.py``'s star: a veth
link per job to a hub bridge, shaped by tbf at 100 Mbit/s in both directions; the torchft lighthouse
runs on the hub (``--min_replicas`` 2, ``--quorum_tick_ms`` 100, heartbeat timeout 2 s) and every job
talks to the others only over its link (the outer payloads, the quorum, the heal). Model: the demo's
Megatron GPT (2 layers, hidden 128, byte vocabulary, 446 k parameters) on the Python standard library
corpus (``megatron_sparseloco.data.build``, held-out split by file), micro batch 4, sequence 128, AdamW
with Megatron's warmup + cosine schedule, ``--clip-grad 1.0``. H = 15. Outer settings: the plugin's
defaults (SparseLoCo k = 64 of 4096, 2-bit, its lr rule; DiLoCo lr 0.7, Nesterov 0.9). Every job runs at a
fixed pace (``ELASTIC_PACE``: its forward and backward take ``--pace`` seconds of wall time, a sleep
making up what the compute does not), so the three jobs sharing this machine's cores run at one speed;
the inner step and the outer rounds add their own time.

Scenarios (each a fresh lighthouse and fresh jobs, the same seeds; the clock starts when every job is
ready):

    mode rows        per method (sparseloco, diloco): blocking (τ = 0, P = 1), τ = 1, τ = 2, P = 2 and P = 2
                     with τ = 1; ``--iters`` + τ iterations (a delayed run's last launch completes)
    kill             per method, τ = 2, ``--kill-iters`` iterations: job 2 killed (SIGKILL) at 30 % of the run,
                     restarted at 50 % (it heals at the survivors' next launch and contributes again)
    slow             sparseloco, blocking, min-workers 2: job 2 at 3x the pace (1/3 of the iterations, so it
                     ends with the others); grace off (the lighthouse waits up to 60 s for it, today's
                     setting in docs/elastic.md) and ``--sparseloco-elastic-grace 0.5`` (join window 500 ms)

Measured (from the round records of every job, rank 0):

    exposed_s_per_round   the training thread's time in a round, mean over the rounds after the start-up
                          round and over the jobs: blocking, the whole round (quorum, header, exchange,
                          verdicts, vote, commit, publish); delayed, the launch (quorum, header, compress) plus
                          the completion (wait, commit, merge, publish)
    held_out_loss         Megatron's validation loss (8 held-out batches) of job 0 at its last iteration
    goodput_steps_s       inner steps that entered a committed θ_outer (H per contributor of each committed
                          round: a Δ that kept a failed round's progress counts H) per second of the run;
                          ``vs_failure_free`` against the τ = 2 row of the same method
    others_steps_s        (slow) the inner steps of jobs 0 and 1 that entered committed rounds, per second,
                          while job 2 ran; ``slow_contributions``: committed rounds job 2 contributed to

Targets (reported, never asserted): exposed time with τ <= 10 % of blocking elastic mode, held-out loss
within +0.02 of blocking; goodput with the kill >= 90 % of failure-free.
"""
from __future__ import annotations

import argparse
import glob
import json
import os
import shlex
import sys
import tempfile
import time
from typing import Dict, List, Optional

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import network  # noqa: E402
import schema  # noqa: E402

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TOKEN = "elastic-streaming-benchmark-secret-0123456789"
W = 3
HUB_ADDR = "10.77.0.254"
METHODS = ("sparseloco", "diloco")
#: (mode, τ, P) of the mode rows
MODES = (("blocking", 0, 1), ("overlap", 1, 1), ("overlap", 2, 1), ("fragments", 0, 2), ("fragments", 1, 2))


# ============================================================================ one scenario
def job_argv(a, prefixes: Dict[str, str], method: str, index: int, lighthouse: str, token: str, iters: int,
             tau: int, P: int, min_workers: int, grace: float) -> List[str]:
    from megatron_sparseloco.demo import build_command
    cmd = build_command(prefixes, nproc=1, workers=W, algorithm=method, inner_steps=a.inner_steps, train_iters=iters,
                        eval_interval=iters, eval_iters=8, log_interval=50, micro_batch_size=4, seq_length=128,
                        seed=1234)
    cmd[cmd.index("--global-batch-size") + 1] = str(4 * W)     # the run's batch: each job trains 1/W of it
    argv = ["-m", "megatron_sparseloco.testing.elastic_launcher"] + cmd[cmd.index("megatron_sparseloco.run") + 1:]
    argv += ["--sparseloco-lighthouse", lighthouse, "--sparseloco-worker-index", str(index),
             "--sparseloco-elastic-token-file", token, "--sparseloco-min-workers", str(min_workers),
             "--sparseloco-outer-timeout", str(a.outer_timeout), "--sparseloco-elastic-host", f"10.77.0.{index + 1}",
             "--sparseloco-elastic-heartbeat-interval", "0.2", "--sparseloco-elastic-quorum-timeout", "300"]
    if tau:
        argv += ["--sparseloco-overlap-steps", str(tau)]
    if P > 1:
        argv += ["--sparseloco-fragments", str(P)]
    if grace:
        argv += ["--sparseloco-elastic-grace", str(grace)]
    return argv


def records(out: str, job: int) -> List[dict]:
    recs = []
    for p in glob.glob(os.path.join(out, f"job{job}.*.rank0.jsonl")):
        attempt = int(os.path.basename(p).split(".")[1])
        with open(p) as f:
            recs += [dict(json.loads(line), attempt=attempt) for line in f]
    return sorted(recs, key=lambda r: r["t"])


def held_out_loss(log_path: str) -> Optional[float]:
    from megatron_sparseloco.demo import parse_megatron_log
    if not os.path.exists(log_path):
        return None
    with open(log_path, errors="replace") as f:
        val = [v for v in parse_megatron_log(f.read().splitlines())["validation"] if v["split"] == "valid"]
    return val[-1]["lm_loss"] if val else None


def run_scenario(a, prefixes, method: str, tau: int, P: int, *, kill: bool = False, slow: bool = False,
                 grace: float = 0.0, log_dir: str) -> dict:
    from megatron_sparseloco.testing.elastic_jobs import ElasticRun
    out = tempfile.mkdtemp(prefix="slb-es-", dir=log_dir)
    token = os.path.join(out, "token")
    with open(token, "w") as f:
        f.write(TOKEN)
    os.chmod(token, 0o600)
    barrier = os.path.join(out, "barrier")
    os.makedirs(barrier)
    iters = (a.kill_iters if kill else a.iters) + tau
    iters_of = {2: iters // 3} if slow else {}
    min_workers = 2
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([REPO] + sys.path), ELASTIC_OUT=out, PYTHONUNBUFFERED="1",
               TORCHDYNAMO_DISABLE="1", OMP_NUM_THREADS="1")
    join_ms = int(grace * 1000) if grace else (60000 if slow else 5000)
    with network.Namespaces() as nss:
        names, addrs = network.hetero_netns(nss, [a.rate] * W)
        hub = f"slb-hub-{os.getpid()}"
        network.sh("ip", "-n", hub, "addr", "add", f"{HUB_ADDR}/24", "dev", "br0")
        with ElasticRun(out, min_replicas=min_workers, env=env, heartbeat_timeout_ms=2000, join_timeout_ms=join_ms,
                        quorum_tick_ms=100, host=HUB_ADDR, netns=hub) as run:
            jobs = []
            for i in range(W):
                argv = job_argv(a, prefixes, method, i, run.lighthouse.url, token, iters_of.get(i, iters), tau, P,
                                min_workers, grace)
                pace = a.pace * (3 if slow and i == 2 else 1)
                jobs.append(run.add_job(f"job{i}", argv, ranks=1, netns=names[i], host=addrs[i],
                                        env={"ELASTIC_PACE": str(pace), "ELASTIC_BARRIER": f"{barrier}:{W}",
                                             "GLOO_SOCKET_IFNAME": "eth0"}))
            for job in jobs:
                job.env["ELASTIC_TAG"] = f"{job.name}.{job.attempt + 1}"
                job.start()
            t_kill = t_restart = None
            if kill:
                t0 = _wait_for(lambda: len(records(out, 0)) >= 1, 600, "the start-up round")
                planned = iters * (a.pace + 0.02)
                _sleep_until(t0 + 0.3 * planned)
                t_kill = time.time()
                jobs[2].kill()
                jobs[2].wait(30)
                _sleep_until(t0 + 0.5 * planned)
                jobs[2].env.pop("ELASTIC_BARRIER", None)
                jobs[2].env["ELASTIC_TAG"] = f"job2.{jobs[2].attempt + 1}"
                t_restart = time.time()
                jobs[2].start()
            codes = [job.wait(a.timeout) for job in jobs]
    recs = {i: records(out, i) for i in range(W)}
    row = measure(a, method, tau, P, recs, iters, held_out_loss(jobs[0].log_path("rank0")))
    row.update(exit_codes=codes, grace_s=grace, pace_s=a.pace)
    print(f"elastic_streaming: logs of this scenario in {out}", flush=True)
    if kill:
        row.update(scenario="kill", killed_s=t_restart - t_kill,
                   rejoin_s=_first(recs[2], lambda r: r["attempt"] == 2 and r["committed"] and r["contributing"],
                                   t_kill))
    elif slow:
        row.update(scenario="slow", **slow_figures(a, recs))
    else:
        row["scenario"] = "mode"
    return row


def measure(a, method: str, tau: int, P: int, recs: Dict[int, List[dict]], iters: int,
            loss: Optional[float]) -> dict:
    rounds = {i: [r for r in rs if not r.get("final")][1:] for i, rs in recs.items()}  # after the start-up round
    exposed = [r["exposed_s"] for rs in rounds.values() for r in rs if r.get("exposed_s") is not None]
    ref = rounds[0]
    committed = [r for r in ref if r["committed"]]
    start = min(r["t"] for rs in recs.values() for r in rs[:1]) if any(recs.values()) else 0.0
    end = max(r["t"] for rs in recs.values() for r in rs) if any(recs.values()) else 0.0
    wall = end - start
    steps = sum(a.inner_steps * len(r["contributors"]) for r in committed) if P == 1 else None
    return {"method": method, "mode": "blocking" if not tau and P == 1 else ("overlap" if tau else "fragments"),
            "overlap_steps": tau, "fragments": P, "iterations": iters, "wall_s": round(wall, 2),
            "rounds_committed": len(committed), "rounds_failed": sum(not r["committed"] for r in ref),
            "exposed_s_per_round": round(sum(exposed) / len(exposed), 4) if exposed else None,
            "quorum_s_per_round": _mean([r["seconds_quorum"] + r["seconds_header"] for r in ref]),
            "bytes_sent_per_round": _mean([r["bytes_sent"] for r in committed]),
            "held_out_loss": loss,
            "goodput_steps_s": round(steps / wall, 3) if steps and wall > 0 else None}


def slow_figures(a, recs: Dict[int, List[dict]]) -> dict:
    """The others' goodput while job 2 ran, and job 2's contributions."""
    slow = [r for r in recs[2] if not r.get("final")]
    t0, t1 = slow[0]["t"], recs[2][-1]["t"]
    rates = []
    for i in (0, 1):
        got = [r for r in recs[i][1:] if not r.get("final") and t0 < r["t"] <= t1 and r["committed"]
               and r["contributing"]]
        rates.append(a.inner_steps * len(got) / (t1 - t0))
    mine = [r for r in slow[1:] if r["committed"] and r["contributing"]]
    return {"others_steps_s": round(sum(rates) / len(rates), 3), "slow_contributions": len(mine),
            "slow_rounds": len(slow) - 1, "slow_wall_s": round(t1 - t0, 2)}


def _mean(xs) -> Optional[float]:
    xs = [x for x in xs if x is not None]
    return round(sum(xs) / len(xs), 4) if xs else None


def _first(recs, pred, after: float) -> Optional[float]:
    hit = next((r for r in recs if r["t"] > after and pred(r)), None)
    return None if hit is None else round(hit["t"] - after, 2)


def _wait_for(pred, timeout: float, what: str) -> float:
    deadline = time.time() + timeout
    while time.time() < deadline:
        if pred():
            return time.time()
        time.sleep(0.2)
    raise TimeoutError(f"timed out waiting for {what}")


def _sleep_until(t: float) -> None:
    time.sleep(max(0.0, t - time.time()))


# ============================================================================ the run, the tables
def summarize(rows: List[dict]) -> Dict[str, Optional[float]]:
    """Per method: exposed time and loss of each delayed / fragment row against blocking; the kill's goodput
    against the failure-free τ = 2 row; the slow job's others' goodput, grace on against off."""
    out: Dict[str, Optional[float]] = {}
    for m in METHODS:
        base = next((r for r in rows if r["scenario"] == "mode" and r["method"] == m and r["mode"] == "blocking"), None)
        for r in rows:
            if r["scenario"] == "mode" and r["method"] == m and r is not base and base and base["exposed_s_per_round"]:
                key = f"{m}_tau{r['overlap_steps']}_P{r['fragments']}"
                out[f"{key}_exposed_vs_blocking"] = round(r["exposed_s_per_round"] / base["exposed_s_per_round"], 4)
                if r["held_out_loss"] is not None and base["held_out_loss"] is not None:
                    out[f"{key}_loss_delta"] = round(r["held_out_loss"] - base["held_out_loss"], 4)
        free = next((r for r in rows if r["scenario"] == "mode" and r["method"] == m and r["overlap_steps"] == 2
                     and r["fragments"] == 1), None)
        kill = next((r for r in rows if r["scenario"] == "kill" and r["method"] == m), None)
        if free and kill and free["goodput_steps_s"] and kill["goodput_steps_s"]:
            out[f"{m}_kill_goodput_vs_failure_free"] = round(kill["goodput_steps_s"] / free["goodput_steps_s"], 4)
    on = next((r for r in rows if r["scenario"] == "slow" and r["grace_s"]), None)
    off = next((r for r in rows if r["scenario"] == "slow" and not r["grace_s"]), None)
    if on and off and off["others_steps_s"]:
        out["slow_others_goodput_grace_on_vs_off"] = round(on["others_steps_s"] / off["others_steps_s"], 4)
    return out


def markdown(doc: dict) -> str:
    rows = doc["rows"]
    f = lambda x, d=3: "—" if x is None else f"{x:.{d}f}"   # noqa: E731
    lines = ["| method | mode | τ | P | exposed s / round | vs blocking | held-out loss | Δ loss | rounds committed / "
             "failed | bytes sent / round |", "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for m in METHODS:
        base = next((r for r in rows if r["scenario"] == "mode" and r["method"] == m and r["mode"] == "blocking"), None)
        for r in [r for r in rows if r["scenario"] == "mode" and r["method"] == m]:
            ratio = (r["exposed_s_per_round"] / base["exposed_s_per_round"]
                     if base and r["exposed_s_per_round"] and base["exposed_s_per_round"] else None)
            dl = (r["held_out_loss"] - base["held_out_loss"]
                  if base and r["held_out_loss"] is not None and base["held_out_loss"] is not None else None)
            sent = r["bytes_sent_per_round"]
            lines.append(f"| {m} | {r['mode']} | {r['overlap_steps']} | {r['fragments']} | "
                         f"{f(r['exposed_s_per_round'])} | {'—' if ratio is None else f'{ratio:.1%}'} | "
                         f"{f(r['held_out_loss'])} | {'—' if dl is None else f'{dl:+.3f}'} | "
                         f"{r['rounds_committed']} / {r['rounds_failed']} | "
                         f"{'—' if sent is None else f'{sent / 1e3:.1f} kB'} |")
    kills = [r for r in rows if r["scenario"] == "kill"]
    if kills:
        lines += ["", "| method | τ | killed for s | wall s | goodput steps/s | vs failure-free τ | rejoin s | "
                      "rounds committed / failed |", "|---|---:|---:|---:|---:|---:|---:|---:|"]
        for r in kills:
            free = next((x for x in rows if x["scenario"] == "mode" and x["method"] == r["method"]
                         and x["overlap_steps"] == r["overlap_steps"] and x["fragments"] == 1), None)
            ratio = (r["goodput_steps_s"] / free["goodput_steps_s"]
                     if free and r["goodput_steps_s"] and free["goodput_steps_s"] else None)
            lines.append(f"| {r['method']} | {r['overlap_steps']} | {f(r['killed_s'], 1)} | {f(r['wall_s'], 1)} | "
                         f"{f(r['goodput_steps_s'], 2)} | {'—' if ratio is None else f'{ratio:.1%}'} | "
                         f"{f(r.get('rejoin_s'), 1)} | {r['rounds_committed']} / {r['rounds_failed']} |")
    slow = [r for r in rows if r["scenario"] == "slow"]
    if slow:
        lines += ["", "| grace s | others' steps/s while job 2 ran | job 2: rounds / contributed to a commit | "
                      "job 2 wall s |", "|---:|---:|---:|---:|"]
        for r in sorted(slow, key=lambda r: r["grace_s"]):
            lines.append(f"| {r['grace_s']:g} | {f(r['others_steps_s'], 2)} | {r['slow_rounds']} / "
                         f"{r['slow_contributions']} | {f(r['slow_wall_s'], 1)} |")
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--iters", type=int, default=450, help="iterations of a blocking run (a delayed run: + τ)")
    p.add_argument("--kill-iters", type=int, default=600, help="iterations of the kill scenario (+ τ): its restart's "
                   "start-up (model build, imports) weighs less in a longer run")
    p.add_argument("--inner-steps", type=int, default=15, help="H")
    p.add_argument("--pace", type=float, default=0.25, help="seconds of forward + backward per iteration")
    p.add_argument("--rate", default="100mbit", help="each job's link (tbf, both directions)")
    p.add_argument("--outer-timeout", type=float, default=10.0, help="--sparseloco-outer-timeout")
    p.add_argument("--timeout", type=float, default=1800.0, help="seconds each scenario's jobs may run")
    p.add_argument("--methods", default=",".join(METHODS))
    p.add_argument("--no-modes", action="store_true", help="skip the mode rows")
    p.add_argument("--no-kill", action="store_true")
    p.add_argument("--no-slow", action="store_true")
    p.add_argument("--quick", action="store_true", help="150 iterations, τ = 2 only, sparseloco only")
    p.add_argument("--log-dir", default=None, help="keep the jobs' logs and records here")
    p.add_argument("--json", default=None)
    p.add_argument("--render", default=None, help="print the tables of a results file")
    a = p.parse_args(argv)
    if a.render:
        print(markdown(schema.load(a.render)))
        return 0
    problem = network.capability_problem()
    if problem:
        print(f"elastic_streaming: cannot run here: {problem}", file=sys.stderr)
        return 2
    from megatron_sparseloco.data.build import PREFIXES, build_dataset
    data = os.path.join(REPO, "data", "stdlib-4MB")
    build_dataset(data, max_bytes=4_000_000, log=lambda m: print(m, flush=True))
    prefixes = {s: os.path.join(data, PREFIXES[s]) for s in ("train", "valid")}
    methods = ["sparseloco"] if a.quick else [m for m in a.methods.split(",") if m]
    if a.quick:
        a.iters, a.kill_iters = min(a.iters, 150), min(a.kill_iters, 300)
    modes = [m for m in MODES if not a.quick or m[1] in (0, 2) and m[2] == 1]
    log_dir = a.log_dir or tempfile.mkdtemp(prefix="slb-es-logs-")
    os.makedirs(log_dir, exist_ok=True)
    import common
    machine, t_start, load = common.machine_info(), time.time(), [schema.loadavg()]
    rows: List[dict] = []

    def run(**kw):
        t = time.time()
        row = run_scenario(a, prefixes, log_dir=log_dir, **kw)
        row["scenario_wall_s"] = round(time.time() - t, 1)
        rows.append(row)
        print(json.dumps(row), flush=True)

    for method in methods:
        for _, tau, P in modes if not a.no_modes else []:
            run(method=method, tau=tau, P=P)
        if not a.no_kill:
            run(method=method, tau=2, P=1, kill=True)
    if not a.no_slow:
        for grace in (0.0, 0.5):
            run(method="sparseloco", tau=0, P=1, slow=True, grace=grace)
    load.append(schema.loadavg())
    from megatron_sparseloco.outer.sparseloco import default_outer_lr
    numel = common.model_numel(common.ModelCfg())
    config = {"workers": W, "iters": a.iters, "kill_iters": a.kill_iters, "inner_steps": a.inner_steps, "pace_s": a.pace, "rate": a.rate,
              "outer_timeout_s": a.outer_timeout, "min_workers": 2, "model": "2 layers x 128 (446 k), seq 128, micro 4",
              "lighthouse": {"min_replicas": 2, "quorum_tick_ms": 100, "heartbeat_timeout_ms": 2000,
                             "join_timeout_ms": "5000; slow: 60000 (grace off) or 1000 x grace"},
              "methods": methods, "modes": [list(m) for m in modes], "numel": numel,
              # the jobs set no outer flag: SparseLoCo's outer lr is the plugin's rule at W jobs (k = 64 of 4096)
              # and the model's size
              "sparseloco_outer_lr": default_outer_lr(W, 64, 4096, numel)}
    doc = schema.document("elastic_streaming", recorded_command(argv), config, rows, machine=machine,
                          wall_s=round(time.time() - t_start, 1), load=load, summary=summarize(rows))
    print(markdown(doc))
    print(json.dumps(doc["summary"], indent=1))
    if a.json:
        schema.write(a.json, doc)
    return 0


def recorded_command(argv: Optional[List[str]]) -> str:
    args = list(sys.argv[1:] if argv is None else argv)
    drop = {"--log-dir"}
    kept, skip = [], False
    for x in args:
        if skip:
            skip = False
            continue
        if x in drop:
            skip = True
            continue
        kept.append(x)
    return "python benchmarks/elastic_streaming.py" + ("" if not kept else " " + shlex.join(kept))


if __name__ == "__main__":
    sys.exit(main())
