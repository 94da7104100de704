"""Elastic workers under failures: goodput, lost work, detection, heal, held-out loss; against fail-fast.

    python benchmarks/elastic.py [--seconds 120] [--json docs/results/elastic.json]
    python benchmarks/elastic.py --smoke --json /tmp/elastic.json            (CI: a tiny model, seconds)
    python benchmarks/elastic.py --render docs/results/elastic.json          (the tables of docs/elastic.md)

W = 3 workers, each its own job (its own process tree, its own torch.distributed world), on the
quality benchmark's model and data (benchmarks/common.py: a megatron-core GPTModel, 2 layers,
hidden 128, byte vocabulary, the Python standard library as corpus, the held-out windows) with the
quality benchmark's inner AdamW (lr 1e-3, betas 0.9 / 0.95, wd 0.1 without the 1-D tensors, as
``common.train_torchft_diloco``: torch's AdamW, the optimizer megatron-core itself uses on CPU
without Apex) and SparseLoCo k = 64 of 4096, 2-bit, β 0.95, H = 15, the plugin's outer lr (the rule of W and k,
evaluated at each round's contributors as in elastic mode: ``rule_fields``). Worker I reads
slot I: the windows of inner step t are drawn from a generator seeded by (seed, I, t), so a job
that heals continues at the healed step and a job restarted from a checkpoint re-reads its steps.
Every worker runs at a fixed speed: an inner step takes ``--step-seconds`` of wall time (its compute,
then a sleep for the rest), so that the W jobs sharing this machine's cores do not speed up when one
of them is down (each row records how many steps' compute exceeded the pace).

The jobs are NOT megatron.training's loop: each is this file's ``--job`` driver, which runs the
inner steps itself and the outer round as the elastic toy job does (``testing/elastic_toy_job.py``):
``ElasticSession`` (real torchft lighthouse, quorum, signed round header, heal over
``SafeHealTransport``) → SparseLoCo's ``RoundPlan`` over ``session.comm`` (compress, exchange,
validation: tags, decode, a finite aggregate) → the signed verdicts → the commit vote → commit or cancel. A job that starts late (a restart) joins and heals at its first
round (θ_outer, the Adam moments, the inner step; error feedback at zero) and contributes from its
second. Fail-fast ("today") is the same driver over one c10d world spanning the jobs
(``ProcessGroupComm``, SparseLoCo's blocking step): a lost job makes the others' next collective
fail, every job exits, and all of them restart from the newest checkpoint they all hold
(``--checkpoint-every`` rounds: θ_outer, error feedback, Adam moments, inner step).

Scenarios (each a fresh lighthouse and fresh jobs, same seeds; the clock starts when every job is
ready, so start-up is not counted, except a restart's):

    failure-free           elastic, no failure (goodput reference; quorum overhead per round)
    static-failure-free    fail-fast mode, no failure (today's round time, for the quorum overhead)
    elastic-keep           job W−1 killed (SIGKILL) at 30 % of the run, restarted at 50 %; after a failed
                           round the survivors keep their local progress (the next Δ covers both rounds)
    elastic-discard        the same, discarding it (θ_local ← θ_outer, as torchft's DiLoCo)
    fail-fast              the same schedule, today's mode: all jobs stop at the failure, all restart at 50 %
                           from the last checkpoint
    elastic-stall          job W−1 stopped whole (SIGSTOP) at 30 % of the run and continued (SIGCONT) at 50 %,
                           no restart: it catches up in place as a Megatron job does (θ_outer and the outer
                           state from a live peer, error feedback at zero; its own inner step, data position
                           and Adam moments kept, its local progress carried onto the new θ_outer)
    inject-keep / inject-discard   (the kept-vs-discarded measure) no kill; every ``--fail-every``-th
                           round is made to fail on every job (an error reported before the vote), the
                           run stops after ``--inject-rounds`` committed rounds: same data, same inner
                           steps, the held-out loss differs only by what each policy does with the
                           failed rounds' local progress

Elastic settings: ``--min-workers`` M = 2 (``--sparseloco-min-workers`` and the lighthouse's
``--min_replicas``: a majority of the 3 slots, so two disjoint quorums can never both commit a
step), lighthouse heartbeat and join timeouts 5 s, ``--sparseloco-outer-timeout`` 10 s.

Measured per scenario (from the jobs' JSONL logs, every record timestamped):

    goodput            inner steps whose Δ entered a committed θ_outer of the final lineage, summed over
                       workers, per wall second of the run (a committed round counts the steps its
                       contributors' Δ covered: 2H for a Δ that kept a failed round's progress; fail-fast
                       rounds redone after the restart count once)
    discarded          inner steps computed by any job that never entered θ_outer
    detection          the kill (stop) → the survivors' next commit (fail-fast: the first commit after the restart)
    heal               seconds and bytes the restarted (continued) job received (elastic), and the kill → its
                       first contribution (rejoin); stall: the continue → its first contribution (catch-up)
    held-out loss      θ_outer's at the end of the run (equal wall time), on the quality benchmark's windows
    quorum overhead    quorum + round header seconds per round, against the round (H inner steps + the
                       outer step) of the failure-free elastic run

Targets (reported, never asserted): elastic goodput ≥ 90 % of the failure-free run's; quorum
overhead ≤ 5 % of the round. On a shared machine the scenarios run one after another under
whatever load there is; each row records the load average at its start and end.
"""
from __future__ import annotations

import argparse
import glob
import json
import os
import shlex
import signal
import sys
import time
from typing import Dict, List, Optional

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import common  # noqa: E402

TOKEN = "elastic-benchmark-secret-0123456789abcdef"


# ============================================================================ the job (one worker)
def job_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    p.add_argument("--job", action="store_true")
    p.add_argument("--mode", choices=("elastic", "static"), required=True)
    p.add_argument("--index", type=int, required=True)
    p.add_argument("--workers", type=int, required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--config", required=True, help="JSON: model, inner, outer settings")
    p.add_argument("--lighthouse", default=None)
    p.add_argument("--token-file", default=None)
    p.add_argument("--store-port", type=int, default=0, help="static: the world's TCP store (job 0 hosts it)")
    p.add_argument("--resume-step", type=int, default=-1, help="static: load the checkpoints of this step")
    p.add_argument("--go-file", default=None, help="wait for this file before the first round")
    return p.parse_args(argv)


class Log:
    def __init__(self, path: str):
        self.f = open(path, "a", buffering=1)

    def __call__(self, kind: str, **rec) -> None:
        self.f.write(json.dumps(dict(rec, k=kind, t=time.time())) + "\n")


class Worker:
    """The model, its inner optimizer and data of one worker; the outer round is the caller's."""

    def __init__(self, a: argparse.Namespace, cfg: dict):
        import torch

        from megatron_sparseloco.testing.megatron_harness import build_tiny_gpt, init_megatron

        self.a, self.cfg = a, cfg
        m = cfg["model"]
        init_megatron(seed=cfg["seed"])   # the default group is this job's world (static: all jobs')
        self.gpt = build_tiny_gpt(num_layers=m["layers"], hidden=m["hidden"], heads=m["heads"], vocab=m["vocab"],
                                  seq_len=m["seq"])[0]
        self.names = [n for n, _ in self.gpt.named_parameters()]
        self.params = [p for p in self.gpt.parameters()]
        self.opt = torch.optim.AdamW(common._adamw_param_groups(self.gpt, cfg["weight_decay"]), lr=cfg["lr"],
                                     betas=(0.9, 0.95), eps=1e-8)
        for p in self.params:   # the state AdamW would create at its first step, created now: a heal's template
            self.opt.state[p] = {"step": torch.tensor(0.0), "exp_avg": torch.zeros_like(p),
                                 "exp_avg_sq": torch.zeros_like(p)}
        self.train = common.load_tokens(cfg["paths"]["train"])
        self.windows = common.heldout_windows(common.load_tokens(cfg["paths"]["valid"]), cfg["eval_windows"], m["seq"])
        self.iteration = 0      # inner steps of this worker's lineage (its data position)
        self.delta_steps = 0    # inner steps the current Δ = θ_outer − θ_local covers
        self.computed = 0       # inner steps this process computed

    def batch(self, iteration: int):
        import numpy as np
        import torch
        m, mbs = self.cfg["model"], self.cfg["mbs"]
        gen = np.random.default_rng([int(self.cfg["seed"]), int(self.a.index), int(iteration), 7919])
        starts = gen.integers(0, len(self.train) - m["seq"] - 1, size=mbs)
        rows = torch.from_numpy(np.stack([np.asarray(self.train[s:s + m["seq"] + 1], dtype=np.int64) for s in starts]))
        return rows[:, :-1].contiguous(), rows[:, 1:].contiguous()

    def inner_steps(self, n: int, log: Log) -> None:
        import torch
        seq = self.cfg["model"]["seq"]
        pos = torch.arange(seq).unsqueeze(0).expand(self.cfg["mbs"], -1)
        pace = self.cfg["step_seconds"]
        for _ in range(n):
            t = time.perf_counter()
            tokens, labels = self.batch(self.iteration)
            self.opt.zero_grad(set_to_none=False)
            loss = self.gpt(tokens, pos, None, labels=labels).float().mean()
            loss.backward()
            self.opt.step()
            self.iteration += 1
            self.delta_steps += 1
            self.computed += 1
            spent = time.perf_counter() - t
            log("step", n=self.computed, it=self.iteration, c=round(spent, 5))
            if spent < pace:    # a worker of fixed speed, whatever else shares this machine's cores
                time.sleep(pace - spent)

    def adam_state(self) -> list:
        return [{k: self.opt.state[p][k] for k in ("step", "exp_avg", "exp_avg_sq")} for p in self.params]

    def load_adam(self, states: list) -> None:
        for p, st in zip(self.params, states):
            for k in ("step", "exp_avg", "exp_avg_sq"):
                self.opt.state[p][k].copy_(st[k])

    def heldout(self, strategy) -> float:
        """θ_outer's held-out loss (the params are put back to θ_outer first)."""
        strategy.reset_to_anchor()
        return common.heldout_loss(self.gpt, self.windows)


def _strategy(worker: Worker, comm, cfg: dict):
    from megatron_sparseloco.outer.registry import build_outer_strategy
    return build_outer_strategy("sparseloco", [p.data for p in worker.params], comm, names=worker.names,
                                **cfg["outer"])


def _wait_go(a: argparse.Namespace) -> None:
    if a.go_file:
        while not os.path.exists(a.go_file):
            time.sleep(0.02)


def _stop_now(cfg: dict, step: int) -> int:
    """1 when the run must end at this round: the stop file (wall-clock scenarios) or --rounds reached."""
    if cfg.get("stop_file") and os.path.exists(cfg["stop_file"]):
        return 1
    return int(cfg.get("rounds", 0) > 0 and step >= cfg["rounds"])


def run_elastic_job(a: argparse.Namespace, cfg: dict, log: Log) -> None:
    from megatron_sparseloco.elastic.config import ElasticConfig
    from megatron_sparseloco.elastic.session import ElasticSession
    from megatron_sparseloco.megatron.consistency import fingerprint
    from megatron_sparseloco.testing.elastic_jobs import ensure_job_store

    import torch.distributed as dist
    store = ensure_job_store()   # noqa: F841 (this job's TCP store, at MASTER_PORT: torchft's rendezvous)
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)   # this job's own world
    w = Worker(a, cfg)
    holder: dict = {}

    def state() -> dict:
        s = holder["strategy"]
        return {"anchor": s.anchor, "adam": w.adam_state(), "iteration": w.iteration}

    def load(st: dict) -> None:
        """Joining (the first round): everything, θ_local ← θ_outer. Catching up (a later round, as
        ``megatron/elastic/heal_state.py``): θ_outer only, error feedback at zero; the inner step, the
        Adam moments and (``holder["keep"]``) the local progress stay this worker's own."""
        s = holder["strategy"]
        if holder.get("joined"):
            if holder["keep"]:
                s.hold_local_progress()
                holder["holds"] = True
            s.anchor.copy_(st["anchor"])
            s.error_feedback.zero_()
            if not holder["keep"]:
                s.reset_to_anchor()
                w.delta_steps = 0
            return
        s.anchor.copy_(st["anchor"])
        w.load_adam(st["adam"])
        s.error_feedback.zero_()      # never copied
        s.reset_to_anchor()           # θ_local ← θ_outer
        w.iteration, w.delta_steps = int(st["iteration"]), 0

    el = cfg["elastic"]
    config = ElasticConfig(lighthouse=a.lighthouse, worker_index=a.index, min_workers=el["min_workers"],
                           token_file=a.token_file,
                           quorum_timeout=el["quorum_timeout"], connect_timeout=30.0,
                           heartbeat_interval=el["heartbeat_interval"]).validate()
    session = ElasticSession(config, group_rank=0, group_world_size=1, store_addr=os.environ["MASTER_ADDR"],
                             store_port=int(os.environ["MASTER_PORT"]), state_fn=state, load_fn=load,
                             outer_timeout=el["outer_timeout"])
    strategy = holder["strategy"] = _strategy(w, session.comm, cfg)
    log("ready")
    _wait_go(a)
    H, first, discard = cfg["H"], True, cfg["after_failed_round"] == "discard"
    fail_every, failed_at = cfg.get("fail_every", 0), set()
    last = None   # (proceeded, contributed, committed) of the previous round: the catch-up's progress rule
    while True:
        if not first:
            w.inner_steps(H, log)
        holder["joined"] = not first
        holder["keep"] = not discard and not (last is not None and last[0] and last[1] and not last[2])
        t_begin = time.time()
        rnd = session.begin_round(contributes=not first, finite=strategy.first_nonfinite_tensor() is None,
                                  samples=w.delta_steps, fingerprint=lambda: fingerprint([strategy.anchor]),
                                  extra={"stop": _stop_now(cfg, session.step)},
                                  ignores_non_contributors=strategy.capabilities.ignores_non_contributors)
        first = False
        if any(h is not None and h["extra"].get("stop") for h in rnd.peers):
            break
        t_header = time.time()
        plan, ok = None, True
        if rnd.exchange:
            session.comm.set_contributors(rnd.contributors)
            plan = strategy.begin_round(strategy.new_stats(), None, held=True, snapshot=True)
            plan.compress_all()
            plan.exchange_all()
            ok = not session.comm.failed and session.comm.rejected is None
            if ok:   # everything received checked before the vote, as a Megatron job does
                plan.validate_all()
                ok = plan.aggregate_finite()
        session.agree(ok)
        injected = bool(fail_every) and rnd.step % fail_every == fail_every - 1 and rnd.step not in failed_at
        if injected:   # the same rule on every job: every job rolls back this round, once per step
            failed_at.add(rnd.step)
            session.report_error(RuntimeError("injected failed round"))
        t_exchange = time.time()
        committed = session.finish_round()
        covered = w.delta_steps
        holds = holder.pop("holds", False)    # a catch-up that keeps its progress holds it in the params
        if plan is not None and committed:
            plan.commit(write_back=not holds)
            if not holds:
                w.delta_steps = 0
        else:
            if plan is not None:
                plan.cancel()
            if discard and not rnd.healed and w.delta_steps:
                strategy.reset_to_anchor()
                w.delta_steps = 0
        if holds:
            strategy.apply_local_progress()
        last = (rnd.proceed, rnd.contributes, committed)
        heals = [vars(r) for r in session.transport.records]
        session.transport.records.clear()
        log("round", t_begin=t_begin, t_header=t_header, t_exchange=t_exchange, step=rnd.step, after=session.step,
            committed=committed, proceed=rnd.proceed, reason=rnd.reason, contributes=rnd.contributes,
            contributors=len(rnd.contributors), samples=rnd.samples if committed else 0, covered=covered,
            size=rnd.size, healed=rnd.healed, heals=heals, injected=injected, seconds_quorum=rnd.seconds_quorum,
            seconds_header=rnd.seconds_header, fp=f"{fingerprint([strategy.anchor]) & (2**64 - 1):016x}")
    loss = w.heldout(strategy)
    log("final", step=session.step, loss=loss, computed=w.computed,
        fp=f"{fingerprint([strategy.anchor]) & (2**64 - 1):016x}")
    session.close()


def _ckpt_path(out: str, index: int, step: int) -> str:
    return os.path.join(out, "ckpt", f"job{index}.step{step}.pt")


def run_static_job(a: argparse.Namespace, cfg: dict, log: Log) -> int:
    import datetime

    import torch
    import torch.distributed as dist

    from megatron_sparseloco.megatron.consistency import fingerprint

    store = dist.TCPStore("127.0.0.1", a.store_port, world_size=a.workers, is_master=a.index == 0,
                          timeout=datetime.timedelta(seconds=120))
    dist.init_process_group("gloo", store=store, rank=a.index, world_size=a.workers,
                            timeout=datetime.timedelta(seconds=cfg["static_timeout"]))
    w = Worker(a, cfg)
    strategy = _strategy(w, None, cfg)
    step = 0
    if a.resume_step >= 0:
        t = time.time()
        st = torch.load(_ckpt_path(a.out, a.index, a.resume_step), weights_only=True)
        strategy.anchor.copy_(st["anchor"])
        strategy.error_feedback.copy_(st["ef"])
        w.load_adam(st["adam"])
        strategy.reset_to_anchor()
        w.iteration, step = int(st["iteration"]), int(st["step"])
        log("load", step=step, seconds=time.time() - t)
    log("ready")
    _wait_go(a)
    H, every = cfg["H"], cfg["checkpoint_every"]
    os.makedirs(os.path.join(a.out, "ckpt"), exist_ok=True)
    try:
        while True:
            w.inner_steps(H, log)
            t_begin = time.time()
            flag = torch.tensor([float(_stop_now(cfg, step))])
            dist.all_reduce(flag, op=dist.ReduceOp.MAX)
            if flag.item() > 0:
                break
            covered = w.delta_steps
            strategy.step()
            step += 1
            w.delta_steps = 0
            log("round", t_begin=t_begin, t_header=t_begin, t_exchange=time.time(), step=step - 1, after=step,
                committed=True, proceed=True, contributes=True, contributors=a.workers,
                samples=covered * a.workers, covered=covered, size=a.workers, healed=False, heals=[],
                seconds_quorum=0.0, seconds_header=0.0, fp=f"{fingerprint([strategy.anchor]) & (2**64 - 1):016x}")
            if step % every == 0:
                t = time.time()
                path = _ckpt_path(a.out, a.index, step)
                torch.save({"anchor": strategy.anchor, "ef": strategy.error_feedback, "adam": w.adam_state(),
                            "iteration": w.iteration, "step": step}, path + ".tmp")
                os.replace(path + ".tmp", path)
                for old in glob.glob(os.path.join(a.out, "ckpt", f"job{a.index}.step*.pt")):
                    if int(old.rsplit("step", 1)[1][:-3]) < step - every:
                        os.remove(old)
                log("ckpt", step=step, seconds=time.time() - t)
    except (RuntimeError, dist.DistBackendError) as exc:   # a peer is gone: fail fast, like today's WorkerLostError
        log("failed", error=str(exc)[:300], step=step)
        return 3
    loss = w.heldout(strategy)
    log("final", step=step, loss=loss, computed=w.computed, fp=f"{fingerprint([strategy.anchor]) & (2**64 - 1):016x}")
    dist.destroy_process_group()
    return 0


def job_main(argv=None) -> int:
    import torch
    torch.set_num_threads(1)
    a = job_args(argv)
    with open(a.config) as f:
        cfg = json.load(f)
    log = Log(os.path.join(a.out, f"job{a.index}.{os.getpid()}.jsonl"))
    log("start", index=a.index, mode=a.mode, pid=os.getpid(), resume_step=a.resume_step)
    if a.mode == "elastic":
        run_elastic_job(a, cfg, log)
        return 0
    return run_static_job(a, cfg, log)


# ============================================================================ the orchestrator
SCENARIOS = ("failure-free", "static-failure-free", "elastic-keep", "elastic-discard", "fail-fast", "elastic-stall",
             "inject-keep", "inject-discard")


def scenario_spec(name: str) -> dict:
    return {"failure-free": dict(mode="elastic", policy="keep", kill=False),
            "static-failure-free": dict(mode="static", policy=None, kill=False),
            "elastic-keep": dict(mode="elastic", policy="keep", kill=True),
            "elastic-discard": dict(mode="elastic", policy="discard", kill=True),
            "fail-fast": dict(mode="static", policy=None, kill=True),
            "elastic-stall": dict(mode="elastic", policy="keep", kill=False, stall=True),
            "inject-keep": dict(mode="elastic", policy="keep", kill=False, inject=True),
            "inject-discard": dict(mode="elastic", policy="discard", kill=False, inject=True)}[name]


def read_logs(out: str) -> List[dict]:
    recs = []
    for path in glob.glob(os.path.join(out, "job*.jsonl")):
        index, pid = os.path.basename(path).split(".")[:2]
        for line in open(path):
            try:
                r = json.loads(line)
            except json.JSONDecodeError:    # a line cut by a SIGKILL
                continue
            r["job"], r["pid"] = int(index[3:]), int(pid)
            recs.append(r)
    return sorted(recs, key=lambda r: r["t"])


def _wait(pred, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not pred():
        if time.monotonic() > deadline:
            raise TimeoutError(f"timed out after {timeout:.0f} s waiting for {what}")
        time.sleep(0.05)


def run_scenario(name: str, args: argparse.Namespace, cfg: dict, root: str, seed: int) -> dict:
    """Run one scenario's jobs, its failure schedule and its stop; return its measured row."""
    from megatron_sparseloco.testing.elastic_jobs import ElasticRun, free_port

    spec = scenario_spec(name)
    out = os.path.join(root, f"{name}.seed{seed}")
    os.makedirs(out)
    token = os.path.join(out, "token")
    with open(token, "w") as f:
        f.write(TOKEN)
    os.chmod(token, 0o600)
    run_cfg = dict(cfg, seed=cfg["seed"] + seed, after_failed_round=spec["policy"] or "keep",
                   stop_file=None if spec.get("inject") else os.path.join(out, "stop"),
                   rounds=args.inject_rounds if spec.get("inject") else 0,
                   fail_every=args.fail_every if spec.get("inject") else 0)
    cfg_path = os.path.join(out, "config.json")
    with open(cfg_path, "w") as f:
        json.dump(run_cfg, f)
    go = os.path.join(out, "go")
    env = dict(os.environ, OMP_NUM_THREADS="1", RUST_LOG="error",
               PYTHONPATH=os.pathsep.join([common.REPO, os.path.dirname(os.path.abspath(__file__))]
                                          + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]))
    W, T = args.workers, args.seconds
    load_start = os.getloadavg()[0]
    el = cfg["elastic"]
    with ElasticRun(out, min_replicas=el["min_workers"], env=env, heartbeat_timeout_ms=el["heartbeat_timeout_ms"],
                    join_timeout_ms=el["join_timeout_ms"], quorum_tick_ms=50) as run:
        store_port = free_port()

        def argv(i: int, resume: int = -1, port: int = 0, wait: bool = True) -> List[str]:
            base = [os.path.abspath(__file__), "--job", "--mode", spec["mode"], "--index", str(i), "--workers", str(W),
                    "--out", out, "--config", cfg_path]
            if spec["mode"] == "elastic":
                base += ["--lighthouse", run.lighthouse.url, "--token-file", token]
            else:
                base += ["--store-port", str(port), "--resume-step", str(resume)]
            return base + (["--go-file", go] if wait else [])

        jobs = [run.add_job(f"job{i}", argv(i, port=store_port)) for i in range(W)]
        for j in jobs:
            j.start()
        ready = lambda: sum(1 for r in read_logs(out) if r["k"] == "ready") >= W  # noqa: E731
        _wait(ready, args.startup_timeout, f"{name}: {W} jobs ready\n" + "\n".join(j.output()[-2000:] for j in jobs))
        t0 = time.time()
        open(go, "w").close()
        events: Dict[str, Optional[float]] = {"kill": None, "restart": None, "stop": None, "cont": None}
        victim = jobs[W - 1]
        if spec.get("stall"):   # stopped for restart_after·T, continued: no restart
            _sleep_until(t0 + args.kill_at * T)
            events["stop"] = time.time()
            victim.stop()
            _sleep_until(t0 + (args.kill_at + args.restart_after) * T)
            events["cont"] = time.time()
            victim.cont()
        if spec.get("inject"):
            _wait(lambda: all(not j.alive() for j in jobs), args.inject_timeout, f"{name}: the jobs to finish")
        else:
            if spec["kill"]:
                _sleep_until(t0 + args.kill_at * T)
                events["kill"] = time.time()
                victim.kill()
                _sleep_until(t0 + (args.kill_at + args.restart_after) * T)
                events["restart"] = time.time()
                if spec["mode"] == "elastic":
                    victim.argv = argv(W - 1, wait=False)
                    victim.start()
                else:   # fail-fast: the run is down until every worker is back; all restart from a checkpoint
                    for j in jobs:
                        if j.alive():
                            j.kill()
                        j.wait(30)
                    resume = _common_checkpoint(out, W)
                    port = free_port()
                    for i, j in enumerate(jobs):
                        j.argv = argv(i, resume=resume, port=port, wait=False)
                        j.start()
            _sleep_until(t0 + T)
            open(os.path.join(out, "stop"), "w").close()
            _wait(lambda: any(not j.alive() for j in jobs[:W - 1]) or not any(j.alive() for j in jobs),
                  args.stop_timeout, f"{name}: a survivor to stop")
            try:
                _wait(lambda: not any(j.alive() for j in jobs), 20, "every job to stop")
            except TimeoutError:
                pass      # a job waiting alone for a quorum after the others left: cleanup kills it
        t_end = time.time()
        logs_tail = "\n".join(f"--- {j.name}\n{j.output()[-1500:]}" for j in jobs)
    recs = read_logs(out)
    row = measure(name, spec, recs, t0, t_end, events, W, run_cfg)
    row.update(seed=seed, load_avg_start=load_start, load_avg_end=os.getloadavg()[0])
    if row["held_out_loss"] is None:
        row["log_tail"] = logs_tail[-3000:]
    return row


def _sleep_until(t: float) -> None:
    while time.time() < t:
        time.sleep(min(0.05, max(0.0, t - time.time())))


def _common_checkpoint(out: str, W: int) -> int:
    """The newest step every job holds a checkpoint of (-1: none, start over)."""
    held = []
    for i in range(W):
        held.append({int(p.rsplit("step", 1)[1][:-3]) for p in glob.glob(os.path.join(out, "ckpt", f"job{i}.step*.pt"))})
    common_steps = set.intersection(*held) if held else set()
    return max(common_steps) if common_steps else -1


def measure(name: str, spec: dict, recs: List[dict], t0: float, t_end: float, events: Dict[str, Optional[float]],
            W: int, cfg: dict) -> dict:
    """One row from the jobs' records (module docstring: what each figure counts)."""
    rounds = [r for r in recs if r["k"] == "round" and r["t"] >= t0]
    committed = [r for r in rounds if r["committed"]]
    lineage: Dict[int, dict] = {}
    for r in committed:             # the last commit of each step number: redone rounds count once
        lineage[r["after"]] = r
    useful = sum(r["samples"] for r in lineage.values())
    steps = [r for r in recs if r["k"] == "step" and r["t"] >= t0]
    computed = len(steps)
    compute_s = sorted(r["c"] for r in steps)
    over_pace = sum(1 for c in compute_s if c > cfg["step_seconds"])
    wall = (t_end - t0) if spec.get("inject") else float(cfg["seconds"])   # scheduled: T, not the teardown
    finals = [r for r in recs if r["k"] == "final"]
    final_fps = {r["fp"] for r in finals}
    kill = events.get("kill") or events.get("stop")
    detect = None
    if kill is not None:   # fail-fast: a round the survivors finish as the victim dies is lost with the world
        since = (events.get("restart") or kill) if spec["mode"] == "static" else kill
        after = [r["t"] for r in committed if r["t"] > since and r["job"] != W - 1]
        detect = (min(after) - kill) if after else None
    heal_recv = [h for r in rounds if r["job"] == W - 1 for h in r["heals"] if h["role"] == "received"]
    rejoin = catch_up = None
    if kill is not None:
        back = [r["t"] for r in committed if r["job"] == W - 1 and r["t"] > kill and r["contributes"]
                and (spec["mode"] == "elastic")]
        if spec["mode"] == "static":
            back = [r["t"] for r in committed if r["t"] > (events.get("restart") or kill)]
        rejoin = (min(back) - kill) if back else None
    cont = events.get("cont")
    if cont is not None:
        back = [r["t"] for r in committed if r["job"] == W - 1 and r["t"] > cont and r["contributes"]]
        catch_up = (min(back) - cont) if back else None
    by_job_rounds = {}
    for r in rounds:
        by_job_rounds.setdefault(r["pid"], []).append(r)
    periods, quorum, header = [], [], []
    for rs in by_job_rounds.values():
        rs = [r for r in rs if r["committed"]]
        periods += [b["t"] - a["t"] for a, b in zip(rs, rs[1:]) if b["after"] == a["after"] + 1]
        quorum += [r["seconds_quorum"] for r in rs]
        header += [r["seconds_header"] for r in rs]
    mean = lambda xs: (sum(xs) / len(xs)) if xs else None  # noqa: E731
    # failed rounds: not committed, except a (re)started job's joining round and rounds nobody contributed to
    failed = {(r["step"], r["pid"]) for r in rounds if not r["committed"] and not r.get("healed")
              and not (r["contributors"] == 0 and "contributing workers" in r.get("reason", ""))}
    return {
        "scenario": name, "mode": spec["mode"], "after_failed_round": spec["policy"],
        "kill_at_s": None if kill is None else kill - t0,
        "restart_at_s": None if events.get("restart") is None else events["restart"] - t0,
        "stop_at_s": None if events.get("stop") is None else events["stop"] - t0,
        "cont_at_s": None if cont is None else cont - t0,
        "catch_up_s": catch_up,
        "victim_pids": len({r["pid"] for r in recs if r.get("job") == W - 1}),
        "wall_s": wall, "rounds_committed": len(lineage), "rounds_failed": len({s for s, _ in failed}),
        "useful_steps": useful, "computed_steps": computed, "discarded_steps": computed - useful,
        "goodput_steps_per_s": useful / wall if wall > 0 else None,
        "detection_s": detect, "rejoin_s": rejoin,
        "heal_s": sum(h["seconds"] for h in heal_recv) if heal_recv else None,
        "heal_bytes": sum(h["nbytes"] for h in heal_recv) if heal_recv else None,
        "held_out_loss": finals[0]["loss"] if finals else None,
        "final_step": max((r["step"] for r in finals), default=None),
        "theta_outer_identical": len(final_fps) == 1 if finals else None,
        "round_s_mean": mean(periods), "quorum_s_mean": mean(quorum), "header_s_mean": mean(header),
        "checkpoints_s_mean": mean([r["seconds"] for r in recs if r["k"] == "ckpt"]),
        "restart_load_s": mean([r["seconds"] for r in recs if r["k"] == "load"]),
        "step_compute_s_median": compute_s[len(compute_s) // 2] if compute_s else None,
        "steps_over_pace": over_pace,
    }


def summarize(rows: List[dict]) -> Dict[str, Optional[float]]:
    """Goodput ratios against the failure-free run and the quorum overhead (targets, reported only)."""
    by = {r["scenario"]: r for r in rows if r["seed"] == 0}
    ref = by.get("failure-free")
    out: Dict[str, Optional[float]] = {}
    if ref and ref["goodput_steps_per_s"]:
        for name in ("elastic-keep", "elastic-discard", "fail-fast", "elastic-stall", "static-failure-free"):
            if name in by and by[name]["goodput_steps_per_s"] is not None:
                out[f"goodput_{name}_vs_failure_free"] = by[name]["goodput_steps_per_s"] / ref["goodput_steps_per_s"]
        if ref["round_s_mean"] and ref["quorum_s_mean"] is not None:
            out["quorum_overhead_of_round"] = (ref["quorum_s_mean"] + ref["header_s_mean"]) / ref["round_s_mean"]
        st = by.get("static-failure-free")
        if st and st["round_s_mean"] and ref["round_s_mean"]:
            out["elastic_round_vs_static_round"] = ref["round_s_mean"] / st["round_s_mean"] - 1.0
    for policy in ("keep", "discard"):
        losses = [r["held_out_loss"] for r in rows if r["scenario"] == f"inject-{policy}" and r["held_out_loss"]]
        if losses:
            out[f"inject_{policy}_loss_mean"] = sum(losses) / len(losses)
    return out


def markdown(data: dict) -> str:
    """The docs table (docs/elastic.md) from a results file."""
    f = lambda v, d=2: "" if v is None else f"{v:.{d}f}"  # noqa: E731
    lines = ["| scenario | wall s | rounds committed / failed | goodput steps/s | vs failure-free | steps discarded | "
             "detection s | rejoin (catch-up) s | heal s / MB | held-out loss | load avg |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    ref = next((r for r in data["rows"] if r["scenario"] == "failure-free"), None)
    for r in data["rows"]:
        if r["scenario"].startswith("inject"):
            continue
        ratio = (r["goodput_steps_per_s"] / ref["goodput_steps_per_s"]) if ref and r["goodput_steps_per_s"] else None
        heal = "" if r["heal_s"] is None else f"{r['heal_s']:.2f} / {r['heal_bytes'] / 1e6:.1f}"
        lines.append(f"| {r['scenario']} | {r['wall_s']:.0f} | {r['rounds_committed']} / {r['rounds_failed']} | "
                     f"{f(r['goodput_steps_per_s'])} | {'' if ratio is None else f'{ratio:.1%}'} | "
                     f"{r['discarded_steps']} | {f(r['detection_s'])} | "
                     f"{f(r['rejoin_s']) if r.get('catch_up_s') is None else '(' + f(r['catch_up_s']) + ')'} | {heal} | "
                     f"{f(r['held_out_loss'], 4)} | {r['load_avg_start']:.0f}–{r['load_avg_end']:.0f} |")
    free = [r for r in data["rows"] if r["scenario"] in ("failure-free", "static-failure-free") and r["round_s_mean"]]
    if free:
        lines += ["", "| without failures | round s (H inner steps + outer step) | quorum s | round header s | "
                  "quorum + header, share of the round | inner-step compute s (median) | steps over the pace |",
                  "|---|---:|---:|---:|---:|---:|---:|"]
        for r in free:
            q = (r["quorum_s_mean"] or 0.0) + (r["header_s_mean"] or 0.0)
            lines.append(f"| {r['scenario']} | {r['round_s_mean']:.3f} | {f(r['quorum_s_mean'], 3)} | "
                         f"{f(r['header_s_mean'], 3)} | {q / r['round_s_mean']:.1%} | {f(r['step_compute_s_median'], 3)} | "
                         f"{r['steps_over_pace']} of {r['computed_steps']} |")
    inj = [r for r in data["rows"] if r["scenario"].startswith("inject")]
    if inj:
        lines += ["", "| after a failed round | seed | rounds committed / failed | inner steps computed | "
                  "steps in θ_outer | held-out loss |", "|---|---:|---:|---:|---:|---:|"]
        for r in sorted(inj, key=lambda r: (r["scenario"], r["seed"])):
            lines.append(f"| {r['after_failed_round']} | {r['seed']} | {r['rounds_committed']} / {r['rounds_failed']} | "
                         f"{r['computed_steps']} | {r['useful_steps']} | {f(r['held_out_loss'], 4)} |")
    return "\n".join(lines)


def main(argv=None) -> int:
    if argv is None and "--job" in sys.argv[1:]:
        return job_main(sys.argv[1:])
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--seconds", type=float, default=120.0, help="T: wall time of each scheduled scenario")
    p.add_argument("--workers", type=int, default=3)
    p.add_argument("--min-workers", type=int, default=2,
                   help="--sparseloco-min-workers and the lighthouse's --min_replicas (default 2: a majority of 3)")
    p.add_argument("--kill-at", type=float, default=0.3, help="the kill, as a fraction of T")
    p.add_argument("--restart-after", type=float, default=0.2, help="the restart, this fraction of T after the kill")
    p.add_argument("--H", type=int, default=15)
    p.add_argument("--outer-timeout", type=float, default=10.0, help="--sparseloco-outer-timeout of the elastic jobs")
    p.add_argument("--step-seconds", type=float, default=0.25, help="the wall time of one inner step (the pace)")
    p.add_argument("--checkpoint-every", type=int, default=10, help="fail-fast: rounds between checkpoints")
    p.add_argument("--fail-every", type=int, default=4, help="inject-*: every N-th round fails on every job")
    p.add_argument("--inject-rounds", type=int, default=40, help="inject-*: committed rounds of each run")
    p.add_argument("--inject-seeds", type=int, default=2)
    p.add_argument("--scenarios", default=",".join(SCENARIOS))
    p.add_argument("--smoke", action="store_true", help="a tiny model and short runs (CI)")
    p.add_argument("--log-dir", default=None, help="the jobs' logs (default: a new directory under /tmp)")
    p.add_argument("--json", default=None)
    p.add_argument("--render", default=None, metavar="RESULTS_JSON",
                   help="print the docs tables of a results file (docs/elastic.md) and exit")
    args = p.parse_args(argv)
    if args.render:
        with open(args.render) as f:
            data = json.load(f)
        print(markdown(data))
        return 0
    names = [s for s in args.scenarios.split(",") if s]
    bad = [s for s in names if s not in SCENARIOS]
    if bad:
        p.error(f"unknown scenario(s) {bad}; choose from {', '.join(SCENARIOS)}")
    model = common.ModelCfg()
    mbs, eval_windows = 8, 64
    if args.smoke:
        model = common.ModelCfg(layers=1, hidden=32, heads=2, seq=32)
        mbs, eval_windows = 2, 8
        args.H = min(args.H, 3)
        args.step_seconds = min(args.step_seconds, 0.03)
        args.inject_rounds, args.inject_seeds, args.fail_every = min(args.inject_rounds, 4), 1, min(args.fail_every, 2)
        args.checkpoint_every = min(args.checkpoint_every, 2)
    args.startup_timeout, args.stop_timeout, args.inject_timeout = 300.0, 120.0, 1800.0
    from megatron_sparseloco.outer.registry import build_outer_config   # noqa: F401 (fail early on a bad install)
    fields = common.strategy_fields(common.RunCfg("sparseloco", k=64), args.workers, common.model_numel(model))
    cfg = {"model": vars(model), "mbs": mbs, "lr": 1e-3, "weight_decay": 0.1, "seed": 1234, "H": args.H,
           "step_seconds": args.step_seconds,
           "eval_windows": eval_windows, "paths": common.ensure_data(), "outer": fields,
           "checkpoint_every": args.checkpoint_every, "static_timeout": 30.0, "seconds": args.seconds,
           "elastic": {"outer_timeout": args.outer_timeout, "quorum_timeout": 120.0, "heartbeat_interval": 0.2,
                       "heartbeat_timeout_ms": 5000, "join_timeout_ms": 5000, "min_workers": args.min_workers}}
    root = args.log_dir or f"/tmp/elastic-bench-{os.getpid()}"
    os.makedirs(root, exist_ok=True)
    rows: List[dict] = []
    machine = common.machine_info()
    t_start = time.time()
    for name in names:
        seeds = range(args.inject_seeds) if name.startswith("inject") else range(1)
        for seed in seeds:
            t = time.time()
            row = run_scenario(name, args, cfg, root, seed)
            row["scenario_wall_s"] = time.time() - t
            rows.append(row)
            print(f"{name} seed {seed}: goodput {row['goodput_steps_per_s']}, loss {row['held_out_loss']}, "
                  f"detection {row['detection_s']}, heal {row['heal_s']} ({time.time() - t:.0f} s)", flush=True)
    import schema
    data = schema.document(
        "elastic", recorded_command(sys.argv[1:] if argv is None else list(argv)),
        dict(cfg, workers=args.workers, kill_at=args.kill_at, restart_after=args.restart_after,
             fail_every=args.fail_every, inject_rounds=args.inject_rounds, scenarios=names, paths=None),
        rows, machine=machine, wall_s=time.time() - t_start, summary=summarize(rows))
    print(markdown(data))
    print(json.dumps(data["summary"], indent=1))
    if args.json:
        schema.write(args.json, data)
    return 0


def recorded_command(argv: List[str]) -> str:
    """The command as a results file records it: ``--log-dir`` (where the jobs' logs went) left out."""
    keep, skip = [], False
    for a in argv:
        if skip:
            skip = False
        elif a == "--log-dir":
            skip = True
        elif not a.startswith("--log-dir="):
            keep.append(a)
    return " ".join(["python", "benchmarks/elastic.py"] + [shlex.quote(a) for a in keep])


if __name__ == "__main__":
    signal.signal(signal.SIGTERM, lambda *a: sys.exit(143))
    sys.exit(main())
