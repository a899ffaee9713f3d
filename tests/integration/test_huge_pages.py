"""torch's allocator asks for transparent huge pages once luwu is imported (``THP_MEM_ALLOC_ENABLE``,
read at torch's first allocation), and a worker that made a tensor before ``import luwu`` is told
that it came too late, with the fix. Each case is a fresh Python process: the variable is read once
per process."""

import os
import subprocess
import sys

import pytest

from luwu.protocol.memory import TORCH_HUGE_PAGES_ENV, thp_mode

pytestmark = [
    pytest.mark.timeout(120),
    pytest.mark.skipif(
        thp_mode() != "madvise", reason="the kernel's huge pages are not in madvise mode"
    ),
]

PROBE = """
import logging, sys
logging.basicConfig(level=logging.WARNING, stream=sys.stderr)
{before}
import os
import luwu
import torch
from luwu.protocol.memory import check_torch_huge_pages, vm_flags
big = torch.empty(16 << 20, dtype=torch.uint8)
print(os.environ.get("THP_MEM_ALLOC_ENABLE"), "hg" in vm_flags(big.data_ptr() + (8 << 20)),
      check_torch_huge_pages())
"""


def _run(before: str = "", env_value: str | None = None) -> tuple[str, str]:
    env = {k: v for k, v in os.environ.items() if k != TORCH_HUGE_PAGES_ENV}
    if env_value is not None:
        env[TORCH_HUGE_PAGES_ENV] = env_value
    p = subprocess.run(
        [sys.executable, "-c", PROBE.format(before=before)],
        env=env,
        capture_output=True,
        text=True,
        timeout=90,
    )
    assert p.returncode == 0, p.stderr
    return p.stdout.strip(), p.stderr


def test_importing_luwu_first_gives_torchs_large_blocks_huge_pages():
    out, err = _run()
    assert out == "1 True True"
    assert "huge pages" not in err


def test_a_tensor_made_before_luwu_is_imported_is_told_with_the_fix():
    out, err = _run(before="import torch; torch.ones(4)")
    assert out == "1 False False"
    assert "Import luwu before making tensors" in err
    assert f"export {TORCH_HUGE_PAGES_ENV}=1" in err


def test_the_users_zero_keeps_torchs_default_and_silences_the_check():
    out, err = _run(env_value="0")
    assert out == "0 False None"
    assert "huge pages" not in err
