"""Settings of a node daemon (the ``node`` section of the cluster file)."""

from __future__ import annotations

import os
from dataclasses import dataclass, field

from luwu.protocol.errors import ConfigError

MODES = ("sync", "async")
WORKER_POLICIES = ("strict", "elastic")
LISTENERS = ("auto", "zmtp", "libzmq")
MIN_JOIN_SECRET = 32
"""Characters a join secret has at least: 128 bits written as hex (``secrets.token_hex(16)``)."""


@dataclass(kw_only=True, slots=True)
class NodeConfig:
    """The ``[node]`` section: one node daemon's address, aggregation mode, worker policy, checkpoints,
    limits and keys."""

    bind: str = "tcp://127.0.0.1:0"
    """ZeroMQ address to bind; port 0 picks a free port (the node prints the bound address).
    Loopback unless told otherwise: binding a public address without CURVE keys is refused."""
    index: int = -1
    """This node's position in the cluster's node list (its identity for checkpoints); -1 takes it
    from the first worker's HELLO."""
    mode: str = "sync"
    """sync: aggregate all workers' pushes of (step, bucket), then step; async: apply each push on arrival."""
    staleness: int = 0
    """async mode: a worker may run at most this many steps ahead of the slowest (0 = lockstep replies)."""
    worker_policy: str = "strict"
    """strict: a missing worker fails the step for everyone with an error naming its rank;
    elastic: after worker_timeout_s the step goes on with the workers present."""
    worker_timeout_s: float = 60.0
    """How long a (step, bucket) waits for the missing workers' pushes before the worker policy acts; a
    worker that leaves its replies unread for a quarter of it is lost too."""
    max_message_bytes: int = 256 * 1024 * 1024
    """Largest message payload accepted; a peer sending a larger one is disconnected before its frames are
    allocated (listener = libzmq: checked per frame)."""
    listener: str = "auto"
    """Who reads the peers' frames. zmtp: the node's own ZMTP reader (NULL or CURVE), which bounds what each
    peer holds (below) before anything is allocated; libzmq: ZeroMQ's ROUTER (bounds one frame and whole
    messages only; kept for comparison, and for inproc:// addresses). auto: zmtp, libzmq for inproc://."""
    peer_bytes: int = 0
    """zmtp: the most one worker's connection holds in the node before its messages are served (the message
    being read and the complete ones waiting); past it the node reads no more from it until served.
    0: max_message_bytes + 1 MiB."""
    stranger_bytes: int = 256 * 1024
    """zmtp: the same for a connection that has not said HELLO (at least 65 KiB: a HELLO fits), and for a
    monitor key (curve_monitor_keys) always."""
    peers_total_bytes: int = 0
    """zmtp: the most all connections together hold (what peer_bytes and stranger_bytes bound per
    connection); past it a peer's read waits until messages are served, and when nothing is being served
    a holder of an unfinished message idle for a second is disconnected, largest first (named in the log),
    else the largest waiting message alone reads on until whole. 0: a quarter of this machine's physical memory,
    at most 32 GiB and at least two workers' peer_bytes: the rest is the shard's and the page cache's, and
    32 GiB is 128 messages of 256 MiB in flight, more than one node's pipeline serves at once (reads wait
    beyond it, nothing is lost)."""
    control_reply_bytes: int = 1024 * 1024
    """zmtp: the most a worker may leave unread of the replies that carry no weights (PONGs to its
    heartbeats, ERRORs, STATS, WELCOME, the handshake's); past it the node disconnects it and names it in
    the log once. Replies with weights are bounded by rcvhwm, and a worker that leaves them unsent for
    worker_timeout_s / 4 is lost. At least 65 KiB (a 64 KiB header fits)."""
    stranger_reply_bytes: int = 128 * 1024
    """zmtp: the same for a connection that has not said HELLO, and a monitor key: small, a tool reads its
    answers."""
    max_message_frames: int = 64
    """zmtp: the most frames one message may have (a header and its payload frames)."""
    max_connections: int = 1024
    """zmtp: the most connections open at once (workers, monitors); more are closed as they come."""
    join_secret: str = ""
    """zmtp: a connection must show this in its ZeroMQ handshake (workers and tools: transport.join_secret)
    or it is closed before it may send a frame: no reply, no job state, no allocation. At least 128 bits;
    a secret: never in argv (LUWU_NODE__JOIN_SECRET or a mode-600 --config file). With CURVE the keys do
    this. '' without CURVE keys: ``luwu node`` makes one (<run dir>/keys/join.toml), ``luwu up`` and
    ``local_cluster`` hand theirs over; only node.insecure_open serves without."""
    torch_threads: int = 1
    """Threads for the optimizer kernel; the event loop needs a core of its own for communication."""
    checkpoint_dir: str = ""
    """Directory for shard checkpoints ('' = no checkpoints)."""
    export_root: str = ""
    """Folder below which EXPORT may write weights as torch.distributed.checkpoint folders (empty: checkpoint_dir;
    neither set: exports are refused)."""
    checkpoint_every: int = 0
    """Write a checkpoint every this many steps (0 = only on SIGTERM and on request)."""
    state_dir: str = ""
    """Folder for the shard's state files (fp32 master weights and optimizer state, meant for NVMe):
    a shard larger than state_memory_bytes lives there, RAM being a window over it ('' = in RAM)."""
    state_memory_bytes: int = 0
    """RAM the shard's state window and its pushes in flight share with state_dir (0 = no bound: the
    shard stays in RAM): the pushes get push_memory_bytes of it (default a quarter), the window the rest."""
    push_memory_bytes: int = 0
    """RAM the pushes in flight may hold: a (step, bucket) counts its accumulator, room for every worker's
    push of it and its reply from its first push until it is applied, and replies count until sent. A
    push that would open a (step, bucket) past it stays unread in its connection (TCP pushes back) until
    enough is released; pushes to an open (step, bucket) are always read, so steps complete. 0: no bound,
    or with state_memory_bytes a quarter of it (raised to one bucket's needs if less). At least
    (2 + world size) x 4 B a parameter of the largest bucket, with three workers or more one more per
    doubling (partial sums; a HELLO is refused below that); zmtp
    listener only."""
    log_every: int = 100
    """One summary log line every this many steps."""
    rcvhwm: int = 1000
    """Messages queued per peer (ZeroMQ high-water mark; zmtp: replies not yet sent); senders wait beyond it."""
    max_world_size: int = 4096
    """The largest world size a HELLO may name (the node keeps per-rank state for each)."""
    max_shard_bytes: int = 64 * 1024**3
    """Most bytes of weights + optimizer state this node agrees to hold; a HELLO asking for more is refused."""
    curve_public_key: str = ""
    """Z85 CURVE public key of the node (``luwu keys``); with the secret key, all traffic is encrypted."""
    curve_secret_key: str = ""
    """Z85 CURVE secret key of the node."""
    curve_authorized_keys: list[str] = field(default_factory=list)
    """Z85 public keys of the workers allowed in; any other client is refused at the handshake."""
    curve_monitor_keys: list[str] = field(default_factory=list)
    """Z85 public keys of tools (luwu status, luwu top) allowed in to ask STATS: they hold at most stranger_bytes
    and never say HELLO (`luwu keys` writes the monitor's here)."""
    curve_aggregator_keys: list[str] = field(default_factory=list)
    """The switch tier's aggregators, ``FIRST-LAST=KEY`` each (``luwu keys``, ``luwu up``): the Z85 public key
    of the aggregator of worker ranks FIRST..LAST. A connection with that key may only say HELLO marked
    ``relay`` (an aggregator's), for a rank of its run, and holds one connection at a time (a newer one
    replaces it); a worker's key never relays. Needs CURVE (curve_secret_key)."""
    curve_keys_by_rank: bool = True
    """With CURVE: the i-th of curve_authorized_keys may only say HELLO as worker rank i, holds one connection at
    a time (a newer one replaces it: a worker's reconnect), and keys past the job's world size (such as a
    luwu status key listed after the workers') are monitor keys; `luwu keys` and `luwu up` write the keys in
    this order. Off: any listed key may be any rank, on any number of connections."""
    insecure_public_bind: bool = False
    """Allow binding a non-loopback address without CURVE keys (trusted networks only)."""
    insecure_open: bool = False
    """Serve anyone who reaches the port: no join secret, no CURVE keys (warned once at start). Off, a
    node without either refuses to start, and ``luwu node`` / ``luwu up`` / ``local_cluster`` make a join
    secret for it; every local user can reach a loopback port, so only a single-user machine is safe open."""
    inflight_bytes: int = 2 * 1024 * 1024 * 1024
    """Gradient accumulators (4 B per parameter of a bucket in flight, shared by the buckets) kept for
    reuse once given back, in bytes; more in flight at once is allocated and freed again. With a push
    budget (push_memory_bytes, or state_memory_bytes) only in the room the pushes in flight leave in it."""
    retain_freed_memory: bool = True
    """Keep freed memory in the process (glibc mallopt) so received messages land in recycled, already
    touched memory instead of fresh pages (~10x slower to fill); costs resident memory up to the peak.
    A node with a push budget gives freed buffers back instead (:mod:`.budget_memory`)."""

    @property
    def aggregator_ranks(self) -> dict[str, tuple[int, int]]:
        """curve_aggregator_keys as {key: (first rank, last rank)}."""
        return {key: ranks for ranks, key in map(_aggregator_key, self.curve_aggregator_keys)}

    @property
    def uses_zmtp(self) -> bool:
        """Whether the node reads its peers' frames itself (:mod:`luwu.switch_nodes.zmtp`)."""
        if self.listener == "auto":
            return not self.bind.startswith("inproc://")
        return self.listener == "zmtp"

    @property
    def gate(self) -> str:
        """Who may talk to this node: 'CURVE keys', 'join secret', 'in-process' (inproc:// reaches no other
        process), or '' (anyone who reaches the port: only with insecure_open)."""
        if self.curve_secret_key:
            return "CURVE keys"
        if self.join_secret:
            return "join secret"
        return "in-process" if self.bind.startswith("inproc://") else ""

    @property
    def peer_budget(self) -> int:
        """node.peer_bytes, 0 resolved."""
        return self.peer_bytes or self.max_message_bytes + (1 << 20)

    @property
    def push_budget(self) -> int:
        """node.push_memory_bytes, 0 resolved: a quarter of state_memory_bytes with state_dir, else 0
        (no bound); 0 with listener = libzmq (it reads every message whole: nothing is left unread)."""
        if not self.uses_zmtp:
            return 0
        if self.push_memory_bytes:
            return self.push_memory_bytes
        return self.state_memory_bytes // 4 if self.state_dir else 0

    @property
    def peers_total_budget(self) -> int:
        """node.peers_total_bytes, 0 resolved (see its docstring)."""
        if self.peers_total_bytes:
            return self.peers_total_bytes
        try:
            memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
        except (ValueError, OSError):
            memory = 1 << 40
        return max(min(memory // 4, 32 << 30), 2 * self.peer_budget)

    def __post_init__(self) -> None:
        if not self.bind.startswith(("tcp://", "ipc://", "inproc://")):
            raise ConfigError(
                f"node.bind must be a ZeroMQ address like tcp://127.0.0.1:0, got {self.bind!r}"
            )
        if self.mode not in MODES:
            raise ConfigError(f"node.mode must be one of {MODES}, got {self.mode!r}")
        if self.worker_policy not in WORKER_POLICIES:
            raise ConfigError(
                f"node.worker_policy must be one of {WORKER_POLICIES}, got {self.worker_policy!r}"
            )
        for name in ("staleness", "checkpoint_every"):
            if getattr(self, name) < 0:
                raise ConfigError(f"node.{name} must be >= 0, got {getattr(self, name)}")
        for name in (
            "torch_threads",
            "log_every",
            "rcvhwm",
            "max_message_bytes",
            "inflight_bytes",
            "max_shard_bytes",
            "max_world_size",
            "max_message_frames",
            "max_connections",
        ):
            if getattr(self, name) < 1:
                raise ConfigError(f"node.{name} must be >= 1, got {getattr(self, name)}")
        if not self.worker_timeout_s > 0:
            raise ConfigError(f"node.worker_timeout_s must be > 0, got {self.worker_timeout_s}")
        self._check_state()
        self._check_budgets()
        self._check_gate()

    def _check_state(self) -> None:
        """state_dir and state_memory_bytes: a bound needs a folder, and the folder is the checkpoint."""
        if self.state_memory_bytes < 0:
            raise ConfigError(
                f"node.state_memory_bytes must be >= 0 (0 = no bound), got {self.state_memory_bytes}"
            )
        if self.state_memory_bytes and not self.state_dir:
            raise ConfigError(
                f"node.state_memory_bytes = {self.state_memory_bytes} needs node.state_dir (a folder on "
                "NVMe for the state that does not fit): set it, or set state_memory_bytes = 0"
            )
        if self.state_dir and self.checkpoint_dir:
            raise ConfigError(
                f"node.state_dir = {self.state_dir!r} and node.checkpoint_dir = {self.checkpoint_dir!r} "
                "do not combine: the state files are the checkpoint (a restarted node resumes from them, "
                "a checkpoint commits them); leave node.checkpoint_dir empty, or leave node.state_dir "
                "empty (the shard in RAM, checkpointed into node.checkpoint_dir)"
            )
        self._check_push_memory()
        if self.state_dir and os.path.exists(self.state_dir) and not os.path.isdir(self.state_dir):
            raise ConfigError(
                f"node.state_dir = {self.state_dir!r} is not a folder: name a folder (made if missing)"
            )

    def _check_push_memory(self) -> None:
        """push_memory_bytes: zmtp leaves a push unread, and with state_memory_bytes it is a share of it."""
        n = self.push_memory_bytes
        if n < 0:
            raise ConfigError(f"node.push_memory_bytes must be >= 0 (0 = default), got {n}")
        if n and not self.uses_zmtp:
            raise ConfigError(
                f"node.push_memory_bytes = {n} needs node.listener = 'zmtp' (libzmq's ROUTER reads every "
                "message whole, so a push cannot be left unread): use listener = 'zmtp' or set 0"
            )
        if n and self.state_memory_bytes and n >= self.state_memory_bytes:
            raise ConfigError(
                f"node.push_memory_bytes = {n} leaves nothing of node.state_memory_bytes = "
                f"{self.state_memory_bytes} (the window and the pushes in flight share it) for the state "
                "window: raise state_memory_bytes, or lower push_memory_bytes (0: a quarter of it)"
            )

    def _check_budgets(self) -> None:
        """Each byte budget holds at least the one message it must let through."""
        for name in ("stranger_bytes", "control_reply_bytes", "stranger_reply_bytes"):
            if getattr(self, name) < 65 * 1024:
                raise ConfigError(
                    f"node.{name} must be >= 66560 (a header of 64 KiB fits), got {getattr(self, name)}"
                )
        if self.peers_total_bytes and self.peers_total_bytes < self.peer_budget:
            raise ConfigError(
                f"node.peers_total_bytes = {self.peers_total_bytes} cannot hold one worker's message (node.peer_bytes resolves to {self.peer_budget}): raise it or set 0"
            )
        if (
            self.peer_bytes
            and self.peer_bytes < self.max_message_bytes + 65 * 1024 + 64 * self.max_message_frames
        ):
            raise ConfigError(
                f"node.peer_bytes = {self.peer_bytes} cannot hold one message of node.max_message_bytes = {self.max_message_bytes}: raise it or set 0"
            )

    def _check_gate(self) -> None:
        """The listener, the keys or secret, and the bind address agree on who may talk."""
        if self.listener not in LISTENERS:
            raise ConfigError(f"node.listener must be one of {LISTENERS}, got {self.listener!r}")
        if self.listener == "zmtp" and self.bind.startswith("inproc://"):
            raise ConfigError(
                "node.listener = 'zmtp' binds tcp:// or ipc:// addresses, not inproc://"
            )
        if self.join_secret and (not self.uses_zmtp or self.curve_secret_key):
            raise ConfigError(
                "node.join_secret is checked by the zmtp listener without CURVE: with CURVE keys, the authorized keys do this (leave it empty)"
            )
        if self.join_secret and len(self.join_secret) < MIN_JOIN_SECRET:
            raise ConfigError(
                f"node.join_secret has {len(self.join_secret)} characters, at least {MIN_JOIN_SECRET} are needed (128 bits as hex): "
                "make one with `python -c 'import secrets; print(secrets.token_hex(16))'` (`luwu up` makes one by itself)"
            )
        if bool(self.curve_public_key) != bool(self.curve_secret_key):
            raise ConfigError(
                "node.curve_public_key and node.curve_secret_key must be given together"
            )
        self._check_aggregator_keys()
        if self.curve_secret_key and not self.curve_authorized_keys:
            raise ConfigError(
                "node.curve_authorized_keys is empty: with CURVE on, list the workers' public keys (luwu keys)"
            )
        host = (
            self.bind.split("://", 1)[1].rsplit(":", 1)[0]
            if self.bind.startswith("tcp://")
            else "127.0.0.1"
        )
        if (
            host not in ("127.0.0.1", "localhost", "[::1]", "::1")
            and not host.startswith("127.")
            and not self.curve_secret_key
            and not self.insecure_public_bind
        ):
            raise ConfigError(
                f"node.bind={self.bind!r} is not loopback: configure CURVE keys (luwu keys) or set node.insecure_public_bind = true on a trusted network"
            )
        if not self.gate and not self.insecure_open and not self.uses_zmtp:
            raise ConfigError(
                f"node.listener = 'libzmq' cannot ask for a join secret, and no CURVE keys are set: configure CURVE keys "
                f"(luwu keys), use listener = 'zmtp' with a join secret, or set node.insecure_open = true to serve anyone who reaches {self.bind}"
            )

    def _check_aggregator_keys(self) -> None:
        """curve_aggregator_keys: CURVE on, each a run of ranks and a key of no other role, runs apart."""
        if not self.curve_aggregator_keys:
            return
        if not self.curve_secret_key:
            raise ConfigError(
                "node.curve_aggregator_keys needs CURVE keys (node.curve_public_key and "
                "curve_secret_key: luwu keys)"
            )
        runs = sorted((r, k) for r, k in map(_aggregator_key, self.curve_aggregator_keys))
        for (prev, key), (run, _) in zip(runs, runs[1:]):
            if run[0] <= prev[1]:
                raise ConfigError(
                    f"node.curve_aggregator_keys: ranks {run[0]}-{run[1]} overlap ranks "
                    f"{prev[0]}-{prev[1]} (key {key}): a rank has one aggregator"
                )
        others = {*self.curve_authorized_keys, *self.curve_monitor_keys}
        for _, key in runs:
            if key in others:
                raise ConfigError(
                    f"node.curve_aggregator_keys: {key} is a worker's or a monitor's key too "
                    "(curve_authorized_keys, curve_monitor_keys): a key has one role"
                )
        if len({k for _, k in runs}) < len(runs):
            raise ConfigError("node.curve_aggregator_keys: a key is listed for two groups")


def _aggregator_key(item: str) -> tuple[tuple[int, int], str]:
    """``FIRST-LAST=KEY`` (one of node.curve_aggregator_keys) -> ((first, last), key)."""
    ranks, eq, key = str(item).strip().partition("=")
    first, dash, last = ranks.partition("-")
    last = last if dash else first
    if not (eq and first.strip().isdigit() and last.strip().isdigit() and len(key) == 40):
        raise ConfigError(
            f"node.curve_aggregator_keys entry {item!r} is not FIRST-LAST=KEY (the ranks of the "
            "aggregator's group, then its 40-character Z85 public key: luwu keys writes them)"
        )
    if int(first) > int(last):
        raise ConfigError(f"node.curve_aggregator_keys entry {item!r}: {first} > {last}")
    return (int(first), int(last)), key
