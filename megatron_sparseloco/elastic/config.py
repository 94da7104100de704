"""The elastic flags: ``ElasticConfig`` and ``validate_elastic_args``.

Elastic mode (``--sparseloco-lighthouse URL``) runs every worker as its own job: job I of at most
W slots (``--sparseloco-worker-index I``, ``--sparseloco-workers W``) joins the outer step of the
other live jobs through torchft's lighthouse; a round commits with at least M contributing
workers (``--sparseloco-min-workers M``); every job reads the run's secret from
``--sparseloco-elastic-token-file`` (``elastic.auth``). docs/elastic.md explains each setting.

``validate_elastic_args(args)`` runs before the model is built (before ``--sparseloco-workers``
is mapped onto distributed-optimizer instances: in elastic mode a job is one worker, W counts
slots). It refuses each bad value with one ``SparseLoCoArgumentError`` naming the flag and the
fix, and refuses the modes that do not follow a changing membership yet (``REFUSED_MODES``).
"""
from __future__ import annotations

import argparse
from dataclasses import dataclass
from typing import Dict, Optional, Set
from urllib.parse import urlsplit

from megatron_sparseloco.comm.topology import TOPOLOGIES
from megatron_sparseloco.elastic.auth import TokenError, read_token
from megatron_sparseloco.outer.config_fields import ConfigError, FieldSpec, check_fields, flag_field, flagged_fields
from megatron_sparseloco.outer.flags import (SparseLoCoArgumentError, argparse_help, argument_error, dest_of,
                                            flag_error, given_flags, option)

#: ``--sparseloco-elastic-after-failed-round``: keep or discard the local progress of a round that did not commit
AFTER_FAILED_ROUND = ("keep", "discard")
#: seconds every operation of a round may wait in elastic mode when ``--sparseloco-outer-timeout`` is unset
DEFAULT_OUTER_TIMEOUT_S = 300.0


@dataclass
class ElasticConfig:
    """One job's elastic settings (each field is the flag ``--sparseloco-<flag>``)."""

    lighthouse: Optional[str] = flag_field(None, type=str, flag="lighthouse")
    """URL of the torchft lighthouse every job of the run talks to (``torchft_lighthouse --bind``, e.g.
    http://host:29510): turns elastic mode on, each worker its own job; unset: elastic mode off."""
    worker_index: Optional[int] = flag_field(None, type=int, flag="worker-index", low=0)
    """Elastic mode: this job's worker slot I, 0 <= I < --sparseloco-workers: its identity (torchft replica
    id) and the slot of the data it reads."""
    min_workers: int = flag_field(1, flag="min-workers", low=1)
    """Elastic mode: a round commits only with at least M contributing workers (M <= --sparseloco-workers;
    also the lighthouse's --min_replicas)."""
    token_file: Optional[str] = flag_field(None, type=str, flag="elastic-token-file")
    """Elastic mode (required): file holding the run's shared secret (>= 16 characters, not readable by other
    users; ``elastic.auth``). Every job of the run must read the same one; a job with another is refused."""
    quorum_timeout: float = flag_field(900.0, flag="elastic-quorum-timeout", low=0.0, low_open=True)
    """Elastic mode: seconds a job waits for a quorum (``start_quorum``); longer than the spread of the
    workers' round times."""
    connect_timeout: float = flag_field(60.0, flag="elastic-connect-timeout", low=0.0, low_open=True)
    """Elastic mode: seconds to connect to the lighthouse and to the peers' manager servers (torchft's RPCs)."""
    heartbeat_interval: float = flag_field(0.5, flag="elastic-heartbeat-interval", low=0.0, low_open=True)
    """Elastic mode: seconds between the heartbeats this job's manager server sends the lighthouse (well below
    the lighthouse's --heartbeat_timeout_ms)."""
    host: Optional[str] = flag_field(None, type=str, flag="elastic-host")
    """Elastic mode: the address other sites reach this job at (its manager server and store); unset:
    MASTER_ADDR for the store, this host's name for the manager server."""
    manager_port: int = flag_field(0, flag="elastic-manager-port", low=0, high=65535)
    """Elastic mode: port of this job's torchft manager server (rank 0); 0: any free port. Fix it to open it
    in a firewall."""
    max_failed_rounds: int = flag_field(0, flag="elastic-max-failed-rounds", low=0)
    """Elastic mode: the job exits after this many consecutive rounds that did not commit (torchft's
    ``max_retries``; 0: never)."""
    heal_chunk_mb: int = flag_field(64, flag="elastic-heal-chunk-mb", low=1, high=1024)
    """Elastic mode: MiB per data message of a heal, the state a joining job receives from a live peer
    (``elastic.heal``); also the source's staging buffer: the source's extra memory is one message (on the
    host, and one on the GPU with NCCL) whatever the state's size. The joining job holds the whole
    received state besides its own until the heal is verified."""
    heal_timeout: float = flag_field(600.0, flag="elastic-heal-timeout", low=0.0, low_open=True)
    """Elastic mode: seconds each message of a heal may take, on the source and on the joining job (the
    handshake, the header, each --sparseloco-elastic-heal-chunk-mb message); instead of
    --sparseloco-outer-timeout, so a large state over a slow link can heal. A joiner that exceeds it is
    given up: the source logs it and goes on; the joining job exits, its restart heals again."""
    grace: float = flag_field(0.0, flag="elastic-grace", low=0.0)
    """Elastic mode: seconds S a round waits for the jobs that have not reached it, run with a lighthouse
    started with ``--join_timeout_ms`` 1000·S (the lighthouse forms a round's quorum with the jobs that asked
    within S seconds of the first, at least --sparseloco-min-workers). A job that arrives later does not
    hold the round back: it catches up in place at its next quorum and its local progress, carried onto the
    run's θ_outer, is its pseudo-gradient there (it contributes one round late instead of sitting that
    round out). 0 (default): today's behaviour, a job that caught up contributes from its next round. Turn
    it on when one site is slower (less compute, a slower link) than the others; docs/elastic.md §4.2."""
    after_failed_round: str = flag_field("keep", flag="elastic-after-failed-round", choices=AFTER_FAILED_ROUND)
    """Elastic mode: what a job does with its local progress when a round does not commit: "keep" it (the
    next pseudo-gradient Δ = θ_outer − θ_local spans both rounds' inner steps) or "discard" it
    (θ_local ← θ_outer, as torchft's DiLoCo); the inner optimizer state is kept either way."""

    def validate(self) -> "ElasticConfig":
        check_fields(self)
        return self


#: modes that do not follow a changing membership yet: (args attribute, the values accepted besides
#: unset (a tuple; None: none), flag, why)
REFUSED_MODES = (
    ("sparseloco_aggregation", ("allgather",), "aggregation",
     "reduce-scatter and hierarchical aggregation assign ranges / sites to a fixed set of workers"),
    ("sparseloco_inner_steps_per_worker", None, "inner-steps-per-worker",
     "per-worker step counts are indexed by a fixed worker list"),
    ("sparseloco_consistency_check_interval", (0,), "consistency-check-interval",
     "every elastic round compares θ_outer's fingerprint in its signed header already"),
    ("sparseloco_gossip_compress", (False,), "gossip-compress",
     "the compressed proposals' public copies are kept per peer rank, which changes with the membership"),
    ("sparseloco_gossip_topology", tuple(t for t in TOPOLOGIES if t != "bandwidth"), "gossip-topology",
     "the bandwidth topology's link-cost table is indexed by a fixed worker list"),
)


def elastic_flags() -> Dict[str, FieldSpec]:
    """flag → field spec of every elastic flag."""
    return flagged_fields(ElasticConfig)


def add_elastic_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Add the elastic flags to ``parser`` (every one None when unset); idempotent."""
    if any(a.dest == dest_of("lighthouse") for a in parser._actions):
        return parser
    group = parser.add_argument_group(title="sparseloco elastic", description="one job per worker, over torchft")
    for flag, spec in elastic_flags().items():
        group.add_argument(option(flag), dest=dest_of(flag), type=spec.type, default=None,
                           help=argparse_help(spec.help),
                           choices=spec.choices)
    return parser


def _config_from_args(args: argparse.Namespace, given: Set[str]) -> ElasticConfig:
    specs = elastic_flags()
    config = ElasticConfig(**{specs[f].name: getattr(args, dest_of(f)) for f in given})
    try:
        return config.validate()
    except ConfigError as exc:
        raise argument_error(exc, ElasticConfig, "--sparseloco-lighthouse") from None


def _check_lighthouse_url(url: str) -> None:
    parts = urlsplit(url)
    try:
        port = parts.port
    except ValueError:
        port = None
    if parts.scheme not in ("http", "https") or not parts.hostname or port is None or parts.path not in ("", "/"):
        raise flag_error("lighthouse", f"{url!r} is not a lighthouse URL", "give http://HOST:PORT, the address "
                    "`torchft_lighthouse --bind` listens on as the jobs reach it, e.g. http://lighthouse-host:29510")


def _check_slots(args: argparse.Namespace, config: ElasticConfig) -> None:
    """W given, 0 <= I < W, M <= W, one distributed-optimizer instance per job."""
    W = getattr(args, "sparseloco_workers", None)
    if W is None:
        raise flag_error("workers", "is required in elastic mode (the number of worker slots W)",
                    "give --sparseloco-workers W, the most workers the run has")
    if W < 1:
        raise flag_error("workers", f"must be >= 1, got {W}", "use the number of worker slots, at least 1")
    if config.worker_index is None:
        raise flag_error("worker-index", "is required in elastic mode (this job's worker slot)",
                    f"give --sparseloco-worker-index I with 0 <= I < {W}, a different I for each job")
    if config.worker_index >= W:
        raise flag_error("worker-index", f"{config.worker_index} is not a slot of --sparseloco-workers {W}",
                    f"use 0 <= I <= {W - 1}, or raise --sparseloco-workers")
    if config.min_workers > W:
        raise flag_error("min-workers", f"{config.min_workers} is more than --sparseloco-workers {W}",
                    f"use 1 <= M <= {W}")
    instances = getattr(args, "num_distributed_optimizer_instances", 1) or 1
    if instances != 1:
        raise SparseLoCoArgumentError(
            f"--num-distributed-optimizer-instances {instances}: in elastic mode each job is one worker. "
            "Fix: drop it (the job's data-parallel ranks form one distributed-optimizer instance)")


def _check_refused_modes(args: argparse.Namespace) -> None:
    for attr, accepted, flag, why in REFUSED_MODES:
        value = getattr(args, attr, None)
        if value is not None and (accepted is None or value not in accepted):
            shown = " / ".join(str(a) for a in accepted or ())
            fix = f"use {option(flag)} {shown} or leave it unset" if accepted is not None else f"drop {option(flag)}"
            if accepted == (False,):
                fix = f"drop {option(flag)}"
            raise flag_error(flag, f"{value} is not supported in elastic mode ({why})",
                        f"{fix}, or run without --sparseloco-lighthouse")


def validate_elastic_args(args: argparse.Namespace) -> Optional[ElasticConfig]:
    """The validated ``ElasticConfig`` (also set as ``args.sparseloco_elastic``), or None when
    ``--sparseloco-lighthouse`` is not given (then no other elastic flag may be, and ``args`` is
    left unchanged)."""
    given = given_flags(args, elastic_flags())
    if "lighthouse" not in given:
        if given:
            flags = ", ".join(option(f) for f in sorted(given, key=list(elastic_flags()).index))
            one = len(given) == 1
            raise SparseLoCoArgumentError(f"{flags} only {'applies' if one else 'apply'} in elastic mode. "
                                          f"Fix: add --sparseloco-lighthouse URL or drop {'it' if one else 'them'}")
        return None
    if getattr(args, "sparseloco_algorithm", None) is None:
        raise flag_error("lighthouse", "elastic mode needs an outer algorithm", "add --sparseloco-algorithm")
    config = _config_from_args(args, given)
    _check_lighthouse_url(args.sparseloco_lighthouse)
    _check_slots(args, config)
    if config.token_file is None:
        raise flag_error("elastic-token-file", "is required in elastic mode (the run's shared secret)",
                    "give the same token file to every job, e.g. created with "
                    "`python -c 'import secrets; print(secrets.token_hex(32))' > FILE && chmod 600 FILE`")
    try:
        read_token(config.token_file)
    except TokenError as exc:
        raise flag_error("elastic-token-file", exc.problem, exc.fix) from None
    _check_refused_modes(args)
    args.sparseloco_elastic = config
    return config
