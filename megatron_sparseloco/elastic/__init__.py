"""Elastic workers: every worker its own job, the outer step over a torchft-managed group.

* ``config``  — the ``--sparseloco-*`` elastic flags (``ElasticConfig``) and their validation;
* ``comm``    — ``TorchFTComm``, the ``OuterComm`` over a torchft ``Manager``'s process group;
* ``auth``    — the run's shared secret (token file) and the MACs made with it;
* ``heal``    — ``SafeHealTransport``: a peer's state as tensors plus a validated JSON header, never pickle;
* ``session`` — ``ElasticSession``: quorum, round header, the caller's communicate, commit or roll back.

docs/elastic.md describes the protocol, the ports, the timeouts and the threat model.
"""
