"""2 workers x 2 nodes, real processes: the nodes' optimizer equals torch.optim on the concatenated batch."""

import pytest
from harness import assert_params_close, run_training
from workers.train import reference  # noqa: E402

CASES = {
    "adamw": {"optimizer": "adamw", "hyper": {"lr": 0.01, "weight_decay": 0.05}},
    "adam": {"optimizer": "adam", "hyper": {"lr": 0.01, "weight_decay": 0.01}},
    "sgd_nesterov": {
        "optimizer": "sgd",
        "hyper": {"lr": 0.05, "momentum": 0.9, "nesterov": True, "weight_decay": 1e-3},
    },
    "sgd_plain": {"optimizer": "sgd", "hyper": {"lr": 0.05}},
}


@pytest.mark.timeout(180)
@pytest.mark.parametrize("name", sorted(CASES))
def test_two_workers_two_nodes_equal_local_torch(name, cluster2, tmp_path):
    spec = dict(CASES[name], steps=20)
    results = run_training(spec, cluster2.addresses, tmp_path)
    want, want_losses = reference(dict(spec, world_size=2))
    for r in results:
        assert_params_close(r["params"], want)
    # both workers hold identical weights
    assert_params_close(results[0]["params"], results[1]["params"], rtol=0, atol=0)


def _pushed(**kw) -> tuple[int, object]:
    """Bytes one worker pushes for one step of a 512 x 512 matrix on a fresh node; and its resolved config."""
    import torch

    import luwu

    model = torch.nn.Linear(
        512, 512, bias=False
    )  # one large matrix: the default policy compresses it
    with luwu.local_cluster(1) as c:
        opt = luwu.RemoteOptimizer(model, nodes=c.addresses, lr=0.01, **kw)
        try:
            before = opt.client.bytes_sent  # after the fp32 INIT that seeds the node
            opt.zero_grad()
            model(torch.ones(2, 512)).sum().backward()
            opt.step()
            opt.synchronize()  # (per-layer waits: step() returns with the pushes queued)
            return opt.client.bytes_sent - before, opt.config
        finally:
            opt.close()


@pytest.mark.timeout(90)
def test_python_api_honours_luwu_env_and_keywords_win(monkeypatch):
    raw = 4 * 512 * 512
    # the link told: measured ("auto", the default) on loopback, a fast measurement makes fp32 pay
    # and the bytes would say nothing of whether compression is on
    monkeypatch.setenv("LUWU_COMPRESSION__LINK_GBPS", "1")
    sent, cfg = _pushed()
    assert cfg.compression.enabled and sent < 0.6 * raw  # on by default: the bf16 warm-up
    monkeypatch.setenv("LUWU_COMPRESSION__ENABLED", "false")
    monkeypatch.setenv("LUWU_TRANSPORT__TIMEOUT_S", "17")
    sent, cfg = _pushed()
    assert cfg.sources["compression.enabled"] == "env LUWU_COMPRESSION__ENABLED"
    assert cfg.transport.timeout_s == 17.0 and sent >= raw  # fp32 both ways
    sent, cfg = _pushed(compression=True, timeout_s=9)
    assert cfg.transport.timeout_s == 9.0 and sent < 0.6 * raw  # keywords over env


@pytest.mark.timeout(60)
def test_from_config_builds_everything_from_the_cluster_file(cluster2, tmp_path):
    import torch

    import luwu
    from luwu.config import load_config

    f = tmp_path / "cluster.toml"
    nodes = ", ".join(f'"{a}"' for a in cluster2.addresses)
    f.write_text(
        f"[cluster]\nnodes = [{nodes}]\ncapacities = [1.0, 3.0]\n[compression]\nenabled = false\n[transport]\nbucket_bytes = 1024\ntimeout_s = 20.0\n"
    )
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Tanh(), torch.nn.Linear(32, 4))
    ref = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Tanh(), torch.nn.Linear(32, 4))
    ref.load_state_dict(model.state_dict())
    opt = luwu.RemoteOptimizer.from_config(
        model,
        load_config(str(f), env={"LUWU_TRANSPORT__JOIN_SECRET": cluster2.join_secret}),
        lr=0.01,
        rank=0,
        world_size=1,
    )
    lopt = torch.optim.AdamW(ref.parameters(), lr=0.01)
    try:
        assert opt.nodes == cluster2.addresses and opt.capacities == [1.0, 3.0]
        assert opt.config.transport.timeout_s == 20.0 and not opt.config.compression.enabled
        per_node = [sum(b.numel for b in opt.layout.buckets_of(n)) for n in range(2)]
        assert per_node[1] > per_node[0]  # the layout weighs the nodes by capacity
        x = torch.randn(8, 16)
        for m, o in ((model, opt), (ref, lopt)):
            for _ in range(3):
                o.zero_grad()
                m(x).square().mean().backward()
                o.step()
        assert_params_close(list(model.parameters()), list(ref.parameters()))
        report = opt.last_report  # what the worker's step reported
        assert (report.step, report.skipped, report.grad_norm, report.delayed) == (
            2,
            False,
            None,
            False,
        )
    finally:
        opt.close()
