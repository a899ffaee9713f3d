"""Racks behind a core: the emulated cluster of ``netns_cluster`` with a bridge per rack.

Each rack's hosts plug into a bridge of its own (``r<k>``); the rack reaches the core bridge (the
cluster's one bridge, where hosts in no rack plug in) through one veth pair, its **uplink**
(``u<k>`` on the rack's side, ``c<k>`` on the core's), limited by tbf both ways at the uplink rate.
So traffic between two hosts of a rack stays on the rack's links, and traffic that leaves a rack
shares its uplink: a rack of hosts on 10 Gbit/s links behind a 1 Gbit/s uplink is a rack behind a
core oversubscribed 10:1 per host.

All bridges and uplinks live in the cluster's bridge namespace, so teardown is the cluster's own.
The uplinks' kernel counters are read through a process living in that namespace
(:meth:`RackCluster.counter_pid`: ``/proc/<pid>/net/dev`` names ``u<k>``; its ``tx`` is what the
rack sent up to the core, its ``rx`` what came down)::

    racks = [[0, 1, 6], [2, 3, 7]]           # hosts 4 and 5 on the core
    with RackCluster(ClusterConfig(num_hosts=8, rate="10gbit", host_rates={4: "1gbit", 5: "1gbit"}),
                     racks=racks, uplink_rate="1gbit") as c:
        ...
"""

from __future__ import annotations

import os
import subprocess
import time
from collections.abc import Sequence

from support.netns_base import BRIDGE_IF, ClusterConfig, NetnsError, parse_rate, run_cmd
from support.netns_cluster import Cluster

__all__ = ["RackCluster", "uplink_if"]


def uplink_if(rack: int) -> str:
    """The rack side of rack ``rack``'s uplink: tx goes up to the core, rx comes down."""
    return f"u{rack}"


class RackCluster(Cluster):
    """A :class:`Cluster` whose hosts in ``racks`` (lists of host indices) sit behind one uplink per
    rack at ``uplink_rate`` (both ways; None: unlimited); the other hosts sit on the core bridge."""

    def __init__(
        self,
        config: ClusterConfig,
        *,
        racks: Sequence[Sequence[int]],
        uplink_rate: str | int | None,
    ) -> None:
        super().__init__(config)
        seen: set[int] = set()
        for members in racks:
            for i in members:
                if not isinstance(i, int) or not 0 <= i < config.num_hosts or i in seen:
                    raise ValueError(
                        f"racks must hold distinct host indices in [0, {config.num_hosts}), got "
                        f"{[list(m) for m in racks]!r}"
                    )
                seen.add(i)
        self.racks = [list(m) for m in racks]
        self.uplink_bps = parse_rate(uplink_rate)
        self._counter: subprocess.Popen | None = None

    def rack_of(self, host: str | int) -> int | None:
        """The rack of ``host`` (None: on the core)."""
        i = self._index(host)
        return next((k for k, members in enumerate(self.racks) if i in members), None)

    def _bridge_of(self, i: int) -> str:
        k = self.rack_of(i)
        return BRIDGE_IF if k is None else f"r{k}"

    def _build_fabric(self) -> None:
        br = self.bridge_ns
        mtu = str(self.config.mtu)
        for k in range(len(self.racks)):
            self._add_bridge(f"r{k}")
            up, core = uplink_if(k), f"c{k}"
            veth = ["link", "add", up, "mtu", mtu, "type", "veth", "peer", "name", core, "mtu", mtu]
            run_cmd(["ip", "-n", br, *veth])
            run_cmd(["ip", "-n", br, "link", "set", core, "master", BRIDGE_IF])
            run_cmd(["ip", "-n", br, "link", "set", up, "master", f"r{k}"])
            if self.uplink_bps is not None:
                self._tbf(br, up, self.uplink_bps)  # rack -> core
                self._tbf(br, core, self.uplink_bps)  # core -> rack
            run_cmd(["ip", "-n", br, "link", "set", core, "up"])
            run_cmd(["ip", "-n", br, "link", "set", up, "up"])

    def counter_pid(self) -> int:
        """The pid of an idle process in the bridge namespace (started once, stopped at teardown):
        ``/proc/<pid>/net/dev`` shows the uplinks' counters."""
        if self._counter is None or self._counter.poll() is not None:
            argv = ["ip", "netns", "exec", self.bridge_ns, "sleep", "infinity"]
            self._counter = subprocess.Popen(argv, stdin=subprocess.DEVNULL)
            self._procs.append(self._counter)
            want = os.stat(f"/run/netns/{self.bridge_ns}").st_ino
            deadline = time.monotonic() + 10.0
            while os.stat(f"/proc/{self._counter.pid}/ns/net").st_ino != want:  # not in it yet
                if time.monotonic() > deadline or self._counter.poll() is not None:
                    raise NetnsError(f"no process in {self.bridge_ns} to read the uplinks through")
                time.sleep(0.01)
        return self._counter.pid

    def describe(self) -> list[dict[str, object]]:
        return [dict(row, rack=self.rack_of(row["host"])) for row in super().describe()]
