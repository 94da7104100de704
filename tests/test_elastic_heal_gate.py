"""``HealGate``: a heal inside a delayed round's quorum (comm thread) runs only while the training thread is
parked at the round's completion; a round without a heal parks nobody (``megatron/elastic/heal_state.py``)."""
from __future__ import annotations

import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from megatron_sparseloco.megatron.elastic.heal_state import HealGate


def test_a_heal_waits_for_the_training_thread_to_park_and_it_stays_parked_until_the_release():
    gate, events = HealGate(timeout=10.0), []
    training_steps = threading.Event()

    def round_on_comm_thread():
        time.sleep(0.05)
        gate.request()                       # the heal: blocks until the training thread parked
        events.append(("heal", training_steps.is_set()))
        time.sleep(0.1)
        events.append(("heal done", None))
        gate.release()
        return "committed"

    with ThreadPoolExecutor(1) as pool:
        gate.arm()
        future = pool.submit(round_on_comm_thread)
        time.sleep(0.2)                      # the window's inner steps
        training_steps.set()                 # ... then the completion: wait for the round, parked for its heal
        gate.serve(future)
        events.append(("completion goes on", None))
        assert future.result() == "committed"
    assert events == [("heal", True), ("heal done", None), ("completion goes on", None)]


def test_outside_a_delayed_quorum_or_once_parked_a_request_does_not_wait():
    gate = HealGate(timeout=0.1)
    gate.request()                           # not armed: a blocking round's heal (training thread waits anyway)
    gate.arm()
    gate.release()
    gate.request()                           # released: the quorum returned
    with ThreadPoolExecutor(1) as pool:      # armed, no heal: the round completes, nobody parks
        gate.arm()
        future = pool.submit(lambda: (gate.release(), "done")[1])
        gate.serve(future)
        assert future.result() == "done"


def test_a_heal_whose_training_thread_never_parks_fails_after_the_heal_timeout():
    gate = HealGate(timeout=0.2)
    gate.arm()
    t0 = time.monotonic()
    with pytest.raises(RuntimeError, match="--sparseloco-elastic-heal-timeout"):
        gate.request()
    assert 0.15 < time.monotonic() - t0 < 2.0
