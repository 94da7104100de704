"""Test-only launcher: megatron_sparseloco.run with a worker that dies inside an outer step.

    torchrun ... tests/crash_launcher.py <pretrain script> <args>   (env CRASH_OUTER_STEP=N, CRASH_RANK=r)

On global rank r the N-th outer step crashes (os._exit) after its first strategy has communicated
and updated θ_outer, before the params are written back to the model: the worst moment, when the
workers' states are mixed.
"""
import os
import sys

import torch.distributed as dist

from megatron_sparseloco.megatron import optimizer as outer_opt
from megatron_sparseloco.run import main

CRASH_STEP = int(os.environ["CRASH_OUTER_STEP"])
CRASH_RANK = int(os.environ["CRASH_RANK"])
_orig_outer_step = outer_opt.OuterLoopOptimizer.outer_step


def _crashing_outer_step(self, *args, **kwargs):
    if dist.get_rank() == CRASH_RANK and self.outer_steps + 1 == CRASH_STEP:
        self.watch.barrier(CRASH_STEP)   # arrives like every rank, then dies mid-step
        self.strategies[0].step()
        print(f"crash_launcher: rank {CRASH_RANK} dies inside outer step {CRASH_STEP}", flush=True)
        os._exit(17)
    return _orig_outer_step(self, *args, **kwargs)


outer_opt.OuterLoopOptimizer.outer_step = _crashing_outer_step

if __name__ == "__main__":
    main(sys.argv[1:])
