"""SparseLoCo all-gather through site groups (``--sparseloco-aggregation hierarchical``).

The W workers of an outer group are cut into G = ``--sparseloco-aggregation-groups`` contiguous
groups of g = W/G (worker w = a·g + i is member i of site a; outer ranks follow the node order, so
list the nodes site by site, as for the layout checker's ``--sites``). Per outer step and bucket,
with P_w worker w's packed payload (every worker's has the same size n), in two rounds:

    1. rail exchange (between sites): worker a·g + i sends P_{a·g+i} to member i of every other
       site and receives theirs — G − 1 messages each way, all at once: one WAN round. It now
       holds the rail set R_i = (P_{0·g+i}, …, P_{(G−1)·g+i}) in site order.
    2. site gather (inside the site): every member sends its rail set to the g − 1 others and
       receives theirs: every member now holds all W payloads.

Every rank then decodes and averages the W payloads, in worker order, exactly as ``allgather`` does
(``outer/sparseloco.py``), so θ_outer is bitwise the all-gather result (tested); a defective payload
is still rejected naming its worker. Only the path changes:

* per worker, the WAN carries (G − 1)·n in and out (all-gather: up to (W − 1)·n), the rest,
  (g − 1)·G·n, comes over the site's LAN: the WAN bytes a worker moves do not grow with the
  number of workers per site;
* into a site the WAN carries (W − g)·n: each remote payload once per remote site;
* a step has one WAN round (the G − 1 rail messages go at once) instead of the W − 1 sequential
  hops of a ring all-gather: the latency term drops from (W − 1)·α to α per collective.

Deviation from the first sketch of the design (exact aggregation in a site, *re-encoded* exchange between sites):
the exchange here is exact, because re-encoding an aggregate at payload density is what costs
reduce-scatter +0.10 … +0.23 nats at W = 8 (docs/scaling.md). Exact relay keeps all-gather's quality
and its received bytes, (W − 1)·n per worker, most of them now over the LAN.

Bytes counted (``CommCounter``): kinds ``"site_exchange"`` (WAN) and ``"group_gather"`` (LAN), with
the bytes each rank hands over; ``wan_sent`` / ``wan_received`` add up the site exchange and are
reported per step as ``wan_bytes_sent`` / ``wan_bytes_received``.
"""
from __future__ import annotations

from typing import Dict, List, Optional

import torch

from megatron_sparseloco.comm.interface import OuterComm


class SiteGroups:
    """The site layout of one outer group, and its two-round all-gather of equal-sized payloads."""

    def __init__(self, world: int, rank: int, groups: int):
        if groups < 1 or (world > 1 and world % groups):   # W = 1: nothing is exchanged, any G will do
            raise ValueError(f"{world} workers cannot be cut into {groups} equal groups")
        groups = min(groups, world)
        self.world, self.rank, self.groups = world, rank, groups
        self.size = world // groups                       # g, workers per site
        self.site, self.index = divmod(rank, self.size)   # a, i
        self.members = [self.site * self.size + j for j in range(self.size)]
        self.rail = [b * self.size + self.index for b in range(groups)]   # member i of every site
        self.wan_sent = 0
        self.wan_received = 0

    def sent_nbytes(self, n: int) -> int:
        """Bytes this rank hands over for one bucket of n-byte payloads: (G − 1)·n + (g − 1)·G·n = (W − 1)·n."""
        return (self.groups - 1) * n + (self.size - 1) * self.groups * n

    def take_wan_bytes(self) -> Dict[str, float]:
        """The site-exchange bytes since the last call (for the step's stats), then reset."""
        out = {"wan_bytes_sent": float(self.wan_sent), "wan_bytes_received": float(self.wan_received)}
        self.wan_sent = self.wan_received = 0
        return out

    def all_gather(self, payload: torch.Tensor, comm: OuterComm) -> List[torch.Tensor]:
        """The W payloads in worker order (every worker's has ``payload.numel()`` bytes: packed indices)."""
        if self.world == 1:
            return [payload]
        n, g, G = payload.numel(), self.size, self.groups
        remote = [w for w in self.rail if w != self.rank]
        got = comm.exchange_pieces({w: payload for w in remote}, {w: n for w in remote}, kind="site_exchange")
        self.wan_sent += n * len(remote)
        self.wan_received += n * len(remote)
        got[self.rank] = payload
        rail_set = torch.cat([got[w] for w in self.rail])           # R_i, in site order
        others = [m for m in self.members if m != self.rank]
        sets = comm.exchange_pieces({m: rail_set for m in others}, {m: G * n for m in others}, kind="group_gather")
        sets[self.rank] = rail_set
        out: List[Optional[torch.Tensor]] = [None] * self.world
        for j, m in enumerate(self.members):
            for b in range(G):
                out[b * g + j] = sets[m][b * n:(b + 1) * n]
        gathered = [t for t in out if t is not None]
        assert len(gathered) == self.world, "every worker's payload arrives through exactly one rail"
        return gathered
