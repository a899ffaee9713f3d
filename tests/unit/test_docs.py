"""The docs site builds without a single warning (``mkdocs build --strict``), as ``make docs`` does.

The API and configuration pages are generated from docstrings, so a docstring that mkdocstrings
cannot parse, a page link that points nowhere or a moved module fails here, in ``make test``.
"""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
DOC_PACKAGES = ("mkdocs", "mkdocstrings", "mkdocstrings_handlers.python")


def _missing() -> list[str]:
    out = []
    for name in DOC_PACKAGES:
        try:
            found = importlib.util.find_spec(name) is not None
        except ModuleNotFoundError:
            found = False
        if not found:
            out.append(name)
    return out


@pytest.mark.timeout(180)
def test_docs_build_strict(tmp_path):
    missing = _missing()
    if missing:
        pytest.skip(f"docs packages not installed ({', '.join(missing)}): pip install -e '.[test]' installs them")
    proc = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--config-file", str(ROOT / "mkdocs.yml"), "--site-dir", str(tmp_path / "site")],
        cwd=tmp_path, capture_output=True, text=True, timeout=150,  # not the root: paths must not hang on the cwd
    )
    log = proc.stdout + proc.stderr
    assert proc.returncode == 0, f"mkdocs build --strict failed (rc {proc.returncode}):\n{log[-6000:]}"
    warnings = [line for line in log.splitlines() if line.startswith(("WARNING", "ERROR"))]
    assert not warnings, "mkdocs printed warnings:\n" + "\n".join(warnings)
    site = tmp_path / "site"
    for page in ("index.html", "architecture.html", "protocol.html", "configuration.html", "api/optimizer.html"):
        assert (site / page).is_file(), f"{page} missing from the built site"
    assert "The LuWu wire format" in (site / "protocol.html").read_text(), "protocol/PROTOCOL.md was not included"
    reference = (site / "configuration.html").read_text()
    for field in ("world_size", "delayed_update", "bucket_bytes", "warmup_steps", "depth", "worker_policy"):
        assert f"{field}" in reference, f"the configuration reference lacks {field}"


def test_protocol_page_includes_the_one_copy():
    """docs/protocol.md includes protocol/PROTOCOL.md at build time instead of holding a second copy."""
    text = (ROOT / "docs" / "protocol.md").read_text()
    assert '--8<-- "protocol/PROTOCOL.md"' in text
    assert "## Ops" not in text
