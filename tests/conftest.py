import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(__file__))  # tests/harness.py


def pytest_addoption(parser):
    parser.addoption("--runslow", action="store_true", default=False, help="run the long studies marked slow")


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
