"""Membership: who is in the job, what they agreed on, and who went missing.

HELLO binds a connection to a worker rank and checks it against the job
(node index, optimizer, mode, world size, layout hash; a new layout is
accepted only as an extension of the known buckets, what ``add_param_group``
sends); INIT seeds a bucket's weights (the first seed wins). A worker that is
not resuming (HELLO without ``resume``) is refused when the node holds the job
at a step past 0 and no worker of it is live: it would silently train on from
another run's weights and moments. BYE frees a rank at once (a clean close); a
crashed worker's rank frees after ``worker_timeout_s`` of silence. The watchdog
says which ranks the node still waits for and, past ``worker_timeout_s``, fails
the step naming them (strict) or drops them and goes on (elastic).
"""

from __future__ import annotations

import logging
import os
import time

from luwu.protocol import messages as wire
from luwu.protocol.codecs import get_codec
from luwu.protocol.errors import (
    ConfigError,
    JobExistsError,
    LayoutMismatchError,
    ProtocolError,
    WorkerLostError,
)
from luwu.protocol.layout import Bucket
from luwu.protocol.messages import Op
from luwu.switch_nodes.context import NodeContext
from luwu.switch_nodes.effects import Answer, Drop, Effect, Recheck, Release, Seeded, Tell
from luwu.switch_nodes.optimizers import OptimizerKind, get_kind
from luwu.switch_nodes.shard import Shard

log = logging.getLogger(__name__)

#: A start-up wait for ranks that have not connected yet is normal this long (the other processes are still
#: importing torch and building their model): said at INFO, and at WARNING once it lasts longer.
WAIT_GRACE_S = 10.0


def _ids(buckets) -> str:
    ids = sorted(buckets)
    return f"{ids[:8]}{' ...' if len(ids) > 8 else ''} ({len(ids)})"


def ranks_text(ranks: list[int], limit: int = 12) -> str:
    """Sorted ranks, three or more in a row as a run (``0-3, 7, 9, 10, 12-4095``), at most ``limit`` runs:
    a log line stays short."""
    runs: list[list[int]] = []
    for r in ranks:
        if runs and r == runs[-1][1] + 1:
            runs[-1][1] = r
        else:
            runs.append([r, r])
    text = ", ".join(
        f"{a}-{b}" if b > a + 1 else ", ".join(map(str, range(a, b + 1))) for a, b in runs[:limit]
    )
    return f"[{text}{f', ... ({len(ranks)} ranks)' if len(runs) > limit else ''}]"


def physical_memory() -> int:
    """Bytes of physical memory of this machine (a shard never gets more)."""
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError):
        return 1 << 62


class Membership:
    """Who is in the job (the context's peers and members) and what they agreed on; the watchdog."""

    def __init__(self, ctx: NodeContext, shard: Shard) -> None:
        self.ctx, self.shard = ctx, shard
        self._last_said = 0.0  # when the watchdog last named the ranks waited for
        self._lost_reported: set[tuple[int, int]] = set()
        self._not_reading: set[int] = (
            set()
        )  # ranks named for leaving their replies unread (until they say HELLO again)
        self._waiting_since: float | None = (
            None  # when the node began to wait for ranks (start-up, a step), for the log
        )
        self._left: set[int] = set()  # ranks that said BYE (until they say HELLO again)

    # ----------------------------------------------------------------- HELLO
    def on_hello(self, ident: bytes, msg: wire.Message) -> list[Effect]:
        h, ctx = msg.header, self.ctx
        w = h["worker"]
        if h["world_size"] < 1 or w >= h["world_size"]:
            raise ProtocolError(f"worker rank {w} is outside world size {h['world_size']}")
        if h["world_size"] > ctx.cfg.max_world_size:  # before anything is sized by it
            raise ConfigError(
                f"HELLO of worker {w} names world size {h['world_size']}, over this node's node.max_world_size = {ctx.cfg.max_world_size}"
            )
        if ctx.index >= 0 and h["node_index"] != ctx.index:
            raise LayoutMismatchError(
                f"this is node {ctx.index}, worker {w} addressed it as node {h['node_index']}"
            )
        kind = get_kind(h["optimizer"])
        if h["mode"] != ctx.cfg.mode:
            raise ConfigError(
                f"worker {w} runs mode {h['mode']!r}, this node runs {ctx.cfg.mode!r}"
            )
        buckets = [Bucket.from_wire(s) for s in h["buckets"]]
        names = h.get("param_names", {})
        if not all(
            type(k) is int and isinstance(v, str) and len(v) < 1024 for k, v in names.items()
        ):
            raise ProtocolError(
                "param_names must map parameter indices (ints) to names (short strings)"
            )
        self._check_key(ident, w)
        bound = ctx.peers.get(w)
        self._check_rank_free(ident, w, bound)
        if bound != ident and not h.get("resume", False):
            self._check_fresh(w)
        self._check_capacity(w, kind, buckets)
        ctx.inflight.check(w, buckets, h["world_size"])  # a bucket's pushes fit push_memory_bytes
        if ctx.layout_hash is not None and h["layout"] != ctx.layout_hash and bound != ident:
            raise LayoutMismatchError(
                f"layout hash mismatch: worker {w} has layout {h['layout']}, the job has {ctx.layout_hash} (only a connected "
                "worker can extend the layout with add_param_group)"
            )
        if ctx.layout_hash is None:
            ctx.index, ctx.world_size, ctx.kind = h["node_index"], h["world_size"], kind
        else:
            self._check_same_job(h, kind, buckets)
        return self._admit(ident, h, kind, buckets, names)

    def _check_rank_free(self, ident: bytes, w: int, bound: bytes | None) -> None:
        """A rank is one connection: another peer claiming a live rank is refused. A worker that closed said
        BYE and freed it; a crashed one's rank frees once its connection has been silent for worker_timeout_s."""
        ctx = self.ctx
        if bound is None or bound == ident:
            return
        if bound in ctx.relays and not ctx.connected(w):
            log.warning(  # (its workers fall back to the nodes: gpu_workers.fallback)
                "node %s: worker rank %d comes back directly, its aggregator's connection closed",
                ctx.index,
                w,
            )
            return
        ago, timeout = time.monotonic() - ctx.last_seen.get(w, 0.0), ctx.cfg.worker_timeout_s
        if ago < timeout:
            raise ProtocolError(
                f"worker rank {w} is held by a live connection (heard from {ago:.1f} s ago): it frees in {timeout - ago:.1f} s "
                f"(node.worker_timeout_s = {timeout:g}) if that worker is gone, at once if it closes (opt.close() says BYE)"
            )

    def live_ranks(self, but: int | None = None) -> list[int]:
        """Ranks (other than ``but``) whose connection is open and was heard from within worker_timeout_s: a
        job with one of them is being trained right now."""
        ctx, now = self.ctx, time.monotonic()
        return sorted(
            r
            for r in ctx.peers
            if r != but
            and now - ctx.last_seen.get(r, 0.0) < ctx.cfg.worker_timeout_s
            and ctx.connected(r)
        )

    def _check_fresh(self, w: int) -> None:
        """A worker that did not ask to resume, arriving while nobody trains the job: refused when this node holds
        the job at a step past 0 (restored from a checkpoint, or left by an earlier run), before anything
        changes; at step 0 it is a fresh start. Every worker of the new run gets the same answer."""
        ctx = self.ctx
        step = self.shard.step
        if step == 0 or self.live_ranks(but=w):
            return
        how = (
            "restored from its checkpoint"
            if ctx.restored_step == step
            else "left by an earlier run"
        )
        ckpt = (
            f" whose node.checkpoint_dir holds no checkpoint of it (this node's, {ctx.cfg.checkpoint_dir}, does)"
            if ctx.ckpt
            else ""
        )
        raise JobExistsError(
            f"job {ctx.job!r}: node {ctx.index} holds its weights and optimizer state at step {step} ({how}) and no worker "
            f"is training it; worker {w} did not ask to resume. Continue from step {step}: RemoteOptimizer(..., resume=True) "
            f"(or optimizer.resume = true). Or start a fresh job: new nodes (`luwu down && luwu up`, a new local_cluster){ckpt}, "
            "or another job= name (cluster.job) served by nodes of its own",
            worker=w,
            step=step,
        )

    def _check_key(self, ident: bytes, w: int) -> None:
        """With CURVE and node.curve_keys_by_rank, rank w may only say HELLO with the w-th authorized key
        (the order `luwu keys` writes: the workers by rank, then the monitor's, which never says HELLO)."""
        cfg = self.ctx.cfg
        if not cfg.curve_secret_key or not cfg.curve_keys_by_rank:
            return
        key, keys = self.ctx.peer_key(ident), cfg.curve_authorized_keys
        if w < len(keys) and key == keys[w]:
            return
        if key in cfg.aggregator_ranks:  # relaying its group: PeerRoles.check_hello bound it to w
            return
        owner = keys.index(key) if key in keys else None
        raise ProtocolError(
            f"HELLO as worker rank {w} with a key that is not rank {w}'s: it is authorized "
            + (f"as rank {owner}" if owner is not None else "for no rank")
            + " (node.curve_keys_by_rank: the i-th authorized key is rank i's)"
        )

    def _check_capacity(self, w: int, kind: OptimizerKind, buckets: list[Bucket]) -> None:
        held = sum(b.numel for b in self.shard.buckets.values())
        new = sum(b.numel for b in buckets if b.id not in self.shard.buckets)
        nbytes = (held + new) * 4 * (1 + len(kind.state_for({})))  # the state every step keeps
        cap = min(self.ctx.cfg.max_shard_bytes, physical_memory())
        if nbytes > cap:
            raise ConfigError(
                f"HELLO of worker {w} would make this node hold {nbytes / 2**30:.1f} GiB, over {cap / 2**30:.1f} GiB "
                "(node.max_shard_bytes, at most this machine's physical memory)"
            )

    def _check_same_job(self, h: dict, kind: OptimizerKind, buckets: list[Bucket]) -> None:
        """A worker joining a running job: same world size and optimizer, and a layout that is the job's
        or extends it (add_param_group: every known bucket unchanged)."""
        ctx, w = self.ctx, h["worker"]
        if h["world_size"] != ctx.world_size:
            raise LayoutMismatchError(
                f"worker {w} says world size {h['world_size']}, the job has {ctx.world_size}"
            )
        if kind is not ctx.kind:
            raise LayoutMismatchError(
                f"worker {w} uses optimizer {kind.name!r}, the job uses {ctx.kind.name!r}"
            )
        new = {b.id: b.to_wire() for b in buckets}
        if h["layout"] == ctx.layout_hash and new.keys() != self.shard.buckets.keys():
            # the job's layout names exactly the job's buckets: a HELLO with its hash and other bucket ids would
            # make the node allocate what a stranger names
            raise LayoutMismatchError(
                f"worker {w} says layout {h['layout']} (the job's) with buckets {_ids(new)}, the job's are {_ids(self.shard.buckets)}: "
                f"nothing allocated"
            )
        for b in self.shard.buckets.values():
            if new.get(b.id) != b.to_wire():
                raise LayoutMismatchError(
                    f"layout hash mismatch: worker {w} has layout {h['layout']}, the job has {ctx.layout_hash} "
                    f"(bucket {b.id} differs: a different model or bucket_bytes)"
                )

    def _admit(
        self, ident: bytes, h: dict, kind: OptimizerKind, buckets: list[Bucket], names: dict
    ) -> list[Effect]:
        ctx, w = self.ctx, h["worker"]
        for spec in buckets:
            if spec.id not in self.shard.buckets:
                self.shard.add(spec, kind, h["step"])  # a group added mid-training: the job's step
        ctx.param_names.update(names)
        ctx.layout_hash = h["layout"]
        ctx.peers[w] = ident
        relay = bool(h.get("relay"))
        if relay:  # an aggregator's connection: its ranks' replies go to it once
            ctx.relays.add(ident)
        if not ctx.members:
            ctx.members = set(range(ctx.world_size))
        ctx.members.add(w)
        self._not_reading.discard(w)
        self._left.discard(w)
        ctx.last_seen[w] = time.monotonic()
        ctx.metrics.workers.set(len(ctx.peers))
        versions = {b.id: b.version for b in self.shard.buckets.values()}
        initialized = [b.id for b in self.shard.buckets.values() if b.initialized]
        fields = {"layout": ctx.layout_hash, "versions": versions, "initialized": initialized}
        if ctx.inflight.limit:
            fields["in_order"] = True  # the same push order on every worker: see gpu_workers.client
        if relay:  # an aggregator sends a block up as it is before this deadline names its ranks
            fields["wait_s"] = ctx.cfg.worker_timeout_s
        # a new connection: nothing held for the old one goes to it
        return [Drop(w), Answer(ident, Op.WELCOME, w, fields)]

    # ----------------------------------------------------------------- INIT, HEARTBEAT, rank checks
    def on_init(self, ident: bytes, msg: wire.Message) -> list[Effect]:
        h = msg.header
        b = self.shard.bucket(h["bucket"])
        if b.initialized:
            return []  # idempotent: the first seed wins (a restarted rank 0 must not reset the weights)
        codec = get_codec(h["codec"])
        codec.validate(b.numel, h["nbytes"], h["cmeta"])
        # (out of core: a slot never read, zeros; its write-back goes on behind)
        with self.shard.loaded(b.id, write=True):
            codec.decode_(b.params, msg.tensors(), h["cmeta"])
        b.initialized = True
        return [Seeded(b)]

    def on_bye(self, ident: bytes, msg: wire.Message) -> list[Effect]:
        """A worker leaves (its connection said HELLO as this rank: :meth:`check_worker` saw to it): the rank is
        free at once for another run or a restarted worker. In elastic mode the others go on without it; in
        strict mode the steps keep waiting for the rank (a worker that resumes takes its place)."""
        ctx, w = self.ctx, msg.header["worker"]
        del ctx.peers[w]
        ctx.last_seen.pop(w, None)
        self._not_reading.discard(w)
        self._left.add(w)
        ctx.metrics.workers.set(len(ctx.peers))
        log.info(
            "node %s: worker %d left the job at step %d (BYE); %d workers connected",
            ctx.index,
            w,
            self.shard.step,
            len(ctx.peers),
        )
        out = [Drop(w), Answer(ident, Op.BYE, w)]
        if ctx.cfg.worker_policy == "elastic" and ctx.members - {w}:
            ctx.members.discard(w)
            out.append(Recheck())
        return out

    def on_heartbeat(self, ident: bytes, msg: wire.Message) -> list[Effect]:
        w = msg.header["worker"]
        self.ctx.last_seen[w] = self.ctx.clock()
        out: list[Effect] = []
        if "seq" in msg.header and self.ctx.peers.get(w) == ident:
            out.append(Release(w, msg.header["seq"]))  # it reached step() of seq (hold_replies)
        out.append(Answer(ident, Op.HEARTBEAT, w))
        return out

    def check_worker(self, ident: bytes, h: dict) -> None:
        """The sender of a ranked op is the connection that said HELLO as that rank, and still a member."""
        ctx, w = self.ctx, h["worker"]
        if ctx.world_size is None or w >= ctx.world_size:
            raise ProtocolError(f"worker rank {w} is outside world size {ctx.world_size}")
        if ctx.peers.get(w) != ident:
            raise ProtocolError(
                f"worker {w}: message from a peer that did not say HELLO as this rank"
            )
        if w not in ctx.members and h["op"] == Op.PUSH:
            raise WorkerLostError(
                f"worker {w} was dropped from the job after {ctx.cfg.worker_timeout_s:.0f} s without pushes (elastic mode): call optimizer.recover() to rejoin"
            )
        ctx.last_seen[w] = time.monotonic()

    # ----------------------------------------------------------------- watchdog
    @property
    def watch_every_s(self) -> float:
        """How often the server calls :meth:`watch`."""
        return min(1.0, self.ctx.cfg.worker_timeout_s / 4)

    def watch(self) -> list[Effect]:
        """The watchdog's round: missing workers fail the step naming them (strict) or are dropped
        and the others go on (elastic)."""
        ctx = self.ctx
        now = time.monotonic()
        if ctx.world_size and self._say_waiting(now, due=now - self._last_said >= 5.0):
            self._last_said = now
        if ctx.ckpt is not None and ctx.ckpt.last_time is not None:
            ctx.metrics.checkpoint_age.set(time.time() - ctx.ckpt.last_time)
        out: list[Effect] = []
        timeout_s = ctx.cfg.worker_timeout_s
        for b in list(self.shard.buckets.values()):
            for step, acc in list(b.accs.items()):
                missing = ctx.members - acc.workers
                if not missing or not acc.workers or now - acc.first_at < timeout_s:
                    continue
                if ctx.cfg.worker_policy == "elastic":
                    out += self._drop(missing, step, b.id)
                elif (step, b.id) not in self._lost_reported:
                    self._lost_reported.add((step, b.id))
                    text = (
                        f"workers {sorted(missing)} sent nothing for step {step}, bucket {b.id} "
                        f"within {timeout_s:.0f} s (strict mode)"
                    )
                    out += [Tell(w, WorkerLostError.code, text, step, b.id) for w in acc.workers]
        return out

    def _say_waiting(self, now: float, due: bool) -> bool:
        """Start-up without silent hangs: when ``due``, log which ranks the connected workers wait for (True if
        said). A wait shorter than WAIT_GRACE_S is the normal start of a job (INFO); a longer one is a WARNING.
        With no worker connected nobody waits; a rank that left (BYE) is not waited for unless a step needs it."""
        ctx = self.ctx
        absent = sorted(set(range(ctx.world_size)) - set(ctx.peers) - self._left)
        absent += [r for r in ctx.peers if ctx.peers[r] in ctx.relays and not ctx.connected(r)]
        absent.sort()  # (an aggregator's ranks count as gone once its connection closed)
        waiting = sorted(
            {
                w
                for b in self.shard.buckets.values()
                for acc in b.accs.values()
                if now - acc.first_at > 5.0
                for w in ctx.members - acc.workers
            }
        )
        if not ctx.peers or not (absent or waiting):
            self._waiting_since = None
            return False
        if self._waiting_since is None:
            self._waiting_since = now
        if not due:
            return False
        level = logging.WARNING if now - self._waiting_since >= WAIT_GRACE_S else logging.INFO
        log.log(
            level,
            "node %s at %s: waiting for worker ranks %s (not connected: %s)",
            ctx.index,
            ctx.address,
            ranks_text(waiting or absent),
            ranks_text(absent),
        )
        return True

    def not_reading(self, ranks: set[int]) -> list[Effect]:
        """Workers that leave their replies unread are lost: named in the log once; strict mode tells the
        others (their step fails with WorkerLostError naming them), elastic mode drops them."""
        ctx = self.ctx
        new = (ranks & ctx.members) - self._not_reading
        if not new:
            return []
        self._not_reading |= new
        who = ", ".join(f"worker {w}" for w in sorted(new))
        ctx.metrics.errors.labels("not_reading").inc(len(new))
        stuck_s = ctx.cfg.worker_timeout_s / 4
        log.error(
            "node %s: %s left its replies unread for %.0f s: %s",
            ctx.index,
            who,
            stuck_s,
            "dropped (elastic)" if ctx.cfg.worker_policy == "elastic" else "lost (strict mode)",
        )
        if ctx.cfg.worker_policy == "elastic":
            return self._drop(new, self.shard.step, -1)
        text = (
            f"{who} stopped reading the node's replies (nothing taken for {stuck_s:.0f} s): lost "
            "(strict mode)"
        )
        step = self.shard.step
        return [Tell(w, WorkerLostError.code, text, step, -1) for w in ctx.members - new]

    def _drop(self, missing: set[int], step: int, bid: int) -> list[Effect]:
        """Elastic mode: the missing ranks leave the job; the steps waiting only for them go on."""
        ctx = self.ctx
        ctx.members -= missing
        out: list[Effect] = [Drop(w) for w in missing]
        ctx.metrics.dropped_workers.inc(len(missing))
        log.warning(
            "node %s: dropped workers %s from step %d (elastic)", ctx.index, sorted(missing), step
        )
        text = f"dropped from step {step} after {ctx.cfg.worker_timeout_s:.0f} s without a push (elastic mode): call optimizer.recover() to rejoin"
        # a stalled worker learns it when it wakes up
        # (``dropped`` tells an aggregator in front of it to stop waiting for it)
        told = {"dropped": True}
        out += [
            Tell(w, WorkerLostError.code, f"worker {w} {text}", step, bid, told) for w in missing
        ]
        return [*out, Recheck()]
