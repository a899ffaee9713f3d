"""An emulated multi-host cluster on one machine: network namespaces, a bridge, tbf links.

On loopback the network is almost free, so what LuWu is for (networks slower
than memory) is invisible. This module builds "hosts" as Linux network
namespaces joined through a Linux bridge that lives in its own namespace, so
the machine's own network is never touched: the only objects created outside
our namespaces are the namespace names themselves (``/run/netns/luwu-*``).
Every host link is limited in both directions with a ``tbf`` qdisc (host side
egress = host -> switch, bridge port egress = switch -> host); netem and fq are
not available here, so links add no latency and incast sharing can be unfair.

Names are ``luwu-<owner>-<tag>-<role>``: owner is the creating pid (or ``cli``
for a cluster made by ``up`` that outlives its command), role is ``br`` or
``h<i>``. Teardown is layered so nothing is left behind: ``with Cluster(...)``
tears down in ``finally``, an atexit hook and a SIGTERM handler cover the rest
of a normal exit, a watchdog process (reading a pipe whose write end only the
creator holds) cleans up the moment the creator dies even by SIGKILL, and each
new cluster first removes clusters whose owner pid is dead.

The module imports nothing of LuWu (``import luwu`` pulls in torch, 1+ s): the
CLI and the watchdog must start in milliseconds. Bad settings raise ValueError.

Module use::

    with Cluster(ClusterConfig(num_hosts=3, rate="1gbit", host_rates={2: "500mbit"})) as c:
        server = c.popen("h1", ["python3", "server.py", c.addr("h1")])
        c.run("h0", ["python3", "client.py", c.addr("h1")])

CLI use (root)::

    python3 benchmarks/netns_cluster.py up --hosts 6 --rate 1gbit --host-rate 5=500mbit
    python3 benchmarks/netns_cluster.py status
    python3 benchmarks/netns_cluster.py exec h0 -- ip addr show eth0
    python3 benchmarks/netns_cluster.py down          # or: down --all / down --stale
"""

from __future__ import annotations

import argparse
import atexit
import functools
import ipaddress
import itertools
import json
import logging
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

log = logging.getLogger(__name__)

_NS_RE = re.compile(r"^luwu-(?P<owner>\d+|cli)-(?P<tag>[A-Za-z0-9_]+)-(?P<role>br|h\d+)$")
_RATE_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*(bit|kbit|mbit|gbit|tbit)?\s*$", re.IGNORECASE)
_RATE_UNITS = {"bit": 1, "kbit": 10**3, "mbit": 10**6, "gbit": 10**9, "tbit": 10**12}
_UNLIMITED = ("unlimited", "none", "inf", "0")
_CMD_TIMEOUT_S = 20.0
# A GSO super-packet (64 KiB) must fit in the bucket, or tbf segments it in software.
_MIN_BURST_BYTES = 128 * 1024
_HOST_IF = "eth0"
_BRIDGE_IF = "br0"
_SEQ = itertools.count()


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
    raise ValueError(f"rate must look like '1gbit', '500mbit', bits/s or 'unlimited', got {value!r}")


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
                raise ValueError(f"host_rates key must be a host index in [0, {self.num_hosts}), got {host!r}")
            parse_rate(rate)
        try:
            net = ipaddress.IPv4Network(self.subnet)
        except ValueError as exc:
            raise ValueError(f"subnet must be an IPv4 network like '10.77.0.0/24', got {self.subnet!r}") from exc
        if net.num_addresses - 2 < self.num_hosts:
            raise ValueError(f"subnet {self.subnet!r} has too few addresses for num_hosts={self.num_hosts}")
        if not 576 <= self.mtu <= 65535:
            raise ValueError(f"mtu must be in [576, 65535], got {self.mtu!r}")
        if not 0 < self.burst_s <= 1:
            raise ValueError(f"burst_s must be in (0, 1], got {self.burst_s!r}")
        if not 0 < self.queue_s <= 10:
            raise ValueError(f"queue_s must be in (0, 10], got {self.queue_s!r}")
        if self.congestion_control is not None and not re.fullmatch(r"[a-z0-9_]+", self.congestion_control):
            raise ValueError(f"congestion_control must be a kernel name like 'cubic', got {self.congestion_control!r}")
        if self.name is not None and not re.fullmatch(r"[A-Za-z0-9_]{1,32}", self.name):
            raise ValueError(f"name must be 1-32 of [A-Za-z0-9_], got {self.name!r}")

    def host_rate_bps(self, index: int) -> int | None:
        """Rate of host ``index`` in bits/s (None = unlimited)."""
        return parse_rate(self.host_rates.get(index, self.rate))


# ---------------------------------------------------------------- commands


def _cmd(argv: Sequence[str], *, check: bool = True) -> str:
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
        _cmd(["ip", "netns", "add", ns])
        try:
            _cmd(["ip", "-n", ns, "link", "add", "b0", "type", "bridge"])
            _cmd(["ip", "-n", ns, "link", "add", "v0", "type", "veth", "peer", "name", "v1"])
            _cmd(["tc", "-n", ns, "qdisc", "add", "dev", "v0", "root", "tbf",
                  "rate", "1gbit", "burst", "128kb", "latency", "4ms"])
        finally:
            _cmd(["ip", "netns", "del", ns], check=False)
    except NetnsError as exc:
        return False, f"cannot build a probe namespace with bridge, veth and tbf: {exc}"
    return True, "ok"


def list_namespaces() -> list[str]:
    """Names of all LuWu cluster namespaces on this machine."""
    names = (line.split()[0] for line in _cmd(["ip", "netns", "list"]).splitlines() if line.strip())
    return sorted(n for n in names if _NS_RE.match(n))


def list_clusters() -> dict[str, list[str]]:
    """Cluster prefix -> its namespaces."""
    out: dict[str, list[str]] = {}
    for ns in list_namespaces():
        m = _NS_RE.match(ns)
        assert m is not None
        out.setdefault(f"luwu-{m['owner']}-{m['tag']}", []).append(ns)
    return out


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


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
        pids.update(int(p) for p in _cmd(["ip", "netns", "pids", ns], check=False).split() if p.isdigit())
    pids.discard(os.getpid())
    _kill_pids(pids)
    for ns in names:
        _cmd(["ip", "netns", "del", ns], check=False)
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
            pids = {p for p in pids if _pid_alive(p) and not _is_zombie(p)}
            time.sleep(0.02)
        if not pids:
            return


def _is_zombie(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] == "Z"
    except (OSError, IndexError):
        return True


def cleanup_stale() -> list[str]:
    """Remove clusters whose owner pid is dead (not 'cli' ones); returns their prefixes."""
    removed = []
    for prefix in list_clusters():
        owner = prefix.split("-")[1]
        if owner.isdigit() and not _pid_alive(int(owner)):
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


# ---------------------------------------------------------------- the cluster

_LIVE: set["Cluster"] = set()
_LIVE_LOCK = threading.Lock()
_HOOKS_INSTALLED = False


def _teardown_live() -> None:
    with _LIVE_LOCK:
        live = list(_LIVE)
    for cluster in live:
        cluster.down()


def _on_sigterm(signum: int, frame: object) -> None:
    # Unwind the main thread: `with` blocks and atexit then tear clusters down.
    raise SystemExit(128 + signum)


def _install_hooks() -> None:
    global _HOOKS_INSTALLED
    if _HOOKS_INSTALLED:
        return
    _HOOKS_INSTALLED = True
    atexit.register(_teardown_live)
    if threading.current_thread() is threading.main_thread() and signal.getsignal(signal.SIGTERM) == signal.SIG_DFL:
        signal.signal(signal.SIGTERM, _on_sigterm)


class Cluster:
    """Hosts as network namespaces behind one bridge; links limited by tbf both ways.

    ``with Cluster(config) as c`` builds it and always tears it down. Hosts are
    named ``h0``..; methods accept the name or the index.
    """

    def __init__(self, config: ClusterConfig | None = None, **kwargs: object) -> None:
        if config is not None and kwargs:
            raise ValueError("pass either a ClusterConfig or keyword settings, not both")
        self.config = config if config is not None else ClusterConfig(**kwargs)  # type: ignore[arg-type]
        owner, tag = ("cli", self.config.name) if self.config.name else (str(os.getpid()), str(next(_SEQ)))
        self.prefix = f"luwu-{owner}-{tag}"
        self.hosts = [f"h{i}" for i in range(self.config.num_hosts)]
        net = ipaddress.IPv4Network(self.config.subnet)
        self._prefixlen = net.prefixlen
        self._addrs = [str(a) for a, _ in zip(net.hosts(), self.hosts)]
        self._rates = [self.config.host_rate_bps(i) for i in range(self.config.num_hosts)]
        self._procs: list[subprocess.Popen] = []
        self._watch: subprocess.Popen | None = None
        self._watch_fd: int | None = None
        self._owned = False

    # -- names

    def _index(self, host: str | int) -> int:
        if isinstance(host, int) and 0 <= host < len(self.hosts):
            return host
        if isinstance(host, str) and host in self.hosts:
            return self.hosts.index(host)
        if isinstance(host, str) and host.isdigit() and int(host) < len(self.hosts):
            return int(host)
        raise ValueError(f"host must be one of {self.hosts} or an index, got {host!r}")

    def ns(self, host: str | int) -> str:
        """Namespace name of ``host`` (for ``ip netns exec``)."""
        return f"{self.prefix}-{self.hosts[self._index(host)]}"

    @property
    def bridge_ns(self) -> str:
        return f"{self.prefix}-br"

    def addr(self, host: str | int) -> str:
        """IPv4 address of ``host``; reachable only from the cluster's namespaces."""
        return self._addrs[self._index(host)]

    def rate_bps(self, host: str | int) -> int | None:
        """Link rate of ``host`` in bits/s, both directions (None = unlimited)."""
        return self._rates[self._index(host)]

    # -- lifecycle

    def up(self) -> "Cluster":
        """Build the namespaces, bridge, veths and qdiscs; on any failure remove them again."""
        if self._owned:
            raise NetnsError(f"cluster {self.prefix} is already up")
        ok, reason = netns_available()
        if not ok:
            raise NetnsError(f"cannot build a cluster: {reason}")
        cleanup_stale()
        if self.config.name and any(ns.startswith(self.prefix + "-") for ns in list_namespaces()):
            raise NetnsError(f"cluster {self.prefix} is already up; run 'down --name {self.config.name}' first")
        cleanup(self.prefix)  # a dead process with our pid may have left this prefix
        self._owned = True
        t0 = time.monotonic()
        try:
            if self.config.name is None:
                with _LIVE_LOCK:
                    _LIVE.add(self)
                _install_hooks()
                if self.config.watchdog:
                    self._start_watchdog()
            self._build()
        except BaseException:
            self.down()
            raise
        log.info("cluster %s up: %d hosts in %.2f s", self.prefix, len(self.hosts), time.monotonic() - t0)
        return self

    def _build(self) -> None:
        br = self.bridge_ns
        _cmd(["ip", "netns", "add", br])
        self._sysctl(br, {"net.bridge.bridge-nf-call-iptables": 0, "net.bridge.bridge-nf-call-ip6tables": 0,
                          "net.bridge.bridge-nf-call-arptables": 0, "net.ipv6.conf.all.disable_ipv6": 1,
                          "net.ipv6.conf.default.disable_ipv6": 1})
        _cmd(["ip", "-n", br, "link", "set", "lo", "up"])
        _cmd(["ip", "-n", br, "link", "add", _BRIDGE_IF, "mtu", str(self.config.mtu), "type", "bridge"])
        _cmd(["ip", "-n", br, "link", "set", _BRIDGE_IF, "up"])
        for i, host in enumerate(self.hosts):
            ns = self.ns(i)
            _cmd(["ip", "netns", "add", ns])
            settings: dict[str, object] = {"net.ipv6.conf.all.disable_ipv6": 1,
                                           "net.ipv6.conf.default.disable_ipv6": 1}
            if self.config.congestion_control:
                settings["net.ipv4.tcp_congestion_control"] = self.config.congestion_control
            self._sysctl(ns, settings, strict=bool(self.config.congestion_control))
            _cmd(["ip", "-n", ns, "link", "set", "lo", "up"])
            mtu = str(self.config.mtu)
            # Both ends are born inside our namespaces: nothing appears in the root one.
            _cmd(["ip", "-n", ns, "link", "add", _HOST_IF, "mtu", mtu, "type", "veth",
                  "peer", "name", host, "mtu", mtu, "netns", br])
            _cmd(["ip", "-n", ns, "addr", "add", f"{self._addrs[i]}/{self._prefixlen}", "dev", _HOST_IF])
            _cmd(["ip", "-n", br, "link", "set", host, "master", _BRIDGE_IF])
            rate = self._rates[i]
            if rate is not None:
                self._tbf(ns, _HOST_IF, rate)  # host -> switch
                self._tbf(br, host, rate)  # switch -> host
            _cmd(["ip", "-n", br, "link", "set", host, "up"])
            _cmd(["ip", "-n", ns, "link", "set", _HOST_IF, "up"])

    def tbf_args(self, rate_bps: int) -> list[str]:
        """tc arguments of one link's tbf: bucket ``burst_s`` of rate, queue ``queue_s``."""
        burst = max(_MIN_BURST_BYTES, int(rate_bps / 8 * self.config.burst_s))
        latency_us = max(1, int(self.config.queue_s * 1e6))
        return ["tbf", "rate", f"{rate_bps}bit", "burst", str(burst), "latency", f"{latency_us}us"]

    def _tbf(self, ns: str, dev: str, rate_bps: int) -> None:
        _cmd(["tc", "-n", ns, "qdisc", "replace", "dev", dev, "root", *self.tbf_args(rate_bps)])

    @staticmethod
    def _sysctl(ns: str, settings: Mapping[str, object], strict: bool = False) -> None:
        argv = ["ip", "netns", "exec", ns, "sysctl", "-q", "-e"]
        argv += [f"{k}={v}" for k, v in settings.items()]
        _cmd(argv, check=strict)

    def _start_watchdog(self) -> None:
        """A process that blocks reading a pipe whose write end only we hold: EOF = we died."""
        r, w = os.pipe()
        try:
            self._watch = subprocess.Popen(
                [sys.executable, os.path.abspath(__file__), "_watch", self.prefix, "--fd", str(r)],
                pass_fds=(r,), start_new_session=True,
                stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        finally:
            os.close(r)
        self._watch_fd = w

    def down(self) -> None:
        """Stop our processes and remove every namespace of the cluster; safe to call twice."""
        if not self._owned:
            return
        self._owned = False
        with _LIVE_LOCK:
            _LIVE.discard(self)
        for proc in self._procs:
            if proc.poll() is None:
                proc.terminate()
        for proc in self._procs:
            try:
                proc.wait(timeout=2.0)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(timeout=5.0)
        try:
            cleanup(self.prefix)
        finally:
            if self._watch_fd is not None:
                os.close(self._watch_fd)
                self._watch_fd = None
            if self._watch is not None:
                try:
                    self._watch.wait(timeout=10.0)
                except subprocess.TimeoutExpired:
                    self._watch.kill()
                self._watch = None
        log.info("cluster %s down", self.prefix)

    def __enter__(self) -> "Cluster":
        return self.up()

    def __exit__(self, *exc: object) -> None:
        self.down()

    @classmethod
    def attach(cls, prefix: str) -> "Cluster":
        """A handle on an existing cluster (e.g. one made by ``up``) that never tears it down."""
        names = list_clusters().get(prefix)
        if not names:
            raise NetnsError(f"no cluster {prefix!r}; up: {sorted(list_clusters())}")
        hosts = sorted((ns.rsplit("-", 1)[1] for ns in names if not ns.endswith("-br")), key=lambda h: int(h[1:]))
        self = cls.__new__(cls)
        self.prefix = prefix
        self.hosts = hosts
        self._addrs, self._rates = [], []
        for h in hosts:
            info = json.loads(_cmd(["ip", "-n", f"{prefix}-{h}", "-j", "addr", "show", "dev", _HOST_IF]))
            inet = [a for a in info[0].get("addr_info", []) if a.get("family") == "inet"]
            self._addrs.append(inet[0]["local"] if inet else "")
            qd = json.loads(_cmd(["tc", "-n", f"{prefix}-{h}", "-j", "qdisc", "show", "dev", _HOST_IF]) or "[]")
            tbf = [q for q in qd if q.get("kind") == "tbf"]
            self._rates.append(int(tbf[0]["options"]["rate"]) * 8 if tbf else None)
        self._prefixlen = 0
        self.config = ClusterConfig(num_hosts=len(hosts), rate=None, watchdog=False)
        self._procs, self._watch, self._watch_fd, self._owned = [], None, None, False
        return self

    # -- processes

    def command(self, host: str | int, argv: Sequence[str]) -> list[str]:
        """``argv`` prefixed to run inside ``host``'s namespace."""
        if isinstance(argv, str):
            raise ValueError(f"argv must be a list of strings, got the string {argv!r}")
        return ["ip", "netns", "exec", self.ns(host), *argv]

    def popen(self, host: str | int, argv: Sequence[str], **kwargs: object) -> subprocess.Popen:
        """Start ``argv`` inside ``host``; it is terminated at teardown if still running."""
        proc = subprocess.Popen(self.command(host, argv), **kwargs)  # type: ignore[call-overload]
        self._procs = [p for p in self._procs if p.poll() is None] + [proc]
        return proc

    def run(self, host: str | int, argv: Sequence[str], *, timeout_s: float = 60.0, check: bool = True,
            **kwargs: object) -> subprocess.CompletedProcess:
        """Run ``argv`` inside ``host`` to completion (bounded by ``timeout_s``), capturing text output."""
        kwargs.setdefault("capture_output", True)
        kwargs.setdefault("text", True)
        argv = self.command(host, argv)
        return subprocess.run(argv, timeout=timeout_s, check=check, **kwargs)  # type: ignore[call-overload]

    def describe(self) -> list[dict[str, object]]:
        """One row per host: name, namespace, address, rate."""
        return [{"host": h, "ns": self.ns(h), "addr": self.addr(h), "rate_bps": self.rate_bps(h)}
                for h in self.hosts]


# ---------------------------------------------------------------- CLI


def _watch_main(prefix: str, fd: int) -> int:
    """Block until the creator's end of the pipe closes, then remove its cluster."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    while True:
        try:
            if not os.read(fd, 1):
                break
        except InterruptedError:
            continue
    for attempt in range(3):
        try:
            cleanup(prefix)
            return 0
        except NetnsError:
            time.sleep(0.5 * (attempt + 1))
    return 1


def _host_rate(text: str) -> tuple[int, str]:
    idx, sep, rate = text.partition("=")
    if not sep or not idx.strip().lstrip("h").isdigit():
        raise argparse.ArgumentTypeError(f"expected HOST=RATE like 5=500mbit, got {text!r}")
    return int(idx.strip().lstrip("h")), rate


def _fmt_rate(bps: object) -> str:
    if not isinstance(bps, int):
        return "unlimited"
    for unit, scale in (("gbit", 10**9), ("mbit", 10**6), ("kbit", 10**3)):
        if bps >= scale:
            return f"{bps / scale:g}{unit}"
    return f"{bps}bit"


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    up = sub.add_parser("up", help="build a persistent cluster (removed only by 'down')")
    up.add_argument("--hosts", type=int, default=3)
    up.add_argument("--rate", default="1gbit", help="link rate of every host, e.g. 1gbit, 10gbit, unlimited")
    up.add_argument("--host-rate", type=_host_rate, action="append", default=[], metavar="I=RATE",
                    help="per-host override, e.g. 5=500mbit (repeatable)")
    up.add_argument("--subnet", default="10.77.0.0/24")
    up.add_argument("--mtu", type=int, default=1500)
    up.add_argument("--cc", default=None, help="TCP congestion control inside the hosts, e.g. cubic")
    down = sub.add_parser("down", help="remove the named cluster, or all / stale ones")
    group = down.add_mutually_exclusive_group()
    group.add_argument("--all", action="store_true", help="every luwu-* cluster, live or not")
    group.add_argument("--stale", action="store_true", help="clusters whose creator pid is dead")
    group.add_argument("--prefix", default=None, help="one cluster by prefix, e.g. luwu-1234-0")
    sub.add_parser("status", help="list clusters and their hosts")
    ex = sub.add_parser("exec", help="run a command inside a host: exec h0 -- cmd ...")
    ex.add_argument("host")
    ex.add_argument("argv", nargs=argparse.REMAINDER)
    watch = sub.add_parser("_watch", help=argparse.SUPPRESS)
    watch.add_argument("prefix")
    watch.add_argument("--fd", type=int, required=True)
    for sp in (up, down, ex):
        sp.add_argument("--name", default="main", help="name of a persistent cluster (default main)")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")

    if args.cmd == "_watch":
        return _watch_main(args.prefix, args.fd)
    try:
        return _run_cli(p, args)
    except NetnsError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1


def _run_cli(p: argparse.ArgumentParser, args: argparse.Namespace) -> int:
    ok, reason = netns_available()
    if not ok:
        print(f"netns cluster unavailable: {reason}", file=sys.stderr)
        return 2
    if args.cmd == "up":
        cfg = ClusterConfig(num_hosts=args.hosts, rate=args.rate, host_rates=dict(args.host_rate),
                            subnet=args.subnet, mtu=args.mtu, congestion_control=args.cc,
                            name=args.name, watchdog=False)
        cluster = Cluster(cfg).up()
        _print_cluster(cluster)
        return 0
    if args.cmd == "down":
        if args.all:
            removed = cleanup_all()
        elif args.stale:
            removed = cleanup_stale()
        else:
            prefix = args.prefix or f"luwu-cli-{args.name}"
            removed = [prefix] if cleanup(prefix) else []
        print("removed: " + (", ".join(removed) or "nothing"))
        return 0
    if args.cmd == "status":
        clusters = list_clusters()
        if not clusters:
            print("no luwu clusters")
        for prefix in clusters:
            owner = prefix.split("-")[1]
            state = "persistent" if owner == "cli" else ("live" if _pid_alive(int(owner)) else "STALE")
            print(f"{prefix} ({state})")
            _print_cluster(Cluster.attach(prefix))
        return 0
    if args.cmd == "exec":
        cmd = args.argv[1:] if args.argv[:1] == ["--"] else args.argv
        if not cmd:
            p.error("exec needs a command after --")
        cluster = Cluster.attach(f"luwu-cli-{args.name}")
        os.execvp("ip", cluster.command(args.host, cmd))
    raise AssertionError(args.cmd)


def _print_cluster(cluster: Cluster) -> None:
    for row in cluster.describe():
        print(f"  {row['host']:>4}  {row['ns']:<24} {row['addr']:<15} {_fmt_rate(row['rate_bps'])}")


if __name__ == "__main__":
    sys.exit(main())
