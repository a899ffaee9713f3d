"""The ``luwu`` command line run as a user runs it: a subprocess from the repository's root."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def luwu(
    *args: str, timeout_s: float = 120, env: dict | None = None, module: str = "luwu"
) -> subprocess.CompletedProcess:
    """``python -m <module> <args>`` (``luwu``, or a module that registers the same parsers), its
    output captured, unbuffered and 200 columns wide."""
    full = dict(os.environ, PYTHONUNBUFFERED="1", COLUMNS="200", **(env or {}))
    return subprocess.run(
        [sys.executable, "-m", module, *args],
        capture_output=True,
        text=True,
        timeout=timeout_s,
        cwd=ROOT,
        env=full,
    )
