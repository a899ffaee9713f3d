"""Config precedence: defaults < TOML file < LUWU_SECTION__FIELD < --section.field; bad input is named."""

import re
import subprocess
import sys

import pytest

from luwu.config import load_config
from luwu.protocol.errors import ConfigError


def test_precedence_and_sources(tmp_path):
    f = tmp_path / "cluster.toml"
    f.write_text(
        '[cluster]\njob = "fromfile"\nnodes = ["tcp://127.0.0.1:5555"]\n[transport]\ntimeout_s = 5.0\nbucket_bytes = 2048\n[node]\nmode = "async"\n'
    )
    cfg = load_config(
        str(f),
        env={"LUWU_TRANSPORT__TIMEOUT_S": "7", "LUWU_NODE__STALENESS": "2"},
        argv=["--transport.timeout_s=9", "--node.log_every", "5"],
    )
    assert cfg.cluster.job == "fromfile" and cfg.sources["cluster.job"] == str(f)
    assert cfg.transport.bucket_bytes == 2048
    assert (
        cfg.transport.timeout_s == 9.0
        and cfg.sources["transport.timeout_s"] == "--transport.timeout_s"
    )
    assert cfg.node.staleness == 2 and cfg.sources["node.staleness"] == "env LUWU_NODE__STALENESS"
    assert cfg.node.log_every == 5 and cfg.node.mode == "async"
    assert cfg.sources["optimizer.name"] == "default"


@pytest.mark.parametrize(
    "kw,match",
    [
        ({"argv": ["--nosuch.key=1"]}, "unknown config section 'nosuch'"),
        ({"argv": ["--node.nosuch=1"]}, "unknown config key node.nosuch"),
        ({"argv": ["--node.mode=fast"]}, "node.mode must be one of"),
        (
            {"argv": ["--transport.timeout_s=abc"]},
            r"transport.timeout_s = 'abc' \(from --transport.timeout_s\)",
        ),
        ({"env": {"LUWU_NODE__STALENESS": "-1"}}, "node.staleness must be >= 0, got -1"),
        (
            {"argv": ["--optimizer.delayed_update_warmup=-3"]},
            "optimizer.delayed_update_warmup must be >= 0, got -3",
        ),
        ({"argv": ["--node.bind=tcp://0.0.0.0:5555"]}, "not loopback: configure CURVE keys"),
        ({"argv": ["--node.listener=zmq"]}, "node.listener must be one of"),
        (
            {"argv": ["--node.listener=zmtp", "--node.bind=inproc://n"]},
            "binds tcp:// or ipc:// addresses, not inproc://",
        ),
        ({"argv": ["--node.stranger_bytes=1000"]}, "node.stranger_bytes must be >= 66560"),
        (
            {"argv": ["--node.peer_bytes=1048576"]},
            "cannot hold one message of node.max_message_bytes",
        ),
        ({"argv": ["--node.max_message_frames=0"]}, "node.max_message_frames must be >= 1"),
        (
            {"env": {"LUWU_NODE__JOIN_SECRET": "x"}, "argv": ["--node.listener=libzmq"]},
            "node.join_secret is checked by the zmtp listener",
        ),
    ],
)
def test_bad_values_and_keys_are_named(kw, match):
    with pytest.raises(ConfigError, match=match):
        load_config(None, env=kw.get("env", {}), argv=kw.get("argv", []))


def test_example_cluster_file_loads():
    cfg = load_config("deploy/cluster.example.toml", env={})
    assert cfg.cluster.nodes


def test_config_show_prints_sources():
    out = subprocess.run(
        [sys.executable, "-m", "luwu", "config", "show", "--node.staleness=3"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 0, out.stderr
    assert "staleness = 3  # from --node.staleness" in out.stdout


def test_plan_cli_prints_bottleneck():
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "luwu",
            "plan",
            "--params",
            "16.7M",
            "--workers",
            "4",
            "--nodes",
            "1",
            "--worker-gbps",
            "1",
            "--compute-ms",
            "200",
        ],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 0, out.stderr
    assert "node" in out.stdout.lower() and "recommend" in out.stdout.lower()


# ---------------------------------------------------------------- the Python API's path through the tree


def test_keyword_over_env_over_file_over_default(tmp_path):
    from luwu.config import keyword_settings

    f = tmp_path / "cluster.toml"
    f.write_text(
        '[cluster]\njob = "fromfile"\nnodes = ["tcp://127.0.0.1:5555"]\n[transport]\ntimeout_s = 5.0\nbucket_bytes = 2048\nsndhwm = 8\n'
    )
    env = {
        "LUWU_TRANSPORT__TIMEOUT_S": "7",
        "LUWU_TRANSPORT__BUCKET_BYTES": "4096",
        "LUWU_COMPRESSION__ENABLED": "false",
    }
    cfg = load_config(str(f), env=env).replace(
        keyword_settings(bucket_bytes=1024, job=None, compression=None)
    )
    assert (
        cfg.transport.bucket_bytes == 1024 and cfg.sources["transport.bucket_bytes"] == "argument"
    )  # keyword
    assert (
        cfg.transport.timeout_s == 7.0
        and cfg.sources["transport.timeout_s"] == "env LUWU_TRANSPORT__TIMEOUT_S"
    )  # env
    assert cfg.transport.sndhwm == 8 and cfg.sources["transport.sndhwm"] == str(f)  # file
    assert cfg.transport.heartbeat_s == 5.0 and cfg.sources["transport.heartbeat_s"] == "default"
    assert cfg.cluster.job == "fromfile"  # a keyword left at None does not override
    assert (
        cfg.compression.enabled is False
        and cfg.sources["compression.enabled"] == "env LUWU_COMPRESSION__ENABLED"
    )
    on = cfg.replace(keyword_settings(compression=True))
    assert on.compression.enabled is True and on.transport.bucket_bytes == 1024


def test_compression_is_on_by_default_and_false_turns_it_off():
    from luwu.config import keyword_settings
    from luwu.protocol.policy import CompressionConfig

    cfg = load_config(None, env={})
    assert cfg.compression.enabled is True
    assert cfg.replace(keyword_settings(compression=False)).compression.enabled is False
    mine = CompressionConfig(large_codec="int4")
    assert cfg.replace(keyword_settings(compression=mine)).compression is mine


def test_keyword_settings_map_onto_the_sections():
    from luwu.config import keyword_settings
    from luwu.gpu_workers.config import TransportConfig

    tc = TransportConfig(timeout_s=3.0, bucket_bytes=512)
    cfg = load_config(None, env={}).replace(
        keyword_settings(
            optimizer="SGD",
            nodes="tcp://127.0.0.1:1, tcp://127.0.0.1:2",
            capacities=[1, 3],
            world_size=2,
            mode="async",
            delayed_update=True,
            delayed_params="0.*",
            max_grad_norm=1,
            transport=tc,
            bucket_bytes=2048,
        )
    )
    assert cfg.optimizer.name == "sgd" and cfg.cluster.nodes == [
        "tcp://127.0.0.1:1",
        "tcp://127.0.0.1:2",
    ]
    assert (
        cfg.cluster.capacities == [1.0, 3.0]
        and cfg.cluster.world_size == 2
        and cfg.node.mode == "async"
    )
    assert cfg.optimizer.delayed_params == ["0.*"] and cfg.optimizer.max_grad_norm == 1.0
    assert (
        cfg.transport.timeout_s == 3.0 and cfg.transport.bucket_bytes == 2048
    )  # a field wins over its section


@pytest.mark.parametrize(
    "settings,match",
    [
        ({"nosuch.key": 1}, "unknown config section 'nosuch'"),
        ({"transport.nosuch": 1}, "unknown config key transport.nosuch"),
        ({"transport.timeout_s": -1.0}, "transport.timeout_s must be > 0"),
        ({"cluster.capacities": [1.0, 2.0]}, "cluster.capacities has 2 entries for 0 nodes"),
        ({"transport": "fast"}, "transport must be a TransportConfig"),
    ],
)
def test_replace_names_bad_settings(settings, match):
    with pytest.raises(ConfigError, match=match):
        load_config(None, env={}).replace(settings)


def test_bad_keyword_values_are_refused():
    from luwu.config import keyword_settings

    with pytest.raises(ConfigError, match="max_grad_norm must be > 0, got 0"):
        keyword_settings(max_grad_norm=0)


BLOCK_TORCH = """
import importlib.abc, sys
class NoTorch(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name == "torch" or name.startswith("torch."):
            raise ImportError("torch is blocked")
sys.meta_path.insert(0, NoTorch())
try:
    import luwu
except ImportError:
    print("SKIP")
    raise SystemExit(0)
import {module}
print("torch" in sys.modules)
"""


@pytest.mark.parametrize("module", ["luwu.config", "luwu.gpu_workers.config"])
def test_config_modules_import_without_torch(module):
    out = subprocess.run(
        [sys.executable, "-c", BLOCK_TORCH.format(module=module)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 0, out.stderr
    if out.stdout.strip() == "SKIP":
        pytest.skip("the luwu package itself imports torch")
    assert out.stdout.strip() == "False"


def test_prefetch_config_keeps_its_old_import_path():
    from luwu.gpu_workers import config, prefetch

    assert prefetch.PrefetchConfig is config.PrefetchConfig


def test_resolve_config_reads_env_and_falls_back_to_luwu_nodes():
    from luwu.config import resolve_config

    env = {
        "LUWU_NODES": "tcp://127.0.0.1:1,tcp://127.0.0.1:2",
        "LUWU_OPTIMIZER__NAME": "sgd",
        "LUWU_CLUSTER__JOB": "envjob",
    }
    cfg = resolve_config(env=env, job="kwjob")
    assert (
        cfg.cluster.nodes == ["tcp://127.0.0.1:1", "tcp://127.0.0.1:2"]
        and cfg.sources["cluster.nodes"] == "env LUWU_NODES"
    )
    assert cfg.optimizer.name == "sgd" and cfg.cluster.job == "kwjob"
    assert resolve_config(env=env, nodes=["tcp://127.0.0.1:3"]).cluster.nodes == [
        "tcp://127.0.0.1:3"
    ]
    with pytest.raises(ConfigError, match="no nodes"):
        resolve_config(env={})
    with pytest.raises(
        ConfigError, match=r"delayed_params=\['a\*', 'b'\] needs delayed_update=True"
    ):
        resolve_config(env=env, delayed_params="a*, b")
    on = resolve_config(env=dict(env, LUWU_OPTIMIZER__DELAYED_UPDATE="true"), delayed_params="a*")
    assert on.optimizer.delayed_update and on.optimizer.delayed_params == ["a*"]


def test_the_nodes_own_listener_serves_curve_too():
    """listener = auto reads ZMTP itself with CURVE keys as without (libzmq only for inproc://); a join
    secret is refused with CURVE keys (the authorized keys do that job)."""
    import zmq

    from luwu.switch_nodes.config import NodeConfig

    pub, sec = (k.decode() for k in zmq.curve_keypair())
    keys = {"curve_public_key": pub, "curve_secret_key": sec, "curve_authorized_keys": [pub]}
    assert NodeConfig(**keys).uses_zmtp and NodeConfig(listener="zmtp", **keys).uses_zmtp
    assert (
        not NodeConfig(bind="inproc://n", **keys).uses_zmtp
        and not NodeConfig(listener="libzmq", **keys).uses_zmtp
    )
    with pytest.raises(ConfigError, match="with CURVE keys, the authorized keys do this"):
        NodeConfig(join_secret="x", **keys)


# ----------------------------------------------------------------- the switch tier's [[groups]]


def _groups_file(tmp_path, body: str) -> str:
    path = tmp_path / "tier.toml"
    path.write_text('[cluster]\nnodes = ["tcp://127.0.0.1:5555"]\nworld_size = 8\n' + body)
    return str(path)


GROUPS = """
[[groups]]
ranks = "0-3"
aggregator = "tcp://10.0.0.1:7100"

[[groups]]
ranks = "4-7"
aggregator = "tcp://10.0.0.2:7100"
"""


def test_groups_load_and_each_rank_finds_its_aggregator(tmp_path):
    from luwu.groups import aggregator_for
    from luwu.ops.cluster_file import cluster_file_text

    cfg = load_config(_groups_file(tmp_path, GROUPS), env={})
    assert [aggregator_for(cfg, r) for r in (0, 3, 4, 7)] == [
        "tcp://10.0.0.1:7100",
        "tcp://10.0.0.1:7100",
        "tcp://10.0.0.2:7100",
        "tcp://10.0.0.2:7100",
    ]
    assert aggregator_for(cfg, 8) == ""  # a rank in no group talks to the nodes directly
    explicit = load_config(
        _groups_file(tmp_path, GROUPS), env={}, argv=["--cluster.aggregator=tcp://h:1"]
    )
    assert aggregator_for(explicit, 0) == "tcp://h:1"  # set explicitly, it wins
    written = tmp_path / "written.toml"
    written.write_text(cluster_file_text(cfg, cfg.cluster.nodes))
    assert "[[groups]]" in written.read_text()
    assert load_config(str(written), env={}).cluster.groups == cfg.cluster.groups
    env = {"LUWU_CLUSTER__GROUPS": "0-3=tcp://10.0.0.1:7100,4-7=tcp://10.0.0.2:7100"}
    assert load_config(None, env=env).cluster.groups == cfg.cluster.groups


@pytest.mark.parametrize(
    "flag, words",
    [
        ("0-3=tcp://h:1,3-5=tcp://h:2", "ranks 3-5 (aggregator tcp://h:2) overlap ranks 0-3"),
        ("5-2=tcp://h:1", "'5-2'"),
        ("0-8=tcp://h:1", "ranks 0-8 are past cluster.world_size = 8"),
        ("0-3=h:1", "got 'h:1'"),
        ("0-3", "'0-3' (from --cluster.groups) is not RANKS=ADDRESS"),
        ("0-1=tcp://h:1,2-3=tcp://h:1", "the same aggregator tcp://h:1"),
    ],
)
def test_bad_groups_are_refused_naming_the_value(tmp_path, flag, words):
    with pytest.raises(ConfigError, match=re.escape(words)):
        load_config(_groups_file(tmp_path, ""), env={}, argv=[f"--cluster.groups={flag}"])


def test_a_group_table_with_a_wrong_key_or_run_is_refused(tmp_path):
    body = '\n[[groups]]\nranks = [0, 2]\naggregator = "tcp://h:1"\n'
    with pytest.raises(ConfigError, match=re.escape("contiguous run, got [0, 2]")):
        load_config(_groups_file(tmp_path, body), env={})
    body = '\n[[groups]]\nranks = "0-1"\naddress = "tcp://h:1"\n'
    with pytest.raises(ConfigError, match="unknown key"):
        load_config(_groups_file(tmp_path, body), env={})
