"""The parts of the emulated cluster that need no cluster object: settings, ``ip``/``tc`` commands,
the names of LuWu's namespaces, and their removal.

Every namespace is named ``luwu-<owner>-<tag>-<role>`` (owner: the creating pid or ``cli``; role:
``br`` or ``h<i>``), so teardown can find and remove everything a cluster made, including what a
dead creator left behind. ``netns_cluster`` builds on this module.
"""

from __future__ import annotations

import functools
import ipaddress
import itertools
import logging
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from luwu.ops.rundir import pid_alive  # torch-free: the CLI and the watchdog start in milliseconds

log = logging.getLogger(__name__)

_NS_RE = re.compile(r"^luwu-(?P<owner>\d+|cli)-(?P<tag>[A-Za-z0-9_]+)-(?P<role>br|h\d+)$")
_RATE_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*(bit|kbit|mbit|gbit|tbit)?\s*$", re.IGNORECASE)
_RATE_UNITS = {"bit": 1, "kbit": 10**3, "mbit": 10**6, "gbit": 10**9, "tbit": 10**12}
_UNLIMITED = ("unlimited", "none", "inf", "0")
_CMD_TIMEOUT_S = 20.0
# A GSO super-packet (64 KiB) must fit in the bucket, or tbf segments it in software.
MIN_BURST_BYTES = 128 * 1024
HOST_IF = "eth0"
BRIDGE_IF = "br0"
SEQ = itertools.count()


class NetnsError(RuntimeError):
    """An ``ip``/``tc`` command failed; the message carries the command and its stderr."""


def parse_rate(value: str | int | float | None) -> int | None:
    """Return a link rate in bits/s from ``"1gbit"``, ``"500mbit"``, ``10**9`` or None.

    None, 0 and "unlimited" mean no limit (returns None), so a config can mix
    limited and unlimited hosts.
    """
    if value is None:
        return None
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        if value < 0:
            raise ValueError(f"rate must be >= 0 bits/s, got {value!r}")
        return int(value) or None
    if isinstance(value, str):
        if value.strip().lower() in _UNLIMITED:
            return None
        m = _RATE_RE.match(value)
        if m:
            bps = int(float(m.group(1)) * _RATE_UNITS[(m.group(2) or "bit").lower()])
            return bps or None
    raise ValueError(
        f"rate must look like '1gbit', '500mbit', bits/s or 'unlimited', got {value!r}"
    )


@dataclass(kw_only=True, slots=True)
class ClusterConfig:
    """Shape of an emulated cluster; every host link is symmetric (same rate both ways)."""

    num_hosts: int = 3
    """Number of host namespaces, named h0..h{n-1}."""
    rate: str | int | None = "1gbit"
    """Default link rate of every host (tc syntax like '10gbit', bits/s, or None = unlimited)."""
    host_rates: Mapping[int, str | int | None] = field(default_factory=dict)
    """Per-host overrides of ``rate`` by host index, for heterogeneous clusters."""
    subnet: str = "10.77.0.0/24"
    """Private IPv4 subnet; host i gets the (i+1)-th address. It exists only inside the namespaces."""
    mtu: int = 1500
    """MTU of every veth (1500 like common Ethernet; 9000 for jumbo frames)."""
    burst_s: float = 0.001
    """tbf bucket size as seconds at link rate (at least 128 KiB so a GSO packet fits)."""
    queue_s: float = 0.004
    """tbf ``latency``: the longest a packet may wait in the queue, i.e. the switch buffer."""
    congestion_control: str | None = None
    """TCP congestion control inside the hosts; None keeps the kernel default (bbr here).

    Outside the root namespace only names in ``net.ipv4.tcp_allowed_congestion_control``
    may be set (here: reno, bbr); anything else fails with NetnsError at ``up``."""
    name: str | None = None
    """Persistent name (owner 'cli'): the cluster outlives its creator until ``down``. None = owned by this pid."""
    watchdog: bool = True
    """Start a process that removes the cluster as soon as the creator dies, even by SIGKILL."""

    def __post_init__(self) -> None:
        if not isinstance(self.num_hosts, int) or not 1 <= self.num_hosts <= 250:
            raise ValueError(f"num_hosts must be an int in [1, 250], got {self.num_hosts!r}")
        parse_rate(self.rate)
        for host, rate in self.host_rates.items():
            if not isinstance(host, int) or not 0 <= host < self.num_hosts:
                raise ValueError(
                    f"host_rates key must be a host index in [0, {self.num_hosts}), got {host!r}"
                )
            parse_rate(rate)
        try:
            net = ipaddress.IPv4Network(self.subnet)
        except ValueError as exc:
            raise ValueError(
                f"subnet must be an IPv4 network like '10.77.0.0/24', got {self.subnet!r}"
            ) from exc
        if net.num_addresses - 2 < self.num_hosts:
            raise ValueError(
                f"subnet {self.subnet!r} has too few addresses for num_hosts={self.num_hosts}"
            )
        if not 576 <= self.mtu <= 65535:
            raise ValueError(f"mtu must be in [576, 65535], got {self.mtu!r}")
        if not 0 < self.burst_s <= 1:
            raise ValueError(f"burst_s must be in (0, 1], got {self.burst_s!r}")
        if not 0 < self.queue_s <= 10:
            raise ValueError(f"queue_s must be in (0, 10], got {self.queue_s!r}")
        if self.congestion_control is not None and not re.fullmatch(
            r"[a-z0-9_]+", self.congestion_control
        ):
            raise ValueError(
                f"congestion_control must be a kernel name like 'cubic', got {self.congestion_control!r}"
            )
        if self.name is not None and not re.fullmatch(r"[A-Za-z0-9_]{1,32}", self.name):
            raise ValueError(f"name must be 1-32 of [A-Za-z0-9_], got {self.name!r}")

    def host_rate_bps(self, index: int) -> int | None:
        """Rate of host ``index`` in bits/s (None = unlimited)."""
        return parse_rate(self.host_rates.get(index, self.rate))


# ---------------------------------------------------------------- commands


def run_cmd(argv: Sequence[str], *, check: bool = True) -> str:
    """Run one iproute2 command; errors name the command and carry its stderr."""
    try:
        proc = subprocess.run(list(argv), capture_output=True, text=True, timeout=_CMD_TIMEOUT_S)
    except subprocess.TimeoutExpired as exc:
        raise NetnsError(f"{' '.join(argv)!r} did not finish in {_CMD_TIMEOUT_S} s") from exc
    if check and proc.returncode != 0:
        raise NetnsError(f"{' '.join(argv)!r} failed ({proc.returncode}): {proc.stderr.strip()}")
    return proc.stdout


@functools.cache
def netns_available() -> tuple[bool, str]:
    """Whether this machine can build clusters, and if not why (for test skips).

    Needs root, iproute2, veth, bridge and the tbf qdisc; probed once per
    process by building a one-namespace throwaway.
    """
    if not sys.platform.startswith("linux"):
        return False, f"network namespaces need Linux, this is {sys.platform}"
    if os.geteuid() != 0:
        return False, "network namespaces need root (euid is not 0)"
    for tool in ("ip", "tc"):
        if shutil.which(tool) is None:
            return False, f"iproute2 '{tool}' not found on PATH"
    ns = f"luwu-{os.getpid()}-probe-br"
    try:
        run_cmd(["ip", "netns", "add", ns])
        try:
            run_cmd(["ip", "-n", ns, "link", "add", "b0", "type", "bridge"])
            run_cmd(["ip", "-n", ns, "link", "add", "v0", "type", "veth", "peer", "name", "v1"])
            run_cmd(
                [
                    "tc",
                    "-n",
                    ns,
                    "qdisc",
                    "add",
                    "dev",
                    "v0",
                    "root",
                    "tbf",
                    "rate",
                    "1gbit",
                    "burst",
                    "128kb",
                    "latency",
                    "4ms",
                ]
            )
        finally:
            run_cmd(["ip", "netns", "del", ns], check=False)
    except NetnsError as exc:
        return False, f"cannot build a probe namespace with bridge, veth and tbf: {exc}"
    return True, "ok"


def list_namespaces() -> list[str]:
    """Names of all LuWu cluster namespaces on this machine."""
    names = (
        line.split()[0] for line in run_cmd(["ip", "netns", "list"]).splitlines() if line.strip()
    )
    return sorted(n for n in names if _NS_RE.match(n))


def list_clusters() -> dict[str, list[str]]:
    """Cluster prefix -> its namespaces."""
    out: dict[str, list[str]] = {}
    for ns in list_namespaces():
        m = _NS_RE.match(ns)
        assert m is not None
        out.setdefault(f"luwu-{m['owner']}-{m['tag']}", []).append(ns)
    return out


def cleanup(prefix: str) -> list[str]:
    """Remove every namespace of cluster ``prefix`` (and its links), killing what runs inside.

    Processes inside would otherwise keep an unnamed namespace and its veths
    alive after ``ip netns del``. Returns the namespaces removed.
    """
    if not re.fullmatch(r"luwu-(\d+|cli)-[A-Za-z0-9_]+", prefix):
        raise ValueError(f"prefix must look like 'luwu-<pid>-<tag>', got {prefix!r}")
    names = [ns for ns in list_namespaces() if ns.startswith(prefix + "-")]
    pids = set()
    for ns in names:
        pids.update(
            int(p) for p in run_cmd(["ip", "netns", "pids", ns], check=False).split() if p.isdigit()
        )
    pids.discard(os.getpid())
    _kill_pids(pids)
    for ns in names:
        run_cmd(["ip", "netns", "del", ns], check=False)
    left = [ns for ns in list_namespaces() if ns.startswith(prefix + "-")]
    if left:
        raise NetnsError(f"cleanup of {prefix} left namespaces behind: {left}")
    return names


def _kill_pids(pids: set[int], grace_s: float = 2.0) -> None:
    """SIGTERM, then SIGKILL what is left after ``grace_s``."""
    for sig in (signal.SIGTERM, signal.SIGKILL):
        for pid in pids:
            try:
                os.kill(pid, sig)
            except ProcessLookupError:
                pass
        deadline = time.monotonic() + grace_s
        while pids and time.monotonic() < deadline:
            pids = {p for p in pids if pid_alive(p)}  # a zombie counts as gone
            time.sleep(0.02)
        if not pids:
            return


def cleanup_stale() -> list[str]:
    """Remove clusters whose owner pid is dead (not 'cli' ones); returns their prefixes."""
    removed = []
    for prefix in list_clusters():
        owner = prefix.split("-")[1]
        if owner.isdigit() and not pid_alive(int(owner)):
            log.info("removing stale cluster %s (owner pid %s is dead)", prefix, owner)
            cleanup(prefix)
            removed.append(prefix)
    return removed


def cleanup_all() -> list[str]:
    """Remove every LuWu cluster on the machine, live or not; returns their prefixes."""
    prefixes = list(list_clusters())
    for prefix in prefixes:
        cleanup(prefix)
    return prefixes
