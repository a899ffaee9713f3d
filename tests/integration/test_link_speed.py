"""``compression.link_gbps = "auto"`` on real nodes over loopback: measured per node link, told wins, on /metrics."""

import dataclasses
import urllib.request

import pytest
import torch

import luwu
from luwu.protocol.compression import CompressionConfig
from luwu.protocol.policy import choose_codec, choose_pull_codec


def big_model() -> torch.nn.Module:
    """Large matrices only: their codecs are the same anywhere from ~8 to ~50 Gbit/s."""
    torch.manual_seed(0)
    return torch.nn.Sequential(*(torch.nn.Linear(1024, 1024, bias=False) for _ in range(4)))


def codecs_at(opt, cfg: CompressionConfig) -> list[tuple[str, str]]:
    """(push, reply) codec of every bucket after the warm-up, decided at ``cfg``."""
    step = cfg.warmup_steps
    return [
        (choose_codec(b, step, cfg)[0], choose_pull_codec(b, step, cfg)) for b in opt.layout.buckets
    ]


def train(opt, model, steps: int) -> None:
    for _ in range(steps):
        opt.zero_grad()
        model(torch.randn(4, 1024)).square().mean().backward()
        opt.step()


@pytest.mark.timeout(120)
def test_auto_measures_loopback_as_fast_and_shows_it_on_metrics(cluster2):
    model = big_model()
    opt = luwu.RemoteOptimizer(
        model, nodes=cluster2.addresses, lr=1e-3, timeout_s=30, metrics_port=0
    )
    try:
        assert opt.config.compression.link_gbps == "auto"
        links = opt._links
        measured = [links.gbps(n) for n in range(2)]
        assert all(g >= 10 for g in measured), f"loopback measured at {measured} Gbit/s"
        decided = [choose_codec(b, 10, links.config(b.node))[0] for b in opt.layout.buckets]
        replies = [choose_pull_codec(b, 10, links.config(b.node)) for b in opt.layout.buckets]
        told40 = codecs_at(opt, dataclasses.replace(opt.config.compression, link_gbps=40.0))
        assert list(zip(decided, replies)) == told40
        assert opt._hold_replies  # as told 40 Gbit/s (>= 10)
        train(opt, model, 3)
        text = urllib.request.urlopen(opt.metrics_url + "/metrics", timeout=10).read().decode()
        for n in range(2):
            line = next(
                ln
                for ln in text.splitlines()
                if ln.startswith(f'luwu_worker_link_gbps{{node="{n}"}}')
            )
            assert float(line.split()[-1]) == pytest.approx(measured[n])
        push = told40[0][0]
        assert f'luwu_worker_link_buckets{{codec="{push}",direction="push",node="0"}}' in text
    finally:
        opt.close()


@pytest.mark.timeout(120)
def test_a_told_speed_wins_over_any_measurement(cluster2):
    model = big_model()
    told = CompressionConfig(link_gbps=1.0)
    opt = luwu.RemoteOptimizer(
        model, nodes=cluster2.addresses, lr=1e-3, timeout_s=30, compression=told, registry=None
    )
    try:
        links = opt._links
        assert [links.gbps(n) for n in range(2)] == [1.0, 1.0]
        assert all(link.probe == 0.0 and link.rule.decided is None for link in links.links), (
            "told: nothing probed"
        )
        assert all(links.config(n) is opt.config.compression for n in range(2))
        assert set(codecs_at(opt, opt.config.compression)) == {("int8", "bf16_steps")}
        assert not opt._hold_replies  # a 1 Gbit/s link: replies come after step() anyway
        train(opt, model, 2)
        assert opt.metrics.registry.get_sample_value("luwu_worker_link_gbps", {"node": "1"}) == 1.0
        assert (
            opt.metrics.registry.get_sample_value(
                "luwu_worker_link_buckets", {"node": "0", "direction": "push", "codec": "int8"}
            )
            >= 1
        )
    finally:
        opt.close()
