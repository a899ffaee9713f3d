"""mkdocs hook: lay out the ``luwu`` import namespace as one folder, so mkdocstrings can read it.

pyproject.toml maps folders of the repository into the namespace with setuptools ``package-dir``
(``luwu.protocol`` is ``protocol/``, ``luwu.gpu_workers`` is ``gpu_workers/``...). mkdocstrings reads
source files without importing them (that is how it sees the docstrings of dataclass fields), so it
looks for ``luwu/protocol/`` and would not find it. This hook builds ``build/docs-src/luwu/`` out of
symbolic links, following ``package-dir`` as pyproject.toml states it; mkdocs.yml points the python
handler there (``paths: [build/docs-src]``). Nothing is copied and nothing in the source folders changes.

The docstrings name other objects with Sphinx roles (``:class:`Layout```), which Markdown does not
know; :func:`on_page_content` shows them as plain code.
"""

from __future__ import annotations

import re
import shutil

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10: the same parser as a package
    import tomli as tomllib
from pathlib import Path

#: A Sphinx cross-reference role as Markdown renders it (``:class:`X``` -> ``:class:<code>X</code>``).
SPHINX_ROLE = re.compile(r":(?:class|func|meth|mod|data|attr|exc|obj):(<code>)~?")

ROOT = Path(__file__).resolve().parent.parent
TREE = ROOT / "build" / "docs-src"


def build_tree() -> Path:
    """(Re)build ``build/docs-src`` from pyproject's ``package-dir``; returns the folder to search."""
    mapping = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"][
        "package-dir"
    ]
    shutil.rmtree(TREE, ignore_errors=True)
    top = TREE / "luwu"
    top.mkdir(parents=True)
    for entry in (ROOT / mapping["luwu"]).iterdir():
        if entry.name != "__pycache__":
            (top / entry.name).symlink_to(entry)
    for package, folder in mapping.items():
        parts = package.split(".")
        if len(parts) == 2:  # luwu.<sub> -> its own folder of the repository
            (top / parts[1]).symlink_to(ROOT / folder, target_is_directory=True)
    return TREE


def on_config(config):
    """Snippets (``--8<--``) read from the repository root wherever mkdocs is started: pymdownx takes
    a relative ``base_path`` from the current directory, not from mkdocs.yml."""
    config["mdx_configs"]["pymdownx.snippets"]["base_path"] = [str(ROOT)]
    return config


def on_page_content(html, page, config, files):
    """Docstrings name other objects with Sphinx roles (``:class:`Layout```); show them as code."""
    return SPHINX_ROLE.sub(r"\1", html)


# mkdocs loads hooks while it validates mkdocs.yml, before any plugin reads its configuration; the
# python handler's ``paths`` (build/docs-src) must exist by then.
build_tree()
