"""Launcher for elastic jobs under test or benchmark: a pretrain script with the plugin, round records, fault hooks.

    torchrun ... -m megatron_sparseloco.testing.elastic_launcher <pretrain script> <args>
    (environment: ELASTIC_OUT, the records' folder; ELASTIC_TAG, the job's name in them)

Every rank appends one JSON line per elastic round to ``<ELASTIC_OUT>/<ELASTIC_TAG>.rank<r>.jsonl``
(``ElasticRounds._end``: the round's step, outcome, participants and contributors as worker
indices, whether it healed, ``sha`` / ``local``: sha256 of this rank's θ_outer / θ_local after the
round, the heal records, the job's iteration) and, once ``train`` returns, a last line ``{"final": true, ...}``
with θ_outer's sha256 and ``params``: sha256 over the model params (name order).

Hooks, each set by an environment variable of the job:

- ``ELASTIC_BARRIER=<dir>:<n>``: before the start-up round, touch ``<dir>/<tag>.<rank>`` and wait until
  the directory holds n files (the jobs of a fresh run meet in one quorum);
- ``ELASTIC_STARTUP_FILE=<path>``: touch ``path`` before the start-up round (a restarted job says it joins);
- ``ELASTIC_HOLD=<path>``: before each contributing round (its quorum), wait while ``path`` exists (a test holds
  the survivors there until a restarted job joins);
- ``ELASTIC_PAUSE=<step>:<path>``: rank 0, in the round after committed step ``step``, after the round
  header and before its exchange, touches ``path`` and sleeps (a test kills or stops it there:
  the other jobs are then waiting in the round's collectives; with τ ≥ 1 the sleep is on the comm
  thread, so the job trains on until its completion waits).
- ``ELASTIC_SLOW=<seconds>``: every rank sleeps this long after each inner step (a slow site).
- ``ELASTIC_PACE=<seconds>``: every rank's iteration up to its optimizer step (forward, backward) takes at
  least this long (a sleep before the step makes up the rest), so jobs sharing a machine's cores run at a
  fixed speed; the inner step and the outer rounds after it add their own time.
- ``ELASTIC_FAIL_VOTE=<step>``: every rank, in the round after committed step ``step``, reports an error
  to the session after the round's verdicts agreed, just before the commit vote, so this job's vote
  fails while the others commit.
"""
import hashlib
import json
import os
import time

import torch
import torch.distributed as dist


OUT, TAG = os.environ["ELASTIC_OUT"], os.environ.get("ELASTIC_TAG", "job")


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def _path(suffix: str) -> str:
    return os.path.join(OUT, f"{TAG}.rank{_rank()}.{suffix}")


def _write(record: dict) -> None:
    with open(_path("jsonl"), "a") as f:
        f.write(json.dumps(dict(record, t=time.time(), pid=os.getpid())) + "\n")


def _sha(tensors) -> str:
    h = hashlib.sha256()
    for t in tensors:
        h.update(t.detach().reshape(-1).cpu().contiguous().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def _spec(name: str):
    value = os.environ.get(name)
    if not value:
        return None
    step, path = value.split(":", 1)
    return int(step), path


def _barrier_then_startup(orig):
    def startup(self):
        barrier = os.environ.get("ELASTIC_BARRIER")
        if barrier:
            where, n = barrier.rsplit(":", 1)
            open(os.path.join(where, f"{TAG}.{_rank()}"), "w").close()
            deadline = time.monotonic() + 300
            while len(os.listdir(where)) < int(n) and time.monotonic() < deadline:
                time.sleep(0.05)
        if os.environ.get("ELASTIC_STARTUP_FILE"):
            open(os.environ["ELASTIC_STARTUP_FILE"], "w").close()
        return orig(self)
    return startup


def _held_round(orig, hold):
    def _open(self, contributes, scheduled, *a, **kw):
        deadline = time.monotonic() + 300
        while hold and contributes and os.path.exists(hold) and time.monotonic() < deadline:
            time.sleep(0.05)
        return orig(self, contributes, scheduled, *a, **kw)
    return _open


def _paused_exchange(orig, pause):
    state = {"pause": pause}

    def _exchange(self, rnd, parts):
        due = state["pause"]
        if due is not None and rnd.step == due[0] and _rank() == 0:
            state["pause"] = None
            open(due[1], "w").close()
            time.sleep(3600)
        return orig(self, rnd, parts)
    return _exchange


def _failing_vote(orig, step):
    """After the round's verdicts agreed, just before the commit vote: an error only this job sees."""
    state = {"step": step}

    def _exchange(self, rnd, parts):
        out = orig(self, rnd, parts)
        if state["step"] is not None and rnd.step == state["step"]:
            state["step"] = None
            session, finish = self.session, self.session.finish_round

            def failing_finish():
                session.finish_round = finish
                session.report_error(RuntimeError(f"injected vote failure (ELASTIC_FAIL_VOTE={rnd.step})"))
                return finish()
            session.finish_round = failing_finish
        return out
    return _exchange


def _recorded_end(orig):
    def _end(self, committed, stats, rnd, t0, launch_s=None):
        heals = [vars(r) for r in self.session.transport.records]
        orig(self, committed, stats, rnd, t0, launch_s=launch_s)
        exposed = time.perf_counter() - t0 + (launch_s or 0.0)   # the training thread's time in this round
        index = [None if h is None else h["index"] for h in rnd.peers]
        args = self.heal.args_fn()
        _write({"step": rnd.step, "after": self.session.step, "committed": committed, "healed": rnd.healed,
                "behind": rnd.behind, "proceed": rnd.proceed, "reason": rnd.reason, "participants": index,
                "contributors": [index[r] for r in rnd.contributors], "contributes": rnd.contributes,
                "sha": _sha([s.anchor for s in self.strategies]), "heals": heals,
                "local": _sha([t for s in self.strategies for t in s.params.tensors]),
                "iteration": getattr(args, "iteration", None), "inner_calls": self.heal.opt.inner_calls,
                "catch_up": bool(rnd.healed and self.heal.in_iteration), "kept": self.heal.keep_progress,
                "samples": getattr(args, "consumed_train_samples", None),
                "seconds_quorum": rnd.seconds_quorum, "seconds_header": rnd.seconds_header,
                "fragment": rnd.fragment, "contributing": rnd.contributing, "delayed": launch_s is not None,
                "launch_s": launch_s, "exposed_s": exposed,
                "bytes_sent": sum(st.bytes_sent for st in stats),
                "bytes_received": sum(st.bytes_received for st in stats)})
    return _end


def _recorded_train(orig):
    from megatron_sparseloco.megatron import plugin

    def train(*a, **kw):
        out = orig(*a, **kw)
        opt = plugin.ACTIVE
        assert opt is not None, "the outer loop is on (--sparseloco-algorithm)"
        model = a[1] if len(a) > 1 else kw["model"]
        named = [(n, p) for chunk in model for n, p in sorted(chunk.named_parameters())]
        tied = {k: _sha([p for n, p in named if n.endswith(suffix)])
                for k, suffix in (("embedding", "embedding.word_embeddings.weight"), ("output", "output_layer.weight"))
                if any(n.endswith(suffix) for n, _ in named)}
        _write({"final": True, "sha": _sha([s.anchor for s in opt.strategies]), "params": _sha([p for _, p in named]),
                "tied": tied, "step": opt.rounds.session.step if hasattr(opt.rounds, "session") else opt.outer_steps,
                "iteration": out[0] if isinstance(out, tuple) else None})
        return out
    return train


def _install() -> None:
    """The hooks of the module docstring: deliberate monkeypatches of ``ElasticRounds`` (every instance of
    this process) and of megatron.training's ``train``."""
    import megatron.training.training as mtrain

    from megatron_sparseloco.megatron.elastic.rounds import ElasticRounds

    hooks = (("startup", _barrier_then_startup(ElasticRounds.startup)),
             ("_open", _held_round(ElasticRounds._open, os.environ.get("ELASTIC_HOLD"))),
             ("_exchange", _paused_exchange(ElasticRounds._exchange, _spec("ELASTIC_PAUSE"))),
             ("_end", _recorded_end(ElasticRounds._end)))
    for name, fn in hooks:
        setattr(ElasticRounds, name, fn)
    fail_vote = os.environ.get("ELASTIC_FAIL_VOTE")
    if fail_vote:
        setattr(ElasticRounds, "_exchange", _failing_vote(ElasticRounds._exchange, int(fail_vote)))
    mtrain.train = _recorded_train(mtrain.train)
    slow = float(os.environ.get("ELASTIC_SLOW", "0") or 0)
    pace = float(os.environ.get("ELASTIC_PACE", "0") or 0)
    if slow > 0 or pace > 0:
        from megatron_sparseloco.megatron.optimizer import OuterLoopOptimizer
        step = OuterLoopOptimizer.step
        last: dict = {"end": None}

        def paced_step(self, *a, **kw):
            if pace > 0 and last["end"] is not None:
                time.sleep(max(0.0, pace - (time.perf_counter() - last["end"])))
            out = step(self, *a, **kw)
            time.sleep(slow)
            last["end"] = time.perf_counter()
            return out
        setattr(OuterLoopOptimizer, "step", paced_step)


if __name__ == "__main__":
    import sys
    os.makedirs(OUT, exist_ok=True)
    if not torch.cuda.is_available():   # as ``megatron_sparseloco.run`` does on a machine without CUDA
        from megatron_sparseloco.testing.cpu_bridges import apply_cpu_bridges
        apply_cpu_bridges()
    _install()
    from megatron_sparseloco.megatron.plugin import run_pretrain_script
    run_pretrain_script(sys.argv[1], sys.argv[2:])
