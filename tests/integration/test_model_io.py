"""Weights out of the nodes as a torch.distributed.checkpoint folder: written by the nodes in parallel,
loaded by a plain torch model and converted by torch's dcp_to_torch_save, equal to model_state_dict()."""

import math
import os
import random

import pytest
import torch

import luwu
from luwu.switch_nodes.export import boxes


def test_boxes_tile_any_flat_range_of_any_shape():
    rng = random.Random(0)
    for shape in [(7,), (5, 6), (3, 4, 5), (2, 3, 1, 4), (1,), (6, 1)]:
        n = math.prod(shape)
        ref = torch.arange(n).view(shape)
        for _ in range(60):
            a = rng.randrange(n)
            b = rng.randrange(a + 1, n + 1)
            got = []
            for offsets, sizes in boxes(shape, a, b):
                index = tuple(slice(o, o + s) for o, s in zip(offsets, sizes))
                got.append(ref[index].reshape(-1))
            assert torch.equal(torch.cat(got), torch.arange(a, b)), (shape, a, b)
            assert len(boxes(shape, a, b)) <= 2 * len(shape) - 1


def _train(opt, model, steps):
    g = torch.Generator().manual_seed(1)
    for _ in range(steps):
        x, y = torch.randn(4, 20, generator=g), torch.randint(0, 5, (4,), generator=g)
        opt.zero_grad()
        torch.nn.functional.cross_entropy(model(x), y).backward()
        opt.step()


@pytest.mark.timeout(180)
@pytest.mark.parametrize("stream", [True, False], ids=["streaming", "resident"])
def test_the_nodes_export_a_dcp_folder_that_plain_torch_loads(tmp_path, stream):
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save
    from workers.stream import make_model

    spec = {"seed": 0, "blocks": 3, "width": 16}
    model = make_model(spec)
    with luwu.local_cluster(2, node_args=["--node.export_root", str(tmp_path)]) as c:
        # 700-byte buckets: most parameters are split between buckets and nodes, mid-row
        opt = luwu.RemoteOptimizer(
            model if stream else model.named_parameters(),
            nodes=c.addresses,
            lr=0.01,
            compression=False,
            stream_weights=stream,
            bucket_bytes=700,
            rank=0,
            world_size=1,
        )
        try:
            _train(opt, model, 3)
            want = (
                opt.model_state_dict()
                if stream
                else {n: p.detach().clone() for n, p in model.named_parameters()}
            )
            folder = luwu.export_dcp(opt, tmp_path / "export")
            with pytest.raises(luwu.LuwuError, match="exists: export into a new folder"):
                luwu.export_dcp(opt, tmp_path / "export")
            with pytest.raises(luwu.LuwuError, match="outside node .* export root"):
                luwu.export_dcp(opt, tmp_path.parent / "elsewhere")
        finally:
            opt.close()
    assert sorted(os.listdir(folder)) == [".metadata", "__0_0.distcp", "__1_0.distcp"]
    plain = make_model(dict(spec, seed=7))  # other weights: all of them must come from the folder
    sd = plain.state_dict()
    dcp.load(sd, checkpoint_id=str(folder), no_dist=True)
    assert sd.keys() == want.keys()
    for name, w in want.items():
        assert torch.equal(sd[name], w), name
    dcp_to_torch_save(str(folder), str(tmp_path / "model.pt"))
    saved = torch.load(tmp_path / "model.pt")
    assert all(torch.equal(saved[n], w) for n, w in want.items())


@pytest.mark.timeout(120)
def test_an_export_needs_an_export_root(cluster1, tmp_path):
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 2))
    opt = luwu.RemoteOptimizer(
        model.parameters(),
        nodes=cluster1.addresses,
        lr=0.01,
        compression=False,
        rank=0,
        world_size=1,
    )
    try:
        with pytest.raises(luwu.LuwuError, match="no export root: set node.export_root"):
            luwu.export_dcp(opt, tmp_path / "x")
    finally:
        opt.close()
    assert not (tmp_path / "x").exists()


@pytest.mark.timeout(180)
@pytest.mark.parametrize("source", ["state_dict_file", "dcp_folder"])
def test_a_meta_model_starts_from_weights_read_unit_by_unit(tmp_path, source):
    """optimizer.init_weights: a model built on the meta device is seeded from a torch state-dict file
    (opened with mmap) or from a DCP folder written by export_dcp, one unit at a time; training then equals
    local AdamW started from those weights."""
    from workers.stream import Net, make_model

    spec = {"seed": 3, "blocks": 3, "width": 16}
    trained = make_model(spec)
    if source == "state_dict_file":
        path = tmp_path / "weights.pt"
        torch.save(trained.state_dict(), path)
    else:  # the weights a previous job's nodes exported
        with luwu.local_cluster(2, node_args=["--node.export_root", str(tmp_path)]) as c:
            opt = luwu.RemoteOptimizer(
                trained.named_parameters(),
                nodes=c.addresses,
                lr=0.01,
                compression=False,
                rank=0,
                world_size=1,
                bucket_bytes=700,
            )
            try:
                path = luwu.export_dcp(opt, tmp_path / "previous")
            finally:
                opt.close()
    with luwu.local_cluster(2) as c:
        with torch.device("meta"):
            model = Net(3, 16)
        opt = luwu.RemoteOptimizer(
            model,
            nodes=c.addresses,
            lr=0.01,
            compression=False,
            stream_weights=True,
            bucket_bytes=1024,
            rank=0,
            world_size=1,
            init_weights=str(path),
        )
        try:
            start = opt.model_state_dict()
            assert all(torch.equal(start[n], p.detach()) for n, p in trained.named_parameters())
            _train(opt, model, 3)
            got = opt.model_state_dict()
        finally:
            opt.close()
    local = torch.optim.AdamW(trained.parameters(), lr=0.01)
    _train(local, trained, 3)
    for name, p in trained.named_parameters():
        torch.testing.assert_close(
            got[name], p.detach(), rtol=1e-6, atol=1e-6, msg=lambda m, name=name: f"{name}: {m}"
        )


def test_init_weights_are_checked_before_anything_starts(tmp_path):
    from workers.stream import Net

    torch.save({"inp.weight": torch.zeros(3)}, tmp_path / "bad.pt")
    with torch.device("meta"):
        model = Net(2, 8)
    with pytest.raises(luwu.ConfigError, match="lacks .* of the model's parameters"):
        luwu.RemoteOptimizer(
            model,
            nodes=["tcp://127.0.0.1:9"],
            lr=0.01,
            stream_weights=True,
            rank=0,
            world_size=1,
            init_weights=str(tmp_path / "bad.pt"),
        )
    with pytest.raises(luwu.ConfigError, match="does not exist"):
        luwu.RemoteOptimizer(
            model,
            nodes=["tcp://127.0.0.1:9"],
            lr=0.01,
            stream_weights=True,
            rank=0,
            world_size=1,
            init_weights=str(tmp_path / "none.pt"),
        )


class _TiedLM(torch.nn.Module):
    """An embedding tied to the output head, and a buffer: model.state_dict() has both names of the tied
    weight (named_parameters() one) and the buffer."""

    def __init__(self):
        super().__init__()
        self.emb = torch.nn.Embedding(11, 8)
        self.norm = torch.nn.BatchNorm1d(8)
        self.head = torch.nn.Linear(8, 11, bias=False)
        self.head.weight = self.emb.weight

    def forward(self, tokens):
        return self.head(self.norm(self.emb(tokens)))


@pytest.mark.timeout(60)
def test_model_state_dict_has_the_models_keys_with_tied_weights(cluster1):
    torch.manual_seed(0)
    model = _TiedLM()
    opt = luwu.RemoteOptimizer(model, "adamw", nodes=cluster1.addresses, lr=0.01, compression=False)
    try:
        for step in range(2):
            opt.zero_grad()
            torch.nn.functional.cross_entropy(
                model(torch.arange(11)), torch.arange(11).roll(step + 1)
            ).backward()
            opt.step()
        sd = opt.model_state_dict()
        want = model.state_dict()
        assert list(sd) == list(want)  # head.weight and the BatchNorm buffers included
        assert sd["head.weight"] is sd["emb.weight"]  # one copy, tied as in the model
        fresh = _TiedLM()
        fresh.load_state_dict(sd)  # strict: every key
        for k, v in want.items():
            assert torch.equal(fresh.state_dict()[k], v), k
    finally:
        opt.close()


def test_a_misspelt_keyword_is_told_the_closest_name():
    """Refused in the constructor, before any connection (the address is never dialled)."""
    model = torch.nn.Linear(4, 2)
    with pytest.raises(
        luwu.ConfigError,
        match=r"stream_weight=True is not a RemoteOptimizer keyword.*did you mean 'stream_weights' \(a RemoteOptimizer keyword\)",
    ):
        luwu.RemoteOptimizer(model, "adamw", nodes=["tcp://127.0.0.1:9"], stream_weight=True)
    with pytest.raises(
        luwu.ConfigError, match=r"did you mean 'weight_decay' \(a hyperparameter of 'adamw'\)"
    ):
        luwu.RemoteOptimizer(model, "adamw", nodes=["tcp://127.0.0.1:9"], weight_decy=0.1)
