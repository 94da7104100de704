"""One job of tests/test_elastic_comm.py's clean-exit test: a round whose peer stops mid-all-gather.

    python tests/elastic_exit_job.py ROLE INDEX LIGHTHOUSE TOKEN OUT_DIR

Both jobs (one rank each, ``ElasticSession`` over a real lighthouse) meet in a round and start a
32 MiB all-gather; both touch ``OUT_DIR/ready.INDEX`` once the round began. ROLE ``stopper`` stops
itself (SIGSTOP) 10 ms into the all-gather, while its part is on the wire (the test kills it later);
ROLE ``survivor``'s all-gather times out (outer timeout 0.5 s: the gloo work is left running), it
rolls back, closes the session and returns from ``main``: the process must exit 0.
"""
import os
import signal
import sys
import threading
import time

import torch

from megatron_sparseloco.elastic.config import ElasticConfig
from megatron_sparseloco.elastic.session import ElasticSession
from megatron_sparseloco.testing.elastic_jobs import ensure_job_store


def main(role: str, index: int, lighthouse: str, token: str, out: str) -> None:
    store = ensure_job_store()  # noqa: F841  (the job's store: rank 0 of a direct launch hosts it)
    config = ElasticConfig(lighthouse=lighthouse, worker_index=index, min_workers=2, token_file=token,
                           quorum_timeout=60.0, connect_timeout=30.0, heartbeat_interval=0.2).validate()
    session = ElasticSession(config, group_rank=0, group_world_size=1, store_addr="127.0.0.1",
                             store_port=int(os.environ["MASTER_PORT"]), state_fn=lambda: {}, load_fn=lambda s: None,
                             outer_timeout=0.5)
    rnd = session.begin_round(contributes=True)
    assert rnd.size == 2, rnd.summary()
    open(os.path.join(out, f"ready.{index}"), "w").close()
    payload = torch.zeros(32 << 20, dtype=torch.uint8)
    if role == "stopper":   # stop itself while its part of the all-gather is on the wire
        threading.Timer(0.01, os.kill, (os.getpid(), signal.SIGSTOP)).start()
        session.comm.all_gather_payloads(payload, equal_sizes=True)
        time.sleep(3600)
    session.comm.all_gather_payloads(payload, equal_sizes=True)
    assert session.comm.failed, "the all-gather with a stopped peer should have failed"
    assert session.finish_round() is False
    session.close()
    print("survivor done", flush=True)


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]), sys.argv[3], sys.argv[4], sys.argv[5])
