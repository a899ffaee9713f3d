"""``RemoteOptimizer``: a ``torch.optim.Optimizer`` whose step runs on the nodes.

Swap ``torch.optim.AdamW(model.parameters(), lr=...)`` for
``luwu.RemoteOptimizer(model, lr=..., nodes=[...])``: the training loop,
schedulers, GradScaler and checkpoints keep working. Gradients stream to the
nodes during ``backward()`` from post-accumulate-grad hooks; ``step()``
pushes what is left, waits for the new weights and writes them into the
parameters. Hyperparameters are read from ``param_groups`` when each bucket is
pushed, so every ``torch.optim.lr_scheduler`` works unchanged.

Settings come from the configuration tree (:mod:`luwu.config`), as for the
node daemons: the hybrid compression policy is on by default, and
``compression=False`` sends fp32 both ways, bit-exact against ``torch.optim``.
The worker (:class:`luwu.gpu_workers.worker.Worker`) runs each step and
returns its :class:`~luwu.gpu_workers.worker.StepReport` (``last_report``),
from which the metrics are recorded.
"""

from __future__ import annotations

import contextlib
import fnmatch
import logging
import os
import time
import warnings

import torch

from luwu import optim_state
from luwu.config import LuwuConfig, resolve_config
from luwu.gpu_workers.client import WorkerClient
from luwu.gpu_workers.config import TransportConfig
from luwu.gpu_workers import grad_views, layer_waits, precision, streaming
from luwu.gpu_workers.metrics import WorkerMetrics
from luwu.gpu_workers.worker import StepReport, Worker
from luwu.protocol.errors import ConfigError, LuwuError, RollbackError
from luwu.protocol.memory import trim_heap
from luwu.protocol.metrics import serve_metrics
from luwu.protocol.feedback import WORKER_MOMENTUM
from luwu.protocol.layout import ParamSpec, build_layout
from luwu.switch_nodes.optimizers import EXTRA_HYPER, IMPLEMENTATION_SWITCHES, check_hyper, get_kind

log = logging.getLogger(__name__)

# GradScaler hands itself to optimizers that take a ``grad_scaler`` argument and warns that this will
# change; LuWu needs the scaler to make the overflow decision global, so the warning is expected.
warnings.filterwarnings("ignore", message="GradScaler is going to stop passing itself", category=FutureWarning)


def _num(v):
    """A hyperparameter as it travels: tensors as floats, pairs (``betas``, ``etas``) as lists."""
    if isinstance(v, (tuple, list)):
        return [_num(x) for x in v]
    return float(v.item()) if isinstance(v, torch.Tensor) else v


class RemoteOptimizer(torch.optim.Optimizer):
    """An optimizer that lives on LuWu nodes.

    Every setting comes from one :class:`luwu.config.LuwuConfig`: :meth:`from_config` takes a resolved
    one (e.g. ``load_config("cluster.toml")``); the keyword constructor resolves defaults and the
    ``LUWU_SECTION__FIELD`` environment variables as ``luwu`` does for a cluster file. A keyword given
    (not None) wins over the configuration: keyword > environment > cluster file > default. The
    resolved tree is ``self.config``.

    Args:
        params: an ``nn.Module`` (parameter names come from it), an iterable of tensors, or param-group dicts;
            as in ``torch.optim``, ``model.named_parameters()`` or groups of ``(name, tensor)`` pairs give the
            names too (per-name compression rules match them; unnamed parameters are ``param<i>``).
        optimizer: a name of ``luwu.switch_nodes.optimizers.OPTIMIZER_NAMES`` (``optimizer.name``): ``"adamw"``,
            ``"adam"``, ``"sgd"``, ``"adagrad"``, ``"rmsprop"``, ``"adamax"``, ``"nadam"``, ``"radam"``,
            ``"adadelta"``, ``"rprop"``, ``"adafactor"``. Torch's other algorithms are refused with the reason.
        **hyper: the optimizer's hyperparameters, with torch's names and defaults (``lr``, ``betas``,
            ``amsgrad``, ``momentum``, ``centered``...); a key the optimizer does not have is a ConfigError.
            torch's implementation switches (``foreach``, ``fused``, ``capturable``) are accepted and
            ignored: the nodes choose their kernels.
        nodes: node addresses (``tcp://host:port``) or a comma-separated string (``cluster.nodes``; when
            none is configured, ``LUWU_NODES``).
        rank, world_size: this worker's identity; default torchrun's ``RANK`` / ``WORLD_SIZE``.
        job, capacities: ``cluster.job``, ``cluster.capacities`` (relative node capacities for the layout).
        mode: ``node.mode``, the nodes' aggregation mode (``sync`` or ``async``).
        delayed_update: ZeRO-Offload's DPU: ``step()`` returns at once, the weights land at the next step.
        delayed_update_warmup: with ``delayed_update``, the steps (from 0) run in sync before the delay
            starts, as ZeRO-Offload turns DPU on only after a warm-up: early gradients change the weights
            the most, so applying them a step late costs the most there.
        delayed_params: with ``delayed_update``, delay only the parameters whose names match one of these
            fnmatch patterns (a list, or a comma-separated string; None: all). The first layers' gradients
            come last in backward and their weights are needed first in forward, so their round trip is
            the tail of a sync step: delaying just them takes it off the critical path at a fraction of
            full delay's cost in loss. The rest stays sync.
        max_grad_norm: clip by the global norm of the averaged gradient across all shards.
        layer_waits: ``optimizer.layer_waits`` (on by default): ``step()`` returns once the pushes are out and
            each parameter waits for its new weights when it is next read, in the next forward when its layer
            runs (:mod:`luwu.gpu_workers.layer_waits`).
        amp: set when a ``torch.amp.GradScaler`` drives this optimizer (the overflow decision is global).
        transport, bucket_bytes, timeout_s: the ``transport`` section, or two of its fields.
        compression: the hybrid codec policy (``compression`` section, on by default): a
            ``CompressionConfig``, or False for bit-exact fp32 both ways (True: the configured policy, on).
        registry: the Prometheus registry of the worker metrics (default: a new one).
        metrics_port, metrics_host: serve ``/metrics`` on this port (0: any free one; None: not served)
            of this host (``metrics.host``). ``metrics.port`` is the nodes' (``luwu up`` gives node i
            port + i), so a worker serves its endpoint only when asked here.
        stream_weights, stream_units, prefetch, init_weights: streaming mode (``optimizer.stream_*``, :mod:`luwu.gpu_workers.streaming`):
            no weights of the units held between uses, each fetched before use. ``model``: the module the units are found in when
            ``params`` are param groups or tensors of it (weight decay on matrices only, as GPT training does); else ``params`` is the model.
    """

    _step_supports_amp_scaling = True

    def __init__(
        self,
        params,
        optimizer: str | None = None,
        *,
        config: LuwuConfig | None = None,
        nodes=None,
        rank: int | None = None,
        world_size: int | None = None,
        job: str | None = None,
        mode: str | None = None,
        delayed_update: bool | None = None,
        delayed_update_warmup: int | None = None,
        delayed_params=None,
        max_grad_norm: float | None = None,
        layer_waits: bool | None = None,
        amp: bool = False,
        transport: TransportConfig | None = None,
        compression=None,
        bucket_bytes: int | None = None,
        timeout_s: float | None = None,
        capacities=None,
        registry=None,
        metrics_port: int | None = None,
        metrics_host: str | None = None,
        stream_weights: bool | None = None, stream_units=None, prefetch: int | None = None, init_weights: str | None = None, model=None,
        **hyper,
    ):
        if optimizer is not None:
            get_kind(optimizer)  # torch's algorithms a node cannot run are refused with the reason
        cfg = resolve_config(
            config, optimizer=optimizer, nodes=nodes, capacities=capacities, world_size=world_size, job=job, mode=mode,
            delayed_update=delayed_update, delayed_update_warmup=delayed_update_warmup, delayed_params=delayed_params,
            max_grad_norm=max_grad_norm, layer_waits=layer_waits, bucket_bytes=bucket_bytes, timeout_s=timeout_s, metrics_host=metrics_host,
            transport=transport, compression=compression, stream_weights=stream_weights, prefetch=prefetch, stream_units=streaming.patterns_of(stream_units), init_weights=init_weights,
        )
        self.config = cfg
        self.streamer, self._waits, (self._units, self._unit_of) = None, None, streaming.plan_units(params if model is None else model, stream_units, cfg.optimizer, model is not None)
        kind = get_kind(cfg.optimizer.name)
        defaults = dict(kind.defaults)
        for k, v in hyper.items():
            if k == "differentiable" and v:
                raise ConfigError("differentiable=True: a node's step runs outside autograd, nothing can differentiate through it")
            if v is None or k in IMPLEMENTATION_SWITCHES:
                continue
            if k not in defaults:
                raise ConfigError(f"{k}={v!r} does not apply to optimizer {kind.name!r} (its hyperparameters: {', '.join(defaults)})")
            defaults[k] = v
        names: dict[int, str] = {} if model is None else {id(p): n for n, p in model.named_parameters()}  # groups named by model=
        if isinstance(params, torch.nn.Module):
            named = [(n, p) for n, p in params.named_parameters() if p.requires_grad]
            names = {id(p): n for n, p in named}
            params = [p for _, p in named]
        self.kind = kind  # before torch's constructor: add_param_group validates each group with it
        super().__init__(params, defaults)
        self._names = names
        self.rank = int(os.environ.get("RANK", 0)) if rank is None else rank
        self.world_size = cfg.cluster.world_size or int(os.environ.get("WORLD_SIZE", 1))
        if not 0 <= self.rank < self.world_size:
            raise ConfigError(f"rank {self.rank} is outside world_size {self.world_size}")
        self.nodes = list(cfg.cluster.nodes)
        self.job = cfg.cluster.job
        self.amp = amp
        self._flat_params()  # a pattern that matches no parameter fails here, before any thread or socket
        self._sync_grads = True
        self._hooks: list = []
        self.metrics = WorkerMetrics(registry, rank=self.rank)
        self.metrics_url = None
        self._http = None
        if metrics_port is not None:
            self._http, port = serve_metrics(self.metrics.registry, cfg.metrics.host, metrics_port)
            self.metrics_url = f"http://{cfg.metrics.host}:{port}"
        self.client = WorkerClient(self.nodes, job=self.job, rank=self.rank, cfg=cfg.transport)
        self._build()
        self.last_report: StepReport | None = None
        self._last_error: LuwuError | None = None

    @classmethod
    def from_config(cls, params, cfg: LuwuConfig, **kwargs) -> RemoteOptimizer:
        """The optimizer ``cfg`` describes (nodes and capacities, job, world size, optimizer, node mode,
        transport, compression, delayed update, clipping, metrics host); ``kwargs`` are the constructor's: hyperparameters (``lr``...),
        ``rank``, ``amp``, ``registry``, and any setting to override."""
        return cls(params, config=cfg, **kwargs)

    @property
    def max_grad_norm(self) -> float | None:
        """The global-norm clipping threshold (None: off)."""
        return self.config.optimizer.max_grad_norm or None

    @property
    def capacities(self) -> list[float]:
        return list(self.config.cluster.capacities) or [1.0] * len(self.nodes)

    # ----------------------------------------------------------------- layout and connection
    def _flat_params(self) -> tuple[list[torch.Tensor], list[ParamSpec]]:
        params, specs = [], []
        patterns = self.config.optimizer.delayed_params
        for gi, g in enumerate(self.param_groups):
            names = g.get("param_names") or [None] * len(g["params"])  # torch keeps named parameters' names here
            for p, name in zip(g["params"], names):
                params.append(p)
                name = name or self._names.get(id(p), f"param{len(specs)}")
                delayed = any(fnmatch.fnmatchcase(name, pat) for pat in patterns)
                specs.append(ParamSpec(name, tuple(p.shape), gi, delayed, self._unit_of.get(id(p), -1), whole=self.kind.whole_params))
        for pat in patterns:
            if not any(fnmatch.fnmatchcase(s.name, pat) for s in specs):
                raise ConfigError(f"delayed_params pattern {pat!r} matches no parameter (names: {', '.join(s.name for s in specs[:8])}{', ...' if len(specs) > 8 else ''})")
        return params, specs

    def _build(self, step: int = 0) -> None:
        params, specs = self._flat_params()
        precision.check_dtypes(params, lambda p: self._names.get(id(p), "?"), streaming=self._units is not None)
        self.layout = build_layout(specs, self.config.transport.bucket_bytes, self.capacities)
        if max((b.nbytes for b in self.layout.buckets), default=0) > self.config.transport.max_message_bytes:  # a whole parameter (Adafactor)
            raise ConfigError("a parameter kept whole is over transport.max_message_bytes: raise it (and node.max_message_bytes)")
        codec_for = pull_for = feedback = None
        cc = self.config.compression
        if cc.enabled:
            from luwu.protocol.feedback import ErrorFeedback
            from luwu.protocol.policy import choose_codec, choose_pull_codec

            streamed = self.layout.streamed_buckets()  # a streamed unit's push keeps no residual between steps
            codec_for = lambda b, step: choose_codec(b, step, cc, residual=b.id not in streamed)  # noqa: E731
            pull_for = lambda b, step: choose_pull_codec(b, step, cc)  # noqa: E731
            feedback = ErrorFeedback(getattr(torch, cc.residual_dtype))
        pull_for = precision.pull_codec_for(params, pull_for)  # a bf16 model's weights come back as bf16
        self.worker = Worker(
            params,
            self.layout,
            self.client,
            rank=self.rank,
            world_size=self.world_size,
            optimizer=self.kind.name,
            mode=self.config.node.mode,
            delayed=self._delayed_buckets(),
            codec_for=codec_for,
            pull_codec_for=pull_for,
            feedback=feedback,
            hyper_of=self._hyper_of,
            momentum_correction=cc.enabled and cc.momentum_correction,
            two_phase=self.max_grad_norm is not None or self.amp,
            **streaming.worker_arguments(self.layout, self._units, self.config.optimizer, cc),
        )
        self.worker.connect(step)
        trim_heap()  # the start-up pull's replies, freed: not kept for reuse as a step's (a second model's worth)
        self.streamer = streaming.restart(self.streamer, self.worker, params, self._units, self.config.optimizer, self.metrics)
        hold = self.config.optimizer.hold_replies
        self._hold_replies = not self.worker.streamed and (hold == "always" or hold == "auto" and self.config.compression.link_gbps >= 10)
        if self._hold_replies:  # from the first step on: as if the step before it had just begun
            self.client.release(step - 1)
        self._close_waits()
        self._waits = layer_waits.attach(self.worker, self.config.optimizer)
        grad_views.attach(self.worker, self.config.optimizer)
        for h in self._hooks:
            h.remove()
        self._hooks = [p.register_post_accumulate_grad_hook(self._make_hook(i)) for i, p in enumerate(params)]

    def _delayed_buckets(self) -> frozenset[int]:
        """Ids of the buckets whose weights land a step late once the delay starts."""
        if not self.config.optimizer.delayed_update:
            return frozenset()
        if not self.config.optimizer.delayed_params:
            return frozenset(b.id for b in self.layout.buckets)
        return self.layout.delayed_buckets()

    def _make_hook(self, index: int):
        def hook(p: torch.Tensor) -> None:
            if (self._sync_grads or self.worker.accumulating) and p.grad is not None:
                self.worker.grad_ready(index, p.grad)

        return hook

    def _hyper_of(self, group: int) -> dict:
        g = self.param_groups[group]
        keys = self.kind.hyper_keys + tuple(k for k in EXTRA_HYPER[self.kind.name] if g.get(k) is not None)
        return {k: _num(g[k]) for k in keys}

    def _check_group(self, gi: int) -> None:
        """What the compression config asks of a param group: momentum correction needs an update linear
        in the momentum the workers send (the node checks it again at every push)."""
        cc = self.config.compression
        if not cc.enabled or not cc.momentum_correction:
            return
        try:
            mode = self.config.node.mode
            if mode != "sync":
                raise ConfigError(f"compression.momentum_correction needs mode='sync', not {mode!r}")
            h = self._hyper_of(gi) | {WORKER_MOMENTUM: cc.topk_density}
            check_hyper(self.kind, h)
            freeze = h.get("variance_freeze_step")
            if freeze is not None and freeze > cc.warmup_steps:
                raise ConfigError(
                    f"variance_freeze_step = {freeze} is after compression.warmup_steps = {cc.warmup_steps}: with momentum correction "
                    f"the variance must be frozen when the top-k steps start"
                )
        except ConfigError as exc:
            raise ConfigError(f"param group {gi}: {exc}") from None

    @contextlib.contextmanager
    def no_sync(self):
        """Gradient accumulation: backward passes inside do not push; the next one outside pushes the sum
        (streaming mode: each streamed unit's micro-batch gradient is pushed and summed on the nodes)."""
        self._sync_grads, self.worker.accumulating = False, self.streamer is not None
        try:
            yield
        finally:
            self._sync_grads, self.worker.accumulating = True, False

    def add_param_group(self, param_group: dict) -> None:
        """As torch's; every worker must add the same group (the layout grows by new buckets only)."""
        if hasattr(self, "worker"):
            self.synchronize()
        super().add_param_group(param_group)
        g = self.param_groups[-1]
        extras = {k: g[k] for names in EXTRA_HYPER.values() for k in names if g.get(k) is not None}
        try:  # as torch's constructors do: a bad value fails here, not at the first push to a node
            check_hyper(self.kind, self._hyper_of(len(self.param_groups) - 1) | extras)  # extras: one for another optimizer is named
        except ConfigError as exc:
            self.param_groups.pop()
            raise ConfigError(f"param group {len(self.param_groups)}: {exc}") from None
        if hasattr(self, "kind"):  # (set before torch's constructor adds the first groups)
            try:
                self._check_group(len(self.param_groups) - 1)
            except ConfigError:
                self.param_groups.pop()  # _check_group named the group already
                raise
        if hasattr(self, "worker"):
            self._build(step=self.worker.step_num)

    # ----------------------------------------------------------------- checkpoints
    def _state_names(self) -> list[str]:
        return ["params", *self.kind.state_names, "steps"]

    def state_dict(self) -> dict:
        """The optimizer state gathered from the shards, in ``torch.optim``'s own format."""
        self.synchronize()
        sd = super().state_dict()
        sd["state"] = optim_state.to_torch(self.kind, self.layout, self._flat_params()[0], self.param_groups, optim_state.fetch(self.worker))
        return sd

    def load_state_dict(self, state_dict: dict) -> None:
        """Load a ``torch.optim`` state dict (from RemoteOptimizer or a local optimizer) and scatter it to the
        nodes, with this worker's current parameters as the master weights; any node count works."""
        self.synchronize()
        super().load_state_dict(state_dict)
        with streaming.gathered(self.streamer):  # streaming mode: the weights are the master weights too
            flats = optim_state.from_torch(self.kind, self.layout, self._flat_params()[0], self.state)
        self.state.clear()
        optim_state.store(self.worker, flats, self._state_names())

    def model_state_dict(self) -> dict[str, torch.Tensor]:
        """Copies of the current weights by parameter name (streaming mode: fetched), for models that fit."""
        self.synchronize()
        with streaming.gathered(self.streamer):
            return {s.name: p.detach().clone() for p, s in zip(*self._flat_params())}

    # ----------------------------------------------------------------- step
    def recover(self) -> int:
        """Rejoin the cluster after a ``RollbackError`` (a node restarted from its checkpoint: every node
        rolls back to that step and this worker takes its weights) or a ``WorkerLostError`` (dropped in
        elastic mode: take the current weights). Returns the step to resume from: rewind the data to it
        (e.g. ``Prefetcher.load_state_dict``, or a sampler indexed by step)."""
        err = self._last_error or self.worker.last_error  # (streaming mode also waits in forward and backward)
        if isinstance(err, RollbackError):
            step = self.worker.recover(err.step, (getattr(err, "detail", None) or {}).get("boot", ""))
        else:
            step = self.worker.recover(None)
        self._last_error = None
        return step

    @torch.no_grad()
    def step(self, closure=None, grad_scaler=None):
        try:
            return self._step(closure, grad_scaler)
        except LuwuError as exc:
            self._last_error = exc
            self.metrics.errors.labels(getattr(exc, "code", "luwu")).inc()
            raise

    def _step(self, closure, grad_scaler):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        inv_scale = 1.0
        if grad_scaler is not None:
            if not self.worker.two_phase:
                raise ConfigError("a GradScaler drives this optimizer: construct RemoteOptimizer(..., amp=True) so the overflow decision is made globally")
            inv_scale = 1.0 / float(grad_scaler.get_scale())
        if self._hold_replies:  # the nodes may send this step's weights now
            self.client.release(self.worker.step_num)
        report = self.worker.step(delay=self._delaying(self.worker.step_num), inv_scale=inv_scale, max_norm=self.max_grad_norm)
        streaming.end_step(self.streamer, report)
        if grad_scaler is not None:
            # Every worker's scaler backs off alike: the decision is the nodes', not this worker's grads.
            state = grad_scaler._per_optimizer_states[id(self)]
            state["found_inf_per_device"] = {torch.device("cpu"): torch.full((), float(report.skipped))}
        self.last_report = report
        self._record(report)
        return loss

    def _delaying(self, step: int) -> bool:
        """Whether ``step``'s weights land a step late (delayed update, past its warm-up)."""
        o = self.config.optimizer
        return o.delayed_update and step >= o.delayed_update_warmup

    def _record(self, report: StepReport) -> None:
        """Per-step metrics: counters from the I/O thread's totals, the step-time breakdown from the report."""
        m, c = self.metrics, self.client
        now = time.perf_counter()
        sent, recv = c.bytes_sent, c.bytes_received
        prev = getattr(self, "_last_totals", (0, 0, None))
        m.bytes_pushed.inc(sent - prev[0])
        m.bytes_pulled.inc(recv - prev[1])
        raw = sum(b.numel for b in self.layout.buckets) * 4
        m.raw_pushed.inc(raw)
        m.raw_pulled.inc(raw)
        if sent > prev[0]:
            m.compression_ratio.set(raw / (sent - prev[0]))
        m.steps.inc()
        if report.skipped:
            m.skipped.inc()
        pf = getattr(self, "_prefetcher", None)
        data_wait = pf.last_wait_s if pf is not None else 0.0
        if pf is not None:
            m.data_wait.observe(data_wait)
        m.push_wait.observe(report.push_wait_s)
        m.update_wait.observe(report.update_wait_s)
        m.staleness.set(1 if report.delayed else 0)
        if prev[2] is not None:
            step_s = now - prev[2]
            m.step_seconds.observe(step_s)
            m.compute.observe(max(0.0, step_s - report.push_wait_s - report.update_wait_s - data_wait))
        self._last_totals = (sent, recv, now)

    def attach_prefetcher(self, prefetcher) -> None:
        """Report the seconds each step waited for data (``luwu_worker_data_wait_seconds``) from a Prefetcher."""
        self._prefetcher = prefetcher

    def zero_grad(self, set_to_none: bool = True) -> None:
        """torch's; zeroing in place waits for the last step's replies first: a gradient that is its bucket's
        view may still be the frame of a push on its way (luwu.gpu_workers.grad_views)."""
        if not set_to_none and self.worker.views is not None and self.worker.defer is not None:
            self.worker.defer.settle()
        super().zero_grad(set_to_none)

    def synchronize(self) -> None:
        """Wait for the weights the last step still owes (delayed update; per-layer waits): call before reading
        parameters outside a forward."""
        self.worker.synchronize()

    def _close_waits(self) -> None:
        """Write the replies the last step still owes (a dead node: give up after a few seconds, named)."""
        waits, self._waits = getattr(self, "_waits", None), None
        if waits is not None and waits.owed:
            try:
                waits.settle(timeout_s=min(5.0, self.config.transport.timeout_s))
            except LuwuError as exc:
                log.warning("rank %d: the weights of the last step did not all arrive before close (%s)", self.rank, exc)
            waits.reset()

    def close(self) -> None:
        self.streamer = streaming.stop(getattr(self, "streamer", None))
        self._close_waits()
        for h in self._hooks:
            h.remove()
        self._hooks = []
        if getattr(self, "client", None) is not None:
            self.client.close()
            self.client = None
        if getattr(self, "_http", None) is not None:
            self._http.shutdown()
            self._http = None

    def __del__(self):
        try:
            self.close()
        except Exception:
            pass
