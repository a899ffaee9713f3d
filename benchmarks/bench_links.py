"""What the emulated links really give: TCP throughput between two namespace hosts.

The head-to-head benchmarks of issue 9 run on tbf-limited links built by
``netns_cluster.py``; before reading their numbers we need to know what a
"1 Gbit/s" or "10 Gbit/s" link delivers to a Python sender on this small box,
and at what CPU cost. Per link (1 Gbit/s, 10 Gbit/s, unlimited veth, and plain
loopback for reference) and message size (1 and 4 MiB), a sender streams
``reps`` back-to-back volumes to a receiver, once over a plain socket
(``sendall`` / ``recv_into`` a reused buffer) and once over pyzmq PUSH/PULL
(``send(copy=False)`` / ``recv_into``). The receiver stamps each volume's last
byte, so a rep is the steady-state rate of one volume; we report the median
and the processes' CPU share (1.0 = one core busy) during the transfer. A
small-message TCP ping-pong gives each link's idle round-trip time.

Root is required (skips with the reason otherwise). Traffic only ever goes to
addresses inside the namespaces built here, or to loopback.

    python3 benchmarks/bench_links.py            # ~1 minute
    python3 benchmarks/bench_links.py --quick    # smoke run, ~10 s
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import platform
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path

sys.path.insert(
    0, str(Path(__file__).resolve().parents[1] / "tests")
)  # `support`: the emulated cluster
from support.netns_cluster import Cluster, ClusterConfig, netns_available  # noqa: E402

log = logging.getLogger(__name__)

RESULTS = Path(__file__).resolve().parent / "results"
MIB = 1 << 20
_TIMEOUT_S = 60.0

# Receiver: stamps the arrival of each volume's last byte; prints the port, then one JSON line.
_RX = r"""
import json, socket, sys, time
transport, addr, volume, msg, reps = sys.argv[1], sys.argv[2], *map(int, sys.argv[3:6])
total, buf = volume * reps, bytearray(msg)
view = memoryview(buf)
if transport == "tcp":
    srv = socket.socket(); srv.bind((addr, 0)); srv.listen(1); srv.settimeout(30)
    print(srv.getsockname()[1], flush=True)
    conn, _ = srv.accept(); conn.settimeout(30)
    recv = lambda: conn.recv_into(view)
else:
    import zmq
    ctx = zmq.Context(); sock = ctx.socket(zmq.PULL); sock.linger = 0; sock.rcvtimeo = 30000
    print(sock.bind_to_random_port(f"tcp://{addr}"), flush=True)
    recv = lambda: sock.recv_into(view)
got, first, marks, next_mark = 0, None, [], volume
while got < total:
    n = recv()
    if not n:
        sys.exit(f"sender closed after {got} of {total} bytes")
    got += n
    now = time.perf_counter()
    if first is None:
        first = (now, n, time.process_time())
    while got >= next_mark and len(marks) < reps:
        marks.append(now); next_mark += volume
cpu = time.process_time() - first[2]
if transport == "tcp":
    conn.sendall(b"k")
starts = [first[0]] + marks[:-1]
sizes = [volume - first[1]] + [volume] * (reps - 1)
rates = [s * 8 / max(t1 - t0, 1e-9) for s, t0, t1 in zip(sizes, starts, marks)]
print(json.dumps({"bits_per_s": rates, "cpu_share": cpu / max(marks[-1] - first[0], 1e-9)}), flush=True)
"""

# Sender: streams reps * volume bytes in msg-sized sends; prints its CPU share.
_TX = r"""
import json, socket, sys, time
transport, addr, port, volume, msg, reps = sys.argv[1], sys.argv[2], *map(int, sys.argv[3:7])
data, count = bytes(msg), volume * reps // msg
if transport == "tcp":
    sock = socket.create_connection((addr, port), timeout=30)
    t0, c0 = time.perf_counter(), time.process_time()
    for _ in range(count):
        sock.sendall(data)
    assert sock.recv(1) == b"k"
else:
    import zmq
    ctx = zmq.Context(); sock = ctx.socket(zmq.PUSH); sock.sndhwm = 4; sock.linger = 30000
    sock.sndtimeo = 30000; sock.connect(f"tcp://{addr}:{port}")
    t0, c0 = time.perf_counter(), time.process_time()
    for _ in range(count):
        sock.send(data, copy=False)
    sock.close(); ctx.term()
print(json.dumps({"cpu_share": (time.process_time() - c0) / (time.perf_counter() - t0)}), flush=True)
"""

# Idle round trip of a 64-byte message, median of `count`.
_PONG = r"""
import socket, sys
srv = socket.socket(); srv.bind((sys.argv[1], 0)); srv.listen(1); srv.settimeout(30)
print(srv.getsockname()[1], flush=True)
conn, _ = srv.accept(); conn.settimeout(30); conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
while (data := conn.recv(64)):
    conn.sendall(data)
print("done", flush=True)
"""
_PING = r"""
import socket, statistics, sys, time
sock = socket.create_connection((sys.argv[1], int(sys.argv[2])), timeout=30)
sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
times = []
for _ in range(int(sys.argv[3])):
    t0 = time.perf_counter(); sock.sendall(b"x" * 64)
    got = 0
    while got < 64:
        got += len(sock.recv(64 - got))
    times.append(time.perf_counter() - t0)
print(statistics.median(times) * 1e6, flush=True)
"""

Runner = Callable[[str, Sequence[str]], subprocess.Popen]


def _pair(
    start_rx: Runner, start_tx: Runner, rx_argv: list[str], tx_argv: Callable[[int], list[str]]
) -> tuple[str, str]:
    """Start a receiver, read its port, run the sender against it; return both last lines."""
    rx = start_rx(sys.executable, ["-c", *rx_argv])
    tx = None
    try:
        port = int(rx.stdout.readline())
        tx = start_tx(sys.executable, ["-c", *tx_argv(port)])
        tx_out, tx_err = tx.communicate(timeout=_TIMEOUT_S)
        rx_out, rx_err = rx.communicate(timeout=_TIMEOUT_S)
        if tx.returncode or rx.returncode:
            raise RuntimeError(
                f"transfer failed: sender {tx.returncode} {tx_err.strip()[-500:]!r}, "
                f"receiver {rx.returncode} {rx_err.strip()[-500:]!r}"
            )
        return rx_out.strip().splitlines()[-1], tx_out.strip().splitlines()[-1]
    finally:
        for proc in (tx, rx):
            if proc is not None and proc.poll() is None:
                proc.kill()
                proc.wait(timeout=5)


def _starter(cluster: Cluster | None, host: str) -> Runner:
    """Start a process in ``host``'s namespace, or in this one for loopback."""

    def start(exe: str, argv: Sequence[str]) -> subprocess.Popen:
        full = [exe, *argv]
        kw = dict(stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        return (
            cluster.popen(host, full, **kw) if cluster is not None else subprocess.Popen(full, **kw)
        )

    return start


def measure_link(
    name: str,
    rate_bps: int | None,
    cluster: Cluster | None,
    src: str,
    dst: str,
    dst_addr: str,
    *,
    msg_sizes: Sequence[int],
    reps: int,
    target_s: float,
) -> tuple[list[dict], float]:
    """Throughput rows (one per transport and message size) and the idle RTT in µs of one link."""
    start_rx, start_tx = _starter(cluster, dst), _starter(cluster, src)
    rows = []
    for transport in ("tcp", "zmq"):
        for msg in msg_sizes:
            assumed_bps = rate_bps or 20e9  # unlimited: what veth/loopback roughly give here
            volume = max(2, round(assumed_bps / 8 * target_s / msg)) * msg
            rx_line, tx_line = _pair(
                start_rx,
                start_tx,
                [_RX, transport, dst_addr, str(volume), str(msg), str(reps)],
                lambda port: [
                    _TX,
                    transport,
                    dst_addr,
                    str(port),
                    str(volume),
                    str(msg),
                    str(reps),
                ],
            )
            rx, tx = json.loads(rx_line), json.loads(tx_line)
            rates = sorted(rx["bits_per_s"])
            median = statistics.median(rates)
            rows.append(
                {
                    "link": name,
                    "rate_bps": rate_bps,
                    "transport": transport,
                    "msg_bytes": msg,
                    "volume_bytes": volume,
                    "reps": reps,
                    "gbit_s_median": median / 1e9,
                    "gbit_s_min": rates[0] / 1e9,
                    "gbit_s_max": rates[-1] / 1e9,
                    "of_nominal": median / rate_bps if rate_bps else None,
                    "rx_cpu_share": rx["cpu_share"],
                    "tx_cpu_share": tx["cpu_share"],
                }
            )
            log.info(
                "%-9s %-3s %d MiB: %.3f Gbit/s (rx cpu %.2f, tx cpu %.2f)",
                name,
                transport,
                msg // MIB,
                median / 1e9,
                rx["cpu_share"],
                tx["cpu_share"],
            )
    pong, ping = _pair(
        start_rx, start_tx, [_PONG, dst_addr], lambda port: [_PING, dst_addr, str(port), "300"]
    )
    return rows, float(ping)


def _table(rows: list[dict], rtts: dict[str, float]) -> str:
    lines = [
        "| link | transport | msg | Gbit/s median (min-max) | of nominal | rx CPU | tx CPU |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        nominal = f"{r['of_nominal']:.1%}" if r["of_nominal"] is not None else "-"
        lines.append(
            f"| {r['link']} | {r['transport']} | {r['msg_bytes'] // MIB} MiB | "
            f"{r['gbit_s_median']:.2f} ({r['gbit_s_min']:.2f}-{r['gbit_s_max']:.2f}) | {nominal} | "
            f"{r['rx_cpu_share']:.2f} | {r['tx_cpu_share']:.2f} |"
        )
    lines += ["", "| link | idle TCP round trip, 64 B (µs, median) |", "|---|---|"]
    lines += [f"| {link} | {rtt:.0f} |" for link, rtt in rtts.items()]
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="smoke run: 1 MiB only, 2 short reps")
    p.add_argument("--reps", type=int, default=5)
    p.add_argument(
        "--target-s", type=float, default=0.4, help="seconds one rep should take at the link rate"
    )
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    ok, reason = netns_available()
    if not ok:
        print(f"skipped: {reason}")
        return 0
    reps, target_s, sizes = (
        (2, 0.1, [MIB]) if args.quick else (args.reps, args.target_s, [MIB, 4 * MIB])
    )
    if not 1 <= reps <= 100 or not 0 < target_s <= 10:
        p.error(f"--reps must be in [1, 100] and --target-s in (0, 10], got {reps}, {target_s}")

    config = ClusterConfig(
        num_hosts=6, rate=None, host_rates={0: "1gbit", 1: "1gbit", 2: "10gbit", 3: "10gbit"}
    )
    rows: list[dict] = []
    rtts: dict[str, float] = {}
    t0, load_before = time.monotonic(), os.getloadavg()[0]
    with Cluster(config) as cluster:
        tbf = {str(rate): " ".join(cluster.tbf_args(rate)) for rate in (10**9, 10**10)}
        for name, src, dst in (
            ("1gbit", "h0", "h1"),
            ("10gbit", "h2", "h3"),
            ("unlimited", "h4", "h5"),
        ):
            link_rows, rtts[name] = measure_link(
                name,
                cluster.rate_bps(dst),
                cluster,
                src,
                dst,
                cluster.addr(dst),
                msg_sizes=sizes,
                reps=reps,
                target_s=target_s,
            )
            rows += link_rows
    link_rows, rtts["loopback"] = measure_link(
        "loopback", None, None, "", "", "127.0.0.1", msg_sizes=sizes, reps=reps, target_s=target_s
    )
    rows += link_rows

    cc = Path("/proc/sys/net/ipv4/tcp_congestion_control").read_text().strip()
    env = {
        "cpus": os.cpu_count(),
        "kernel": platform.release(),
        "python": platform.python_version(),
        "tcp_congestion_control": cc,
        "mtu": config.mtu,
        "tbf": tbf,
        "quick": args.quick,
        "elapsed_s": round(time.monotonic() - t0, 1),
        "loadavg_1min_before_after": [load_before, os.getloadavg()[0]],
    }
    table = _table(rows, rtts)
    note = (
        "TCP payload can reach at most 1448/1514 = 95.6% of a tbf rate at MTU 1500 (tbf counts "
        "Ethernet + IP + TCP headers). CPU share: process CPU time / wall time during the transfer "
        "(1.0 = one of the {cpus} cores); kernel work of the veth/bridge path lands partly in these "
        "processes. 1 Gbit/s links hold their rate under load; 10 Gbit/s and unlimited ones are bound by "
        "the CPU and fall when other work shares the box (see loadavg below)."
    ).format(cpus=env["cpus"])
    print(table)
    print()
    print(note)
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "bench_links.json").write_text(
        json.dumps({"env": env, "rows": rows, "rtt_us": rtts}, indent=2) + "\n"
    )
    (RESULTS / "bench_links.md").write_text(
        f"# bench_links: what the emulated links deliver\n\n{table}\n\n{note}\n\n"
        f"Environment: `{json.dumps(env)}`\n"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
