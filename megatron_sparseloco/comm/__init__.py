"""Collectives across DiLoCo workers with exact byte accounting (see ``collectives``)."""
from megatron_sparseloco.comm.collectives import (  # noqa: F401
    CommCounter,
    all_gather_payloads,
    all_reduce_,
    broadcast_,
)
