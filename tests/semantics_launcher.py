"""Test-only launcher: megatron_sparseloco.run with a collective spy and model fingerprints per rank.

    torchrun ... tests/semantics_launcher.py <pretrain script> <args>     (env SEMANTICS_OUT=<dir>)

Inside every rank, around megatron.training's ``train`` (the training loop; recorded from the first
iteration's ``train_step`` to the end of the loop), a ``CollectiveSpy`` records every torch.distributed call with its group's global
ranks; calls made inside ``OuterLoopOptimizer.outer_step`` are counted apart (they are meant to
cross workers). After ``train`` returns, each rank writes ``<dir>/rank<r>.json``:

- ``worker_of``: global rank -> worker index (gathered from every rank);
- ``inner_calls``: [name, ranks, caller] of every call outside outer steps; ``outer_calls``: how many
  inside, ``outer_groups``: the distinct rank groups of those, except the in-worker param all-gather
  that ends the step (``OuterLoopOptimizer.publish``);
- ``outer_steps``: outer steps done;
- ``params``: {model param name: sha256 of its bytes} of this rank's model chunks, and
  ``tied``: {"embedding"/"output": sha256} of the first stage's ``word_embeddings.weight`` and the
  last stage's ``output_layer.weight`` (where this rank holds them);
- ``pp_rank``, ``tp_rank``, ``ep_rank``: the rank's place (to pair ranks holding the same shard);
- ``forward_calls``: how many times the pretrain script's forward step ran (once per microbatch of
  every iteration that computed), ``iterations``: train_step calls.

With env ``SEMANTICS_DUMP=1`` each rank also writes its model params (``{name: tensor}``, ``torch.save``)
after every outer step to ``<dir>/outer<step>_rank<r>.pt`` (then they hold θ_outer) and at the start
of ``train`` to ``<dir>/start_rank<r>.pt`` (what a load put there) — also with the plugin off.

Fault injection (env ``STALL_RANK=r``, ``STALL_AT_ITER=n``): global rank r stops itself with SIGSTOP
at the start of iteration n (a stalled worker: alive, connections open, silent), or with
``STALL_SIGNAL=KILL`` is killed by SIGKILL (a lost worker: its connections close); a rank whose
train_step raises prints ``semantics_launcher: rank <r> failed t=<time>: <error>``, and one whose
outer step raises first prints ``semantics_launcher: rank <r> issued <n> collective(s) in the failed
outer step <k>, which raised after <s> s``. ``WATCHDOG=1`` does what NCCL's watchdog does with
``TORCH_NCCL_ASYNC_ERROR_HANDLING=1`` (examples/slurm/sparseloco.sbatch): a collective that fails
takes the process down at once (``semantics_launcher: watchdog: ...``, exit code 6), before any
Python code could name the missing worker. A slow GPU
(env ``SLOW_RANK=r``, ``SLOW_FORWARD_S=s``): global rank r sleeps s seconds in every forward step it runs.
"""
import functools
import hashlib
import json
import os
import signal
import sys
import time
import traceback

import torch
import torch.distributed as dist

from megatron_sparseloco.run import main

OUT = os.environ["SEMANTICS_OUT"]
#: optional fault injection: this global rank stops itself (SIGSTOP) at the start of that iteration
STALL_RANK = int(os.environ.get("STALL_RANK", "-1"))
STALL_AT = int(os.environ.get("STALL_AT_ITER", "0"))
STALL_SIGNAL = getattr(signal, "SIG" + os.environ.get("STALL_SIGNAL", "STOP"))
WATCHDOG = os.environ.get("WATCHDOG") == "1"
DUMP = os.environ.get("SEMANTICS_DUMP") == "1"
#: optional slow GPU: this global rank sleeps this long in every forward step
SLOW_RANK = int(os.environ.get("SLOW_RANK", "-1"))
SLOW_FORWARD_S = float(os.environ.get("SLOW_FORWARD_S", "0"))


def _dump(chunks, name: str) -> None:
    params = {f"{i}.{n}": p.detach().cpu().clone() for i, c in enumerate(chunks) for n, p in c.named_parameters()}
    os.makedirs(OUT, exist_ok=True)
    torch.save(params, os.path.join(OUT, f"{name}_rank{dist.get_rank()}.pt"))


def _sha(t: torch.Tensor) -> str:
    flat = t.detach().reshape(-1).cpu().contiguous()
    return hashlib.sha256(flat.view(torch.uint8).numpy().tobytes()).hexdigest()


def _where() -> str:
    """file:line function of the nearest caller outside torch.distributed and the spy."""
    for frame in reversed(traceback.extract_stack()[:-2]):
        f = frame.filename
        if "torch/distributed" in f or "collective_spy" in f or f.endswith("semantics_launcher.py"):
            continue
        parts = f.split(os.sep)
        return f"{'/'.join(parts[-3:])}:{frame.lineno} {frame.name}"
    return "?"


def _install():
    import megatron.training.training as mtrain

    from megatron_sparseloco.megatron import optimizer as outer_opt
    from megatron_sparseloco.megatron import plugin
    from megatron_sparseloco.testing.collective_spy import CollectiveSpy

    class WhereSpy(CollectiveSpy):
        def _wrap(self, name, fn):
            inner = super()._wrap(name, fn)

            def spy(*args, **kwargs):
                self.where.append(_where())
                if not WATCHDOG:
                    return inner(*args, **kwargs)
                try:
                    return inner(*args, **kwargs)
                except BaseException as exc:
                    print(f"semantics_launcher: watchdog: rank {dist.get_rank()}: {name} failed ({type(exc).__name__}: "
                          f"{exc}); taking the process down", flush=True)
                    os._exit(6)
            return spy

        def __enter__(self):
            self.where = []
            return super().__enter__()

    state = {"outer_calls": 0, "outer_groups": set(), "spy": None}
    orig_outer = outer_opt.OuterLoopOptimizer.outer_step

    def outer_step(self, *args, **kwargs):   # (a fragment's index with --sparseloco-fragments)
        spy = state["spy"]
        n0 = len(spy.calls) if spy is not None else 0
        t0 = time.monotonic()
        publish = type(self).publish
        in_worker = []  # [start, end) of the in-worker param all-gather that ends the step

        def publish_spied():
            a = len(spy.calls) if spy is not None else 0
            publish(self)
            in_worker.append((a, len(spy.calls) if spy is not None else 0))

        self.publish = publish_spied
        try:
            out = orig_outer(self, *args, **kwargs)
            if DUMP:
                _dump(self.model_chunks, f"outer{self.outer_steps}")
            return out
        except BaseException:
            if spy is not None:
                print(f"semantics_launcher: rank {dist.get_rank()} issued {len(spy.calls) - n0} collective(s) in the "
                      f"failed outer step {self.outer_steps + 1}, which raised after {time.monotonic() - t0:.2f} s",
                      flush=True)
            raise
        finally:
            del self.publish
            if spy is not None:
                state["outer_calls"] += len(spy.calls) - n0
                skip = {i for a, b in in_worker for i in range(a, b)}
                state["outer_groups"].update(tuple(r) for i, (_, r) in enumerate(spy.calls) if i >= n0 and i not in skip)
                del spy.calls[n0:]
                del spy.where[n0:]

    outer_opt.OuterLoopOptimizer.outer_step = outer_step
    orig_train = mtrain.train

    def train(*a, **kw):
        if DUMP:
            model = kw["model"] if "model" in kw else a[1]
            _dump(model if isinstance(model, list) else [model], "start")
        with WhereSpy() as spy:
            state["spy"] = spy
            try:
                out = orig_train(*a, **kw)
            finally:
                state["spy"] = None
        _report(spy, state, plugin.ACTIVE)
        return out

    mtrain.train = train
    orig_train_step = mtrain.train_step

    def count_forward(forward_step_func):
        @functools.wraps(forward_step_func)
        def counted(*fa, **fkw):
            state["forward_calls"] = state.get("forward_calls", 0) + 1
            if SLOW_RANK == dist.get_rank():
                time.sleep(SLOW_FORWARD_S)
            return forward_step_func(*fa, **fkw)
        return counted

    @functools.wraps(orig_train_step)
    def train_step(*a, **kw):
        a = (count_forward(a[0]),) + a[1:]
        spy = state["spy"]
        if spy is not None and state.get("first") is None:
            state["first"] = len(spy.calls)  # record from the first iteration on
        state["iteration"] = state.get("iteration", 0) + 1
        if STALL_RANK == dist.get_rank() and state["iteration"] == STALL_AT:
            how = signal.Signals(STALL_SIGNAL).name
            print(f"semantics_launcher: rank {STALL_RANK} stalls ({how}) at iteration {STALL_AT} t={time.time():.3f}",
                  flush=True)
            os.kill(os.getpid(), STALL_SIGNAL)
        try:
            return orig_train_step(*a, **kw)
        except BaseException as exc:
            print(f"semantics_launcher: rank {dist.get_rank()} failed t={time.time():.3f}: {type(exc).__name__}: {exc}",
                  flush=True)
            raise

    mtrain.train_step = train_step


def _report(spy, state, active):
    from megatron.core import parallel_state as ps

    rank = dist.get_rank()
    worker = active.worker_index if active is not None else 0
    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, (rank, worker))
    worker_of = {r: w for r, w in gathered}
    params, tied = {}, {}
    chunks = active.model_chunks if active is not None else []
    for i, chunk in enumerate(chunks):
        for name, p in chunk.named_parameters():
            params[f"{i}.{name}"] = _sha(p)
            if name.endswith("embedding.word_embeddings.weight"):
                tied["embedding"] = _sha(p)
            if name.endswith("output_layer.weight"):
                tied["output"] = _sha(p)
    first = state.get("first") or 0
    calls = list(zip(spy.calls, spy.where))[first:]
    out = {"rank": rank, "worker_of": worker_of, "inner_calls": [[n, list(r), w] for (n, r), w in calls],
           "outer_calls": state["outer_calls"], "outer_groups": sorted(list(g) for g in state["outer_groups"]), "outer_steps": active.outer_steps if active is not None else 0,
           "params": params, "tied": tied, "pp_rank": ps.get_pipeline_model_parallel_rank(),
           "theta_outer": [_sha(s.anchor) for s in active.strategies] if active is not None else [],
           "forward_calls": state.get("forward_calls", 0), "iterations": state.get("iteration", 0),
           "tp_rank": ps.get_tensor_model_parallel_rank(), "ep_rank": ps.get_expert_model_parallel_rank()}
    os.makedirs(OUT, exist_ok=True)
    with open(os.path.join(OUT, f"rank{rank}.json"), "w") as f:
        json.dump(out, f)


if __name__ == "__main__":
    if not torch.cuda.is_available():  # as run.main does, before megatron.training is imported
        from megatron_sparseloco.testing.cpu_bridges import apply_cpu_bridges
        apply_cpu_bridges()
    _install()
    main(sys.argv[1:])
