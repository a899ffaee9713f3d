"""The optimizer state between ``torch.optim``'s format and the nodes' shards.

On the wire (``STATE``, :func:`fetch` / :func:`store`) every bucket's state is a list of flat fp32
frames: ``[params, *state, per-segment steps]`` (the state names come from the optimizer kind).
:func:`to_torch` builds torch's per-parameter ``state`` from those frames, and :func:`from_torch`
the frames from a ``torch.optim`` state dict and this worker's parameters (the master weights).
"""

from __future__ import annotations

import torch

from luwu.protocol.errors import ProtocolError
from luwu.protocol.messages import Op
from luwu.switch_nodes.optimizers import torch_state
from luwu.switch_nodes.torch_state import step_of, torch_param_state


def fetch(worker) -> dict[int, list[torch.Tensor]]:
    """Every bucket's [params, *optimizer state, per-segment steps] from its node."""
    layout, client = worker.layout, worker.client
    get = {"op": Op.STATE, "step": worker.step_num, "action": "get", "names": []}
    msgs = _answers(
        worker, [worker.channels[b.id].state(get) for b in layout.buckets], "optimizer state"
    )
    out = {}
    for b, m in zip(layout.buckets, msgs):
        frames = [t.view(torch.float32).clone() for t in m.tensors()]
        if (
            len(frames) != len(m.header["names"])
            or frames[-1].numel() != len(b.segments)
            or any(f.numel() != b.numel for f in frames[:-1])
        ):
            raise ProtocolError(
                f"STATE reply for bucket {b.id} from node {client.nodes[b.node]} has wrong sizes"
            )
        out[b.id] = frames
    return out


def store(worker, flats: dict[int, list[torch.Tensor]], names: list[str]) -> None:
    """Write [params, *state, steps] of every bucket to its node, then wait for every node's ack."""
    put = {"op": Op.STATE, "step": worker.step_num, "action": "set", "names": names}
    replies = [worker.channels[b.id].state(put, flats[b.id]) for b in worker.layout.buckets]
    _answers(worker, replies, "optimizer state ack")


def _answers(worker, replies: list, what: str) -> list:
    """The nodes' answers to a STATE request per bucket (futures of its channels), in bucket order;
    a node's error raises, a missing answer names node, step and bucket at the deadline."""
    for _ in worker.client.arrivals(replies, what=what):
        pass
    return [r.msg for r in replies]


def to_torch(
    kind,
    layout,
    params: list[torch.Tensor],
    groups: list[dict],
    flats: dict[int, list[torch.Tensor]],
) -> dict[int, dict]:
    """torch's ``state`` (parameter index -> entry) from the shards' frames; ``groups``: param_groups."""
    per: dict[int, dict] = {}
    for b in layout.buckets:
        st = flats[b.id]
        for si, seg in enumerate(b.segments):
            p = params[seg.param]
            d = per.setdefault(
                seg.param,
                {
                    "step": float(st[-1][si]),
                    **{n: torch.zeros(p.numel()) for n in kind.state_names},
                },
            )
            for n, t in zip(kind.state_names, st[1:-1]):
                d[n].narrow(0, seg.param_offset, seg.numel).copy_(
                    t.narrow(0, seg.offset, seg.numel)
                )
    group_of = [gi for gi, g in enumerate(groups) for _ in g["params"]]
    state = {}
    for i, d in per.items():  # (a parameter never stepped has no state: torch creates it lazily)
        scalars, shapes = torch_param_state(
            kind, tuple(params[i].shape), d["step"], groups[group_of[i]]
        )
        entry = scalars | {n: torch_state(d[n], shape) for n, shape in shapes.items()}
        if entry:
            state[i] = entry
    return state


def from_torch(
    kind, layout, params: list[torch.Tensor], state: dict
) -> dict[int, list[torch.Tensor]]:
    """The shards' frames from torch's ``state`` (parameter -> entry, as ``Optimizer.state`` after
    ``load_state_dict``), with ``params`` as the master weights."""
    flats = {}
    for b in layout.buckets:
        out = [torch.zeros(b.numel) for _ in range(1 + len(kind.state_names))] + [
            torch.zeros(len(b.segments))
        ]
        for si, seg in enumerate(b.segments):
            p = params[seg.param]
            out[0].narrow(0, seg.offset, seg.numel).copy_(
                p.detach().reshape(-1).narrow(0, seg.param_offset, seg.numel)
            )
            st = state.get(p, {})
            for k, n in enumerate(kind.state_names, start=1):
                t = st.get(n)
                if (
                    t is not None
                ):  # (a shaped state, Adafactor's, may be shorter than its whole parameter's slot)
                    m = min(seg.numel, t.numel() - seg.param_offset)
                    out[k].narrow(0, seg.offset, m).copy_(
                        t.detach().reshape(-1).narrow(0, seg.param_offset, m)
                    )
            out[-1][si] = step_of(
                kind, st.get("step"), any(st.get(n) is not None for n in kind.state_names)
            )
        flats[b.id] = out
    return flats
