"""Heal throughput: ``SafeHealTransport`` between two processes over a torchft ProcessGroupGloo.

    python benchmarks/elastic_heal.py --mib 64 256

Rank 0 sends a state of N MiB of fp32 (θ_outer, two Adam-like moments, a few scalars) to rank 1
through the transport torchft's manager uses for a heal (handshake, JSON header, the stream in
64 MiB messages, SHA-256 + HMAC); each side prints the bytes and seconds it recorded. Loopback
only: a measure of the transport's own cost, not of a WAN link.
"""
import argparse
import os
import subprocess
import sys
import time
from datetime import timedelta


def side(rank: int, port: int, mib: int) -> None:
    import torch
    from torch.distributed import TCPStore
    from torchft.process_group import ProcessGroupGloo

    from megatron_sparseloco.elastic.auth import derive_key
    from megatron_sparseloco.elastic.heal import SafeHealTransport

    store = TCPStore("127.0.0.1", port, is_master=rank == 0, wait_for_workers=False)  # noqa: F841
    pg = ProcessGroupGloo(timeout=timedelta(seconds=120))
    pg.configure(f"127.0.0.1:{port}/heal", f"r{rank}", rank, 2)
    n = mib * (1 << 20) // 4
    state = {"user": {"elastic": {"anchor": torch.randn(n // 2), "moments": [torch.randn(n // 4), torch.randn(n // 4)],
                                  "iteration": 1000}}, "torchft": {"step": 3, "batches_committed": 9}}
    transport = SafeHealTransport(pg, derive_key(b"benchmark-secret-0123456789"), lambda: state, timedelta(seconds=120))
    if rank == 0:
        transport.send_checkpoint([1], 3, state, timedelta(seconds=120))
    else:
        transport.recv_checkpoint(0, "", 3, timedelta(seconds=120))
    r = transport.records[-1]
    print(f"{mib} MiB {r.role}: {r.nbytes} bytes in {r.seconds:.3f} s = {r.nbytes / r.seconds / 1e6:.1f} MB/s",
          flush=True)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--mib", type=int, nargs="+", default=[64])
    p.add_argument("--side", type=int, nargs=3, help=argparse.SUPPRESS)   # rank port mib (internal)
    a = p.parse_args()
    if a.side:
        side(*a.side)
        return
    from megatron_sparseloco.testing.elastic_jobs import free_port
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([os.path.dirname(os.path.dirname(os.path.abspath(__file__)))]
                                                      + sys.path))
    for mib in a.mib:
        port = free_port()
        procs = [subprocess.Popen([sys.executable, __file__, "--side", str(r), str(port), str(mib)], env=env)
                 for r in (0, 1)]
        try:
            for proc in procs:
                proc.wait(600)
        finally:
            for proc in procs:
                if proc.poll() is None:
                    proc.kill()
                    proc.wait()
        time.sleep(0.5)


if __name__ == "__main__":
    main()
