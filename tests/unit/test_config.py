"""Config precedence: defaults < TOML file < LUWU_SECTION__FIELD < --section.field; bad input is named."""

import subprocess
import sys

import pytest

from luwu.config import load_config
from luwu.protocol.errors import ConfigError


def test_precedence_and_sources(tmp_path):
    f = tmp_path / "cluster.toml"
    f.write_text('[cluster]\njob = "fromfile"\nnodes = ["tcp://127.0.0.1:5555"]\n[transport]\ntimeout_s = 5.0\nbucket_bytes = 2048\n[node]\nmode = "async"\n')
    cfg = load_config(str(f), env={"LUWU_TRANSPORT__TIMEOUT_S": "7", "LUWU_NODE__STALENESS": "2"}, argv=["--transport.timeout_s=9", "--node.log_every", "5"])
    assert cfg.cluster.job == "fromfile" and cfg.sources["cluster.job"] == str(f)
    assert cfg.transport.bucket_bytes == 2048
    assert cfg.transport.timeout_s == 9.0 and cfg.sources["transport.timeout_s"] == "--transport.timeout_s"
    assert cfg.node.staleness == 2 and cfg.sources["node.staleness"] == "env LUWU_NODE__STALENESS"
    assert cfg.node.log_every == 5 and cfg.node.mode == "async"
    assert cfg.sources["optimizer.name"] == "default"


@pytest.mark.parametrize(
    "kw,match",
    [
        ({"argv": ["--nosuch.key=1"]}, "unknown config section 'nosuch'"),
        ({"argv": ["--node.nosuch=1"]}, "unknown config key node.nosuch"),
        ({"argv": ["--node.mode=fast"]}, "node.mode must be one of"),
        ({"argv": ["--transport.timeout_s=abc"]}, r"transport.timeout_s = 'abc' \(from --transport.timeout_s\)"),
        ({"env": {"LUWU_NODE__STALENESS": "-1"}}, "node.staleness must be >= 0, got -1"),
        ({"argv": ["--optimizer.delayed_update_warmup=-3"]}, "optimizer.delayed_update_warmup must be >= 0, got -3"),
        ({"argv": ["--node.bind=tcp://0.0.0.0:5555"]}, "not loopback: configure CURVE keys"),
    ],
)
def test_bad_values_and_keys_are_named(kw, match):
    with pytest.raises(ConfigError, match=match):
        load_config(None, env=kw.get("env", {}), argv=kw.get("argv", []))


def test_example_cluster_file_loads():
    cfg = load_config("deploy/cluster.example.toml", env={})
    assert cfg.cluster.nodes


def test_config_show_prints_sources():
    out = subprocess.run([sys.executable, "-m", "luwu", "config", "show", "--node.staleness=3"], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert "staleness = 3  # from --node.staleness" in out.stdout


def test_plan_cli_prints_bottleneck():
    out = subprocess.run([sys.executable, "-m", "luwu", "plan", "--params", "16.7M", "--workers", "4", "--nodes", "1", "--worker-gbps", "1", "--compute-ms", "200"], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert "node" in out.stdout.lower() and "recommend" in out.stdout.lower()
