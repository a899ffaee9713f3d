"""The pushes in flight, within ``node.push_memory_bytes``: backpressure, never a refusal.

What a node holds for its pushes besides its state is counted here, in one place:

- an **open (step, bucket)**, from the push that opens it until its step is applied: its fp32
  partial sums (:func:`.summation.partial_sums`: one for two workers), room for every member's
  push (undecoded until its left neighbours are in, read whole first) and its reply, encoded before
  the sum is given back: a :class:`Ticket` of ``4 B x numel x partial sums + members x payload +
  reply`` (async mode: one push, one ticket);
- **replies** not yet sent (or held for a worker's ``step()``), counted until their last byte is in
  the kernel; frames a resident shard lends a reply (fp32 zero-copy) cost nothing;
- buffers kept for reuse (accumulators, received frames: :mod:`.kept_frames`), in the room left.

The gate is the listener (:mod:`.zmtp`): when the header of a message with a payload has been read,
it asks :meth:`PushBudget.gate`. A PUSH that would open a (step, bucket) and does not fit is left
unread: its connection is paused (TCP pushes back on the worker; the payload is never allocated,
nothing is refused or lost) and read on, in arrival order, as memory is released. Every other
message goes on, a push to an open (step, bucket) included.

**No stall.** A step of a bucket needs every member's push of it, so backpressure must never keep
out for good a push that an open (step, bucket) waits for:

1. only a push that opens a (step, bucket) waits; one to an open (step, bucket) is always read and
   summed (into the (step, bucket)'s partial sums), its room reserved by the opener;
2. with nothing in flight, an opener is let in whatever its size, and a HELLO whose largest bucket
   needs more than the budget ((1 + partial sums + world size) x 4 B a parameter) is refused;
3. what is in flight is released without any further push: open (step, bucket)s whose pushes are
   all in are stepped by the optimizer thread; replies go out whatever the workers do (their ZeroMQ
   I/O threads read), and replies held for a worker's ``step()`` are sent at once while a push waits
   (the worker's word that releases them may be behind the waiting push). When the workers push a
   step's buckets in the same order, the worker that waits is the one ahead, the others' pushes
   join, and the budget is kept;
4. a two-phase step (global-norm clipping, AMP, and every worker's first step) keeps all its
   buckets' accumulators until the workers' COMMIT, which needs every bucket's norm. Where the node
   spills (out of core: :mod:`.ooc.spill`), a sum whose norm is computed goes to a scratch file while
   a push waits (rule 3 holds), and is read back at COMMIT while the budget has room (or, the one the
   optimizer needs next, after a short wait). Elsewhere its pushes are never held back: the peak shows it;
5. workers may push in different orders (a worker's I/O thread sends what waits first layers
   first, so a worker whose pushes waited sends them in another order than one whose did not): an
   open (step, bucket) may then wait for a worker's push that is behind the push that waits in that
   worker's connection. When nothing can be released without another push (the optimizer thread
   idle, no reply on its way, no message read and not served) and every worker an open (step,
   bucket) waits for is waiting here, or nothing was released for ``IDLE_S``, one waiting push (of a
   worker an open (step, bucket) waits for first) goes in past the budget, counted and logged once.
   The budget is then exceeded by what the workers' orders force the node to read, and nothing else.

Every wait ends: released memory wakes the waiting connections in order, or rule 5 does.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

import msgpack
import zmq

from luwu.protocol.messages import Op
from luwu.switch_nodes.budget_memory import too_small
from luwu.switch_nodes.fetch_room import FetchRoom
from luwu.switch_nodes.summation import partial_sums

if TYPE_CHECKING:
    from luwu.switch_nodes.context import NodeContext
    from luwu.switch_nodes.store import BucketState

__all__ = ["FREE", "IDLE_S", "PushBudget", "Ticket"]

log = logging.getLogger(__name__)

IDLE_S = 2.0
"""Seconds nothing is released (nor can be) before a waiting push goes in anyway (rule 5's second case)."""
TICK_S = 0.02
"""How often replies on their way are looked at while any are, or a push waits."""


class Ticket:
    """Bytes counted for one open (step, bucket) (``key``), from its opening push's header until its
    accumulator is given back. The listener :meth:`free` s a ticket no accumulator :meth:`claim` ed."""

    __slots__ = ("budget", "nbytes", "key", "claimed", "done", "seen", "bounded")

    def __init__(self, budget: PushBudget | None, nbytes: int, key=None, bounded=True) -> None:
        self.budget, self.nbytes, self.key, self.bounded = budget, nbytes, key, bounded
        self.claimed = self.done = False
        self.seen: set = set()  # the workers whose push of it was read (sync mode)

    def free(self) -> None:
        """The message it was taken for is served: give it back, unless an accumulator holds it."""
        if not self.claimed:
            self.release()

    def release(self) -> None:
        if not self.done and self.budget is not None:
            self.done = True
            self.budget.give(self)


FREE = Ticket(None, 0)
"""What a message that opens nothing takes (a push to an open (step, bucket), any other message)."""


def _done(tracker) -> bool:
    if tracker is None:
        return True
    try:
        tracker.wait(0)
    except zmq.NotDone:
        return False
    return True


class PushBudget:
    """The node's pushes in flight against ``node.push_memory_bytes`` (see the module's doc). Counts
    always (``luwu_node_inflight_bytes``); gates only with a limit."""

    def __init__(self, ctx: NodeContext) -> None:
        self.ctx, self.limit = ctx, ctx.cfg.push_budget
        self.reserved = self.replies = self.peak = 0
        self._lock = threading.Lock()
        self._live: set[Ticket] = set()
        self._keys: dict[tuple, Ticket] = {}  # sync mode: the ticket of each open (step, bucket)
        self._sending: list[tuple[int, list]] = []  # (bytes, trackers) of replies on their way
        self._waiters: dict[bytes, object] = {}  # paused connections, in arrival order
        self._overdraft: bytes | None = None
        self._blocked_at: float | None = None
        self._released_at = time.monotonic()
        self._told = False
        self._tick: object | None = None
        self.loop = None
        self.buckets: Callable[[], dict[int, BucketState]] = dict
        self.on_pressure: Callable[[], None] = lambda: None
        self.spill = None  # where two-phase sums go while they wait for COMMIT (use_spill)
        self.fetches = FetchRoom(self)  # answers to weight fetches waiting for room
        self.handover: Ticket | None = None  # the room of the fetch answer being sent (fetch_room)
        self.urgent = 0  # bytes the optimizer waits for room for (a spilled sum it steps next)
        self.queued = 0  # room of fetch answers queued behind the steps, not encoded (no memory)
        self.kept = None  # buffers kept for reuse, fit to the room (budget_memory.arrange_memory)
        ctx.metrics.inflight_limit.set(self.limit)

    @property
    def used(self) -> int:
        return self.reserved + self.replies

    def bind(self, buckets: Callable[[], dict], on_pressure: Callable[[], None]) -> None:
        """The shard's buckets (to tell an opening push), and what sends the held replies at once."""
        self.buckets, self.on_pressure = buckets, on_pressure

    def use_spill(self, spill) -> None:
        """Two-phase sums waiting for COMMIT go to ``spill`` (:class:`.ooc.spill.Spill`, None: they
        stay in RAM): their pushes are then held back as any are (rule 4 of the module's doc)."""
        self.spill = spill

    def spilled(self, acc) -> bool:
        """Whether ``acc``'s sum is in the scratch file (or on its way there)."""
        return self.spill is not None and self.spill.is_out(acc)

    def prefetch(self, pairs: list) -> None:
        """COMMIT: the (bucket, accumulator)s about to step, in that order (their sums read back)."""
        if self.spill is not None and pairs:
            self.spill.prefetch(pairs)

    # ----------------------------------------------------------------- sizes
    def cost(self, b: BucketState, h: dict) -> int:
        """What a push opening (step, bucket) ``b`` holds until its step is applied (see the doc)."""
        members = 1 if self.ctx.cfg.mode == "async" else len(self.ctx.members) or 1
        nbytes = h.get("nbytes")  # (a header not checked yet: what is not a count counts as fp32)
        ok = isinstance(nbytes, list) and all(type(n) is int for n in nbytes)
        payload = sum(nbytes) if ok else b.numel * 4
        reply = 0 if h.get("pull") == "ack" else b.numel * 4
        return b.numel * 4 * partial_sums(members) + members * max(0, int(payload)) + reply

    def check(self, worker: int, buckets, world_size: int) -> None:
        """A HELLO's layout (or a restart's, ``worker`` -1) against the budget: one bucket's full set
        of fp32 pushes must fit. The default share of state_memory_bytes grows to it if it can."""
        if not self.limit or not buckets:
            return
        big = max(buckets, key=lambda b: b.numel)
        n = 1 if self.ctx.cfg.mode == "async" else world_size
        need = big.numel * 4 * (1 + partial_sums(n) + n)
        cfg = self.ctx.cfg
        if need > self.limit and not cfg.push_memory_bytes and need < cfg.state_memory_bytes:
            # the quarter of state_memory_bytes was less than one bucket's needs
            self.limit = need
            self.ctx.metrics.inflight_limit.set(need)
        if need > self.limit:
            raise too_small(self.ctx, worker, big, world_size, need, self.limit)

    @property
    def window_bytes(self) -> int:
        """The state window's share of node.state_memory_bytes: what the pushes in flight leave."""
        smb = self.ctx.cfg.state_memory_bytes
        return max(0, smb - self.limit) if smb else 0

    # ----------------------------------------------------------------- the gate (the listener's)
    def gate(self, peer, header) -> Ticket | None:
        """A message's header is read, its payload next: its ticket, or None (``peer`` waits, paused)."""
        self._on_loop()
        h = _header(header)
        if h is not None and h.get("op") != Op.PUSH:
            return self._gate_held(peer, h)
        b = self.buckets().get(h["bucket"]) if h and type(h.get("bucket")) is int else None
        step, rank = (h.get("step"), h.get("worker")) if b is not None else (None, None)
        if (
            not isinstance(step, int)
            or not isinstance(rank, int)
            or (self.sync and step < b.version)
        ):
            return FREE  # not a push (or one the node refuses when served), or a retry
        if self.sync:
            t = self._keys.get((b.id, step))
            if t is not None or step in b.accs:  # joins an open (step, bucket): always read
                if t is not None:
                    t.seen.add(rank)
                return FREE
        self._prune()
        t = self._ticket(b, h)
        t.seen.add(rank)
        if self._overdraft == peer.ident:
            self._overdraft = None
        elif t.bounded and self._full(t.nbytes):
            self._wait(peer, rank)
            return None
        self._waiters.pop(peer.ident, None)
        self._take(t)
        return t

    def _gate_held(self, peer, h: dict) -> Ticket | None:
        """A message other than a push whose payload is held until served (a seed, INIT; a STATE set):
        counted until served, read once it fits, as an opening push (rank 0 seeds faster than an out-of-
        core node writes seeds back: they would pile up to node.peer_bytes, unseen by the budget)."""
        n = h.get("nbytes")
        size = sum(n) if isinstance(n, list) and all(type(x) is int for x in n) else 0
        if size <= 0:
            return FREE
        t = Ticket(self, size, ("held", h.get("op")))
        if self._overdraft == peer.ident:
            self._overdraft = None
        elif self._full(size):
            self._wait(peer, h.get("worker"))
            return None
        self._waiters.pop(peer.ident, None)
        self._take(t, keyed=False)
        return t

    def _on_loop(self) -> None:
        """(Called on the event loop: the loop the budget's timers and wake-ups run on.)"""
        if self.loop is None:
            import asyncio

            self.loop = asyncio.get_running_loop()

    @property
    def sync(self) -> bool:
        return self.ctx.cfg.mode != "async"

    def _full(self, nbytes: int) -> bool:
        return bool(self.limit and self.used and self.used + self.urgent + nbytes > self.limit)

    def pressed(self) -> bool:
        """Whether a push waits for room."""
        return bool(self._waiters)

    def fits(self, nbytes: int, urgent: bool = False) -> bool:
        """Whether ``nbytes`` more stay within the budget (always without one); what the optimizer
        waits for now (``urgent``: a spilled sum it steps next) goes before any other."""
        if urgent:  # (the answers queued behind it hold no memory before it is stepped)
            return not self.limit or self.used - self.queued + nbytes <= self.limit
        return not self.limit or self.used + nbytes + self.urgent <= self.limit

    def _wait(self, peer, rank) -> None:
        if peer.ident not in self._waiters:
            self._waiters[peer.ident] = (peer, rank)
            if len(self._waiters) == 1:
                self.loop.call_soon(self.on_pressure)
                if self.spill is not None:  # complete two-phase sums go to disk
                    self.spill.relieve()
        if self._blocked_at is None:
            self._blocked_at = time.monotonic()
        self._arm()

    def _awaited(self, rank) -> bool:
        """Whether an open (step, bucket) still waits for a push of worker ``rank`` not read yet (sync
        mode): it may be behind the push at hand (rule 5 of the module's doc lets that one in first)."""
        members = self.ctx.members
        if not self.sync or rank not in members:
            return False
        return any(rank not in t.seen and len(t.seen) < len(members) for t in self._keys.values())

    def claim(self, acc, b: BucketState, h: dict) -> None:
        """``acc`` was opened by this push: it holds the ticket the (step, bucket)'s first header took
        (or a new one)."""
        key = (b.id, h["step"])
        t = self._keys.get(key) if self.sync else getattr(self.ctx.listener, "ticket", None)
        if t is None or t.claimed or t.key != key:
            t = self._ticket(b, h)
            self._take(t)
        t.claimed = True
        t.seen.update(acc.workers, (h["worker"],))
        acc.ticket = t

    # ----------------------------------------------------------------- counting
    def _ticket(self, b: BucketState, h: dict) -> Ticket:
        bounded = h.get("two_phase") is not True or self.spill is not None
        return Ticket(self, self.cost(b, h), (b.id, h.get("step")), bounded)

    def _take(self, t: Ticket, keyed: bool = True) -> None:
        with self._lock:
            self.reserved += t.nbytes
            self._live.add(t)
            if self.sync and keyed:
                self._keys[t.key] = t
        self._moved(up=True, spare=t.nbytes)

    def give(self, t: Ticket) -> None:
        """From any thread: ``t`` is given back."""
        with self._lock:
            self.reserved -= t.nbytes
            self._live.discard(t)
            if self._keys.get(t.key) is t:
                del self._keys[t.key]
        self._moved(up=False)

    def resize(self, t: Ticket | None, nbytes: int) -> None:
        """From any thread: ``t`` holds ``nbytes`` from now on (a spilled sum: nothing; read back:
        the sum and its reply)."""
        if t is None:
            return
        with self._lock:
            if t.done or t not in self._live:
                return
            delta, t.nbytes = nbytes - t.nbytes, nbytes
            self.reserved += delta
        self._moved(up=delta > 0)

    def reply(self, payload, trackers: list, in_ram: bool) -> None:
        """A reply was sent (or held) to ``trackers``' workers: counted until all of them are out."""
        if payload.borrowed and in_ram:
            return  # frames of the resident shard itself
        nbytes = sum(getattr(f, "nbytes", 0) for f in payload.frames)
        waits = [t for _, t in trackers if t is not None]
        if not nbytes or not waits:
            return
        self._on_loop()
        self._prune()
        self._sending.append((nbytes, waits))
        with self._lock:
            self.replies += nbytes
        ticket, self.handover = self.handover, None
        if ticket is not None:  # the answer to a fetch counts itself now: its room is given back
            ticket.release()
        self._moved(up=True)
        self._arm()

    def forget(self) -> None:
        """After a rollback replaced the buckets: give back what their accumulators held."""
        held = {id(a.ticket) for b in self.buckets().values() for a in b.accs.values()}
        for t in [t for t in list(self._live) if t.claimed and id(t) not in held]:
            t.release()

    def _moved(self, up: bool, spare: int = 0) -> None:
        used = self.used
        self.ctx.metrics.inflight.set(used)
        if used > self.peak:
            self.peak = used
            self.ctx.metrics.inflight_peak.set(used)
        if up and self.limit and self.kept is not None:  # (``spare``: a new ticket's bytes)
            self.kept.fit(self.limit - used + spare)
        if not up:
            self._released_at = time.monotonic()
            if self.spill is not None:
                self.spill.pump()  # (room for the sums of a COMMIT to come back)
            if (self._waiters or self.fetches.waiting) and self.loop is not None:
                self.loop.call_soon_threadsafe(self._wake)

    # ----------------------------------------------------------------- waking, on the event loop
    def _wake(self) -> None:
        self.fetches.wake()
        for ident, (peer, _) in list(self._waiters.items()):
            if ident not in self._waiters:
                continue
            if peer.closed or peer.refused:
                del self._waiters[ident]
                continue
            del self._waiters[ident]
            peer.resume()  # reads on: asks the gate again, and waits again if it still does not fit
        if not self._waiters:
            self._unblock()

    def _unblock(self) -> None:
        if self._blocked_at is not None:
            self.ctx.metrics.inflight_blocked.inc(time.monotonic() - self._blocked_at)
            self._blocked_at = None

    def hold(self, nbytes: int) -> Ticket:
        """A ticket of ``nbytes`` taken now (an answer to a fetch, :mod:`.fetch_room`)."""
        self._on_loop()
        t = Ticket(self, nbytes)
        self._take(t, keyed=False)  # (no open (step, bucket): it awaits no worker)
        return t

    def arm(self) -> None:
        """Look again at the next tick (something waits for room)."""
        self._on_loop()
        self._arm()

    def _arm(self) -> None:
        if self._tick is None and self.loop is not None:
            self._tick = self.loop.call_later(TICK_S, self._on_tick)

    def _prune(self) -> None:
        """Replies whose sends are done are given back."""
        keep, sent = [], 0
        for e in self._sending:
            if all(_done(t) for t in e[1]):
                sent += e[0]
            else:
                keep.append(e)
        if sent:
            self._sending = keep
            with self._lock:
                self.replies -= sent
            self._moved(up=False)

    def _on_tick(self) -> None:
        self._tick = None
        if self._waiters:
            self.on_pressure()  # (replies held since the first push began to wait)
        self._prune()
        now = time.monotonic()
        if self._blocked_at is not None:  # (counted as it goes, not only when it ends)
            self.ctx.metrics.inflight_blocked.inc(now - self._blocked_at)
            self._blocked_at = now if self._waiters else None
        if self.fetches.waiting and self.ctx.queue.idle() and self._still():
            if self._deadlocked() or now - self._released_at >= IDLE_S:
                self.fetches.overdraw()  # (an answer, once sent, releases its memory by itself)
        elif self._waiters and self.ctx.queue.idle() and self._still():
            if self._deadlocked() or now - self._released_at >= IDLE_S:
                self._let_one_in(now)
        if self._sending or self._waiters or self.fetches.waiting:
            self._arm()

    def _still(self) -> bool:
        """Nothing in flight can be released without another push: no reply on its way, no message
        read and not yet served, no sum on its way to or from the scratch file (the optimizer thread is
        idle: the caller's)."""
        serving = getattr(self.ctx.listener, "serving", lambda: False)
        spilling = self.spill is not None and self.spill.busy()
        return not self._sending and not serving() and not spilling

    def _deadlocked(self) -> bool:
        """Every worker an open (step, bucket) waits for is itself waiting here, for room for its push
        (its push to it may be behind the one that waits) or for its fetch's answer (it pushes once its
        unit's weights are in): only letting one in ends it."""
        paused = {r for _, r in self._waiters.values()} | self.fetches.ranks()
        members = self.ctx.members
        awaited = {
            r for t in self._keys.values() if len(t.seen) < len(members) for r in members - t.seen
        }
        return bool(awaited) and awaited <= paused

    def _let_one_in(self, now: float) -> None:
        """Rule 5 of the module's doc: nothing can be released without another push; one waiting push
        goes in."""
        first = next(iter(self._waiters))
        ident = next((i for i, (_, r) in self._waiters.items() if self._awaited(r)), first)
        peer, _ = self._waiters.pop(ident)
        if peer.closed or peer.refused:
            return
        self._overdraft, self._released_at = ident, now
        self.ctx.metrics.inflight_overdrafts.labels("push").inc()
        if not self._told:
            self._told = True
            log.warning(
                "node %s: nothing in flight could be released (or was, for %g s) with pushes waiting for "
                "node.push_memory_bytes = %d (in flight: %d B for the (step, bucket)s %s, %d B of "
                "replies on their way): a waiting push goes in past it (workers pushing in other orders) "
                "(luwu_node_inflight_overdrafts_total counts them; said once)",
                self.ctx.index,
                IDLE_S,
                self.limit,
                self.reserved,
                sorted((t.key for t in self._live), key=str)[:16],
                self.replies,
            )
        peer.resume()
        if not self._waiters:
            self._unblock()


def _header(frame) -> dict | None:
    """A message's header (None: not a header)."""
    try:
        h = msgpack.unpackb(bytes(frame), raw=False, strict_map_key=False)
    except Exception:
        return None
    return h if isinstance(h, dict) else None
