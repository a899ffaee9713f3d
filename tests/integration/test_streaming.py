"""Streaming mode, 2 workers x 2 nodes in real processes: a worker that holds no weights of its blocks
between uses trains exactly as local torch AdamW does (compression off)."""

import time

import pytest
import torch
from harness import STREAM, kill_node_after_step, run_streaming, start_workers, wait_all
from workers.stream import reference  # noqa: E402

RTOL, ATOL = 1e-6, 1e-6


def assert_equals_reference(
    results: list[dict], spec: dict, rtol: float = RTOL, atol: float = ATOL
) -> None:
    want, want_eval = reference(dict(spec, world_size=2))
    for r in results:
        assert r["params"].keys() == want.keys()
        for name, w in want.items():
            torch.testing.assert_close(
                r["params"][name], w, rtol=rtol, atol=atol, msg=lambda m, name=name: f"{name}: {m}"
            )
        assert r["eval_loss"] == pytest.approx(want_eval, rel=1e-6, abs=1e-6)


def lockstep(ref, local, model, opt, steps: int = 4, forward=None) -> list[int]:
    """Train ``ref`` with ``local`` (torch) and ``model`` with the streaming ``opt`` on the same batches
    (``forward(net, x, streaming)``: default ``net(x)``); after each step the streamed units hold
    nothing, at the end the nodes' weights equal torch's. Returns the units fetched in each step."""
    forward = forward or (lambda net, x, streaming: net(x))
    fetched = []
    for step in range(steps):
        g = torch.Generator().manual_seed(step)
        x, y = torch.randn(4, 20, generator=g), torch.randint(0, 5, (4,), generator=g)
        before = opt.streamer.fetches
        for net, o, streaming in ((ref, local, False), (model, opt, True)):
            o.zero_grad()
            torch.nn.functional.cross_entropy(forward(net, x, streaming), y).backward()
            o.step()
        fetched.append(opt.streamer.fetches - before)
        assert opt.streamer.resident_bytes() == 0
    got = opt.model_state_dict()
    for name, p in ref.named_parameters():
        torch.testing.assert_close(
            got[name], p.detach(), rtol=RTOL, atol=ATOL, msg=lambda m, name=name: f"{name}: {m}"
        )
    return fetched


def probing(probe, seen: list):
    """A ``lockstep`` forward that appends ``probe()`` to ``seen`` after each streaming forward."""

    def forward(net, x, streaming):
        out = net(x)
        if streaming:
            seen.append(probe())
        return out

    return forward


@pytest.mark.timeout(240)
def test_streaming_equals_local_adamw_and_holds_no_weights_between_steps(cluster2, tmp_path):
    spec = {"steps": 10}
    results = run_streaming(spec, cluster2.addresses, tmp_path)
    assert_equals_reference(results, spec)
    for r in results:
        assert r["num_units"] == 4 and r["num_streamed"] == 4 * 6
        assert r["held_after_step"] == [0] * 10  # no storage for the streamed blocks between steps
        assert r["same_as_resident"] == [True, True]  # and the module still works as a module
        ev = r[
            "evaluation"
        ]  # eval under no_grad: every block fetched once, nothing pushed, nothing kept
        assert (
            ev["pushes"] == 0
            and ev["units_fetched"] == 4
            and ev["pulls"] > 0
            and ev["held_after"] == 0
        )
        # The nodes send the first 2 units' new weights with the answers to their pushes, and those of the
        # units after them whose replies fit optimizer.stream_hold_bytes (by default two blocks of fp32: the
        # other two blocks' fp32 replies): after the first step forward asks for none of the four (step 1
        # follows a model_state_dict(), which fetched and released every unit).
        first = set(r["first_units"])
        assert first and first <= set(r["forward_pulls"][0])
        for step in range(2, 10):
            assert not r["forward_pulls"].get(step), (step, r["forward_pulls"].get(step))
    torch.testing.assert_close(results[0]["params"], results[1]["params"], rtol=0, atol=0)


@pytest.mark.timeout(240)
def test_no_sync_accumulates_micro_batches_on_the_nodes(cluster2, tmp_path):
    """Gradient accumulation in streaming mode: each micro-batch's unit gradients are pushed as partial
    sums (the worker keeps none of them) and the nodes add them up; 3 micro-batches per step equal
    local AdamW on the accumulated gradient."""
    spec = {"steps": 5, "accumulate": 3}
    results = run_streaming(spec, cluster2.addresses, tmp_path)
    assert_equals_reference(results, spec, rtol=1e-5, atol=1e-6)
    for r in results:
        assert r["held_after_step"] == [0] * 5
        assert (
            r["partial_pushes"] == 5 * 2 * r["streamed_buckets"] > 0
        )  # 2 of 3 micro-batches per step, every streamed bucket


@pytest.mark.timeout(240)
def test_streaming_with_lr_scheduler_equals_local_torch(cluster2, tmp_path):
    spec = {"steps": 8, "scheduler": ["StepLR", {"step_size": 3, "gamma": 0.5}], "prefetch": 1}
    results = run_streaming(spec, cluster2.addresses, tmp_path)
    assert_equals_reference(results, spec)
    assert results[0]["lrs"] == [0.01 * 0.5**2]


@pytest.mark.timeout(240)
def test_streaming_with_clipping_and_scheduler_equals_local_torch(cluster2, tmp_path):
    spec = {
        "steps": 8,
        "max_grad_norm": 0.05,
        "scheduler": ["StepLR", {"step_size": 3, "gamma": 0.5}],
        "prefetch": 0,
    }
    results = run_streaming(spec, cluster2.addresses, tmp_path)
    # The global norm is summed per bucket, torch sums it per parameter: the clip coefficient may differ
    # in its last bit, and AdamW turns that into ~1e-6 on the few elements whose second moment is tiny
    # (resident mode on this model differs from torch by ~1e-6 at the same element); the loss agrees.
    assert_equals_reference(results, spec, rtol=1e-4, atol=1e-5)


@pytest.mark.timeout(120)
def test_activation_checkpointing_recomputes_on_the_fetched_weights(cluster1):
    """``torch.utils.checkpoint`` re-enters a unit's forward during backward: the weights fetched for
    that backward serve the recomputation (not released in between), and training equals local AdamW."""
    from torch.utils.checkpoint import checkpoint
    from workers.stream import make_model

    import luwu

    spec = {"seed": 0, "blocks": 3, "width": 16}
    ref, model = make_model(spec), make_model(spec)

    def forward(net, x, ck):
        x = net.inp(x)
        for b in net.blocks:
            x = checkpoint(b, x, use_reentrant=False) if ck else b(x)
        return net.head(x)

    local = torch.optim.AdamW(ref.parameters(), lr=0.01)
    opt = luwu.RemoteOptimizer(
        model,
        nodes=cluster1.addresses,
        lr=0.01,
        compression=False,
        stream_weights=True,
        bucket_bytes=1024,
        rank=0,
        world_size=1,
    )
    try:
        lockstep(ref, local, model, opt, forward=forward)
    finally:
        opt.close()


@pytest.mark.timeout(120)
def test_grad_scaler_skips_and_backs_off_in_streaming_mode(cluster1):
    """AMP's GradScaler drives a streaming optimizer: an inf in one block's gradient makes the nodes skip
    the step and the scaler back off, as local torch does; the weights stay equal."""
    from workers.stream import make_model

    import luwu

    spec = {"seed": 0, "blocks": 3, "width": 16}
    ref, model = make_model(spec), make_model(spec)
    local = torch.optim.AdamW(ref.parameters(), lr=0.01)
    opt = luwu.RemoteOptimizer(
        model,
        nodes=cluster1.addresses,
        lr=0.01,
        compression=False,
        stream_weights=True,
        bucket_bytes=1024,
        rank=0,
        world_size=1,
        amp=True,
    )
    scalers = [torch.amp.GradScaler("cpu", init_scale=2.0**10) for _ in range(2)]
    try:
        for step in range(5):
            g = torch.Generator().manual_seed(step)
            x, y = torch.randn(4, 20, generator=g), torch.randint(0, 5, (4,), generator=g)
            for net, o, scaler in ((ref, local, scalers[0]), (model, opt, scalers[1])):
                o.zero_grad()
                hook = (
                    net.blocks[1].fc1.weight.register_hook(lambda g: g * float("inf"))
                    if step == 2
                    else None
                )
                scaler.scale(torch.nn.functional.cross_entropy(net(x), y)).backward()
                if hook is not None:
                    hook.remove()
                scaler.step(o)
                scaler.update()
        assert scalers[0].get_scale() == scalers[1].get_scale() == 2.0**9
        got = opt.model_state_dict()
        for name, p in ref.named_parameters():
            torch.testing.assert_close(
                got[name], p.detach(), rtol=1e-6, atol=1e-6, msg=lambda m, name=name: f"{name}: {m}"
            )
    finally:
        opt.close()


@pytest.mark.timeout(120)
def test_with_compression_units_travel_in_int8_and_model_state_dict_is_fp32(cluster1):
    """Compression on: each unit's weights travel as int8 blocks (bf16 in the warm-up) and are widened
    into the fp32 parameters, its gradients go int8 without a residual; ``model_state_dict()`` still
    gives the nodes' fp32 master weights."""
    from workers.stream import make_model

    import luwu
    from luwu.protocol.compression import CompressionConfig

    received, sent = {}, {}
    # the link told (1 Gbit/s): measured on loopback it can be fast enough for fp32 to pay
    for name, compression in (
        ("fp32", False),
        ("bf16", CompressionConfig(link_gbps=1.0)),
        ("int8", CompressionConfig(warmup_steps=0, link_gbps=1.0)),
    ):
        model = make_model({"seed": 0, "blocks": 3, "width": 256})
        with luwu.local_cluster(1) as c:
            opt = luwu.RemoteOptimizer(
                model,
                nodes=c.addresses,
                lr=1e-3,
                compression=compression,
                stream_weights=True,
                rank=0,
                world_size=1,
            )
            try:
                x, y = torch.randn(8, 20), torch.randint(0, 5, (8,))
                for _ in range(2):
                    before, before_sent = opt.client.bytes_received, opt.client.bytes_sent
                    opt.zero_grad()
                    torch.nn.functional.cross_entropy(model(x), y).backward()
                    opt.step()
                received[name], sent[name] = (
                    opt.client.bytes_received - before,
                    opt.client.bytes_sent - before_sent,
                )
                w = opt.model_state_dict()["blocks.0.fc1.weight"]
                assert w.dtype == torch.float32 and not torch.equal(
                    w, w.bfloat16().float()
                )  # not rounded to bf16
            finally:
                opt.close()
    assert received["bf16"] < 0.55 * received["fp32"]
    assert received["int8"] < 0.32 * received["fp32"] and sent["int8"] < 0.32 * sent["fp32"], (
        received,
        sent,
    )


@pytest.mark.timeout(300)
def test_sigkill_node_mid_training_streaming_workers_recover_and_equal_local_torch(tmp_path):
    """A node is SIGKILLed and restarted from its checkpoint while streaming workers train: the error
    reaches them in step() or inside forward / backward (where a streaming worker waits for weights and
    acknowledgements), recover() rolls every node back, and the final weights equal local torch."""
    import os
    import random

    import luwu

    kill_at = random.Random(os.environ.get("LUWU_TEST_SEED", time.time_ns())).randint(6, 16)
    print(f"killing node 1 after step {kill_at}")
    spec = {"steps": 22, "resilient": True, "step_sleep": 0.03, "timeout_s": 20.0}
    args = ["--node.checkpoint_dir", str(tmp_path / "ckpt"), "--node.checkpoint_every", "5"]
    with luwu.local_cluster(2, node_args=args) as cluster:
        run = dict(spec, nodes=cluster.addresses, world_size=2, out=str(tmp_path / "res"))
        procs = start_workers(STREAM, run, 2, tmp_path)
        seen = kill_node_after_step(cluster, procs[0], kill_at)
        outs = wait_all(procs, 200)
    results = [torch.load(f"{run['out']}.rank{r}") for r in range(2)]
    assert all(r["recoveries"] >= 1 for r in results), "".join(seen) + outs[0][-3000:]
    assert_equals_reference(results, spec)
    for r in results:
        assert r["held_after_step"] == [0] * spec["steps"]


@pytest.mark.timeout(120)
@pytest.mark.parametrize("hold", [-1, 0], ids=["forward-kept-for-backward", "fetched-twice"])
def test_fetch_waits_are_on_the_workers_metrics_endpoint(cluster1, monkeypatch, hold):
    """A real scrape of the worker's /metrics: the weight-fetch wait per step and per streamed unit, and how
    often each unit was fetched."""
    import urllib.request

    from workers.stream import make_model

    import luwu

    monkeypatch.setenv("LUWU_OPTIMIZER__STREAM_HOLD_BYTES", str(hold))
    model = make_model({"seed": 0, "blocks": 3, "width": 16})
    opt = luwu.RemoteOptimizer(
        model,
        nodes=cluster1.addresses,
        lr=0.01,
        compression=False,
        stream_weights=True,
        bucket_bytes=1024,
        rank=0,
        world_size=1,
        metrics_port=0,
    )
    try:
        for step in range(3):
            g = torch.Generator().manual_seed(step)
            x, y = torch.randn(4, 20, generator=g), torch.randint(0, 5, (4,), generator=g)
            opt.zero_grad()
            torch.nn.functional.cross_entropy(model(x), y).backward()
            opt.step()
        text = urllib.request.urlopen(f"{opt.metrics_url}/metrics", timeout=10).read().decode()
    finally:
        opt.close()
    samples = {
        line.rsplit(" ", 1)[0]: float(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        if line and not line.startswith("#")
    }
    assert samples["luwu_worker_fetch_wait_seconds_count"] == 3
    for i in range(
        3
    ):  # the last max(1, prefetch) = 2 blocks of the forward stay for their backward, right after;
        # the first is fetched again for its backward (6 fetches in 3 steps) unless its forward's reply was kept
        assert samples[f'luwu_worker_unit_fetches_total{{unit="blocks.{i}"}}'] == (
            6 if i == 0 and hold == 0 else 3
        )
        assert samples[f'luwu_worker_unit_fetch_wait_seconds_total{{unit="blocks.{i}"}}'] > 0


@pytest.mark.timeout(180)
def test_a_model_built_on_the_meta_device_starts_as_the_eager_one(cluster2, tmp_path):
    """``with torch.device("meta")``: the optimizer initializes one unit at a time (reset_parameters in
    module order) and seeds the nodes; with the same seed that is the eager start, and training from it
    equals local AdamW. Two workers: rank 1 never initializes anything the nodes keep."""
    spec = {"steps": 3, "meta": True}
    results = run_streaming(spec, cluster2.addresses, tmp_path)
    assert_equals_reference(results, spec)
    for r in results:
        assert (
            r["initial_equals_eager"] and 0 < r["peak_unit_bytes"] <= r["largest_unit_bytes"]
        )  # one block allocated at a time


@pytest.mark.timeout(60)
def test_a_meta_module_without_reset_parameters_is_refused_by_name(cluster1):
    import luwu

    class Scale(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.w = torch.nn.Parameter(torch.ones(8))

        def forward(self, x):
            return x * self.w

    with torch.device("meta"):
        model = torch.nn.Sequential(torch.nn.Linear(8, 8), Scale(), torch.nn.Linear(8, 8))
    with pytest.raises(
        luwu.ConfigError,
        match=r"module '1' \(Scale\) has parameters or buffers on the meta device and no reset_parameters",
    ):
        luwu.RemoteOptimizer(
            model, nodes=cluster1.addresses, lr=0.01, stream_weights=True, rank=0, world_size=1
        )


@pytest.mark.timeout(120)
def test_keeping_units_for_backward_fetches_once_a_step(cluster1, monkeypatch):
    """optimizer.stream_keep_for_backward: a unit's weights stay from its forward to its backward (FSDP2's
    reshard_after_forward=False): one fetch per unit a step instead of two, the same training."""
    from workers.stream import make_model

    import luwu

    monkeypatch.setenv("LUWU_OPTIMIZER__STREAM_KEEP_FOR_BACKWARD", "true")
    spec = {"seed": 0, "blocks": 3, "width": 16}
    ref, model = make_model(spec), make_model(spec)
    local = torch.optim.AdamW(ref.parameters(), lr=0.01)
    opt = luwu.RemoteOptimizer(
        model,
        nodes=cluster1.addresses,
        lr=0.01,
        compression=False,
        stream_weights=True,
        bucket_bytes=1024,
        rank=0,
        world_size=1,
    )
    kept = []
    try:
        assert opt.config.optimizer.stream_keep_for_backward
        assert lockstep(
            ref, local, model, opt, forward=probing(lambda: opt.streamer.reply_bytes_kept(), kept)
        ) == [3, 3, 3, 3]  # three blocks, each fetched once (forward), kept for backward
        assert kept == [0] * 4  # the weights are kept, not also the replies they were written from
    finally:
        opt.close()


@pytest.mark.timeout(120)
def test_param_groups_stream_with_the_model_named_apart(cluster1):
    """``RemoteOptimizer(groups, model=model, stream_weights=True)``: GPT-style groups (weight decay on
    matrices, none on biases) in streaming mode equal local AdamW with the same groups."""
    from workers.stream import make_model

    import luwu

    spec = {"seed": 0, "blocks": 3, "width": 16}
    ref, model = make_model(spec), make_model(spec)

    def groups(net):
        return [
            {"params": [p for p in net.parameters() if p.ndim >= 2], "weight_decay": 0.5},
            {"params": [p for p in net.parameters() if p.ndim < 2], "weight_decay": 0.0},
        ]

    local = torch.optim.AdamW(groups(ref), lr=0.01)
    opt = luwu.RemoteOptimizer(
        groups(model),
        nodes=cluster1.addresses,
        lr=0.01,
        compression=False,
        stream_weights=True,
        model=model,
        bucket_bytes=1024,
        rank=0,
        world_size=1,
    )
    try:
        assert opt.streamer is not None and [g["weight_decay"] for g in opt.param_groups] == [
            0.5,
            0.0,
        ]
        lockstep(ref, local, model, opt)
    finally:
        opt.close()
    with pytest.raises(luwu.ConfigError, match="needs stream_weights"):
        luwu.RemoteOptimizer(
            groups(model), nodes=cluster1.addresses, lr=0.01, model=model, rank=0, world_size=1
        )


@pytest.mark.timeout(120)
@pytest.mark.parametrize("hold", [-1, 0], ids=["default", "off"])
def test_a_units_forward_reply_is_kept_for_its_backward_within_the_budget(
    cluster1, monkeypatch, hold
):
    """optimizer.stream_hold_bytes: what a unit's forward was written from stays, as it travelled, until its
    backward writes it again, for the units that fit (forward order); the others are fetched again. The
    default budget, two units of fp32, keeps two of the four blocks before the turn in fp32 replies; the
    training is the same, and nothing is held between steps. The same budget has the next step's weights of
    as many blocks sent with the answers to their pushes."""
    from workers.stream import make_model

    import luwu

    monkeypatch.setenv("LUWU_OPTIMIZER__STREAM_HOLD_BYTES", str(hold))
    spec = {"seed": 0, "blocks": 6, "width": 16}
    ref, model = make_model(spec), make_model(spec)
    unit_bytes = 4 * sum(p.numel() for p in model.blocks[0].parameters())
    held = []
    local = torch.optim.AdamW(ref.parameters(), lr=0.01)
    opt = luwu.RemoteOptimizer(
        model,
        nodes=cluster1.addresses,
        lr=0.01,
        compression=False,
        stream_weights=True,
        bucket_bytes=1024,
        rank=0,
        world_size=1,
    )
    try:
        assert opt.streamer.hold_bytes == (2 * unit_bytes if hold == -1 else 0)
        # six blocks fetched for forward; of the four before the last two (kept whole for their backward, right
        # after), two are fetched again for backward (four with nothing kept)
        assert (
            lockstep(
                ref, local, model, opt, forward=probing(lambda: opt.streamer.held_bytes(), held)
            )
            == [8 if hold == -1 else 10] * 4
        )
        assert held == [2 * unit_bytes if hold == -1 else 0] * 4
        assert opt.streamer.held_bytes() == 0 and opt.streamer.resident_bytes() == 0
        # the pushes that ask for the new weights with their answer: the first prefetch = 2 blocks', and those of
        # the blocks after them whose replies fit the same budget (two more)
        with_reply = {u.unit.name for u in opt.streamer.units if u.buckets and u.with_reply}
        assert with_reply == {f"blocks.{i}" for i in range(4 if hold == -1 else 2)}
    finally:
        opt.close()


@pytest.mark.timeout(120)
def test_kept_replies_are_int8_with_compression_on(cluster1):
    """With int8 fetches a kept reply is a quarter of the unit's fp32 weights (plus a scale per block), so the
    default budget keeps all four blocks before the turn: one fetch a unit a step, like keeping the fp32
    weights (stream_keep_for_backward) at a quarter of the memory."""
    from workers.stream import make_model

    import luwu
    from luwu.protocol.compression import CompressionConfig

    model = make_model({"seed": 0, "blocks": 6, "width": 256})
    unit_numel = sum(p.numel() for p in model.blocks[0].parameters())
    opt = luwu.RemoteOptimizer(
        model,
        nodes=cluster1.addresses,
        lr=0.01,
        compression=CompressionConfig(warmup_steps=0, link_gbps=1),
        stream_weights=True,
        bucket_bytes=1 << 20,
        rank=0,
        world_size=1,
    )
    try:
        for step in range(3):
            g = torch.Generator().manual_seed(step)
            x, y = torch.randn(4, 20, generator=g), torch.randint(0, 5, (4,), generator=g)
            before = opt.streamer.fetches
            opt.zero_grad()
            loss = torch.nn.functional.cross_entropy(model(x), y)
            kept = opt.streamer.held_bytes()
            loss.backward()
            opt.step()
            assert opt.streamer.fetches - before == 6
            # int8 codes with fp32 scales for the matrices, bf16 for the norms and biases: not 4 B a parameter
            assert 4 * unit_numel <= kept <= 4 * unit_numel * 1.1
    finally:
        opt.close()
