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

Of LuWu it imports only the torch-free ``luwu.ops.rundir`` (torch takes 1+ s to load):
the CLI and the watchdog must start in milliseconds. Bad settings raise ValueError.
The settings, the ``ip``/``tc`` commands and the cleanup live in ``netns_base``;
this module re-exports what a user needs, so one import is enough.

Module use (``tests/`` on ``sys.path``, as the test configuration sets it)::

    from support.netns_cluster import Cluster, ClusterConfig

    with Cluster(ClusterConfig(num_hosts=3, rate="1gbit", host_rates={2: "500mbit"})) as c:
        server = c.popen("h1", ["python3", "server.py", c.addr("h1")])
        c.run("h0", ["python3", "client.py", c.addr("h1")])

CLI use (root)::

    python3 tests/support/netns_cluster.py up --hosts 6 --rate 1gbit --host-rate 5=500mbit
    python3 tests/support/netns_cluster.py status
    python3 tests/support/netns_cluster.py exec h0 -- ip addr show eth0
    python3 tests/support/netns_cluster.py down          # or: down --all / down --stale
"""

from __future__ import annotations

import argparse
import atexit
import ipaddress
import json
import logging
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Mapping, Sequence
from pathlib import Path

if __package__ in (None, ""):  # run as a script (the CLI, the watchdog): `support` lives next to us
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from support.netns_base import (  # noqa: E402  (re-exported: the one import a user of the cluster needs)
    BRIDGE_IF,
    HOST_IF,
    MIN_BURST_BYTES,
    SEQ,
    ClusterConfig,
    NetnsError,
    cleanup,
    cleanup_all,
    cleanup_stale,
    list_clusters,
    list_namespaces,
    netns_available,
    parse_rate,
    pid_alive,
    run_cmd,
)

__all__ = [
    "Cluster",
    "ClusterConfig",
    "NetnsError",
    "cleanup",
    "cleanup_all",
    "cleanup_stale",
    "list_clusters",
    "list_namespaces",
    "main",
    "netns_available",
    "parse_rate",
]

log = logging.getLogger(__name__)


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
    if (
        threading.current_thread() is threading.main_thread()
        and signal.getsignal(signal.SIGTERM) == signal.SIG_DFL
    ):
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
        owner, tag = (
            ("cli", self.config.name) if self.config.name else (str(os.getpid()), str(next(SEQ)))
        )
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
            raise NetnsError(
                f"cluster {self.prefix} is already up; run 'down --name {self.config.name}' first"
            )
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
        log.info(
            "cluster %s up: %d hosts in %.2f s", self.prefix, len(self.hosts), time.monotonic() - t0
        )
        return self

    def _build(self) -> None:
        br = self.bridge_ns
        run_cmd(["ip", "netns", "add", br])
        self._sysctl(
            br,
            {
                "net.bridge.bridge-nf-call-iptables": 0,
                "net.bridge.bridge-nf-call-ip6tables": 0,
                "net.bridge.bridge-nf-call-arptables": 0,
                "net.ipv6.conf.all.disable_ipv6": 1,
                "net.ipv6.conf.default.disable_ipv6": 1,
            },
        )
        run_cmd(["ip", "-n", br, "link", "set", "lo", "up"])
        self._add_bridge(BRIDGE_IF)
        self._build_fabric()
        for i in range(len(self.hosts)):
            self._add_host(i, self._bridge_of(i))

    def _add_bridge(self, name: str) -> None:
        """One Linux bridge ``name`` in the bridge namespace, up."""
        br = self.bridge_ns
        mtu = str(self.config.mtu)
        run_cmd(["ip", "-n", br, "link", "add", name, "mtu", mtu, "type", "bridge"])
        run_cmd(["ip", "-n", br, "link", "set", name, "up"])

    def _build_fabric(self) -> None:
        """Hook: more bridges and the links between them, before the hosts join (none here: one
        bridge for every host)."""

    def _bridge_of(self, i: int) -> str:
        """Hook: the bridge host ``i`` is plugged into (here always the one bridge)."""
        return BRIDGE_IF

    def _add_host(self, i: int, bridge: str) -> None:
        """Host ``i``'s namespace and its veth to ``bridge``, limited by tbf both ways."""
        host, ns, br = self.hosts[i], self.ns(i), self.bridge_ns
        run_cmd(["ip", "netns", "add", ns])
        settings: dict[str, object] = {
            "net.ipv6.conf.all.disable_ipv6": 1,
            "net.ipv6.conf.default.disable_ipv6": 1,
        }
        if self.config.congestion_control:
            settings["net.ipv4.tcp_congestion_control"] = self.config.congestion_control
        self._sysctl(ns, settings, strict=bool(self.config.congestion_control))
        run_cmd(["ip", "-n", ns, "link", "set", "lo", "up"])
        mtu = str(self.config.mtu)
        # Both ends are born inside our namespaces: nothing appears in the root one.
        veth = ["link", "add", HOST_IF, "mtu", mtu, "type", "veth"]
        run_cmd(["ip", "-n", ns, *veth, "peer", "name", host, "mtu", mtu, "netns", br])
        addr = f"{self._addrs[i]}/{self._prefixlen}"
        run_cmd(["ip", "-n", ns, "addr", "add", addr, "dev", HOST_IF])
        run_cmd(["ip", "-n", br, "link", "set", host, "master", bridge])
        rate = self._rates[i]
        if rate is not None:
            self._tbf(ns, HOST_IF, rate)  # host -> switch
            self._tbf(br, host, rate)  # switch -> host
        run_cmd(["ip", "-n", br, "link", "set", host, "up"])
        run_cmd(["ip", "-n", ns, "link", "set", HOST_IF, "up"])

    def tbf_args(self, rate_bps: int) -> list[str]:
        """tc arguments of one link's tbf: bucket ``burst_s`` of rate, queue ``queue_s``."""
        burst = max(MIN_BURST_BYTES, int(rate_bps / 8 * self.config.burst_s))
        latency_us = max(1, int(self.config.queue_s * 1e6))
        return ["tbf", "rate", f"{rate_bps}bit", "burst", str(burst), "latency", f"{latency_us}us"]

    def _tbf(self, ns: str, dev: str, rate_bps: int) -> None:
        run_cmd(["tc", "-n", ns, "qdisc", "replace", "dev", dev, "root", *self.tbf_args(rate_bps)])

    @staticmethod
    def _sysctl(ns: str, settings: Mapping[str, object], strict: bool = False) -> None:
        argv = ["ip", "netns", "exec", ns, "sysctl", "-q", "-e"]
        argv += [f"{k}={v}" for k, v in settings.items()]
        run_cmd(argv, check=strict)

    def _start_watchdog(self) -> None:
        """A process that blocks reading a pipe whose write end only we hold: EOF = we died."""
        r, w = os.pipe()
        try:
            self._watch = subprocess.Popen(
                [sys.executable, os.path.abspath(__file__), "_watch", self.prefix, "--fd", str(r)],
                pass_fds=(r,),
                start_new_session=True,
                stdin=subprocess.DEVNULL,
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
            )
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
        hosts = sorted(
            (ns.rsplit("-", 1)[1] for ns in names if not ns.endswith("-br")),
            key=lambda h: int(h[1:]),
        )
        self = cls.__new__(cls)
        self.prefix = prefix
        self.hosts = hosts
        self._addrs, self._rates = [], []
        for h in hosts:
            info = json.loads(
                run_cmd(["ip", "-n", f"{prefix}-{h}", "-j", "addr", "show", "dev", HOST_IF])
            )
            inet = [a for a in info[0].get("addr_info", []) if a.get("family") == "inet"]
            self._addrs.append(inet[0]["local"] if inet else "")
            qd = json.loads(
                run_cmd(["tc", "-n", f"{prefix}-{h}", "-j", "qdisc", "show", "dev", HOST_IF])
                or "[]"
            )
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

    def run(
        self,
        host: str | int,
        argv: Sequence[str],
        *,
        timeout_s: float = 60.0,
        check: bool = True,
        **kwargs: object,
    ) -> subprocess.CompletedProcess:
        """Run ``argv`` inside ``host`` to completion (bounded by ``timeout_s``), capturing text output."""
        kwargs.setdefault("capture_output", True)
        kwargs.setdefault("text", True)
        argv = self.command(host, argv)
        return subprocess.run(argv, timeout=timeout_s, check=check, **kwargs)  # type: ignore[call-overload]

    def describe(self) -> list[dict[str, object]]:
        """One row per host: name, namespace, address, rate."""
        return [
            {"host": h, "ns": self.ns(h), "addr": self.addr(h), "rate_bps": self.rate_bps(h)}
            for h in self.hosts
        ]


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
    up.add_argument(
        "--rate", default="1gbit", help="link rate of every host, e.g. 1gbit, 10gbit, unlimited"
    )
    up.add_argument(
        "--host-rate",
        type=_host_rate,
        action="append",
        default=[],
        metavar="I=RATE",
        help="per-host override, e.g. 5=500mbit (repeatable)",
    )
    up.add_argument("--subnet", default="10.77.0.0/24")
    up.add_argument("--mtu", type=int, default=1500)
    up.add_argument(
        "--cc", default=None, help="TCP congestion control inside the hosts, e.g. cubic"
    )
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
        sp.add_argument(
            "--name", default="main", help="name of a persistent cluster (default main)"
        )
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
        cfg = ClusterConfig(
            num_hosts=args.hosts,
            rate=args.rate,
            host_rates=dict(args.host_rate),
            subnet=args.subnet,
            mtu=args.mtu,
            congestion_control=args.cc,
            name=args.name,
            watchdog=False,
        )
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
            state = (
                "persistent" if owner == "cli" else ("live" if pid_alive(int(owner)) else "STALE")
            )
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
