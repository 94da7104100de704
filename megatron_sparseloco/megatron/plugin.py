"""Install the plugin into megatron.training without editing Megatron.

``install()`` wraps module attributes that megatron.training looks up at call time:

- ``megatron.training.arguments.add_megatron_arguments``: also adds the ``--sparseloco-*`` group,
  so any pretrain script's ``parse_args`` / ``parse_and_validate_args`` accepts our flags;
- ``megatron.training.arguments.validate_args``: runs ``validate_sparseloco_args`` (which maps
  ``--sparseloco-workers`` onto ``--num-distributed-optimizer-instances``) *before* Megatron's own
  checks; a bad flag ends the job with one message on rank 0 (``check_sparseloco_args_or_exit``);
- ``megatron.training.training.get_megatron_optimizer``: wraps the optimizer in
  ``OuterLoopOptimizer`` when ``--sparseloco-algorithm`` is set (its ``close`` runs at exit:
  ``atexit``, so a delayed round in flight is waited for and the comm thread ends);
- ``megatron.training.training.training_log``: after Megatron's own line, a ``sparseloco |`` line
  and ``sparseloco/*`` TensorBoard / W&B scalars at every ``--log-interval``;
- ``megatron.training.training.save_checkpoint`` (and ``megatron.training.checkpointing``'s): the
  save runs with θ_outer in the model, so the checkpoint's model part is the synced model and not
  a mixture of the workers' mid-round params (``OuterLoopOptimizer.model_holds_outer_params``);
- ``setup_model_and_optimizer`` is followed by the rounds' ``setup`` before the data iterators are
  built (elastic mode, ``megatron/elastic/rounds.py``: the job's first round, which joins, heals a
  (re)started job and sets the iteration / consumed samples / LR schedule); ``build_pretraining_data_loader``
  and ``get_train_valid_test_num_samples`` read worker I's slot of the run's data (``elastic/data_slots.py``);
- ``megatron.training.training.train_step``: with W > 1 its loss all-reduce runs over the worker's
  data-parallel group; the optimizer wrap also scopes Megatron's timer barriers and rerun-machine
  flags to the worker (``placement/training_reductions.py``), so inner steps issue no cross-worker collective; and an
  iteration a worker leaves inactive (``--sparseloco-inner-steps-per-worker``) runs no
  forward/backward (``auto_steps.skip_inactive_iterations``).

With ``--sparseloco-algorithm`` unset the plugin changes nothing.
"""
from __future__ import annotations

import functools
import logging
import os
import sys
import time
from typing import Sequence

logger = logging.getLogger(__name__)

_INSTALLED = False
#: the OuterLoopOptimizer of this process (set when the optimizer is wrapped)
ACTIVE = None


#: Seconds a rank other than 0 waits before exiting on a bad flag. A launcher (torchrun, ``srun
#: --kill-on-bad-exit``) kills the whole job at the first exit; if a silent rank exited first, a rank 0
#: still starting up (a loaded node) was killed before printing and the job ended with no message.
#: Rank 0 exits at once, so under torchrun the wait ends as soon as rank 0 has printed.
NONZERO_RANK_EXIT_GRACE_S = 20.0


def check_sparseloco_args_or_exit(args) -> None:
    """Validate the ``--sparseloco-*`` flags (resolving defaults); a bad one ends the process.

    Runs before Megatron's ``validate_args`` and before torch.distributed is initialised: rank 0
    prints one message (flag, value, why, fix) on stderr, every rank exits with status 2 and no
    traceback, so a torchrun job stops at once with a single explanation. The other ranks wait up to
    ``NONZERO_RANK_EXIT_GRACE_S`` before exiting, so that rank 0 is the first to exit and its message
    is never lost to the launcher's tear-down.
    """
    from megatron_sparseloco.megatron.args import SparseLoCoArgumentError, validate_sparseloco_args
    try:
        validate_sparseloco_args(args)
    except SparseLoCoArgumentError as exc:
        if int(os.environ.get("RANK", getattr(args, "rank", 0) or 0)) == 0:
            print(f"megatron_sparseloco: error: {exc}", file=sys.stderr, flush=True)
        elif int(os.environ.get("WORLD_SIZE", "1")) > 1:
            time.sleep(NONZERO_RANK_EXIT_GRACE_S)
        sys.exit(2)


def explain_resume_error(exc: BaseException):
    """Our message for Megatron's refusal to resume across a TP/PP change (None: not that error).

    megatron-core 0.19.2 says "use `--ckpt-fully-parallel-save`", which is already the default and
    does not make the distributed optimizer's ``dp_reshardable`` state reshardable across TP/PP.
    """
    text = str(exc)
    if "(TP, PP) mismatch" not in text or "--ckpt-fully-parallel-save" not in text:
        return None
    return (f"{text.split(':')[0]}: the checkpoint's distributed-optimizer state cannot be resharded to a different "
            "--tensor-model-parallel-size / --pipeline-model-parallel-size (Megatron's hint about "
            "--ckpt-fully-parallel-save does not help: it is the default). Fix: resume with the saving run's "
            "--tensor-model-parallel-size and --pipeline-model-parallel-size, or load only the params with "
            "--no-load-optim (or --finetune): the inner optimizer and the sparseloco outer state then start fresh, "
            "θ_outer anchored on the loaded params")


def wrap_optimizer_from_args(optimizer, model_chunks, args):
    """The OuterLoopOptimizer for validated ``args`` (or ``optimizer`` itself when the plugin is off): the
    loop and outer configs ``validate_sparseloco_args`` built, this worker's H_w, and the rounds of the
    job's mode (``rounds_factory_from_args``)."""
    if getattr(args, "sparseloco_algorithm", None) is None:
        _open_plugin_checkpoints_without_plugin(optimizer)
        return optimizer
    import dataclasses

    import torch.distributed as dist

    from megatron_sparseloco.megatron.args.model_size import model_parameter_count
    from megatron_sparseloco.megatron.optimizer import OuterLoopOptimizer
    from megatron_sparseloco.megatron.placement.gradient_isolation import cross_worker_group
    from megatron_sparseloco.outer.registry import strategy_factory

    group = cross_worker_group(model_chunks)
    outer_config = args.sparseloco_outer_config
    if outer_config.rule_fields:   # defaults from a rule of W that also follows the model's size (SparseLoCo's s(N)):
        # resolved before any strategy; the count's collective is skipped where no rule needs it
        outer_config.resolve_for_model(args.sparseloco_workers, model_parameter_count(model_chunks))
    config = dataclasses.replace(args.sparseloco_loop_config)
    if not config.auto_inner_steps:   # ("auto": H_w measured and agreed at run time)
        config.active_inner_steps = config.inner_steps_for(dist.get_rank(group) if group is not None else 0)
    global ACTIVE
    ACTIVE = OuterLoopOptimizer(optimizer, model_chunks, strategy_factory(args.sparseloco_algorithm,
                                                                          args.sparseloco_outer_config),
                                config, group=group, rounds_factory=rounds_factory_from_args(args))
    import atexit
    atexit.register(ACTIVE.close)
    from megatron_sparseloco.megatron.args.startup_report import log_startup, warn_if_outer_state_not_loaded
    log_startup(ACTIVE, args)               # rank 0: resolved settings, worker map, expected bytes
    warn_if_outer_state_not_loaded(args)
    from megatron.training.global_vars import get_timers

    from megatron_sparseloco.megatron.placement.training_reductions import make_training_reductions_worker_local
    make_training_reductions_worker_local(ACTIVE.num_workers, get_timers())
    return ACTIVE


def rounds_factory_from_args(args):
    """The one place a job's mode picks its rounds: elastic mode's (``--sparseloco-lighthouse``: the
    session, the heal, rounds through torchft) or a single job's."""
    elastic = getattr(args, "sparseloco_elastic", None)
    if elastic is None:
        from megatron_sparseloco.megatron.rounds import single_job_rounds
        return single_job_rounds
    from megatron_sparseloco.megatron.elastic.rounds import elastic_rounds
    return elastic_rounds(elastic)


def plain_load_message(saved: dict) -> str:
    algos = ",".join(saved.get("algorithms") or []) or "?"
    return (f"sparseloco: this checkpoint was written with the outer loop on ({saved.get('num_workers')} workers, "
            f"--sparseloco-algorithm {algos}, {saved.get('outer_steps')} outer steps). Without --sparseloco-algorithm "
            "it loads as a plain Megatron checkpoint: the model (θ_outer, the synced model; gasloc: the workers' mean) "
            "and Megatron's copy of the inner optimizer state; each worker's own θ_local and Adam moments and the "
            "error feedback are ignored. To continue the outer loop pass "
            f"--sparseloco-algorithm {algos.split(',')[0]} --sparseloco-workers {saved.get('num_workers')} "
            f"--sparseloco-inner-steps {saved.get('inner_steps', 'H')}")


def _open_plugin_checkpoints_without_plugin(optimizer) -> None:
    """Plugin off: a plugin checkpoint still loads (model + worker 0's optimizer state), announced.

    megatron-core 0.19.2 without Apex/TE cannot load any checkpoint into a fresh distributed
    optimizer (``assert len(steps) == 1``: torch creates Adam's ``step`` only at the first step);
    the same placeholders the outer loop adds before a load (``checkpoint.outer_state.ensure_adam_step_state``)
    are added here, on load only. Nothing else changes.
    """
    if not hasattr(optimizer, "sharded_state_dict") or getattr(optimizer, "_sparseloco_plain_loader", False):
        return
    orig = optimizer.sharded_state_dict

    @functools.wraps(orig)
    def sharded_state_dict(model_sharded_state_dict, is_loading: bool = False, **kwargs):
        if is_loading:
            from megatron_sparseloco.megatron.checkpoint import outer_state as ckpt
            from megatron_sparseloco.megatron.main_params import member_optimizers
            metadata = kwargs.get("metadata")
            saved = metadata.get(ckpt.METADATA_KEY) if isinstance(metadata, dict) else None
            if saved is not None:
                message = plain_load_message(saved)
                logger.warning(message)
                import torch.distributed as dist
                if not dist.is_initialized() or dist.get_rank() == 0:
                    print(message, flush=True)
            ckpt.ensure_adam_step_state([m for m in member_optimizers(optimizer)
                                         if not getattr(m, "is_stub_optimizer", False)])
        return orig(model_sharded_state_dict, is_loading, **kwargs)

    orig_load = optimizer.load_state_dict

    @functools.wraps(orig_load)
    def load_state_dict(state_dict):
        # no_grad: megatron-core 0.19.2's DistributedOptimizer copies loaded values into fp32 main
        # params that are views of model params (leaves requiring grad) in place (as in
        # OuterLoopOptimizer.load_state_dict)
        import torch
        with torch.no_grad():
            return orig_load(state_dict)

    optimizer.sharded_state_dict = sharded_state_dict
    optimizer.load_state_dict = load_state_dict
    optimizer._sparseloco_plain_loader = True


def _active_workers() -> int:
    return ACTIVE.num_workers if ACTIVE is not None else 1


def log_outer_metrics(iteration: int) -> None:
    """At ``--log-interval`` iterations: the sparseloco log line (last rank) and TensorBoard / W&B scalars."""
    if ACTIVE is None:
        return
    from megatron.core import parallel_state
    from megatron.training.global_vars import get_args, get_tensorboard_writer, get_wandb_writer
    from megatron.training.utils import print_rank_last

    from megatron_sparseloco.megatron.metrics import format_log_line, worker_totals, write_scalars

    args = get_args()
    if not args.log_interval or iteration % args.log_interval != 0:
        return
    totals = worker_totals(ACTIVE, parallel_state.get_intra_distributed_optimizer_instance_group())
    print_rank_last(format_log_line(totals, args.sparseloco_algorithm, ACTIVE.config.inner_steps))
    write_scalars(totals, iteration, get_tensorboard_writer(), get_wandb_writer())


def _with_sparseloco_args(orig_add):
    @functools.wraps(orig_add)
    def add_megatron_arguments(parser):
        parser = orig_add(parser)
        from megatron_sparseloco.megatron.args import add_sparseloco_args
        if not any(a.dest == "sparseloco_algorithm" for a in parser._actions):
            parser = add_sparseloco_args(parser)
        if "-h" in sys.argv or "--help" in sys.argv:
            from megatron_sparseloco.megatron.args.help import repair_help_strings
            repair_help_strings(parser)   # megatron-core 0.19.2's --help trips over a stray '%'
        return parser
    return add_megatron_arguments


def _checking_sparseloco_args_first(orig_validate):
    @functools.wraps(orig_validate)
    def validate_args(args, defaults={}):
        check_sparseloco_args_or_exit(args)   # before Megatron's own checks, so ours name the flag
        return orig_validate(args, defaults)
    return validate_args


def _wrapping_the_optimizer(orig_get_opt):
    @functools.wraps(orig_get_opt)
    def get_megatron_optimizer(config, model_chunks, *a, **kw):
        optimizer = orig_get_opt(config, model_chunks, *a, **kw)
        from megatron.training.global_vars import get_args
        return wrap_optimizer_from_args(optimizer, model_chunks, get_args())
    return get_megatron_optimizer


def _setting_up_the_rounds(orig_setup):
    @functools.wraps(orig_setup)
    def setup_model_and_optimizer(*a, **kw):
        model, optimizer, scheduler = orig_setup(*a, **kw)
        if ACTIVE is not None:   # elastic mode: the job's first round (join, heal) before the data iterators
            from megatron.training.global_vars import get_args
            ACTIVE.rounds.setup(scheduler, get_args())
        return model, optimizer, scheduler
    return setup_model_and_optimizer


def _logging_outer_metrics(orig_training_log):
    @functools.wraps(orig_training_log)
    def training_log(*a, **kw):
        out = orig_training_log(*a, **kw)
        iteration = kw["iteration"] if "iteration" in kw else a[3]
        log_outer_metrics(iteration)
        return out
    return training_log


def _explaining_resume_errors(orig_load):
    @functools.wraps(orig_load)
    def load_checkpoint(*a, **kw):
        try:
            return orig_load(*a, **kw)
        except RuntimeError as exc:
            better = explain_resume_error(exc)
            if better is None:
                raise
            raise RuntimeError(better) from exc
    return load_checkpoint


def _saving_outer_params(orig_save):
    @functools.wraps(orig_save)
    def save_checkpoint(*a, **kw):
        if ACTIVE is None:
            return orig_save(*a, **kw)
        with ACTIVE.model_holds_outer_params():   # re-entrant: an inner call finds it active
            return orig_save(*a, **kw)
    return save_checkpoint


def install() -> None:
    """Idempotently patch megatron.training (see module docstring)."""
    global _INSTALLED
    if _INSTALLED:
        return
    import megatron.training.arguments as margs
    import megatron.training.checkpointing as mckpt
    import megatron.training.training as mtrain

    from megatron_sparseloco.megatron.auto_steps import skip_inactive_iterations
    from megatron_sparseloco.megatron.placement.training_reductions import wrap_train_step

    margs.add_megatron_arguments = _with_sparseloco_args(margs.add_megatron_arguments)
    margs.validate_args = _checking_sparseloco_args_first(margs.validate_args)
    mtrain.get_megatron_optimizer = _wrapping_the_optimizer(mtrain.get_megatron_optimizer)
    mtrain.training_log = _logging_outer_metrics(mtrain.training_log)
    mtrain.load_checkpoint = _explaining_resume_errors(mtrain.load_checkpoint)
    mckpt.save_checkpoint = mtrain.save_checkpoint = _saving_outer_params(mckpt.save_checkpoint)
    mtrain.train_step = skip_inactive_iterations(wrap_train_step(mtrain.train_step, _active_workers))
    from megatron.training.global_vars import get_args

    from megatron_sparseloco.megatron.elastic.data_slots import wrap_data_loader, wrap_num_samples
    mtrain.setup_model_and_optimizer = _setting_up_the_rounds(mtrain.setup_model_and_optimizer)
    mtrain.build_pretraining_data_loader = wrap_data_loader(mtrain.build_pretraining_data_loader, get_args)
    mtrain.get_train_valid_test_num_samples = wrap_num_samples(mtrain.get_train_valid_test_num_samples, get_args)
    _INSTALLED = True


def run_pretrain_script(script: str, argv: Sequence[str]) -> None:
    """Install the plugin and execute the pretrain ``script`` as ``__main__`` with Megatron's ``argv``."""
    import runpy
    install()
    sys.argv = [script, *argv]
    sys.path.insert(0, os.path.dirname(os.path.abspath(script)))
    runpy.run_path(script, run_name="__main__")
