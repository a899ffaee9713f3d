"""Checks of ``luwu plan``'s inputs: a bad number is refused by name, with the value it was given."""

from __future__ import annotations

import math
from typing import Any

from luwu.protocol.errors import ConfigError


def _positive(name: str, value: float) -> None:
    if not (isinstance(value, (int, float)) and math.isfinite(value) and value > 0):
        raise ConfigError(f"{name} must be a positive finite number, got {value!r}")


def _non_negative(name: str, value: float) -> None:
    if not (isinstance(value, (int, float)) and math.isfinite(value) and value >= 0):
        raise ConfigError(f"{name} must be a finite number >= 0, got {value!r}")


def _positive_int(name: str, value: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ConfigError(f"{name} must be an integer >= 1, got {value!r}")


def check_state_fields(spec: Any) -> None:
    """Validate a PlanSpec's state and disk fields: disks per node, their rates and the budgets."""
    if isinstance(spec.disks, bool) or not isinstance(spec.disks, int) or spec.disks < 0:
        raise ConfigError(f"disks must be an integer >= 0 (disks per node), got {spec.disks!r}")
    for name in ("disk_read_gb_s", "disk_write_gb_s", "state_bytes_per_param"):
        _positive(name, getattr(spec, name))
    for name in ("disk_mixed_gb_s", "state_memory_bytes", "disk_bytes"):
        if getattr(spec, name) is not None:
            _positive(name, getattr(spec, name))


def check_spec(spec: Any) -> None:
    """Validate a PlanSpec (called by its ``__post_init__``; normalises list inputs to tuples)."""
    check_state_fields(spec)
    _positive_int("num_params", spec.num_params)
    _positive_int("workers", spec.workers)
    _positive_int("nodes", spec.nodes)
    _positive_int("node_threads", spec.node_threads)
    _positive_int("bucket_bytes", spec.bucket_bytes)
    if spec.batch_per_worker is not None:
        _positive_int("batch_per_worker", spec.batch_per_worker)
    if spec.stream_units is not None:
        _positive_int("stream_units", spec.stream_units)
    if not 0.0 <= spec.stream_refetch <= 1.0:
        raise ConfigError(
            f"stream_refetch must be in [0, 1] (the share of the weights fetched again for backward), got {spec.stream_refetch!r}"
        )
    for name in (
        "worker_gbps",
        "push_bytes_per_elem",
        "pull_bytes_per_elem",
        "opt_params_per_s",
    ):
        _positive(name, getattr(spec, name))
    for name in (
        "compute_s",
        "push_encode_s_per_elem",
        "push_decode_s_per_elem",
        "pull_encode_s_per_elem",
        "pull_decode_s_per_elem",
        "net_cpu_s_per_byte",
    ):
        _non_negative(name, getattr(spec, name))
    if spec.capacities is not None:
        spec.capacities = tuple(spec.capacities)
        if len(spec.capacities) != spec.nodes:
            raise ConfigError(
                f"capacities has {len(spec.capacities)} entries for nodes={spec.nodes}: "
                f"{spec.capacities!r}"
            )
        for i, c in enumerate(spec.capacities):
            _positive(f"capacities[{i}]", c)
    if isinstance(spec.node_gbps, (list, tuple)):
        spec.node_gbps = tuple(spec.node_gbps)
        if len(spec.node_gbps) != spec.nodes:
            raise ConfigError(
                f"node_gbps has {len(spec.node_gbps)} entries for nodes={spec.nodes}: "
                f"{spec.node_gbps!r}"
            )
        for i, g in enumerate(spec.node_gbps):
            _positive(f"node_gbps[{i}]", g)
    else:
        _positive("node_gbps", spec.node_gbps)
    if spec.shared_cores is not None:
        _positive("shared_cores", spec.shared_cores)
    _check_tier(spec)
    if spec.overlap_fraction is not None and not (
        isinstance(spec.overlap_fraction, (int, float)) and 0.0 <= spec.overlap_fraction <= 1.0
    ):
        raise ConfigError(
            f"overlap_fraction must be in [0, 1] or None, got {spec.overlap_fraction!r}"
        )
    if spec.stream_weights and spec.delayed_update:
        raise ConfigError(
            "stream_weights and delayed_update cannot be combined (a streaming worker holds no weights to update late)"
        )
    if not (
        isinstance(spec.protocol_efficiency, (int, float)) and 0.0 < spec.protocol_efficiency <= 1.0
    ):
        raise ConfigError(
            f"protocol_efficiency must be in (0, 1], got {spec.protocol_efficiency!r}"
        )


def _check_tier(spec: Any) -> None:
    """The switch tier's fields: a group of 1 to ``workers`` workers, positive link rates."""
    _positive_int("aggregator_threads", spec.aggregator_threads)
    for name in ("group_gbps", "aggregator_gbps"):
        if getattr(spec, name) is not None:
            _positive(name, getattr(spec, name))
    if spec.group_size is None:
        return
    _positive_int("group_size", spec.group_size)
    if spec.group_size > spec.workers:
        raise ConfigError(
            f"group_size {spec.group_size} is larger than workers={spec.workers}: a group holds "
            "at most every worker (or leave group_size unset for the flat layout)"
        )
