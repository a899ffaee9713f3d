import os
import sys

import pytest

_TESTS = os.path.dirname(os.path.abspath(__file__))
# tests/: `harness` and `support` (the emulated cluster); the repo root: `benchmarks` as a package.
sys.path[:0] = [_TESTS, os.path.dirname(_TESTS)]


def pytest_addoption(parser):
    parser.addoption(
        "--runslow", action="store_true", default=False, help="run the long studies marked slow"
    )


def pytest_collection_modifyitems(config, items):
    if config.getoption("--runslow") or os.environ.get("LUWU_SLOW") == "1":
        return
    skip = pytest.mark.skip(reason="long study: run with --runslow or LUWU_SLOW=1")
    for item in items:
        if "slow" in item.keywords:
            item.add_marker(skip)


@pytest.fixture
def cluster2():
    import luwu

    with luwu.local_cluster(2) as c:
        yield c


@pytest.fixture
def cluster1():
    import luwu

    with luwu.local_cluster(1) as c:
        yield c
