"""The ``--sparseloco-*`` flags and their checks: what ``megatron.training``'s argument parsing sees.

    flags.py           the flags on Megatron's parser, one per flagged config field (``add_sparseloco_args``)
    validation.py      the checks, and the configs built once from the flags (``validate_sparseloco_args``:
                       ``args.sparseloco_loop_config``, ``args.sparseloco_outer_config``, ``args.sparseloco_elastic``)
    loop_config.py     ``OuterLoopConfig``, the outer loop's settings and cross-field rules
    help.py            the flag reference (``--sparseloco-help``, the README table)
    startup_report.py  the start-up block rank 0 prints before training
"""
from megatron_sparseloco.megatron.args.flags import (ALGORITHMS, LOOP, LoopFlags, add_sparseloco_args, algorithms,
                                                     flag_table, shared_help, takers)
from megatron_sparseloco.megatron.args.validation import (elastic_job_batch, parse_per_worker_steps, resolve_workers,
                                                          resolved_flag_values, validate_sparseloco_args)
from megatron_sparseloco.outer.flags import SparseLoCoArgumentError, dest_of, option

__all__ = ["ALGORITHMS", "LOOP", "LoopFlags", "SparseLoCoArgumentError", "add_sparseloco_args", "algorithms",
           "dest_of", "elastic_job_batch", "flag_table", "option", "parse_per_worker_steps", "resolve_workers",
           "resolved_flag_values", "shared_help", "takers", "validate_sparseloco_args"]
