"""The docs site builds without a single warning (``mkdocs build --strict``), as ``make docs`` does.

The API and configuration pages are generated from docstrings, so a docstring that mkdocstrings
cannot parse, a page link that points nowhere or a moved module fails here, in ``make test``.
"""

from __future__ import annotations

import importlib.util
import re
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
        pytest.skip(
            f"docs packages not installed ({', '.join(missing)}): pip install -e '.[test]' installs them"
        )
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "mkdocs",
            "build",
            "--strict",
            "--config-file",
            str(ROOT / "mkdocs.yml"),
            "--site-dir",
            str(tmp_path / "site"),
        ],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=150,  # not the root: paths must not hang on the cwd
    )
    log = proc.stdout + proc.stderr
    assert proc.returncode == 0, (
        f"mkdocs build --strict failed (rc {proc.returncode}):\n{log[-6000:]}"
    )
    warnings = [line for line in log.splitlines() if line.startswith(("WARNING", "ERROR"))]
    assert not warnings, "mkdocs printed warnings:\n" + "\n".join(warnings)
    site = tmp_path / "site"
    for page in (
        "index.html",
        "architecture.html",
        "protocol.html",
        "configuration.html",
        "api/optimizer.html",
    ):
        assert (site / page).is_file(), f"{page} missing from the built site"
    assert "The LuWu wire format" in (site / "protocol.html").read_text(), (
        "protocol/PROTOCOL.md was not included"
    )
    reference = (site / "configuration.html").read_text()
    for field in (
        "world_size",
        "delayed_update",
        "bucket_bytes",
        "warmup_steps",
        "depth",
        "worker_policy",
    ):
        assert f"{field}" in reference, f"the configuration reference lacks {field}"


def test_protocol_page_includes_the_one_copy():
    """docs/protocol.md includes protocol/PROTOCOL.md at build time instead of holding a second copy."""
    text = (ROOT / "docs" / "protocol.md").read_text()
    assert '--8<-- "protocol/PROTOCOL.md"' in text
    assert "## Ops" not in text


def test_the_readme_is_a_users_document():
    """README.md stays short (the rest lives on the docs site), its two commands are Makefile targets that
    set everything up first, and every file it links to exists."""
    text = (ROOT / "README.md").read_text()
    lines = text.count("\n")
    assert lines <= 250, (
        f"README.md has {lines} lines: move details to docs/ (mkdocs nav) and keep it under 250"
    )
    makefile = (ROOT / "Makefile").read_text()
    for target in ("demo", "test"):
        assert f"make {target}" in text, f"the README no longer shows `make {target}`"
        assert re.search(rf"^{target}: setup$", makefile, flags=re.M), (
            f"`make {target}` must run setup first"
        )
    missing = []
    for link in re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", text):
        if "://" not in link and not (ROOT / link).exists():
            missing.append(link)
    assert not missing, f"README.md links to files that do not exist: {missing}"
