"""Sphinx configuration for the cupy_poolmem documentation.

Build (no GPU and no network needed)::

    python -m sphinx -W -b html docs docs/_build/html
"""

from __future__ import annotations

import os
import re
import sys

# Document the checkout this file belongs to, installed or not.
sys.path.insert(0, os.path.abspath(os.path.join(os.path.dirname(__file__), "..", "src")))

import cupy_poolmem  # noqa: E402  (importing works without a GPU)

HERE = os.path.dirname(os.path.abspath(__file__))


def _changelog_rst(markdown: str) -> str:
    """CHANGELOG.md (headings, bullets, `code`, [links](url)) as reST, no extra package."""
    out = []
    for line in markdown.splitlines():
        line = re.sub(r"`([^`]+)`", r"``\1``", line)
        line = re.sub(r"\[([^\]]+)\]\(([^)]+)\)", r"`\1 <\2>`__", line)
        m = re.match(r"^(#+)\s+(.*)$", line)
        if m:
            level, title = len(m.group(1)), m.group(2)
            if level == 1:
                continue  # the page has its own title
            out += [title, "-~^"[min(level - 2, 2)] * len(title), ""]
            continue
        out.append(line)
    return "\n".join(out) + "\n"


def _write_changelog() -> None:
    with open(os.path.join(HERE, "..", "CHANGELOG.md"), encoding="utf-8") as f:
        text = _changelog_rst(f.read())
    target = os.path.join(HERE, "_changelog.inc")
    if not os.path.exists(target) or open(target, encoding="utf-8").read() != text:
        with open(target, "w", encoding="utf-8") as f:
            f.write(text)


_write_changelog()

project = "cupy_poolmem"
author = "cupy_poolmem contributors"
copyright = "cupy_poolmem contributors"
release = cupy_poolmem.__version__
version = ".".join(release.split(".")[:2])

extensions = [
    "sphinx.ext.autodoc",
    "numpydoc",
]

# Every reference to the package's own objects must resolve (CI builds with -W -n).
# No intersphinx: the build must work offline, so references to Python's, CuPy's,
# Numba's and Dask's objects cannot become links; they are listed here, and only they.
nitpicky = True
nitpick_ignore_regex = [
    (
        r"py:.*",
        r"(builtins|multiprocessing|pickle|concurrent|threading|os|numpy|cupy|cupyx|"
        r"cupy_backends|cuda|numba|dask|distributed|dask_cuda|rmm|torch)(\..*)?",
    ),
]

exclude_patterns = ["_build", "_measured.rst", "_figures", "Thumbs.db", ".DS_Store"]
# CHANGELOG.md lives at the top of the repository; changelog.rst includes it.
templates_path: list[str] = []
source_suffix = {".rst": "restructuredtext"}
root_doc = "index"

# -- autodoc -------------------------------------------------------------------------
autodoc_member_order = "bysource"
autodoc_typehints = "none"  # the numpydoc "Parameters" sections say it all
autodoc_default_options: dict[str, object] = {}
autoclass_content = "class"

# -- numpydoc ------------------------------------------------------------------------
numpydoc_show_class_members = False  # members are listed explicitly with :members:
numpydoc_show_inherited_class_members = False
numpydoc_class_members_toctree = False
numpydoc_attributes_as_param_list = True
numpydoc_xref_param_type = False
numpydoc_validation_checks: set[str] = set()

# -- HTML ------------------------------------------------------------------------------
# The PyData Sphinx theme, as CuPy's, RMM's and Dask's documentation use.  Its page is
# as wide as the screen allows (up to 100rem) and the article as wide as the page, so
# code blocks with aligned comments (up to 100 characters, the package's line length)
# fit without scrolling on a common screen; a narrower one scrolls the block.
html_theme = "pydata_sphinx_theme"
html_title = f"cupy_poolmem {release}"
html_static_path = ["_static"]
html_css_files = ["cupy_poolmem.css"]
html_theme_options = {
    # No links to a repository or an analytics service: the docs build offline.
    "navbar_align": "left",
    "show_toc_level": 2,
    "navigation_depth": 2,
    "show_prev_next": True,
    "secondary_sidebar_items": ["page-toc"],
    "footer_start": ["copyright"],
    "footer_end": ["sphinx-version"],
}
# No left sidebar: every page is a top-level page of the navigation bar, so the theme's
# "Section Navigation" would be empty, and its width is the code blocks'.
html_sidebars: dict[str, list[str]] = {"**": []}
trim_doctest_flags = True
