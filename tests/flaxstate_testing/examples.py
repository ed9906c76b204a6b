"""The examples (`examples/*.py`, scripts rather than a package), loaded as modules for tests and workers."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

EXAMPLES = Path(__file__).parents[2] / "examples"


def load(name: str) -> ModuleType:
    """Returns `examples/<name>.py` as a module (loaded once a process)."""
    module_name = f"{name}_example"
    if module_name not in sys.modules:
        spec = importlib.util.spec_from_file_location(module_name, EXAMPLES / f"{name}.py")
        module = importlib.util.module_from_spec(spec)
        sys.modules[module_name] = module  # dataclasses look their module up while the file runs
        spec.loader.exec_module(module)
    return sys.modules[module_name]
