"""Sphinx configuration for the cupy_poolmem documentation.

Build (no GPU and no network needed)::

    python -m sphinx -W -b html docs docs/_build/html
"""

from __future__ import annotations

import os
import sys

# Document the checkout this file belongs to, installed or not.
sys.path.insert(0, os.path.abspath(os.path.join(os.path.dirname(__file__), "..")))

import cupy_poolmem  # noqa: E402  (importing works without a GPU)

project = "cupy_poolmem"
author = "cupy_poolmem contributors"
copyright = "cupy_poolmem contributors"
release = cupy_poolmem.__version__
version = ".".join(release.split(".")[:2])

extensions = [
    "sphinx.ext.autodoc",
    "numpydoc",
]

# No intersphinx: the build must work offline.  References to CuPy, CUDA and Python
# objects that cannot be resolved stay plain text (nitpicky is off).
nitpicky = False

exclude_patterns = ["_build", "_measured.rst", "Thumbs.db", ".DS_Store"]
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
html_theme = "alabaster"
html_title = f"cupy_poolmem {release}"
html_static_path: list[str] = []
html_theme_options = {
    "description": "CUDA stream-ordered memory pools for CuPy",
    "fixed_sidebar": True,
}
pygments_style = "sphinx"
trim_doctest_flags = True
