"""Who a connection is to the node, and so what it may hold in the listener (:mod:`.zmtp`).

- A **worker**: said HELLO as a rank, or (with CURVE) holds a worker's key: it may hold ``node.peer_bytes``
  and leave ``node.control_reply_bytes`` of replies unread. With ``node.curve_keys_by_rank`` a worker key
  holds one connection at a time: a newer one replaces it (a worker that reconnects before the node saw
  its old connection end), and the rank the old one said HELLO as goes on with the new one.
- A **monitor**: a key of ``node.curve_monitor_keys`` (``luwu status``, ``luwu top``), or with
  ``node.curve_keys_by_rank`` an authorized key past the job's world size (the order `luwu up` lists the
  monitor's key in): it asks STATS, holds what a stranger does, and its HELLO is refused.
- An **aggregator** (the switch tier): a key of ``node.curve_aggregator_keys``, bound to its group's run of
  ranks as a worker's key is to its rank. It may say HELLO only marked ``relay`` and only for a rank of its
  run; a worker's key never relays. It holds what a worker does (per connection: it speaks for its group),
  one connection at a time (a newer one replaces it, and every rank bound to the old one goes on with it).
- A **stranger**: any other connection (NULL, with or without the join secret) that has not said HELLO:
  ``node.stranger_bytes`` and ``node.stranger_reply_bytes``.

:meth:`PeerRoles.listener` builds the listener the config names with these callbacks.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

from luwu.protocol.errors import ProtocolError
from luwu.switch_nodes.context import NodeContext
from luwu.switch_nodes.listener import LibzmqListener, Listener

__all__ = ["PeerRoles"]

log = logging.getLogger(__name__)


class PeerRoles:
    """The listener's callbacks about connections, read from the node's config and its members."""

    def __init__(self, ctx: NodeContext, on_stuck: Callable[[set[int]], None]) -> None:
        self.ctx, self.cfg, self._on_stuck = ctx, ctx.cfg, on_stuck
        self._monitors = set(ctx.cfg.curve_monitor_keys)
        self._rank_of_key = {k: i for i, k in enumerate(ctx.cfg.curve_authorized_keys)}
        self._told: set[str] = set()  # monitor keys named in the log for saying HELLO
        # the switch tier: an aggregator's key -> the (first, last) rank it may relay
        self._groups = ctx.cfg.aggregator_ranks

    def key(self, ident: bytes) -> str | None:
        return self.ctx.peer_key(ident)

    def rank(self, ident: bytes) -> int | None:
        """The worker rank ``ident`` said HELLO as (None: it did not)."""
        return self.ctx.rank_of(ident)

    def is_monitor(self, key: str | None) -> bool:
        if key is None:
            return False
        if key in self._monitors:
            return True
        index, world = self._rank_of_key.get(key), self.ctx.world_size
        return (
            self.cfg.curve_keys_by_rank
            and index is not None
            and world is not None
            and index >= world
        )

    def member(self, ident: bytes) -> bool:
        """Said HELLO, or holds a worker's CURVE key (it proved it belongs to the job)."""
        if ident in self.ctx.peers.values():
            return True
        key = self.key(ident)
        return key is not None and not self.is_monitor(key)

    def budget(self, ident: bytes) -> int:
        """What a connection may hold in the listener: a worker's budget, else a stranger's."""
        return self.cfg.peer_budget if self.member(ident) else self.cfg.stranger_bytes

    def reply_budget(self, ident: bytes) -> int:
        """What a connection may leave unread of the replies without payload."""
        return self.cfg.control_reply_bytes if self.member(ident) else self.cfg.stranger_reply_bytes

    def exclusive(self, key: str) -> bool:
        """A worker's key with node.curve_keys_by_rank, or an aggregator's: one connection at a time."""
        if key in self._groups:
            return True
        return self.cfg.curve_keys_by_rank and key in self._rank_of_key and not self.is_monitor(key)

    def replaced(self, old: bytes, new: bytes) -> None:
        """A key's newer connection replaced ``old``: the ranks ``old`` said HELLO as (a worker's one, an
        aggregator's group) go on with it."""
        ctx = self.ctx
        ranks = sorted(r for r, ident in ctx.peers.items() if ident == old)
        for rank in ranks:
            ctx.peers[rank] = new
        if old in ctx.relays:
            ctx.relays.discard(old)
            ctx.relays.add(new)
        if ranks:
            log.info(
                "node %s: worker rank(s) %s go on with their key's new connection",
                ctx.index,
                ranks,
            )

    def check_hello(self, ident: bytes, header: dict | None = None) -> None:
        """A monitor key never says HELLO (refused, named in the log once per key); with aggregator keys
        (node.curve_aggregator_keys), a HELLO marked ``relay`` needs the key of the aggregator of its
        rank, and an aggregator's key says nothing but such a HELLO (:meth:`_check_relay`)."""
        key = self.key(ident)
        if header is not None and self.cfg.curve_secret_key:
            self._check_relay(key, header["worker"], bool(header.get("relay")))
        if not self.is_monitor(key):
            return
        if key not in self._told:
            self._told.add(key)
            log.warning(
                "node %s: refusing HELLO from the monitor key %s (it may ask STATS, never train); said once per key",
                self.ctx.index,
                key,
            )
        raise ProtocolError(
            f"HELLO with the CURVE key {key}, a monitor key (node.curve_monitor_keys, or listed past the job's world size with "
            "node.curve_keys_by_rank): it may ask STATS, never say HELLO; train with a worker's key (luwu keys: keys/worker<rank>.toml)"
        )

    def _check_relay(self, key: str | None, rank: int, relay: bool) -> None:
        """Who may speak for ``rank`` marked relay, and who may not speak as a plain worker."""
        run = self._groups.get(key)
        if relay and run is None:
            raise ProtocolError(
                f"HELLO marked relay for worker rank {rank} with the CURVE key {key}, which is no "
                "aggregator's (node.curve_aggregator_keys): only the aggregator of the rank's group "
                "relays it; a worker's key speaks as its own rank, without relay"
            )
        if relay and not run[0] <= rank <= run[1]:
            raise ProtocolError(
                f"HELLO relaying worker rank {rank} with the CURVE key {key} of the aggregator of "
                f"ranks {run[0]}-{run[1]} (node.curve_aggregator_keys): rank {rank} is outside its "
                "group"
            )
        if not relay and run is not None:
            raise ProtocolError(
                f"HELLO as plain worker rank {rank} with the CURVE key {key} of the aggregator of "
                f"ranks {run[0]}-{run[1]} (node.curve_aggregator_keys): an aggregator's key only "
                "relays its group's ranks (HELLO marked relay); a worker uses its own key"
            )

    def stuck(self, ident: bytes) -> None:
        """``ident``'s replies stayed unsent for worker_timeout_s / 4: a worker that does not read (its
        other ranks are told, or it is dropped: :meth:`.Membership.not_reading`)."""
        rank = self.rank(ident)
        if rank is not None:
            self._on_stuck({rank})

    def listener(self) -> Listener:
        """The listener the config names (not started), with these callbacks."""
        cfg = self.cfg
        if cfg.uses_zmtp:
            from luwu.switch_nodes.curve import CurveKeys
            from luwu.switch_nodes.zmtp import ZmtpListener

            keys = (
                CurveKeys(
                    cfg.curve_public_key,
                    cfg.curve_secret_key,
                    cfg.curve_authorized_keys,
                    cfg.curve_monitor_keys,
                    list(self._groups),
                )
                if cfg.curve_secret_key
                else None
            )
            roles = self
            return ZmtpListener(
                cfg.bind,
                max_message_bytes=cfg.max_message_bytes,
                max_frames=cfg.max_message_frames,
                budget=roles.budget,
                who=self.ctx.who,
                max_connections=cfg.max_connections,
                sndhwm=cfg.rcvhwm,
                join_secret=cfg.join_secret,
                member=roles.member,
                curve=keys,
                reply_budget=roles.reply_budget,
                total_bytes=cfg.peers_total_budget,
                exclusive=roles.exclusive,
                replaced=roles.replaced,
                stuck_s=cfg.worker_timeout_s / 4,
                on_stuck=roles.stuck,
                gate=self.ctx.inflight.gate if self.ctx.inflight.limit else None,
            )
        else:
            curve = (
                (
                    cfg.curve_public_key,
                    cfg.curve_secret_key,
                    [*cfg.curve_authorized_keys, *cfg.curve_monitor_keys, *self._groups],
                )
                if cfg.curve_secret_key
                else None
            )
            return LibzmqListener(
                cfg.bind, max_message_bytes=cfg.max_message_bytes, hwm=cfg.rcvhwm, curve=curve
            )
