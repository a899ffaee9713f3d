"""The test harness itself: what every multi-process test relies on."""

from __future__ import annotations

import subprocess
import sys

import pytest
from harness import wait_all

pytestmark = pytest.mark.timeout(60)


def test_wait_all_reads_every_worker_at_once(tmp_path):
    """Worker 0 runs until worker 1 is done, and worker 1 prints more than a pipe holds first (as a long
    training prints a STEP line per step): read one after another, worker 1 would block in print and
    both would hang (a 7,000-step training stalled at step 6,657 that way)."""
    done = tmp_path / "done"
    waiter = f"import pathlib, time\nwhile not pathlib.Path({str(done)!r}).exists(): time.sleep(0.01)\nprint('waited')"
    talker = f"import pathlib\nfor i in range(20000): print(f'STEP {{i}}')\npathlib.Path({str(done)!r}).touch()"
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", code],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for code in (waiter, talker)
    ]
    outs = wait_all(procs, timeout_s=30)
    assert outs[0].strip() == "waited"
    assert outs[1].count("\n") == 20000 and outs[1].endswith("STEP 19999\n")


def test_wait_all_names_the_worker_that_failed(tmp_path):
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", code],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for code in ("print('fine')", "import sys; print('broken'); sys.exit(3)")
    ]
    with pytest.raises(AssertionError, match=r"worker 1 exited with 3:\nbroken"):
        wait_all(procs, timeout_s=30)
