"""Data slots in elastic mode: worker I of W reads slot I of the run's data, as in single-job mode.

In single-job mode the W workers are distributed-optimizer instances of one job: Megatron's
data-parallel group spans all of them, instance I holds data-parallel ranks I·d … I·d + d − 1
(d = ranks per worker; ``parallel_state``'s intra-instance groups are consecutive blocks of the
data-parallel group), every iteration consumes the run's global batch G, and Megatron's sampler
gives data-parallel rank q of D = W·d the micro-batches [q·m, (q+1)·m) of each consecutive
block of m·D samples, from the run's consumed samples on.

In elastic mode each job is one worker with its own data-parallel group of d ranks and its own
batch G / W (``arguments.elastic_job_batch``); its ``consumed_train_samples`` counts its own
samples, i.e. the run's / W. Around Megatron's data loaders this module gives the sampler

    data-parallel rank   I·d + r          (r: the rank's data-parallel rank in its job)
    data-parallel size   W·d
    consumed samples     W · the job's consumed samples
    dataset size         W · what the job's own counts would ask for

so that, without failures, job I reads exactly what instance I reads in single-job mode. The
position is a function of the run's iteration, not of who is alive: a missing worker's slot is
skipped (never read twice, by anyone), and a healed job continues at the healed consumed samples
(``elastic_state``).
"""
from __future__ import annotations

import contextlib
import functools
from typing import Any, Iterator, Optional, Tuple


def elastic_slots(args) -> Optional[Tuple[int, int]]:
    """(worker index I, slots W) in elastic mode, else None."""
    config = getattr(args, "sparseloco_elastic", None)
    if config is None or getattr(args, "sparseloco_algorithm", None) is None:
        return None
    return int(config.worker_index), int(args.sparseloco_workers)


class SlotParallelState:
    """``parallel_state`` as the data samplers see it: the data-parallel rank and size of the run's
    slot layout (module docstring); every other attribute is the real module's."""

    def __init__(self, base: Any, index: int, workers: int):
        self._base, self._index, self._workers = base, index, workers

    def get_data_parallel_rank(self, *a, **kw) -> int:
        return self._index * self._base.get_data_parallel_world_size(*a, **kw) + \
            self._base.get_data_parallel_rank(*a, **kw)

    def get_data_parallel_world_size(self, *a, **kw) -> int:
        return self._workers * self._base.get_data_parallel_world_size(*a, **kw)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._base, name)


@contextlib.contextmanager
def slot_layout(samplers_module, index: int, workers: int) -> Iterator[None]:
    """Inside the block ``samplers_module.mpu`` answers with the run's slot layout."""
    base = samplers_module.mpu
    samplers_module.mpu = SlotParallelState(base, index, workers)
    try:
        yield
    finally:
        samplers_module.mpu = base


def wrap_data_loader(orig, args_fn):
    """``build_pretraining_data_loader(dataset, consumed_samples)`` reading this worker's slot."""

    @functools.wraps(orig)
    def build_pretraining_data_loader(dataset, consumed_samples, *a, **kw):
        slots = elastic_slots(args_fn())
        if slots is None or dataset is None:
            return orig(dataset, consumed_samples, *a, **kw)
        from megatron.training.datasets import data_samplers
        index, workers = slots
        with slot_layout(data_samplers, index, workers):
            return orig(dataset, consumed_samples * workers, *a, **kw)

    return build_pretraining_data_loader


def wrap_num_samples(orig, args_fn):
    """``get_train_valid_test_num_samples()`` of the run (W times the job's), so every job builds the
    run's datasets (the same samples, in the same order, as single-job mode)."""

    @functools.wraps(orig)
    def get_train_valid_test_num_samples(*a, **kw):
        nums = orig(*a, **kw)
        slots = elastic_slots(args_fn())
        if slots is None:
            return nums
        return tuple(None if n is None else n * slots[1] for n in nums)

    return get_train_valid_test_num_samples


__all__ = ["SlotParallelState", "elastic_slots", "slot_layout", "wrap_data_loader", "wrap_num_samples"]
