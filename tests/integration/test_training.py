"""2 workers x 2 nodes, real processes: the nodes' optimizer equals torch.optim on the concatenated batch."""

import pytest
from harness import assert_params_close, run_training
from workers.train import reference  # noqa: E402

CASES = {
    "adamw": {"optimizer": "adamw", "hyper": {"lr": 0.01, "weight_decay": 0.05}},
    "adam": {"optimizer": "adam", "hyper": {"lr": 0.01, "weight_decay": 0.01}},
    "sgd_nesterov": {"optimizer": "sgd", "hyper": {"lr": 0.05, "momentum": 0.9, "nesterov": True, "weight_decay": 1e-3}},
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
