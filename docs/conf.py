"""Sphinx configuration of flaxstate's docs site (`make docs`): myst-nb pages and notebooks, and an API reference.

The reference (`api.md`) is written here, before the build, from `flaxstate.__all__`:
every public name gets its autodoc entry, and a name without a docstring of its
own stops the build (`UndocumentedName`).
"""

from __future__ import annotations

import inspect
import os
import sys
from pathlib import Path

from sphinx.pycode import ModuleAnalyzer

# The tutorials' kernels run on the CPU: where libtpu is installed (flaxstate[test], [plan]), JAX would
# otherwise probe for a TPU at its first call and print libtpu's errors into the page.
os.environ.setdefault("JAX_PLATFORMS", "cpu")
HERE = Path(__file__).parent
sys.path.insert(0, str(HERE.parent))

import flaxstate  # noqa: E402

project = "flaxstate"
author = "the flaxstate authors"
release = flaxstate.__version__
extensions = ["myst_nb", "sphinx.ext.autodoc", "sphinx.ext.napoleon", "sphinx.ext.viewcode"]
exclude_patterns = ["_build", "Thumbs.db", ".DS_Store", "**.ipynb_checkpoints", "jupyter_execute"]
html_theme = "sphinx_book_theme"
html_title = "flaxstate"
html_favicon = "_static/favicon.svg"
html_context = {"default_mode": "auto"}  # the theme's script reports an empty mode as an error
html_theme_options = {"show_toc_level": 2, "repository_url": "https://github.com/flaxstate/flaxstate"}
myst_enable_extensions = ["colon_fence", "deflist"]
default_role = "code"  # docstrings write `name` for code, as Markdown does
myst_heading_anchors = 3
nb_execution_mode = "force"  # every tutorial runs at every build: its outputs cannot rot
nb_execution_in_temp = True  # a tutorial that writes a file (train.py) writes it in a temporary directory
nb_execution_timeout = 600
nb_execution_raise_on_error = True
nb_execution_show_tb = True
autodoc_member_order = "bysource"
autodoc_typehints = "description"
autodoc_default_options = {"members": True, "show-inheritance": True}
napoleon_google_docstring = True
napoleon_numpy_docstring = False
suppress_warnings = ["mystnb.unknown_mime_type"]


class UndocumentedName(Exception):
    """A name in `flaxstate.__all__` without a docstring of its own."""


def _defining_module(name: str, value: object) -> str:
    """The module whose source documents `name` (where a class or function is defined; for an alias, its module)."""
    if inspect.isclass(value) or inspect.isfunction(value):
        return value.__module__
    for module_name, module in sorted(sys.modules.items()):
        if module_name.startswith("flaxstate.") and getattr(module, name, None) is value:
            docs = ModuleAnalyzer.for_module(module_name).find_attr_docs()
            if ("", name) in docs:
                return module_name
    raise UndocumentedName(f"flaxstate.{name} has no docstring: document it where it is defined.")


def api_reference() -> str:
    """The API page: one entry per public name, grouped by kind, each by its own docstring."""
    classes, functions, data = [], [], []
    for name in sorted(flaxstate.__all__):
        value = getattr(flaxstate, name)
        module = _defining_module(name, value)
        own = inspect.getdoc(value) if inspect.isclass(value) or inspect.isfunction(value) else "alias"
        if not own or (inspect.isclass(value) and value.__doc__ is None):
            raise UndocumentedName(f"flaxstate.{name} ({module}) has no docstring: document it.")
        if inspect.isclass(value):
            classes.append(f"```{{eval-rst}}\n.. autoclass:: flaxstate.{name}\n```\n")
        elif inspect.isfunction(value):
            functions.append(f"```{{eval-rst}}\n.. autofunction:: flaxstate.{name}\n```\n")
        else:
            data.append(f"```{{eval-rst}}\n.. autodata:: {module}.{name}\n   :no-value:\n```\n")
    return "\n".join(
        [
            "# API reference\n",
            "Every public name, `import flaxstate as fs` then `fs.<name>`, from its docstring.\n",
            "## Classes\n",
            *classes,
            "## Functions\n",
            *functions,
            "## Types\n",
            *data,
        ]
    )


def setup(app: object) -> None:
    """Writes the API page before Sphinx reads the sources (a name left undocumented stops the build here)."""
    (HERE / "api.md").write_text(api_reference())
