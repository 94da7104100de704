"""``testing.multirank.free_port``: the ports the multi-process tests hand to stores and lighthouses."""
import socket

from megatron_sparseloco.testing import elastic_jobs, multirank


def test_the_port_lies_below_the_kernels_ephemeral_range_and_can_be_bound():
    low = multirank._ephemeral_low()
    for _ in range(20):
        port = multirank.free_port()
        assert 1024 <= port < low
        with socket.socket() as s:
            s.bind(("127.0.0.1", port))


def test_a_port_someone_listens_on_is_passed_over(monkeypatch):
    taken = socket.socket()
    taken.bind(("", 0))
    taken.listen()
    busy = taken.getsockname()[1]
    monkeypatch.setattr(multirank, "_ephemeral_low", lambda: 65535)   # both ports below (kernel picks lie in 32768..60999)
    with socket.socket() as probe:
        probe.bind(("", 0))
        idle = probe.getsockname()[1]      # free once the probe closes

    class Draws:
        def __init__(self):
            self.ports = [busy, idle]

        def randrange(self, lo, hi):
            assert lo <= busy < hi and lo <= idle < hi
            return self.ports.pop(0)

    monkeypatch.setattr(multirank.random, "Random", Draws)
    try:
        assert multirank.free_port() == idle
    finally:
        taken.close()


def test_the_elastic_harness_uses_the_same_function():
    assert elastic_jobs.free_port is multirank.free_port
