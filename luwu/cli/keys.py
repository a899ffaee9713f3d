"""``luwu keys``: CURVE key pairs for the nodes and the workers."""

from __future__ import annotations

import os

from luwu.cli.common import add_command, positive_int


def _toml(table: dict) -> str:
    import tomli_w

    return tomli_w.dumps(table)


def cmd_keys(args) -> int:
    """One key pair for the nodes, one per worker, and the nodes' list of authorized worker keys."""
    import zmq

    os.makedirs(args.out, exist_ok=True)
    pub, sec = zmq.curve_keypair()
    workers = [zmq.curve_keypair() for _ in range(args.workers)]
    node = {"curve_public_key": pub.decode(), "curve_secret_key": sec.decode(), "curve_authorized_keys": [w[0].decode() for w in workers]}
    files = {"node.toml": _toml({"node": node})}
    for i, (wp, ws) in enumerate(workers):
        files[f"worker{i}.toml"] = _toml({"transport": {"curve_server_key": pub.decode(), "curve_public_key": wp.decode(), "curve_secret_key": ws.decode()}})
    for name, text in files.items():
        path = os.path.join(args.out, name)
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as fh:
            fh.write(text)
        os.chmod(path, 0o600)
    print(f"wrote {args.out}/node.toml (node keys + authorized worker keys) and worker0..{args.workers - 1}.toml (mode 600)")
    return 0


def register(subparsers) -> None:
    s = add_command(
        subparsers, "keys", func=cmd_keys, settings=False,
        help="generate CURVE keys for nodes and workers",
        description="Generate a CURVE key pair for the nodes and one per worker; nodes then accept only the listed worker keys, and all traffic is encrypted.",
    )
    s.add_argument("--out", default="luwu-keys", help="directory to write the key files into (default ./luwu-keys)")
    s.add_argument("--workers", type=positive_int, default=1, help="number of worker key pairs (default 1)")
