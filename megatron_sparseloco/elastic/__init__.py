"""Elastic workers: every worker its own job, the outer step over a torchft-managed group.

* ``config``  — the ``--sparseloco-*`` elastic flags (``ElasticConfig``) and their validation;
* ``comm``    — ``TorchFTComm``, the ``OuterComm`` over a torchft ``Manager``'s process group;
* ``auth``    — the run's shared secret (token file) and the MACs made with it;
* ``heal``    — ``SafeHealTransport``: a peer's state as tensors plus a validated JSON header, never pickle;
* ``messages`` — a round's signed messages (nonces, header, verdict), bound to the round and the sender's position;
* ``decision`` — the round's decisions as pure functions (``decide``, the fork rule, the verdict tally);
* ``session`` — ``ElasticSession``: quorum, round header, the caller's communicate, verdicts, commit or roll back.

docs/elastic.md describes the protocol, the ports, the timeouts and the threat model.
"""
