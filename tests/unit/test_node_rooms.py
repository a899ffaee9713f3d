"""The node is a pipeline of narrow rooms: none holds the server, each gets the shared context.

Read from the source with ``ast`` (nothing of the server is imported for the first two), then one
gradient walked through the rooms by hand, with no server at all: aggregator, shard, reply encoder.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
import torch
from support.node_messages import push_message

from luwu.protocol.codecs import get_codec
from luwu.protocol.layout import Bucket
from luwu.switch_nodes.aggregation import Aggregator
from luwu.switch_nodes.config import NodeConfig
from luwu.switch_nodes.context import NodeContext, OptimizerQueue
from luwu.switch_nodes.effects import ApplyStep, Ready
from luwu.switch_nodes.metrics import NodeMetrics
from luwu.switch_nodes.optimizers import ADAMW
from luwu.switch_nodes.replies import PullCodecs, encode_reply
from luwu.switch_nodes.shard import ResidentShard

pytestmark = pytest.mark.timeout(60)

NODE = Path(__file__).resolve().parents[2] / "switch_nodes"
SERVER = "luwu.switch_nodes.server"
#: the process entry point that builds and runs the server (the pipeline's top, as luwu's CLI is)
RUNS_THE_SERVER = {"daemon.py"}


def _modules() -> list[Path]:
    return [p for p in sorted(NODE.rglob("*.py")) if p.name != "server.py"]


def _imported(tree: ast.AST, path: Path) -> set[str]:
    """Every module an import in ``tree`` names (relative ones resolved), wherever it sits: at the
    top, in a function, under ``if TYPE_CHECKING:``."""
    package = ["luwu", *path.relative_to(NODE.parent).parent.parts]
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = package[: len(package) - node.level + 1] if node.level else []
            mod = ".".join([*base, *([node.module] if node.module else [])])
            out.add(mod)
            out |= {f"{mod}.{a.name}" for a in node.names}
    return out


def test_no_module_of_the_node_imports_the_server():
    offenders = []
    for path in _modules():
        if path.name in RUNS_THE_SERVER:
            continue
        names = _imported(ast.parse(path.read_text()), path)
        if SERVER in names or any(n.startswith(SERVER + ".") for n in names):
            offenders.append(str(path.relative_to(NODE.parent)))
    assert not offenders, f"these modules import the server (even under TYPE_CHECKING): {offenders}"


def _mentions(tree: ast.AST) -> set[str]:
    """Every name, attribute and string annotation in ``tree``."""
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Name):
            out.add(node.id)
        elif isinstance(node, ast.Attribute):
            out.add(node.attr)
        elif isinstance(node, ast.Constant) and isinstance(node.value, str):
            try:  # a quoted annotation: "NodeServer"
                out |= {
                    n.id
                    for n in ast.walk(ast.parse(node.value, mode="eval"))
                    if isinstance(n, ast.Name)
                }
            except SyntaxError:
                pass
    return out


def test_no_room_holds_a_node_server():
    """No module but the server's own and its runner names ``NodeServer``: no room takes it, types a
    reference as it, or keeps one."""
    holders = [
        str(p.relative_to(NODE.parent))
        for p in _modules()
        if p.name not in RUNS_THE_SERVER and "NodeServer" in _mentions(ast.parse(p.read_text()))
    ]
    assert not holders, f"these modules hold or type a reference as NodeServer: {holders}"


def test_one_gradient_walks_aggregator_shard_and_encoder_without_a_server():
    """Two workers' pushes: the aggregator says the step is ready (an effect, nothing sent), the
    shard steps the bucket as torch's AdamW does on the average, and the encoder gives the bf16
    weights for the reply."""
    numel, hyper = 256, {"lr": 1e-2, "weight_decay": 0.01}
    metrics = NodeMetrics(None)
    ctx = NodeContext(
        cfg=NodeConfig(), job="j", metrics=metrics, queue=OptimizerQueue(metrics), index=0
    )
    ctx.world_size, ctx.members = 2, {0, 1}
    shard = ResidentShard(ctx, on_stuck=lambda ranks: None)
    b = shard.add(Bucket.from_wire([0, 0, numel, [[0, 0, 0, numel]]]), ADAMW, 0)
    init = torch.randn(numel)
    b.params.copy_(init)
    b.initialized = True
    grads = [torch.randn(numel), torch.randn(numel)]
    agg = Aggregator(ctx, shard)

    assert agg.on_push(b"w0", push_message(0, grads[0], hyper)) == []
    (ready,) = agg.on_push(b"w1", push_message(1, grads[1], hyper))
    assert isinstance(ready, Ready) and isinstance(ready.then, ApplyStep)
    step = ready.then
    assert (step.bucket, step.step, step.divisor) == (b, 0, 2.0)

    codec = PullCodecs().get(step.acc.pull)
    shard.apply(b, step.step, step.acc, step.divisor, step.skip)
    payload = encode_reply(b, codec, shard.lent(b.id))
    assert b.version == 1

    p = torch.nn.Parameter(init.clone())
    p.grad = (grads[0] + grads[1]) / 2
    torch.optim.AdamW([p], lr=hyper["lr"], weight_decay=hyper["weight_decay"]).step()
    torch.testing.assert_close(b.params, p.detach(), rtol=1e-6, atol=1e-7)
    held = torch.empty(numel)
    get_codec(payload.codec).decode_(held, payload.frames, payload.meta)
    assert payload.codec == "bf16" and torch.equal(held, b.params.to(torch.bfloat16).float())
