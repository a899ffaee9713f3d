"""Which parameter dtypes a worker may train, and the pull codec a bf16 model needs.

A worker trains fp32 parameters, or, in resident mode, bf16 ones: ZeRO-Offload's
mixed-precision layout, where the worker holds bf16 weights and gradients and
the nodes hold the fp32 master weights and the optimizer's moments. A bucket of
bf16 parameters alone has a bf16 gradient buffer (the parameters' ``.grad`` are
views of it, :mod:`luwu.gpu_workers.grad_views`) and is pushed as is with the
``bf16`` codec: lossless for a bf16 gradient, so the nodes step on the very
gradient backward produced, with no error-feedback residual on the worker (a
bucket mixing dtypes has an fp32 buffer, exact too). The weights come back rounded to bf16: the
``bf16`` pull codec rounds to nearest even on the node, which is what writing
fp32 weights into a bf16 tensor does, at half the bytes; ``bf16_steps`` gives the
same bits as one-byte steps on the bf16 grid, and is kept where the policy picks
it. ``int8_delta`` is not used for such a model: its delta is added to what the
worker holds, and a bf16 sum drifts from the node's record of it.

Streaming mode fetches weights into the model's own parameters at every use;
it keeps fp32 parameters (use ``torch.autocast`` for bf16 compute there).
"""

from __future__ import annotations

from typing import Callable

import torch

from luwu.protocol.errors import ConfigError

#: Parameter dtypes a resident worker trains; streaming mode takes only the first.
TRAINABLE = (torch.float32, torch.bfloat16)
#: The pull codec of a bucket holding bf16 parameters, and the one that gives the same bits in steps.
BF16_PULL, STEPS_PULL = "bf16", "bf16_steps"


def check_dtypes(
    params: list[torch.Tensor], name_of: Callable[[torch.Tensor], str], streaming: bool
) -> None:
    """Raise ConfigError for a parameter this worker cannot train (see the module docstring)."""
    allowed = TRAINABLE[:1] if streaming else TRAINABLE
    for p in params:
        if p.dtype not in allowed:
            why = (
                "streaming mode keeps fp32 parameters"
                if streaming
                else "LuWu trains fp32 or bf16 parameters"
            )
            raise ConfigError(
                f"parameter {name_of(p)} has dtype {p.dtype}: {why} (use autocast for bf16 compute)"
            )


def half_params(params: list[torch.Tensor]) -> frozenset[int]:
    """Indices of the bf16 parameters: a bucket holding one is pulled as ``bf16`` unless the policy
    picks ``bf16_steps`` (see the module docstring; :class:`~luwu.gpu_workers.codec_plan.CodecPlan`)."""
    return frozenset(i for i, p in enumerate(params) if p.dtype == torch.bfloat16)
