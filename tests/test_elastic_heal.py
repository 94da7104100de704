"""SafeHealTransport: a state round-trips bitwise; wrong secrets, tampering and bad headers are refused;
each joiner is served on its own; every exchange follows one order without tags (the strict checker).

The endpoints of one ``StrictP2P`` world (``testing/strict_p2p.py``: send / recv as torchft's groups
offer, matched by issue order alone as NCCL matches them, every violation kept) run the source in
a thread and the receivers in the test or in threads; nothing is unpickled on either side.
"""
import json
import logging
import queue
import threading
import time
from dataclasses import dataclass
from datetime import timedelta
from types import SimpleNamespace
from typing import Any, List, Optional

import pytest
import torch

from megatron_sparseloco.elastic.auth import derive_key
from megatron_sparseloco.elastic.heal import (HELLO_BYTES, MAC_BYTES, PROOF_BYTES, WORD_BYTES, HealError,
                                              SafeHealTransport, _copy_flat, describe, flatten, plan_receive)
from megatron_sparseloco.testing.strict_p2p import StrictP2P, StrictP2PError, StrictP2PTimeout
from megatron_sparseloco.testing.tensor_accounting import TensorAccounting

KEY = derive_key(b"0123456789abcdef-the-run-secret")
OTHER_KEY = derive_key(b"another-secret-of-enough-length")
TIMEOUT = timedelta(seconds=20)
#: the source's sends to one joiner, by index: 0 its proof (message 2), 1 the header length, 2 the
#: header, 3.. the data chunks, the last the stream MAC
FIRST_DATA_SEND = 3


class _Work:
    def __init__(self, wait=lambda: None):
        self._wait = wait

    def wait(self, timeout=None):
        self._wait()
        return True


class LoopbackPG:
    """One endpoint (``rank``) of a group made of queues, one per (src, dst, tag): a plain stand-in for a
    torchft group (no ordering rules of its own), wrapped by the strict checker in one test."""

    def __init__(self, rank, queues):
        self.rank, self.queues = rank, queues

    def _q(self, src, dst, tag):
        return self.queues.setdefault((src, dst, tag), queue.Queue())

    def send(self, tensors, dst, tag):
        self._q(self.rank, dst, tag).put(tensors[0].clone())
        return _Work()

    def recv(self, tensors, src, tag):
        def wait():
            got = self._q(src, self.rank, tag).get(timeout=20)
            if got.numel() != tensors[0].numel():
                raise RuntimeError(f"size mismatch {got.numel()} vs {tensors[0].numel()}")
            tensors[0].copy_(got)
        return _Work(wait)


class Tampering:
    """A group whose sends pass through ``tamper(index, data)`` (index: this side's n-th send) first."""

    def __init__(self, inner, tamper):
        self.inner, self.tamper, self.sent = inner, tamper, 0

    def send(self, tensors, dst, tag):
        data = self.tamper(self.sent, tensors[0].clone())
        self.sent += 1
        return self.inner.send([data], dst, tag)

    def recv(self, tensors, src, tag):
        return self.inner.recv(tensors, src, tag)


class Scripted:
    """A joiner's group that runs ``before(index)`` before its n-th operation (sleep, die, ...)."""

    def __init__(self, inner, before):
        self.inner, self.before, self.ops = inner, before, 0

    def _next(self):
        self.before(self.ops)
        self.ops += 1

    def send(self, tensors, dst, tag):
        self._next()
        return self.inner.send(tensors, dst, tag)

    def recv(self, tensors, src, tag):
        self._next()
        return self.inner.recv(tensors, src, tag)


def state(seed=0):
    g = torch.Generator().manual_seed(seed)
    return {"user": {"elastic": {
        "anchor": torch.randn(37, generator=g), "momentum": torch.randn(5, 3, generator=g),
        "adam": [torch.randn(4, 4, generator=g).to(torch.bfloat16), torch.randn(9, generator=g).half()],
        "flags": torch.tensor([True, False, True]), "counts": torch.randint(-5, 1 << 40, (6,), generator=g),
        "empty": torch.zeros(0), "pair": (torch.arange(3, dtype=torch.int32), 2.5),
        "iteration": 120, "consumed_samples": 7680, "lr": 3e-4, "name": "sparseloco", "none": None}},
        "torchft": {"step": 7, "batches_committed": 21}}


@dataclass
class Heal:
    got: Any                    # the received state, or the receiver's HealError
    err: Optional[Exception]    # what send_checkpoint raised (None: nothing)
    messages: List[tuple]       # (src, dst, bytes) of every message, in order
    src: SafeHealTransport
    dst: SafeHealTransport
    world: StrictP2P


def transfer(sent, template, key_s=KEY, key_r=KEY, step=7, chunk=7, tamper=None, timeout=TIMEOUT):
    """Run a heal from rank 0 to rank 1 over a strict world; the world is checked before returning."""
    world = StrictP2P()
    pg0 = world.group(0) if tamper is None else Tampering(world.group(0), tamper)
    src = SafeHealTransport(pg0, key_s, lambda: sent, timeout, chunk_bytes=chunk, identity=4)
    dst = SafeHealTransport(world.group(1), key_r, lambda: template, timeout, chunk_bytes=chunk, identity=5)
    errors: list = []

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
    t.join(10)
    assert not t.is_alive(), "the source still runs"
    world.check()
    return Heal(got, errors[0] if errors else None, world.messages, src, dst, world)


def assert_bitwise(a, b):
    la, lb = flatten(a), flatten(b)
    assert [p for p, _ in la] == [p for p, _ in lb]
    for (path, x), (_, y) in zip(la, lb):
        if isinstance(x, torch.Tensor):
            assert x.dtype == y.dtype and x.shape == y.shape and torch.equal(x.view(-1).view(torch.uint8),
                                                                              y.view(-1).view(torch.uint8)), path
        else:
            assert type(x) is type(y) and x == y, path


def sizes(h, src, dst):
    return [n for a, b, n in h.messages if (a, b) == (src, dst)]


@pytest.mark.parametrize("chunk", [7, 64, 1 << 20])
def test_a_state_round_trips_bitwise(chunk):
    sent, template = state(0), state(1)
    sent["user"]["elastic"]["anchor"][3] = float("nan")
    h = transfer(sent, template, chunk=chunk)
    assert h.err is None and not isinstance(h.got, Exception), (h.got, h.err)
    assert_bitwise(h.got, sent)
    assert isinstance(h.got["user"]["elastic"]["pair"], tuple)
    assert h.got["user"]["elastic"]["anchor"] is not template["user"]["elastic"]["anchor"]   # fresh buffers
    header, tensors = describe(sent, 7, chunk)
    total = sum(t.numel() * t.element_size() for t in tensors)
    nbytes = len(header) + total
    assert [(r.role, r.peer, r.step, r.nbytes, r.claimed) for r in h.src.records] == [("sent", 1, 7, nbytes, 5)]
    assert [(r.role, r.peer, r.step, r.nbytes) for r in h.dst.records] == [("received", 0, 7, nbytes)]
    chunks = [min(chunk, total - s) for s in range(0, total, chunk)]
    assert sizes(h, 0, 1) == [PROOF_BYTES, WORD_BYTES, len(header), *chunks, MAC_BYTES]
    assert sizes(h, 1, 0) == [HELLO_BYTES, MAC_BYTES, WORD_BYTES]


def test_a_receiver_without_the_secret_gets_nothing():
    h = transfer(state(0), state(1), key_r=OTHER_KEY)
    assert h.err is None, "a refused joiner must not fail the source's round"
    [rec] = h.src.records
    assert (rec.role, rec.peer, rec.nbytes, rec.claimed) == ("refused", 1, 0, 5)
    assert "secret" in rec.reason and "nothing was sent" in rec.reason
    assert isinstance(h.got, HealError) and "secret" in str(h.got) and "worker index 4" in str(h.got)
    assert sizes(h, 0, 1) == [PROOF_BYTES, WORD_BYTES]     # the proof, then the refusal: no header, no data
    assert h.dst.records == []


def test_a_source_without_the_secret_is_refused_by_the_joiner():
    h = transfer(state(0), state(1), key_s=OTHER_KEY)
    assert isinstance(h.got, HealError) and "peer (it claims worker index 4) does not hold" in str(h.got)
    assert [r.role for r in h.src.records] == ["refused"] and h.err is None
    assert sizes(h, 1, 0) == [HELLO_BYTES, MAC_BYTES] and sizes(h, 0, 1) == [PROOF_BYTES, WORD_BYTES]


def test_a_stream_modified_in_transit_is_discarded():
    def flip(index, data):
        if index == FIRST_DATA_SEND + 1 and data.numel() > 3:
            data[3] ^= 1
        return data
    h = transfer(state(0), state(1), tamper=flip)
    assert isinstance(h.got, HealError) and "MAC" in str(h.got)
    assert h.dst.records == []


def test_a_bad_header_is_refused_before_any_tensor_byte():
    template = state(1)
    template["user"]["elastic"]["anchor"] = torch.zeros(38)
    h = transfer(state(0), template)
    assert isinstance(h.got, HealError) and "anchor" in str(h.got) and "shape [37]" in str(h.got)
    header, _ = describe(state(0), 7, 7)
    assert sizes(h, 0, 1) == [PROOF_BYTES, WORD_BYTES, len(header)]   # no data message
    [rec] = h.src.records
    assert rec.role == "refused" and "refused the header" in rec.reason and rec.nbytes == len(header) and h.err is None


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
    (_header(version=1), "not a megatron_sparseloco.heal"),
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


# ---------------------------------------------------------------------- several joiners, each on its own
def heal_many(sent, joiners, heal_timeout=TIMEOUT, chunk=64, world=None, groups=None):
    """Rank 0 heals ranks 1..n in one ``send_checkpoint``; ``joiners``: one dict per joiner (``key``,
    ``wrap(group)``, ``absent``, ``timeout``: its heal timeout if not the source's); ``groups(rank)``:
    each rank's group (default: the world's fakes). Returns (source transport, source error, joiner
    results, world)."""
    world = world or StrictP2P()
    groups = groups or world.group
    src = SafeHealTransport(groups(0), KEY, lambda: sent, heal_timeout, chunk_bytes=chunk, identity=0)
    results: list = [None] * len(joiners)
    threads = []
    for i, j in enumerate(joiners):
        rank = i + 1
        if j.get("absent"):
            continue
        group = j.get("wrap", lambda g: g)(groups(rank))
        dst = SafeHealTransport(group, j.get("key", KEY), lambda: state(1), j.get("timeout", heal_timeout),
                                chunk_bytes=chunk, identity=10 + rank)

        def run(i=i, dst=dst):
            try:
                results[i] = dst.recv_checkpoint(0, "", 7, timedelta(seconds=0.01))
            except Exception as exc:  # the joiner's own outcome
                results[i] = exc
        threads.append(threading.Thread(target=run, daemon=True))
    for t in threads:
        t.start()
    try:
        src.send_checkpoint(list(range(1, len(joiners) + 1)), 7, sent, timedelta(seconds=0.01))
        err = None
    except Exception as exc:  # must not happen: asserted by the tests
        err = exc
    for t in threads:
        t.join(20)
    assert not any(t.is_alive() for t in threads)
    return src, err, results, world


def _dies_after(world, rank, ops):
    def before(index):
        if index == ops:
            world.kill(rank)
            raise ConnectionError(f"rank {rank} died")
    return lambda group: Scripted(group, before)


@pytest.mark.parametrize("first", ["wrong token", "dies mid-transfer", "never shows up"])
def test_two_joiners_one_failing_the_source_names_it_and_heals_the_other(first, caplog):
    sent, world = state(0), StrictP2P()
    header, tensors = describe(sent, 7, 64)
    joiner = {"wrong token": {"key": OTHER_KEY},
              # its operations: 0 nonce, 1-2 proofs, 3 length, 4 header, 5 verdict, 6.. data: dies at the 3rd chunk
              "dies mid-transfer": {"wrap": _dies_after(world, 1, 6 + 2)},
              "never shows up": {"absent": True}}[first]
    # joiners are served one after the other: the second one's first message waits while the source
    # waits for the absent one (docs/elastic.md §5), so its own heal timeout must cover that here
    second = {"timeout": TIMEOUT}
    with caplog.at_level(logging.WARNING, logger="megatron_sparseloco.elastic.heal"):
        src, err, got, world = heal_many(sent, [joiner, second], world=world,
                                         heal_timeout=timedelta(seconds=0.5 if first == "never shows up" else 20))
    assert err is None, f"the source raised because of one joiner: {err!r}"
    assert_bitwise(got[1], sent)
    bad, good = src.records
    assert (good.role, good.peer, good.claimed) == ("sent", 2, 12)
    assert bad.peer == 1 and bad.role == ("refused" if first == "wrong token" else "failed")
    said = caplog.text
    assert "group rank 1" in said and bad.reason in said
    if first == "wrong token":
        assert bad.claimed == 11 and "claims worker index 11" in said and "secret" in bad.reason and bad.nbytes == 0
        assert isinstance(got[0], HealError) and "secret" in str(got[0])
    elif first == "dies mid-transfer":
        assert bad.claimed == 11 and "claims worker index 11" in said and "data chunk 3 of" in bad.reason
        assert bad.nbytes == len(header) + 2 * 64 and isinstance(got[0], HealError) and "rank 1 died" in str(got[0])
    else:
        assert bad.claimed == -1 and "claims worker index ?" in said and bad.nbytes == 0
        assert "heal timeout (0.5 s, --sparseloco-elastic-heal-timeout)" in bad.reason
    world.check(allow_unmatched=first == "never shows up")   # the absent joiner's first message never came


def test_only_the_sources_own_faults_raise():
    src = SafeHealTransport(StrictP2P().group(0), KEY, dict, TIMEOUT)
    with pytest.raises(HealError, match="JSON scalars"):
        src.send_checkpoint([1, 2], 7, {"x": object()}, TIMEOUT)
    assert src.records == []


# ---------------------------------------------------------------------- one order, no tags
def test_strict_p2p_order_of_a_full_and_a_refused_heal():
    """Every message meets its counterpart in position, same size, tag 0 (the checker raises otherwise),
    through the fake and through a wrapped plain group."""
    ok = transfer(state(0), state(1), chunk=64)      # transfer() ends with world.check()
    assert not isinstance(ok.got, Exception) and ok.world.violations == [] and ok.world.unmatched() == []
    refused = transfer(state(0), state(1), key_r=OTHER_KEY)
    assert refused.world.violations == [] and refused.world.unmatched() == []
    # the checker wrapping groups that move the bytes themselves (plain queue groups here): a heal and a
    # refusal from one source, the same messages as through the fakes
    world, queues = StrictP2P(), {}
    src, err, got, _ = heal_many(state(0), [{}, {"key": OTHER_KEY}], world=world,
                                 groups=lambda r: world.group(r, inner=LoopbackPG(r, queues)))
    assert err is None and [r.role for r in src.records] == ["sent", "refused"]
    assert_bitwise(got[0], state(0))
    world.check()
    assert [m for m in world.messages if 1 in m[:2]] == ok.messages
    assert [tuple(1 if r == 2 else r for r in m[:2]) + m[2:] for m in world.messages if 2 in m[:2]] == refused.messages


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


# ---------------------------------------------------------------------- memory and time
def test_heal_staging_memory_is_one_chunk_and_noncontiguous_tensors_stream_too():
    g = torch.Generator().manual_seed(3)
    big = {"user": {"elastic": {"anchor": torch.randn(1 << 16, generator=g), "moments": [
        torch.randn(1 << 16, generator=g), torch.randn(256, 64, generator=g).t(),     # a transposed one
        torch.randn(3, 5, 7, generator=g).permute(2, 0, 1)[1:], torch.randn(1, generator=g).expand(9)],
        "iteration": 3}}, "torchft": {"step": 7, "batches_committed": 1}}
    template = {"user": {"elastic": {"anchor": torch.zeros(1 << 16), "moments": [
        torch.zeros(1 << 16), torch.zeros(64, 256), torch.zeros(6, 3, 5), torch.zeros(9)], "iteration": 0}},
        "torchft": {"step": 0, "batches_committed": 0}}
    chunk = 4096
    world = StrictP2P()
    src = SafeHealTransport(world.group(0), KEY, lambda: big, TIMEOUT, chunk_bytes=chunk)
    dst = SafeHealTransport(world.group(1), KEY, lambda: template, TIMEOUT, chunk_bytes=chunk)
    acc = TensorAccounting()

    def send():
        with acc:
            src.send_checkpoint([1], 7, big, TIMEOUT)
    t = threading.Thread(target=send, daemon=True)
    t.start()
    got = dst.recv_checkpoint(0, "", 7, TIMEOUT)
    t.join(20)
    world.check()
    assert_bitwise(got, {"user": {"elastic": {**big["user"]["elastic"], "moments": [
        m.contiguous() for m in big["user"]["elastic"]["moments"]]}}, "torchft": big["torchft"]})
    _, tensors = describe(big, 7, chunk)
    total = sum(t.numel() * t.element_size() for t in tensors)
    # the staging buffer, a few handshake words, and (for the non-contiguous tensors) one chunk of elements
    assert acc.peak["cpu"] <= 2 * chunk + 1024, (acc.peak["cpu"], total)
    assert total > 100 * chunk and src.records[0].role == "sent"


@pytest.mark.parametrize("shape,perm,start,stop", [((4, 5, 6), (2, 0, 1), 0, 120), ((4, 5, 6), (1, 2, 0), 7, 93),
                                                   ((3, 1, 8), (2, 1, 0), 5, 6), ((6, 7), (1, 0), 13, 14),
                                                   ((2, 3, 4, 5), (3, 1, 0, 2), 11, 109)])
def test_heal_copies_element_ranges_of_any_strides(shape, perm, start, stop):
    t = torch.arange(int(torch.tensor(shape).prod())).reshape(shape).permute(*perm)
    out = torch.full((stop - start,), -1, dtype=t.dtype)
    _copy_flat(t, start, stop, out)
    assert torch.equal(out, t.reshape(-1)[start:stop])


def _slow_joiner(seconds):
    """A joiner that waits ``seconds`` before its proof (message 3) and its header verdict (message 6)."""
    return lambda group: Scripted(group, lambda i: time.sleep(seconds) if i in (2, 5) else None)


def test_heal_longer_than_the_outer_timeout_completes_within_the_heal_timeout():
    """torchft passes its outer timeout (10 ms here) to send / recv_checkpoint; each message waits the
    heal timeout instead: a joiner slower than the outer timeout heals, one slower than the heal
    timeout is given up without failing the source."""
    sent = state(0)
    src, err, got, world = heal_many(sent, [{"wrap": _slow_joiner(0.3)}], heal_timeout=timedelta(seconds=5))
    assert err is None and [r.role for r in src.records] == ["sent"] and src.records[0].seconds > 0.5
    assert_bitwise(got[0], sent)
    world.check()
    src, err, got, world = heal_many(sent, [{"wrap": _slow_joiner(1.0)}], heal_timeout=timedelta(seconds=0.3))
    assert err is None and [r.role for r in src.records] == ["failed"]
    assert "within the heal timeout (0.3 s, --sparseloco-elastic-heal-timeout)" in src.records[0].reason
    assert isinstance(got[0], HealError)


def test_the_session_gives_the_transport_the_heal_flags(token, monkeypatch):
    from megatron_sparseloco.elastic.config import ElasticConfig
    from megatron_sparseloco.elastic.session import ElasticSession
    monkeypatch.setattr(ElasticSession, "_connect",
                        lambda self, *a: SimpleNamespace(register_state_dict_fn=lambda *a: None))
    config = ElasticConfig(lighthouse="http://127.0.0.1:1", worker_index=3, token_file=token, heal_timeout=42.0,
                           heal_chunk_mb=2).validate()
    session = ElasticSession(config, group_rank=0, group_world_size=1, store_addr="127.0.0.1", store_port=1,
                             state_fn=dict, load_fn=lambda s: None, outer_timeout=5.0, pg=StrictP2P().group(0))
    t = session.transport
    assert (t.timeout, t.chunk_bytes, t.identity) == (timedelta(seconds=42), 2 << 20, 3)
    assert ElasticConfig().heal_timeout == 600.0
