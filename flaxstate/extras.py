"""The optional extras: a module that one of them installs, imported with an error that names the extra."""

from __future__ import annotations

import importlib
from types import ModuleType


def require(module: str, extra: str, what: str) -> ModuleType:
    """Imports `module`, installed by `pip install 'flaxstate[extra]'`.

    Args:
        module: the module's name, e.g. "safetensors".
        extra: the extra that installs it, e.g. "safetensors".
        what: what needs it, for the error, e.g. "SafetensorsReader".

    Raises:
        ImportError: it is not installed, naming the module and the command that installs it.

    Example:
        >>> require("json", "none", "this example").__name__
        'json'
    """
    try:
        return importlib.import_module(module)
    except ImportError as error:
        raise ImportError(
            f"{what} needs the {module.split('.')[0]} package, which is not installed ({error}): "
            f"pip install 'flaxstate[{extra}]'."
        ) from error
