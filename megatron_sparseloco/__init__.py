"""megatron_sparseloco — communication-efficient outer steps for Megatron pretraining.

Floors (a module imports its own unit and the floors below it, never a unit beside or above it; no
import cycles; ``tests/test_repo_hygiene.py -k layer`` checks both, ``TYPE_CHECKING`` imports excepted):

    6  run, demo, worker_layout, __main__   entry points: the launcher, the CPU demo, the layout and flag CLIs
    5  testing     multi-rank CPU harness, CPU bridges for megatron-core, elastic test jobs (never in production)
    4  megatron    megatron-core / megatron.training integration:
                   top: plugin, optimizer wrapper, rounds, schedule, fragments, tied params, metrics
                   args/ flags, validation, help, start-up report   placement/ which ranks form a worker
                   checkpoint/ outer state in checkpoints           elastic/ the Megatron side of elastic mode
    3  elastic     one job per worker over torchft: session, signed round headers, heal, auth, flags
    2  outer       outer optimisers (averaging, DiLoCo, SparseLoCo, GASLoC) on flat fp32 shards, their
                   configs and flag names;  costmodel  bytes and time of one outer step
    1  comm        OuterComm (collectives, p2p, byte accounting), Pending, topologies
    0  compress    codec: chunked Top-k, quantiser, bit-packed wire format, error feedback;  data  offline corpus
"""

__version__ = "0.1.0"
