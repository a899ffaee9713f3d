"""A worker of tests/integration/test_dcp_checkpoint.py: a LuWu rank or an FSDP2 rank on one model.

Run as ``python tests/workers/dcp_checkpoint.py SPEC.json`` with RANK and WORLD_SIZE set (an
FSDP2 rank also MASTER_ADDR / MASTER_PORT); it saves what it saw with torch.save to the spec's
``out`` path with ``.rank<r>`` appended. Both kinds train the same model on the same data: rank r's
batch of step t comes from a generator seeded with (t, r), so a run resumed at step t sees what the
uninterrupted run saw.

``role: "luwu"``: RemoteOptimizer (AdamW, no compression) on ``nodes``; ``load``: start from that
checkpoint (``luwu.load_checkpoint``, every rank); then ``steps`` steps, rank 0 saving a checkpoint
into ``save`` after ``save_at`` of them. Records the weights after every step, and at the load and
the save the weights, ``state_dict()`` and the returned step.

``role: "fsdp"``: FSDP2 (``fully_shard`` per layer and the root) over gloo on CPU with
``torch.optim.AdamW``; ``load``: ``dcp.load`` + ``set_state_dict`` from that folder; then ``steps``
steps, saving ``get_state_dict`` with ``dcp.save`` into ``save`` after ``save_at`` of them. Records
the full weights and optimizer state (by name) at the load and the save, and the full weights after
every step.
"""

from __future__ import annotations

import copy
import json
import os
import sys

import torch


def make_model(seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(6, 10), torch.nn.Tanh(), torch.nn.Linear(10, 4))


def batch(step: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 * step + rank)
    return torch.randn(8, 6, generator=g), torch.randn(8, 4, generator=g)


def train_step(opt, model, step: int, rank: int) -> None:
    x, y = batch(step, rank)
    opt.zero_grad()
    torch.nn.functional.mse_loss(model(x), y).backward()
    opt.step()


def luwu_rank(spec: dict, rank: int, world: int) -> dict:
    import luwu

    model = make_model(spec["seed"])
    opt = luwu.RemoteOptimizer(
        model, nodes=spec["nodes"], lr=spec["lr"], compression=False, bucket_bytes=spec["bucket_bytes"],
        rank=rank, world_size=world, timeout_s=60.0,
    )  # fmt: skip
    out: dict = {"after": []}

    def weights() -> dict:
        opt.synchronize()  # the weights the last step still owes land (per-layer waits: at the next forward)
        return {n: p.detach().clone() for n, p in model.named_parameters()}

    def snapshot() -> dict:
        return {"weights": weights(), "state": opt.state_dict(), "lr": opt.param_groups[0]["lr"]}

    try:
        step = 0
        if spec.get("load"):
            step = luwu.load_checkpoint(opt, spec["load"])
            out["loaded"] = snapshot() | {"step": step}
        for i in range(spec["steps"]):
            if i == spec.get("save_at") and rank == 0:
                out["saved"] = snapshot() | {
                    "step": step,
                    "folder": str(luwu.save_checkpoint(opt, spec["save"])),
                }
            train_step(opt, model, step, rank)
            step += 1
            out["after"].append(weights())
    finally:
        opt.close()
    return out


def fsdp_rank(spec: dict, rank: int, world: int) -> dict:
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        get_state_dict,
        set_state_dict,
    )
    from torch.distributed.fsdp import fully_shard

    dist.init_process_group("gloo", rank=rank, world_size=world)
    model = make_model(spec["seed"])
    for layer in model:
        if isinstance(layer, torch.nn.Linear):
            fully_shard(layer)
    fully_shard(model)
    opt = torch.optim.AdamW(
        model.parameters(), lr=spec["lr"], weight_decay=spec.get("weight_decay", 0.01)
    )
    full = StateDictOptions(full_state_dict=True)  # every rank gets the whole tensors
    out: dict = {"after": []}

    def snapshot() -> dict:  # (copies: torch's state dict holds the optimizer's own step tensors)
        msd, osd = copy.deepcopy(get_state_dict(model, opt, options=full))
        return {"weights": msd, "state": osd["state"], "groups": osd["param_groups"]}

    step = 0
    if spec.get("load"):
        msd, osd = get_state_dict(model, opt)
        sd = {"model": msd, "optim": osd}
        dcp.load(sd, checkpoint_id=spec["load"])
        set_state_dict(model, opt, model_state_dict=sd["model"], optim_state_dict=sd["optim"])
        out["loaded"] = snapshot()
        step = int(max(float(s["step"]) for s in out["loaded"]["state"].values()))
    for i in range(spec["steps"]):
        if i == spec.get("save_at"):
            msd, osd = get_state_dict(model, opt)
            dcp.save({"model": msd, "optim": osd}, checkpoint_id=spec["save"])
            out["saved"] = snapshot() | {"step": step}
        train_step(opt, model, step, rank)
        step += 1
        out["after"].append(copy.deepcopy(get_state_dict(model, opt, options=full)[0]))
    # Both ranks arrive before either tears gloo down: a rank that destroys its group while the other
    # still finishes its last collective can abort it ("terminate called without an active exception")
    dist.barrier()
    dist.destroy_process_group()
    return out


def main() -> None:
    with open(sys.argv[1]) as f:
        spec = json.load(f)
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    out = (luwu_rank if spec["role"] == "luwu" else fsdp_rank)(spec, rank, world)
    torch.save(out, f"{spec['out']}.rank{rank}")


if __name__ == "__main__":
    main()
