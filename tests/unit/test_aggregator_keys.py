"""The switch tier's key role, without processes: node.curve_aggregator_keys, the key set's
aggregator files and the groups' ``aggregator_key`` (the processes: tests/integration/test_tier_curve.py)."""

from __future__ import annotations

import stat
import tomllib

import pytest
import zmq

from luwu.config import load_config
from luwu.groups import aggregator_key_for, checked_groups
from luwu.ops.keyset import KeySet, read_env_file, with_aggregator_keys, write_keyset
from luwu.protocol.errors import ConfigError
from luwu.switch_nodes.config import NodeConfig


def _key() -> str:
    return zmq.curve_keypair()[0].decode()


def _node(**kw) -> NodeConfig:
    public, secret = zmq.curve_keypair()
    return NodeConfig(
        curve_public_key=public.decode(),
        curve_secret_key=secret.decode(),
        curve_authorized_keys=kw.pop("workers", [_key(), _key()]),
        **kw,
    )


def test_aggregator_keys_bind_a_run_of_ranks_each():
    a, b = _key(), _key()
    cfg = _node(curve_aggregator_keys=[f"0-3={a}", f"4={b}"])
    assert cfg.aggregator_ranks == {a: (0, 3), b: (4, 4)}


@pytest.mark.parametrize(
    "entries, match",
    [
        (lambda a, b, w: [f"0-3={a}", f"3-4={b}"], "overlap ranks 0-3"),
        (lambda a, b, w: [f"0-1={w}"], "a worker's or a monitor's key too"),
        (lambda a, b, w: [f"0-1={a}", f"2-3={a}"], "listed for two groups"),
        (lambda a, b, w: [f"0-1{a}"], "is not FIRST-LAST=KEY"),
        (lambda a, b, w: [f"3-1={a}"], "3 > 1"),
    ],
)
def test_bad_aggregator_keys_are_named(entries, match):
    a, b, w = _key(), _key(), _key()
    with pytest.raises(ConfigError, match=match):
        _node(workers=[w], curve_aggregator_keys=entries(a, b, w))


def test_aggregator_keys_need_curve():
    with pytest.raises(ConfigError, match="needs CURVE keys"):
        NodeConfig(curve_aggregator_keys=[f"0-1={_key()}"])


def test_key_files_give_each_aggregator_its_own_pair_for_both_hops(tmp_path):
    keys = KeySet.generate(4, groups=["0-1", "2-3"])
    groups = [
        {"ranks": r, "aggregator": f"tcp://10.0.0.{i}:7100"} for i, r in enumerate(["0-1", "2-3"])
    ]
    shared = {"cluster": {"world_size": 4}, "groups": with_aggregator_keys(groups, keys)}
    write_keyset(tmp_path, keys, shared=shared)
    node = NodeConfig(**tomllib.loads((tmp_path / "node.toml").read_text())["node"])
    pub = [pair[0] for _, pair in keys.aggregators]
    assert node.aggregator_ranks == {pub[0]: (0, 1), pub[1]: (2, 3)}
    agg = load_config(str(tmp_path / "aggregator1.toml"), env={})
    assert stat.S_IMODE((tmp_path / "aggregator1.toml").stat().st_mode) == 0o600
    assert agg.node.curve_public_key == pub[1] != node.curve_public_key
    assert agg.node.curve_authorized_keys == node.curve_authorized_keys  # rank r's is the r-th
    assert agg.transport.curve_server_key == node.curve_public_key
    assert agg.transport.curve_public_key == pub[1]
    env = read_env_file(tmp_path / "aggregator1.env")
    assert env["LUWU_NODE__CURVE_SECRET_KEY"] == agg.node.curve_secret_key
    assert node.curve_secret_key not in (tmp_path / "aggregator1.toml").read_text()
    worker = load_config(str(tmp_path / "worker3.toml"), env={})
    assert aggregator_key_for(worker, 3) == pub[1] and aggregator_key_for(worker, 0) == pub[0]
    assert worker.transport.curve_server_key == node.curve_public_key  # the nodes' stays


def test_a_groups_aggregator_key_is_checked_and_an_explicit_aggregator_has_its_own():
    with pytest.raises(ConfigError, match="aggregator_key must be"):
        checked_groups([{"ranks": "0-1", "aggregator": "tcp://h:1", "aggregator_key": "short"}])
    cfg = load_config(
        env={"LUWU_CLUSTER__AGGREGATOR": "tcp://h:2", "LUWU_CLUSTER__AGGREGATOR_KEY": "k" * 40}
    )
    assert aggregator_key_for(cfg, 0) == "k" * 40
