"""SafeHealTransport: a state round-trips bitwise; wrong secrets, tampering and bad headers are refused.

Two endpoints of a loopback "process group" (send / recv with tags, as torchft's groups offer) run
the sender in a thread and the receiver in the test; nothing is unpickled on either side.
"""
import json
import queue
import threading
from datetime import timedelta

import pytest
import torch

from megatron_sparseloco.elastic.auth import derive_key
from megatron_sparseloco.elastic.heal import (HealError, SafeHealTransport, TAG_DATA, TAG_HEADER, describe, flatten,
                                              plan_receive)
from megatron_sparseloco.testing.strict_p2p import StrictP2P, StrictP2PError, StrictP2PTimeout

KEY = derive_key(b"0123456789abcdef-the-run-secret")
TIMEOUT = timedelta(seconds=20)


class _Work:
    def __init__(self, wait=lambda: None):
        self._wait = wait

    def wait(self, timeout=None):
        self._wait()
        return True


class LoopbackPG:
    """One endpoint (``rank``) of a two-rank group made of queues; ``tamper(tag, data)`` may edit messages."""

    def __init__(self, rank, queues, log, tamper=None):
        self.rank, self.queues, self.log, self.tamper = rank, queues, log, tamper

    def _q(self, src, dst, tag):
        return self.queues.setdefault((src, dst, tag), queue.Queue())

    def send(self, tensors, dst, tag):
        data = tensors[0].clone()
        if self.tamper is not None:
            data = self.tamper(tag, data)
        self.log.append((self.rank, tag, data.numel()))
        self._q(self.rank, dst, tag).put(data)
        return _Work()

    def recv(self, tensors, src, tag):
        def wait():
            got = self._q(src, self.rank, tag).get(timeout=20)
            if got.numel() != tensors[0].numel():
                raise RuntimeError(f"size mismatch {got.numel()} vs {tensors[0].numel()}")
            tensors[0].copy_(got)
        return _Work(wait)


def state(seed=0):
    g = torch.Generator().manual_seed(seed)
    return {"user": {"elastic": {
        "anchor": torch.randn(37, generator=g), "momentum": torch.randn(5, 3, generator=g),
        "adam": [torch.randn(4, 4, generator=g).to(torch.bfloat16), torch.randn(9, generator=g).half()],
        "flags": torch.tensor([True, False, True]), "counts": torch.randint(-5, 1 << 40, (6,), generator=g),
        "empty": torch.zeros(0), "pair": (torch.arange(3, dtype=torch.int32), 2.5),
        "iteration": 120, "consumed_samples": 7680, "lr": 3e-4, "name": "sparseloco", "none": None}},
        "torchft": {"step": 7, "batches_committed": 21}}


def transfer(sent, template, key_s=KEY, key_r=KEY, step=7, chunk=7, tamper=None):
    """Run a heal from rank 0 to rank 1; returns (received or the receiver's error, sender's error, log)."""
    queues, log, errors = {}, [], []
    src = SafeHealTransport(LoopbackPG(0, queues, log, tamper), key_s, lambda: sent, TIMEOUT, chunk_bytes=chunk)
    dst = SafeHealTransport(LoopbackPG(1, queues, log), key_r, lambda: template, TIMEOUT, chunk_bytes=chunk)

    def send():
        try:
            src.send_checkpoint([1], step, sent, TIMEOUT)
        except Exception as exc:  # recorded for the test
            errors.append(exc)

    t = threading.Thread(target=send, daemon=True)
    t.start()
    try:
        got = dst.recv_checkpoint(0, "", step, TIMEOUT)
    except HealError as exc:
        got = exc
    t.join(5)
    return got, (errors[0] if errors else None), log, src, dst


def assert_bitwise(a, b):
    la, lb = flatten(a), flatten(b)
    assert [p for p, _ in la] == [p for p, _ in lb]
    for (path, x), (_, y) in zip(la, lb):
        if isinstance(x, torch.Tensor):
            assert x.dtype == y.dtype and x.shape == y.shape and torch.equal(x.view(-1).view(torch.uint8),
                                                                              y.view(-1).view(torch.uint8)), path
        else:
            assert type(x) is type(y) and x == y, path


@pytest.mark.parametrize("chunk", [7, 64, 1 << 20])
def test_a_state_round_trips_bitwise(chunk):
    sent, template = state(0), state(1)
    sent["user"]["elastic"]["anchor"][3] = float("nan")
    got, err, _, src, dst = transfer(sent, template, chunk=chunk)
    assert err is None and not isinstance(got, Exception), (got, err)
    assert_bitwise(got, sent)
    assert isinstance(got["user"]["elastic"]["pair"], tuple)
    assert got["user"]["elastic"]["anchor"] is not template["user"]["elastic"]["anchor"]   # fresh buffers
    header, tensors = describe(sent, 7, chunk)
    nbytes = len(header) + sum(t.numel() * t.element_size() for t in tensors)
    assert [(r.role, r.peer, r.step, r.nbytes) for r in src.records] == [("sent", 1, 7, nbytes)]
    assert [(r.role, r.peer, r.step, r.nbytes) for r in dst.records] == [("received", 0, 7, nbytes)]


def test_a_receiver_without_the_secret_gets_nothing():
    got, err, log, _, _ = transfer(state(0), state(1), key_r=derive_key(b"another-secret-of-enough-length"))
    assert isinstance(err, HealError) and "secret" in str(err) and "nothing was sent" in str(err)
    assert isinstance(got, HealError) and "secret" in str(got)
    assert not [m for m in log if m[0] == 0 and m[1] in (TAG_HEADER, TAG_DATA)]


def test_a_stream_modified_in_transit_is_discarded():
    def flip(tag, data):
        if tag == TAG_DATA and data.numel() > 3:
            data[3] ^= 1
        return data
    got, _, _, _, dst = transfer(state(0), state(1), tamper=flip)
    assert isinstance(got, HealError) and "MAC" in str(got)
    assert dst.records == []


def test_a_bad_header_is_refused_before_any_tensor_byte():
    template = state(1)
    template["user"]["elastic"]["anchor"] = torch.zeros(38)
    got, _, log, _, _ = transfer(state(0), template)
    assert isinstance(got, HealError) and "anchor" in str(got) and "shape [37]" in str(got)
    received_data = [m for m in log if m[0] == 1 and m[1] == TAG_DATA]
    assert received_data == []


def _header(**edits):
    header, _ = describe(state(0), 7, 64)
    doc = json.loads(header)
    for k, v in edits.items():
        if callable(v):
            v(doc)
        else:
            doc[k] = v
    return json.dumps(doc).encode()


def _entry(path):
    return lambda doc: next(e for e in doc["entries"] if e["path"] == path)


@pytest.mark.parametrize("header,words", [
    (b"\x80not json", "not JSON"),
    (b"[" * 100000, "not JSON"),
    (_header(format="pickle"), "not a megatron_sparseloco.heal"),
    (_header(version=2), "not a megatron_sparseloco.heal"),
    (_header(step=6), "step 6"),
    (_header(chunk_bytes=0), "chunk size"),
    (_header(total_bytes=1), "announces 1 bytes"),
    (_header(e=lambda d: _entry(["user", "elastic", "anchor"])(d).update(dtype="float16")), "dtype 'float16'"),
    (_header(e=lambda d: _entry(["user", "elastic", "anchor"])(d).update(shape=[36])), "shape [36]"),
    (_header(e=lambda d: _entry(["user", "elastic", "iteration"])(d).update(value="120")), "is a str"),
    (_header(e=lambda d: d["entries"].append({"path": ["user", "evil"], "value": 1})), "not part of this job"),
    (_header(e=lambda d: d["entries"].pop()), "lacks 1 entries"),
    (_header(e=lambda d: d["entries"].append(d["entries"][0])), "appears twice"),
    (_header(e=lambda d: d["entries"][0].update(path=[["x"]])), "malformed entry"),
    (_header(e=lambda d: _entry(["user", "elastic", "anchor"])(d).update(value=1)), "must be a tensor"),
    (_header(e=lambda d: _entry(["user", "elastic", "lr"])(d).update(dtype="float32", shape=[])), "must be a value"),
])
def test_malformed_headers_are_refused(header, words):
    with pytest.raises(HealError, match=None) as exc:
        plan_receive(header, state(1), 7)
    assert words in str(exc.value), str(exc.value)


def test_unsupported_leaves_are_refused_on_the_sending_side():
    with pytest.raises(HealError, match="JSON scalars"):
        describe({"x": object()}, 1, 64)
    with pytest.raises(HealError, match="dtype"):
        describe({"x": torch.zeros(2, dtype=torch.complex64)}, 1, 64)


# ---------------------------------------------------------------------- the strict point-to-point checker
def _pair(world, a_ops, b_ops, timeout=2.0):
    """Rank 0 runs ``a_ops``, rank 1 ``b_ops`` (each a list of ("send" | "recv", nbytes, tag)), each op
    waited before the next; returns the exceptions of both ranks."""
    errors: list = [None, None]

    def run(rank, ops):
        g = world.group(rank)
        try:
            for kind, n, tag in ops:
                getattr(g, kind)([torch.zeros(n, dtype=torch.uint8)], 1 - rank, tag).wait(timeout)
        except Exception as exc:  # the verdict under test
            errors[rank] = exc
    threads = [threading.Thread(target=run, args=(r, ops), daemon=True) for r, ops in enumerate((a_ops, b_ops))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(10)
    return errors


def test_strict_p2p_order_checker_rejects_tags_sizes_and_crossed_sends():
    world = StrictP2P()
    errors = _pair(world, [("send", 8, 0), ("recv", 8, 0)], [("recv", 8, 0), ("send", 8, 0)])
    assert errors == [None, None] and world.violations == [] and world.unmatched() == []
    world.check()

    world = StrictP2P()
    errors = _pair(world, [("send", 8, 104)], [("recv", 8, 104)])
    assert all(isinstance(e, StrictP2PError) and "tag 104" in str(e) for e in errors), errors
    with pytest.raises(StrictP2PError, match="tag 104"):
        world.check()

    world = StrictP2P()
    errors = _pair(world, [("send", 8, 0)], [("recv", 16, 0)])
    assert all(isinstance(e, StrictP2PError) and "size mismatch" in str(e) for e in errors), errors
    assert "rank 0's send #0 to rank 1 (8 bytes" in world.violations[0] and "16 bytes" in world.violations[0]

    world = StrictP2P()   # the old swap: both send, then both receive
    errors = _pair(world, [("send", 8, 0), ("recv", 8, 0)], [("send", 8, 0), ("recv", 8, 0)])
    assert all(isinstance(e, StrictP2PError) and "crossed order" in str(e) for e in errors), errors
    assert "deadlock" in world.violations[0]
    with pytest.raises(StrictP2PError, match="crossed order"):
        world.check()

    world = StrictP2P()   # a message nobody receives
    g = world.group(0)
    g.send([torch.zeros(4, dtype=torch.uint8)], 1, 0)
    with pytest.raises(StrictP2PError, match="never matched: rank 0's send #0 to rank 1"):
        world.check()


def test_strict_p2p_order_checker_finds_a_wait_cycle_and_times_out():
    world = StrictP2P()   # 0 → 1 → 2 → 0: each sends first, every pair mirrors, yet nobody can go on
    errors: list = [None] * 3

    def run(rank):
        g = world.group(rank)
        try:
            g.send([torch.zeros(4, dtype=torch.uint8)], (rank + 1) % 3, 0).wait(5)
            g.recv([torch.zeros(4, dtype=torch.uint8)], (rank - 1) % 3, 0).wait(5)
        except Exception as exc:  # the verdict under test
            errors[rank] = exc
    threads = [threading.Thread(target=run, args=(r,), daemon=True) for r in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(10)
    assert all(isinstance(e, StrictP2PError) and "deadlock" in str(e) for e in errors), errors
    world = StrictP2P()
    with pytest.raises(StrictP2PTimeout, match="not issued within 0.05 s"):
        world.group(0).recv([torch.zeros(4, dtype=torch.uint8)], 1, 0).wait(0.05)
