"""``compression.link_gbps = "auto"`` behind a real 1 Gbit/s link (tbf in network namespaces): the worker's
measurement decides what a worker told ``link_gbps = 1`` decides. Needs root and iproute2; skipped with the
reason otherwise."""

from __future__ import annotations

import json
import os
import secrets
import subprocess
import sys

import pytest
from support import netns_cluster as nc

pytestmark = pytest.mark.system

PORT = 29611

_WORKER = r"""
import dataclasses, json, sys, torch, luwu
from luwu.protocol.policy import choose_codec, choose_pull_codec
torch.manual_seed(0)
model = torch.nn.Sequential(*(torch.nn.Linear(1024, 1024, bias=False) for _ in range(2)))
opt = luwu.RemoteOptimizer(model, nodes=[sys.argv[1]], lr=1e-3, timeout_s=60, job="linktest", rank=0, world_size=1)
try:
    step = opt.config.compression.warmup_steps
    told = dataclasses.replace(opt.config.compression, link_gbps=1.0)
    def picks(cfg_of):
        return [[choose_codec(b, step, cfg_of(b))[0], choose_pull_codec(b, step, cfg_of(b))] for b in opt.layout.buckets]
    print(json.dumps({"gbps": opt._links.gbps(0), "auto": picks(lambda b: opt._links.config(b.node)),
                      "told": picks(lambda b: told), "hold": opt._hold_replies}), flush=True)
finally:
    opt.close()
"""


@pytest.mark.timeout(180)
def test_auto_under_a_1gbit_link_picks_what_told_1gbit_picks():
    ok, reason = nc.netns_available()
    if not ok:
        pytest.skip(f"network namespaces cannot be made here: {reason}")
    secret = secrets.token_hex(16)
    env = dict(
        os.environ,
        LUWU_NODE__JOIN_SECRET=secret,
        LUWU_TRANSPORT__JOIN_SECRET=secret,
        PYTHONUNBUFFERED="1",
    )
    with nc.Cluster(num_hosts=2, rate="1gbit") as c:
        addr = f"tcp://{c.addr('h0')}:{PORT}"
        node = c.popen(
            "h0",
            [
                sys.executable,
                "-m",
                "luwu",
                "node",
                f"--node.bind={addr}",
                "--node.index=0",
                "--cluster.job=linktest",
                "--node.insecure_public_bind=true",
            ],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            env=env,
        )
        try:
            for line in node.stdout:  # its READY line
                if line.startswith("LUWU") or "READY" in line:
                    break
            worker = c.popen(
                "h1",
                [sys.executable, "-c", _WORKER, addr],
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
                env=env,
            )
            out, err = worker.communicate(timeout=150)
            assert worker.returncode == 0, err[-3000:]
            got = json.loads(out.strip().splitlines()[-1])
        finally:
            node.kill()
            node.wait(10)
    assert 0.5 <= got["gbps"] <= 1.5, got
    assert got["auto"] == got["told"] and not got["hold"], got
