"""``luwu plan``: an analytical model of one training step, to size a cluster before renting it.

:mod:`.model` holds the formulas (its docstring derives each term), :mod:`.profiles` what a codec
costs (from :mod:`luwu.protocol.codec_facts`), :mod:`.recommend` the search over nodes and codecs,
and :mod:`.cli` the command.
"""

from luwu.plan.cli import add_arguments, parse_count, run, spec_from_args
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
from luwu.plan.profiles import PULL_CODECS, PUSH_CODECS, CodecProfile, codec_profile
from luwu.plan.recommend import Option, Recommendation, recommend

__all__ = [
    "ADAMW_PARAMS_PER_S_PER_THREAD",
    "BACKWARD_FRACTION",
    "DEFAULT_BUCKET_BYTES",
    "PULL_CODECS",
    "PUSH_CODECS",
    "CodecProfile",
    "Option",
    "Plan",
    "PlanSpec",
    "Recommendation",
    "add_arguments",
    "codec_profile",
    "parse_count",
    "plan",
    "recommend",
    "run",
    "spec_from_args",
    "spec_with_codecs",
    "stream_refetch_share",
]
