"""``luwu plan``: an analytical model of one training step, to size a cluster before renting it.

:mod:`.model` holds the formulas (its docstring derives each term), :mod:`.disk` those of out-of-core
nodes (state on disk, RAM as a window), :mod:`.profiles` what a codec costs (from
:mod:`luwu.protocol.codec_facts`), :mod:`.recommend` the search over nodes and codecs, :mod:`.sizing`
the search over nodes and disks, :mod:`.presets` named setups and their assumptions, :mod:`.checks`
the input checks, :mod:`.cli` the command and :mod:`.report` what it prints.
"""

from luwu.plan.cli import add_arguments, parse_count, parse_size, run, spec_from_args
from luwu.plan.disk import disk_stream_s, state_bytes_per_param
from luwu.plan.model import (
    ADAMW_PARAMS_PER_S_PER_THREAD,
    BACKWARD_FRACTION,
    DEFAULT_BUCKET_BYTES,
    Plan,
    PlanSpec,
    plan,
    spec_with_codecs,
    stream_refetch_share,
)
from luwu.plan.presets import PRESETS, Assumption, Preset
from luwu.plan.profiles import PULL_CODECS, PUSH_CODECS, CodecProfile, codec_profile
from luwu.plan.recommend import Option, Recommendation, recommend
from luwu.plan.sizing import NodeCountRow, SizeOption, Sizing, size_cluster

__all__ = [
    "ADAMW_PARAMS_PER_S_PER_THREAD",
    "BACKWARD_FRACTION",
    "DEFAULT_BUCKET_BYTES",
    "PRESETS",
    "PULL_CODECS",
    "PUSH_CODECS",
    "Assumption",
    "CodecProfile",
    "NodeCountRow",
    "Option",
    "Plan",
    "PlanSpec",
    "Preset",
    "Recommendation",
    "SizeOption",
    "Sizing",
    "add_arguments",
    "codec_profile",
    "disk_stream_s",
    "parse_count",
    "parse_size",
    "plan",
    "recommend",
    "run",
    "size_cluster",
    "spec_from_args",
    "spec_with_codecs",
    "state_bytes_per_param",
    "stream_refetch_share",
]
