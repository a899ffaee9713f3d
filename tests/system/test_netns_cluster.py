"""The emulated cluster (tests/support/netns_cluster.py): real namespaces, real TCP, real teardown.

Needs root and iproute2; skipped with the reason otherwise. Only addresses inside
the namespaces these tests create are ever contacted.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from support import netns_cluster as nc

pytestmark = pytest.mark.system

_TESTS = Path(__file__).resolve().parents[1]
_SCRIPT = _TESTS / "support" / "netns_cluster.py"

# Receives exactly N bytes on an ephemeral port; reports the time from first to last byte.
_SERVER = r"""
import hashlib, json, socket, sys, time
addr, total = sys.argv[1], int(sys.argv[2])
srv = socket.socket(); srv.bind((addr, 0)); srv.listen(1); srv.settimeout(15)
print(srv.getsockname()[1], flush=True)
conn, _ = srv.accept(); conn.settimeout(15)
buf = memoryview(bytearray(1 << 20)); digest = hashlib.sha256(); got = 0; t0 = None
while got < total:
    n = conn.recv_into(buf)
    if not n:
        break
    t0 = t0 or time.perf_counter()
    digest.update(buf[:n]); got += n
seconds = time.perf_counter() - t0
conn.sendall(b"k")
print(json.dumps({"bytes": got, "seconds": seconds, "sha256": digest.hexdigest()}), flush=True)
"""

_CLIENT = r"""
import socket, sys
addr, port, total = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
data = (bytes(range(256)) * (total // 256 + 1))[:total]
sock = socket.create_connection((addr, port), timeout=15)
sock.sendall(data)
assert sock.recv(1) == b"k"
"""

# Builds a cluster, prints its prefix, then waits to be killed.
_CREATOR = r"""
import sys, time
sys.path.insert(0, sys.argv[1])
from support import netns_cluster as nc
c = nc.Cluster(num_hosts=2, rate="1gbit", watchdog=sys.argv[2] == "1").up()
c.popen("h1", ["sleep", "30"])
print(c.prefix, flush=True)
time.sleep(30)
"""


def _pattern_sha(total: int) -> str:
    import hashlib

    return hashlib.sha256((bytes(range(256)) * (total // 256 + 1))[:total]).hexdigest()


def _transfer(cluster, src: str, dst: str, total: int) -> dict:
    server = cluster.popen(
        dst,
        [sys.executable, "-c", _SERVER, cluster.addr(dst), str(total)],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        port = int(server.stdout.readline())
        cluster.run(
            src,
            [sys.executable, "-c", _CLIENT, cluster.addr(dst), str(port), str(total)],
            timeout_s=20,
        )
        result = json.loads(server.stdout.readline())
        assert server.wait(timeout=10) == 0
    finally:
        if server.poll() is None:
            server.kill()
            server.wait(timeout=5)
    return result


def _root_links() -> set[str]:
    return {
        link["ifname"] for link in json.loads(subprocess.check_output(["ip", "-j", "link", "show"]))
    }


def _namespaces(prefix: str) -> list[str]:
    return [ns for ns in nc.list_namespaces() if ns.startswith(prefix + "-")]


def _wait_gone(prefix: str, timeout_s: float) -> list[str]:
    deadline = time.monotonic() + timeout_s
    while (left := _namespaces(prefix)) and time.monotonic() < deadline:
        time.sleep(0.1)
    return left


@pytest.fixture(scope="module")
def available():
    ok, reason = nc.netns_available()
    if not ok:
        pytest.skip(reason)


@pytest.fixture(scope="module")
def cluster(available):
    before = _root_links()
    with nc.Cluster(num_hosts=3, rate=None, host_rates={2: "100mbit"}) as c:
        c.root_links_before = before
        yield c
    assert not _namespaces(c.prefix)


def test_config_rejects_bad_values():
    assert nc.parse_rate("1gbit") == 10**9
    assert nc.parse_rate("500mbit") == 5 * 10**8
    assert nc.parse_rate("unlimited") is None and nc.parse_rate(None) is None
    with pytest.raises(ValueError, match="fast"):
        nc.parse_rate("fast")
    with pytest.raises(ValueError, match="host_rates"):
        nc.ClusterConfig(num_hosts=2, host_rates={2: "1gbit"})
    with pytest.raises(ValueError, match="num_hosts"):
        nc.ClusterConfig(num_hosts=0)
    with pytest.raises(ValueError, match="subnet"):
        nc.ClusterConfig(num_hosts=5, subnet="10.77.0.0/30")


@pytest.mark.timeout(20)
def test_hosts_get_addresses_and_tbf_both_ways_and_root_is_untouched(cluster):
    assert _root_links() == cluster.root_links_before
    assert sorted(_namespaces(cluster.prefix)) == sorted(
        [cluster.bridge_ns] + [cluster.ns(h) for h in cluster.hosts]
    )
    assert [cluster.addr(h) for h in cluster.hosts] == ["10.77.0.1", "10.77.0.2", "10.77.0.3"]
    for host in cluster.hosts:
        addrs = json.loads(cluster.run(host, ["ip", "-j", "addr", "show", "dev", "eth0"]).stdout)
        assert cluster.addr(host) in [a["local"] for a in addrs[0]["addr_info"]]
    qdisc = json.loads(cluster.run("h2", ["tc", "-j", "qdisc", "show", "dev", "eth0"]).stdout)
    assert [(q["kind"], q["options"]["rate"] * 8) for q in qdisc] == [("tbf", 10**8)]
    port = json.loads(
        subprocess.check_output(["tc", "-n", cluster.bridge_ns, "-j", "qdisc", "show", "dev", "h2"])
    )
    assert [(q["kind"], q["options"]["rate"] * 8) for q in port] == [("tbf", 10**8)]
    unlimited = json.loads(cluster.run("h0", ["tc", "-j", "qdisc", "show", "dev", "eth0"]).stdout)
    assert "tbf" not in [q["kind"] for q in unlimited]
    attached = nc.Cluster.attach(cluster.prefix)
    assert attached.describe() == cluster.describe()


@pytest.mark.timeout(30)
def test_tcp_transfer_between_host_namespaces(cluster):
    total = 4 << 20
    result = _transfer(cluster, "h0", "h1", total)
    assert result["bytes"] == total and result["sha256"] == _pattern_sha(total)


@pytest.mark.timeout(40)
def test_rate_limit_applies_in_both_directions(cluster):
    total = 4 << 20
    implied_s = total * 8 / cluster.rate_bps("h2")  # 0.34 s at 100 Mbit/s
    unlimited = _transfer(cluster, "h0", "h1", total)["seconds"]
    into = _transfer(cluster, "h0", "h2", total)["seconds"]  # limited at the bridge port
    out_of = _transfer(cluster, "h2", "h0", total)["seconds"]  # limited at h2's own veth
    for seconds in (into, out_of):
        # tbf cannot deliver faster than its rate (less one 128 KiB burst); a loose upper bound
        # catches a link limited far below what was asked.
        assert 0.8 * implied_s < seconds < 8 * implied_s, (seconds, implied_s)
        assert seconds > 3 * unlimited, (seconds, unlimited)


@pytest.mark.timeout(30)
def test_failed_build_and_normal_exit_leave_nothing(available):
    bad = nc.Cluster(num_hosts=2, congestion_control="no_such_cc")
    with pytest.raises(nc.NetnsError, match="no_such_cc"):
        bad.up()
    assert not _namespaces(bad.prefix)

    with nc.Cluster(num_hosts=2, rate="1gbit") as c:
        sleeper = c.popen("h0", ["sleep", "30"])
        assert len(_namespaces(c.prefix)) == 3
    assert not _namespaces(c.prefix)
    assert sleeper.poll() is not None  # processes inside do not keep the namespace alive


def _start_creator(watchdog: bool) -> tuple[subprocess.Popen, str]:
    proc = subprocess.Popen(
        [sys.executable, "-c", _CREATOR, str(_TESTS), "1" if watchdog else "0"],
        stdout=subprocess.PIPE,
        text=True,
    )
    prefix = proc.stdout.readline().strip()
    assert prefix.startswith(f"luwu-{proc.pid}-"), prefix
    assert len(_namespaces(prefix)) == 3
    return proc, prefix


@pytest.mark.timeout(40)
def test_sigkill_of_creator_is_cleaned_by_watchdog(available):
    proc, prefix = _start_creator(watchdog=True)
    proc.kill()
    proc.wait(timeout=5)
    assert not _wait_gone(prefix, timeout_s=15)


@pytest.mark.timeout(40)
def test_sigkill_without_watchdog_is_cleaned_as_stale_at_next_start(available):
    proc, prefix = _start_creator(watchdog=False)
    proc.kill()
    proc.wait(timeout=5)
    assert len(_namespaces(prefix)) == 3  # nothing else cleaned it: the stale path must
    with nc.Cluster(num_hosts=1, rate=None) as c:
        assert not _namespaces(prefix)
        assert c.run("h0", ["true"]).returncode == 0
    assert not _namespaces(c.prefix)


@pytest.mark.timeout(40)
def test_sigterm_of_creator_tears_down_before_exit(available):
    proc, prefix = _start_creator(watchdog=False)
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=15) == 128 + signal.SIGTERM
    assert not _namespaces(prefix)


@pytest.mark.timeout(40)
def test_cli_up_status_exec_down(available):
    name = f"t{os.getpid()}"
    cli = [sys.executable, str(_SCRIPT)]

    def run(*args: str) -> str:
        return subprocess.run(
            [*cli, *args], capture_output=True, text=True, timeout=30, check=True
        ).stdout

    try:
        run("up", "--name", name, "--hosts", "2", "--rate", "1gbit", "--host-rate", "1=500mbit")
        status = run("status")
        assert f"luwu-cli-{name} (persistent)" in status and "500mbit" in status
        shown = json.loads(
            run("exec", "--name", name, "h1", "--", "ip", "-j", "addr", "show", "dev", "eth0")
        )
        assert "10.77.0.2" in [a["local"] for a in shown[0]["addr_info"]]
    finally:
        assert f"luwu-cli-{name}" in run("down", "--name", name)
    assert not _namespaces(f"luwu-cli-{name}")
