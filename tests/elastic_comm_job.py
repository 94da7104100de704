"""One replica group of tests/test_elastic_comm.py: every ``OuterComm`` operation over torchft and over c10d.

    python tests/elastic_comm_job.py INDEX N LIGHTHOUSE C10D_PORT OUT_DIR

Each of N processes is a one-rank torchft replica group (its own store, replica id ``jobINDEX``)
and also rank INDEX of a c10d gloo group of the same N processes. Phase 1 runs every operation
of ``OuterComm`` on the same inputs through ``TorchFTComm`` and ``ProcessGroupComm`` and records
whether the results are bitwise equal and the byte counts identical. Phase 2: process N-1 exits
abruptly before an all-gather; the others record what the failed round returned, how long the
skipped operations took, ``should_commit`` and the next round (survivors only). OUT_DIR/INDEX.json.
"""
import json
import os
import sys
import time
from datetime import timedelta

import torch
import torch.distributed as dist

from megatron_sparseloco.comm.collectives import CommCounter
from megatron_sparseloco.comm.process_group import ProcessGroupComm
from megatron_sparseloco.elastic.comm import TorchFTComm
from megatron_sparseloco.testing.elastic_jobs import ensure_job_store


def by_peer(received: dict) -> list:
    return [received[p] for p in sorted(received)]


def inputs(rank: int, n: int):
    """Deterministic per-rank inputs, one list of (name, call) per operation."""
    g = torch.Generator().manual_seed(100 + rank)
    dense = torch.randn(1000, generator=g)
    ints = torch.randint(0, 1 << 40, (17,), generator=g)
    var = torch.randint(0, 256, (7 + 13 * rank,), dtype=torch.uint8, generator=g)
    fixed = torch.randint(0, 256, (64,), dtype=torch.uint8, generator=g)
    ring = sorted({(rank + 1) % n, (rank - 1) % n} - {rank})
    per_peer = {p: torch.randint(0, 256, (5 + 3 * rank + p,), dtype=torch.uint8, generator=g) for p in ring}
    pieces = {p: torch.randint(0, 256, ((rank * 7 + p) % 4,), dtype=torch.uint8, generator=g)
              for p in range(n) if p != rank}
    recv_sizes = {p: (p * 7 + rank) % 4 for p in range(n) if p != rank}
    return [
        ("all_reduce_sum", lambda c: [c.all_reduce_(dense.clone(), "sum")]),
        ("all_reduce_max", lambda c: [c.all_reduce_(ints.clone(), "max")]),
        ("broadcast", lambda c: [c.broadcast_(dense.clone() * (rank + 1), src=1)]),
        ("all_gather_var", lambda c: c.all_gather_payloads(var)),
        ("all_gather_equal", lambda c: c.all_gather_payloads(fixed, equal_sizes=True)),
        ("agree_max", lambda c: [torch.tensor([c.agree_max(3 * rank + 1)])]),
        ("exchange", lambda c: by_peer(c.exchange(dense[:50] + rank, ring))),
        ("exchange_per_peer", lambda c: by_peer(c.exchange_per_peer(per_peer, None))),
        ("exchange_per_peer_known",
         lambda c: by_peer(c.exchange_per_peer(per_peer, {p: 5 + 3 * p + rank for p in ring}))),
        ("exchange_pieces", lambda c: by_peer(c.exchange_pieces(pieces, recv_sizes))),
        ("start_all_reduce", lambda c: [c.start_all_reduce_(dense.clone(), "sum").wait()]),
        ("start_all_gather", lambda c: c.start_all_gather_payloads(var).wait()),
    ]


def counts(counter: CommCounter):
    return [counter.bytes_sent, counter.bytes_received, counter.collectives, dict(counter.by_kind)]


def compare(ft: TorchFTComm, ref: ProcessGroupComm, rank: int, n: int) -> dict:
    report = {}
    for name, call in inputs(rank, n):
        ft.counter.reset()
        ref.counter.reset()
        got, want = call(ft), call(ref)
        same = len(got) == len(want) and all(a.dtype == b.dtype and torch.equal(a, b) for a, b in zip(got, want))
        report[name] = {"equal": same, "torchft": counts(ft.counter), "c10d": counts(ref.counter)}
    return report


def failure_phase(manager, comm: TorchFTComm, rank: int, n: int) -> dict:
    """Process n-1 leaves before an all-gather; the others see the failed round, then the next one."""
    manager.start_quorum()
    comm.sync_with_quorum()
    if rank == n - 1:
        os._exit(0)
    payload = torch.arange(10, dtype=torch.uint8) + rank
    t0 = time.perf_counter()
    got = comm.all_gather_payloads(payload, equal_sizes=True)
    failed_after = time.perf_counter() - t0
    t0 = time.perf_counter()
    x = torch.full((4,), float(rank))
    reduced = comm.all_reduce_(x, "sum")
    exchanged = comm.exchange(x, [(rank + 1) % comm.size])
    skipped = time.perf_counter() - t0
    out = {"failed": comm.failed, "manager_errored": manager.errored() is not None,
           "stand_in": all(torch.equal(g, payload) for g in got) and len(got) == n,
           "failed_after_s": failed_after, "skipped_ops_s": skipped,
           "later_ops_unchanged": torch.equal(reduced, torch.full((4,), float(rank)))
           and all(torch.equal(v, x) for v in exchanged.values()),
           "commit": manager.should_commit()}
    manager.start_quorum()
    comm.sync_with_quorum()
    y = comm.all_reduce_(torch.ones(3), "sum")
    out.update(next_size=comm.size, next_sum=y.tolist(), next_failed=comm.failed, next_commit=manager.should_commit())
    return out


def main() -> None:
    index, n, lighthouse, c10d_port, out_dir = sys.argv[1:6]
    index, n, c10d_port = int(index), int(n), int(c10d_port)
    from torchft.manager import Manager
    from torchft.process_group import ProcessGroupGloo
    store = ensure_job_store()  # noqa: F841  (kept alive)
    timeout = timedelta(seconds=10)
    pg = ProcessGroupGloo(timeout=timeout)
    manager = Manager(pg=pg, load_state_dict=None, state_dict=None, min_replica_size=1, use_async_quorum=False,
                      timeout=timeout, quorum_timeout=timedelta(seconds=60), connect_timeout=timedelta(seconds=30),
                      rank=0, world_size=1, store_addr="127.0.0.1", store_port=int(os.environ["MASTER_PORT"]),
                      lighthouse_addr=lighthouse, replica_id=f"job{index}", hostname="127.0.0.1", init_sync=False)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{c10d_port}", rank=index, world_size=n)
    dist.barrier()   # every manager is up (heartbeating) before the first quorum: all N join it
    comm = TorchFTComm(manager, pg, timeout)
    manager.start_quorum()
    comm.sync_with_quorum()
    result = {"size": comm.size, "rank": comm.rank,
              "ops": compare(comm, ProcessGroupComm(None), index, n), "commit": manager.should_commit()}
    dist.destroy_process_group()
    result["failure"] = failure_phase(manager, comm, index, n)
    with open(os.path.join(out_dir, f"{index}.json"), "w") as f:
        json.dump(result, f)
    manager.shutdown(wait=False)


if __name__ == "__main__":
    main()
