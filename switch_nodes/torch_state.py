"""A parameter's optimizer state as ``torch.optim`` keeps it, and where it lies in a bucket's flat state.

A node keeps each state tensor flat per bucket (:mod:`.store`); torch keeps one entry per parameter:
``step`` (for most kinds), derived scalars (NAdam's ``mu_product``) and the state tensors its
param group uses, each of torch's shape. :func:`torch_param_state` says which, for the gatherers of
``state_dict()`` (``luwu.optim_state``) and the nodes' DCP checkpoints (:mod:`.export`, :mod:`.dcp_import`)
alike; :func:`slot` where a segment's part of a state tensor lies.
"""

from __future__ import annotations

import math

import torch

from luwu.switch_nodes.optimizers import OptimizerKind, torch_scalars


def torch_param_state(
    kind: OptimizerKind, shape: tuple[int, ...], step: float, hyper: dict
) -> tuple[dict[str, torch.Tensor], dict[str, tuple[int, ...]]]:
    """For a parameter of ``shape`` after ``step`` steps in a param group with hyperparameters
    ``hyper``: torch's scalars (0-d tensors: ``step``, NAdam's ``mu_product``) and the shape of each
    state tensor torch keeps. Nothing for a parameter never stepped: torch creates state lazily."""
    if step == 0:
        return {}, {}
    scalars = {"step": torch.tensor(float(step), dtype=torch.float32)} if kind.step_in_state else {}
    scalars |= torch_scalars(kind, int(step), hyper)
    shapes = kind.state_shapes(tuple(shape))
    return scalars, {n: tuple(shapes[n]) for n in kind.state_for(hyper) if n in shapes}


def slot(
    shape: tuple[int, ...], state_shape: tuple[int, ...], param_offset: int, numel: int
) -> tuple[int, int]:
    """``(start, length)``: the elements of a state tensor of ``state_shape`` that a segment (elements
    ``param_offset`` to ``param_offset + numel`` of a parameter of ``shape``) holds, from the start of
    the segment's slot in the flat state. Elementwise state: the segment's own elements; a shaped state
    (Adafactor's, its parameter whole in the segment): all of it, at the start of the slot."""
    if tuple(state_shape) == tuple(shape):
        return param_offset, numel
    return 0, math.prod(state_shape)


def step_of(kind: OptimizerKind, step: float | None, has_state: bool) -> float:
    """A segment's step counter from torch's entry: its ``step``; for a kind without one in its state
    (SGD), 1 once it has state (the momentum buffer exists: the next step is not the first)."""
    if step is not None:
        return float(step)
    return 1.0 if has_state and not kind.step_in_state else 0.0
