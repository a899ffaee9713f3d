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
returns its :class:`~luwu.gpu_workers.metrics.StepReport` (``last_report``),
from which the metrics are recorded.
"""

from __future__ import annotations

import contextlib
import logging
import os
import warnings

import torch

from luwu import assembly, clipping, model_io, optim_state, resumed
from luwu import hyper as hyperparameters
from luwu.clipping import RoundPolicy
from luwu.config import LuwuConfig, resolve_config
from luwu.gpu_workers import precision, streaming
from luwu.gpu_workers.client import WorkerClient
from luwu.gpu_workers.config import TransportConfig
from luwu.gpu_workers.links import LinkSpeeds
from luwu.gpu_workers.metrics import StepReport, WorkerMetrics
from luwu.gpu_workers.streamer import Streamer
from luwu.groups import worker_route
from luwu.protocol.errors import ConfigError, LuwuError, RollbackError
from luwu.protocol.layout import ParamSpec
from luwu.protocol.memory import trim_heap
from luwu.protocol.metrics import serve_metrics
from luwu.stepping import StepDriver
from luwu.switch_nodes.optimizers import get_kind

log = logging.getLogger(__name__)

# GradScaler hands itself to optimizers that take a ``grad_scaler`` argument and warns that this will
# change; LuWu needs the scaler to make the overflow decision global, so the warning is expected.
warnings.filterwarnings(
    "ignore", message="GradScaler is going to stop passing itself", category=FutureWarning
)


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
        rank: this worker's rank; default torchrun's ``RANK``.
        world_size: the number of workers (``cluster.world_size``); default torchrun's ``WORLD_SIZE``.
        job: ``cluster.job``, the job id the nodes serve.
        aggregator: ``cluster.aggregator``, the address of this worker's aggregator (``luwu aggregator``,
            the switch tier: it sums its group's pushes before the nodes); None: the nodes directly.
        capacities: ``cluster.capacities``, relative node capacities for the layout.
        mode: ``node.mode``, the nodes' aggregation mode (``sync`` or ``async``).
        delayed_update: ZeRO-Offload's DPU: ``step()`` returns at once, the weights land at the next step.
        delayed_update_warmup: with ``delayed_update``, the steps (from 0) run in sync before the delay
            starts (ZeRO-Offload's DPU warm-up).
        delayed_params: with ``delayed_update``, delay only the parameters whose names match one of these
            fnmatch patterns (a list, or a comma-separated string; None: all); the rest stays sync.
        max_grad_norm: clip by the global norm of the averaged gradient across all shards, every step (or call
            :meth:`clip_grad_norm_` after ``backward()``, as with FSDP).
        layer_waits: ``optimizer.layer_waits`` (on by default): ``step()`` returns once the pushes are out and, in
            the next forward, each module waits for its parameters' new weights when it runs (forward pre-hooks on
            the model's modules, graph breaks under ``torch.compile``; :mod:`luwu.gpu_workers.layer_waits`). Needs
            the model (``params`` a module): with tensors alone ``step()`` waits for every reply. Read the
            parameters outside a forward (an EMA, a copy) after :meth:`synchronize`.
        amp: True, or the ``torch.amp.GradScaler`` itself, when one drives this optimizer (the overflow decision is
            global); the scaler itself lets :meth:`clip_grad_norm_` unscale the norm.
        transport: the ``transport`` section (a ``TransportConfig``).
        bucket_bytes: ``transport.bucket_bytes``.
        timeout_s: ``transport.timeout_s``.
        compression: the hybrid codec policy (``compression`` section, on by default): a
            ``CompressionConfig``, or False for bit-exact fp32 both ways (True: the configured policy, on).
        registry: the Prometheus registry of the worker metrics (default: a new one).
        metrics_port: serve ``/metrics`` on this port (0: any free one; None: not served). ``metrics.port`` is
            the nodes' (``luwu up`` gives node i port + i), so a worker serves its endpoint only when asked here.
        metrics_host: the host it is served on (``metrics.host``).
        stream_weights: streaming mode (``optimizer.stream_weights``, :mod:`luwu.gpu_workers.streaming`): no
            weights of the units held between uses, each fetched before use.
        stream_units: which modules are units (class names or name patterns; default: the largest
            ModuleList's blocks).
        prefetch: units fetched ahead (``optimizer.stream_prefetch``).
        init_weights: a ``torch.save`` state dict (mmap) or DCP folder to start the units from.
        model: the module the units are found in when ``params`` are param groups or tensors of it (weight
            decay on matrices only, as GPT training does); else ``params`` is the model.
        resume: ``optimizer.resume``: continue from the step the nodes hold, their weights and optimizer state (rewind the data to
            ``worker.step_num``). Without it, nodes holding the job past step 0 with nobody training it refuse (JobExistsError).
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
        aggregator: str | None = None,
        mode: str | None = None,
        delayed_update: bool | None = None,
        delayed_update_warmup: int | None = None,
        delayed_params=None,
        max_grad_norm: float | None = None,
        layer_waits: bool | None = None,
        amp=False,
        transport: TransportConfig | None = None,
        compression=None,
        bucket_bytes: int | None = None,
        timeout_s: float | None = None,
        capacities=None,
        registry=None,
        metrics_port: int | None = None,
        metrics_host: str | None = None,
        stream_weights: bool | None = None,
        stream_units=None,
        prefetch: int | None = None,
        init_weights: str | None = None,
        model=None,
        resume: bool | None = None,
        **hyper,
    ):
        if optimizer is not None:
            get_kind(optimizer)  # torch's algorithms a node cannot run are refused with the reason
        cfg = resolve_config(
            config,
            optimizer=optimizer,
            nodes=nodes,
            capacities=capacities,
            world_size=world_size,
            job=job,
            aggregator=aggregator,
            mode=mode,
            delayed_update=delayed_update,
            delayed_update_warmup=delayed_update_warmup,
            delayed_params=delayed_params,
            max_grad_norm=max_grad_norm,
            layer_waits=layer_waits,
            bucket_bytes=bucket_bytes,
            timeout_s=timeout_s,
            metrics_host=metrics_host,
            transport=transport,
            compression=compression,
            stream_weights=stream_weights,
            prefetch=prefetch,
            stream_units=streaming.patterns_of(stream_units),
            init_weights=init_weights,
            resume=resume,
        )
        self.config = cfg
        self._units, self._unit_of = streaming.plan_units(
            params if model is None else model, stream_units, cfg.optimizer, model is not None
        )
        kind = get_kind(cfg.optimizer.name)
        defaults = hyperparameters.defaults_of(kind, hyper, RemoteOptimizer.__init__)
        params, self._names, self._model = assembly.named_params(params, model)
        self.kind = kind  # before torch's constructor: add_param_group validates each group with it
        super().__init__(params, defaults)
        self._join(rank, amp, registry, metrics_port)

    def _join(self, rank: int | None, amp, registry, metrics_port: int | None) -> None:
        """Who this worker is, its metrics (served when ``metrics_port`` is given), and the start:
        connected to the nodes, in the job."""
        cfg = self.config
        self.rank = int(os.environ.get("RANK", 0)) if rank is None else rank
        self.world_size = cfg.cluster.world_size or int(os.environ.get("WORLD_SIZE", 1))
        if not 0 <= self.rank < self.world_size:
            raise ConfigError(f"rank {self.rank} is outside world_size {self.world_size}")
        self.nodes, self.job, self.amp = list(cfg.cluster.nodes), cfg.cluster.job, amp
        self._round_policy = RoundPolicy(
            max_grad_norm=self.max_grad_norm,
            amp=amp,
            mode=cfg.node.mode,
            resume=cfg.optimizer.resume,
        )
        # a pattern that matches no parameter fails here, before any thread or socket
        self._flat_params()
        self._sync_grads = True
        self._hooks: list = []
        self.metrics = WorkerMetrics(registry, rank=self.rank)
        self.metrics_url = None
        self._http = None
        if metrics_port is not None:
            self._http, port = serve_metrics(self.metrics.registry, cfg.metrics.host, metrics_port)
            self.metrics_url = f"http://{cfg.metrics.host}:{port}"
        self.last_report: StepReport | None = None
        self._last_error: LuwuError | None = None
        self._start()

    def _start(self) -> None:
        """Connect to the nodes and join the job. A refused start holds no rank there: BYE to the nodes that
        welcomed this worker before another refused it."""
        via, key = worker_route(self.config, self.rank)  # the switch tier: nodes through it
        kw = {"job": self.job, "rank": self.rank, "cfg": self.config.transport}
        self.client = WorkerClient(self.nodes, **kw, via=via, via_key=key)
        try:
            self._build()
        except BaseException:
            self.close()
            raise

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
        """Every parameter in order and its spec (:func:`luwu.assembly.flat_params`)."""
        return assembly.flat_params(
            self.param_groups,
            self._names,
            self._unit_of,
            self.kind,
            self.config.optimizer.delayed_params,
        )

    def _build(self, step: int = 0) -> None:
        params, specs = self._flat_params()
        streamed = self._units is not None
        precision.check_dtypes(params, lambda p: self._names.get(id(p), "?"), streaming=streamed)
        self.layout = assembly.layout_of(specs, self.config, self.capacities)
        self._retire_worker()  # (a rebuild: the last worker's hooks off first)
        self._links = LinkSpeeds(
            self.client,
            self.config.compression,
            self.layout,
            self.metrics,
            rank=self.rank,
            before=getattr(self, "_links", None),
        )  # each node link's codecs
        self.worker = assembly.build_worker(
            params,
            self.layout,
            self.client,
            self._links,
            self.config,
            kind=self.kind,
            rank=self.rank,
            world_size=self.world_size,
            hyper_of=self._hyper_of,
            metrics=self.metrics,
            model=self._model,
            units=self._units,
        )
        welcomes = self.worker.connect(step, resume=self.config.optimizer.resume)
        if self.config.optimizer.resume and step == 0:
            resumed.refuse_mixed_steps(welcomes, self.rank, self.job)
        self._links.start(self.worker.step_num)
        trim_heap()  # the start-up pull's replies, freed: not kept for reuse as a step's
        self._driver = StepDriver(
            self.worker, self._links, self.metrics, self.config, self._round_policy, step
        )
        self._hooks = [
            p.register_post_accumulate_grad_hook(self._make_hook(i)) for i, p in enumerate(params)
        ]

    @property
    def _hold_replies(self) -> bool:
        """Whether the nodes hold this worker's replies until it reaches ``step()``."""
        return self._driver.hold_replies

    @property
    def streamer(self) -> Streamer | None:
        """Streaming mode's units (None in resident mode)."""
        worker = getattr(self, "worker", None)
        return worker.streamer if worker is not None else None

    def _retire_worker(self) -> None:
        """Take the worker's hooks off the model: its streamer's, its per-layer waits' (writing the
        replies the last step still owes; a dead node: given up after a few seconds, named) and
        the gradient hooks."""
        streaming.stop(self.streamer)
        waits = self.worker.defer if getattr(self, "worker", None) is not None else None
        if waits is not None:
            waits.close(timeout_s=min(5.0, self.config.transport.timeout_s))
        for h in getattr(self, "_hooks", ()):
            h.remove()
        self._hooks = []

    def _make_hook(self, index: int):
        def hook(p: torch.Tensor) -> None:
            if (self._sync_grads or self.worker.accumulating) and p.grad is not None:
                self.worker.grad_ready(index, p.grad)

        return hook

    def _hyper_of(self, group: int) -> dict:
        return hyperparameters.of_group(self.kind, self.param_groups[group])

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
        gi = len(self.param_groups) - 1
        try:  # as torch's constructors do: a bad value fails here, not at the first push to a node
            assembly.check_group(
                self.kind, self.param_groups[gi], self._hyper_of(gi), self.config, gi
            )
        except ConfigError:
            self.param_groups.pop()
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
        sd["state"] = optim_state.to_torch(
            self.kind,
            self.layout,
            self._flat_params()[0],
            self.param_groups,
            optim_state.fetch(self.worker),
        )
        return sd

    def load_state_dict(self, state_dict: dict) -> None:
        """Load a ``torch.optim`` state dict (from RemoteOptimizer or a local optimizer) and scatter it to the
        nodes, with this worker's current parameters as the master weights; any node count works."""
        self.synchronize()
        super().load_state_dict(state_dict)
        params = self._flat_params()[0]
        # streaming mode: the weights are the master weights too
        with streaming.gathered(self.streamer):
            flats = optim_state.from_torch(self.kind, self.layout, params, self.state)
        self.state.clear()
        optim_state.store(self.worker, flats, self._state_names())

    def model_state_dict(self) -> dict[str, torch.Tensor]:
        """Copies of the current weights (streaming mode: fetched), for models that fit: with the model known
        (``params`` a module, or ``model=``) exactly ``model.state_dict()``'s keys, buffers and every name of a
        tied parameter included, so ``model.load_state_dict(opt.model_state_dict())`` works; else by
        parameter name."""
        self.synchronize()
        with streaming.gathered(self.streamer):
            params, specs = self._flat_params()
            if self._model is None:
                return {s.name: p.detach().clone() for p, s in zip(params, specs)}
            return model_io.state_dict_copy(self._model)

    # ----------------------------------------------------------------- step
    def recover(self) -> int:
        """Rejoin the cluster after a ``RollbackError`` (a node restarted from its checkpoint: every node
        rolls back to that step and this worker takes its weights) or a ``WorkerLostError`` (dropped in
        elastic mode: take the current weights). Returns the step to resume from: rewind the data to it
        (e.g. ``Prefetcher.load_state_dict``, or a sampler indexed by step)."""
        # (streaming mode also waits in forward and backward)
        err = self._last_error or self.worker.last_error
        if isinstance(err, RollbackError):
            boot = (getattr(err, "detail", None) or {}).get("boot", "")
            step = self.worker.recover(err.step, boot)
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
        inv_scale = clipping.inv_scale_of(grad_scaler, self.amp)
        report = self._driver.step(
            inv_scale, self.max_grad_norm, getattr(self, "_prefetcher", None)
        )
        clipping.tell_scaler(grad_scaler, self, report.skipped)
        self.last_report = report
        return loss

    def clip_grad_norm_(
        self,
        max_norm: float,
        norm_type: float = 2.0,
        error_if_nonfinite: bool = False,
        foreach=None,
    ) -> torch.Tensor:
        """Clip the averaged gradient by its global norm on the nodes, as ``torch.nn.utils.clip_grad_norm_``
        does locally (FSDP's ``model.clip_grad_norm_``): call it after ``backward()`` and before ``step()``.
        Returns the total 2-norm of the averaged gradient (unscaled with ``amp=scaler``), the same on every
        worker. ``torch.nn.utils.clip_grad_norm_`` cannot work here: the gradients left for the nodes during
        backward, and changing them afterwards is refused at ``step()``.

        Call it from the first step on (every step, or with ``max_norm=float("inf")`` on steps that should not
        clip): the first step's gradients wait for it on the nodes, and once it is called every step does.
        ``foreach`` is accepted for torch's signature and ignored."""
        step = self.worker.step_num
        inv_scale = self._round_policy.inv_scale_for_clip(
            step, self.worker.two_phase, max_norm, norm_type
        )
        try:
            nonfinite, norm = self.worker.clip_round(inv_scale, float(max_norm))
        except LuwuError as exc:
            self._last_error = exc
            raise
        if nonfinite and error_if_nonfinite:
            raise clipping.nonfinite_norm_error(step)
        return torch.tensor(norm, dtype=torch.float32)

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

    def close(self) -> None:
        """Stop, and say BYE to the nodes: this rank is free there at once (a script that never
        closes is closed at exit)."""
        self._retire_worker()
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
