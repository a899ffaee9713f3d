"""Which codec each bucket travels in, in each direction: one object the worker is given.

Three directions: a push (the gradient, with or without error feedback), the reply to a push of a
resident bucket (the new weights, ``pull``), and a streamed unit's weights fetched before use
(``fetch``). Each is decided per bucket and step from the config of the bucket's node link
(:class:`luwu.gpu_workers.links.LinkSpeeds` moves a link's config when its measured speed moves),
so the plan reads the link configs when asked, never a copy. With compression off every direction
is ``none`` (fp32, bit-exact); a bucket holding bf16 parameters comes back as ``bf16`` (see
:mod:`luwu.gpu_workers.precision`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from luwu.gpu_workers.precision import BF16_PULL, STEPS_PULL
from luwu.protocol.compression import CompressionConfig
from luwu.protocol.layout import Bucket
from luwu.protocol.policy import choose_codec, choose_fetch_codec, choose_pull_codec


@dataclass(frozen=True, slots=True)
class CodecPlan:
    """The codecs of one worker's buckets. ``config_of(node)``: the compression config the policy
    decides that node's buckets with (None: compression off). ``streamed``: the buckets of streamed
    units (their pushes keep no error-feedback residual between steps). ``half``: indices of bf16
    parameters (a bucket holding one is pulled as ``bf16`` unless the policy picks ``bf16_steps``)."""

    config_of: Callable[[int], CompressionConfig] | None = None
    streamed: frozenset[int] = frozenset()
    half: frozenset[int] = frozenset()

    def push(self, b: Bucket, step: int) -> tuple[str, bool]:
        """(codec, with error feedback) of ``b``'s gradient at ``step``."""
        if self.config_of is None:
            return "none", False
        return choose_codec(b, step, self.config_of(b.node), residual=b.id not in self.streamed)

    def pull(self, b: Bucket, step: int) -> str:
        """The codec the new weights of resident bucket ``b`` come back in after ``step``."""
        name = (
            "none" if self.config_of is None else choose_pull_codec(b, step, self.config_of(b.node))
        )
        if self.half and name != STEPS_PULL and any(s.param in self.half for s in b.segments):
            return BF16_PULL
        return name

    def fetch(self, b: Bucket, step: int) -> str:
        """The codec a streamed unit's weights are fetched in (fp32 with compression off)."""
        if self.config_of is None:
            return "none"
        return choose_fetch_codec(b, step, self.config_of(b.node))
