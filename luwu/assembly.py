"""How a :class:`~luwu.optimizer.RemoteOptimizer`'s worker is put together from its configuration.

The param groups are flattened into the layout's :class:`ParamSpec` list (names, shapes, groups,
delayed parameters, units); the layout is computed from them; the link to each node gets its
codec policy (:class:`LinkSpeeds`), whose :class:`CodecPlan` the gradient encoder and the worker
read; and the :class:`Worker` is built with its streaming units, per-layer waits and gradient
views. Each piece is passed in: nothing is attached to the worker afterwards.
"""

from __future__ import annotations

import fnmatch

import torch

from luwu import hyper as hyperparameters
from luwu.config import LuwuConfig
from luwu.gpu_workers import layer_waits, precision, streaming
from luwu.gpu_workers.client import WorkerClient
from luwu.gpu_workers.encoding import GradientEncoder
from luwu.gpu_workers.links import LinkSpeeds
from luwu.gpu_workers.metrics import WorkerMetrics
from luwu.gpu_workers.worker import Worker
from luwu.protocol.errors import ConfigError
from luwu.protocol.feedback import ErrorFeedback
from luwu.protocol.layout import Layout, ParamSpec, build_layout
from luwu.switch_nodes.optimizers import EXTRA_HYPER, check_hyper


def flat_params(
    param_groups: list[dict], names: dict[int, str], unit_of: dict[int, int], kind, patterns
) -> tuple[list[torch.Tensor], list[ParamSpec]]:
    """Every parameter of ``param_groups`` in order, and its spec: the name (torch's
    ``param_names``, else ``names[id(p)]``, else ``param<i>``), whether it matches one of the
    ``delayed_params`` ``patterns``, and its unit (``unit_of[id(p)]``, -1: none). A pattern that
    matches no parameter is refused."""
    params, specs = [], []
    for gi, g in enumerate(param_groups):
        # torch keeps named parameters' names here
        group_names = g.get("param_names") or [None] * len(g["params"])
        for p, name in zip(g["params"], group_names):
            params.append(p)
            name = name or names.get(id(p), f"param{len(specs)}")
            delayed = any(fnmatch.fnmatchcase(name, pat) for pat in patterns)
            unit = unit_of.get(id(p), -1)
            specs.append(
                ParamSpec(name, tuple(p.shape), gi, delayed, unit, whole=kind.whole_params)
            )
    for pat in patterns:
        if not any(fnmatch.fnmatchcase(s.name, pat) for s in specs):
            shown = ", ".join(s.name for s in specs[:8]) + (", ..." if len(specs) > 8 else "")
            raise ConfigError(
                f"delayed_params pattern {pat!r} matches no parameter (names: {shown})"
            )
    return params, specs


def layout_of(specs: list[ParamSpec], cfg: LuwuConfig, capacities: list[float]) -> Layout:
    """The buckets of ``specs`` and their nodes; a parameter kept whole (Adafactor) over
    ``transport.max_message_bytes`` is refused."""
    layout = build_layout(specs, cfg.transport.bucket_bytes, capacities)
    if max((b.nbytes for b in layout.buckets), default=0) > cfg.transport.max_message_bytes:
        raise ConfigError(
            "a parameter kept whole is over transport.max_message_bytes: raise it (and "
            "node.max_message_bytes)"
        )
    return layout


def delayed_buckets(layout: Layout, cfg: LuwuConfig) -> frozenset[int]:
    """Ids of the buckets whose weights land a step late once the delay starts."""
    if not cfg.optimizer.delayed_update:
        return frozenset()
    if not cfg.optimizer.delayed_params:
        return frozenset(b.id for b in layout.buckets)
    return layout.delayed_buckets()


def build_worker(
    params: list[torch.Tensor],
    layout: Layout,
    client: WorkerClient,
    links: LinkSpeeds,
    cfg: LuwuConfig,
    *,
    kind,
    rank: int,
    world_size: int,
    hyper_of,
    metrics: WorkerMetrics,
    model: torch.nn.Module | None,
    units,
) -> Worker:
    """The worker of ``params`` (not connected yet): its gradient encoder on ``links``' codec
    plan, its streamed units (``units``, None: resident), its per-layer waits on ``model``'s
    modules when the configuration asks for them, its gradient views."""
    cc, opt = cfg.compression, cfg.optimizer
    feedback = ErrorFeedback(getattr(torch, cc.residual_dtype)) if cc.enabled else None
    encoder = GradientEncoder(
        links.codec_plan(precision.half_params(params)),
        feedback,
        optimizer=kind.name,
        world_size=world_size,
        momentum_correction=cc.enabled and cc.momentum_correction,
        streamed=layout.streamed_buckets(),
    )
    return Worker(
        params,
        layout,
        client,
        encoder,
        rank=rank,
        world_size=world_size,
        mode=cfg.node.mode,
        delayed=delayed_buckets(layout, cfg),
        hyper_of=hyper_of,
        two_phase=False,  # (decided once connected: RoundPolicy)
        metrics=metrics,
        model=layer_waits.model_for(opt, model, rank),
        grad_views=opt.grads_in_buckets,
        **streaming.worker_arguments(layout, units, opt),
    )


def named_params(params, model: torch.nn.Module | None):
    """``(params, names, model)``: the optimizer's parameters (a module's trainable ones when
    ``params`` is a module), ``id(p)`` -> name (from the module, or ``model=`` naming param groups),
    and the model (``model_state_dict``'s keys; None when only tensors were given)."""
    if isinstance(params, torch.nn.Module):
        named = [(n, p) for n, p in params.named_parameters() if p.requires_grad]
        return [p for _, p in named], {id(p): n for n, p in named}, params
    names = {} if model is None else {id(p): n for n, p in model.named_parameters()}
    return params, names, model


def check_group(kind, group: dict, hyper: dict, cfg: LuwuConfig, gi: int) -> None:
    """Param group ``gi``'s hyperparameters (``hyper``, as pushed), checked when it is added: a bad
    value, or a key of another optimizer (named), and what the compression config asks of it
    (momentum correction needs an update linear in the momentum the workers send; the node checks
    it again at every push)."""
    extras = {
        k: group[k] for names in EXTRA_HYPER.values() for k in names if group.get(k) is not None
    }
    cc = cfg.compression
    try:
        check_hyper(kind, hyper | extras)
        if cc.enabled and cc.momentum_correction:
            hyperparameters.check_momentum_correction(kind, hyper, cc, cfg.node.mode)
    except ConfigError as exc:
        raise ConfigError(f"param group {gi}: {exc}") from None
