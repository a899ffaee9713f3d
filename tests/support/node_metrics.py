"""A free loopback port for a node's /metrics, and the numbers it shows."""

import socket
import urllib.request


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def scrape(port: int, *prefixes: str) -> dict[str, float]:
    """The samples of the node's /metrics on ``port`` whose names start with one of ``prefixes``; a
    labelled one also under its bare name, summed over its labels."""
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
    out = {}
    for line in text.splitlines():
        if line.startswith(prefixes):
            sample, value = line.rsplit(" ", 1)
            out[sample] = float(value)
            name = sample.partition("{")[0]
            if name != sample:
                out[name] = out.get(name, 0.0) + float(value)
    return out
