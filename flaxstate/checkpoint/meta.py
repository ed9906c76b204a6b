"""The JSON `meta` item of a checkpoint: what each field holds, checked on every read.

A checkpoint's `meta` names its step, run, random key, data position,
metrics and the user's metadata (`flaxstate.checkpoint.stores.orbax_manager` writes it).
What a reader takes from disk is checked here against that format, types
included, before anything uses it: a field of the wrong type (a step `"ten"`,
a format version `"3"`, an rng without its data) is damage, named with the
file and the field, never a `TypeError` from deep inside the loop.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from flaxstate.checkpoint import formats
from flaxstate.checkpoint.damage import DamagedCheckpointError
from flaxstate.checkpoint.errors import CheckpointError

FILE = "metadata"
"""The file that orbax's JSON handler writes inside a step's `meta` item."""


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


def _optional(check: Callable[[Any], str | None]) -> Callable[[Any], str | None]:
    return lambda value: None if value is None else check(value)


def _step(value: Any) -> str | None:
    return None if _is_int(value) and value >= 0 else "expected a non-negative int"


def _string(value: Any) -> str | None:
    return None if isinstance(value, str) else "expected a string"


def _number(value: Any) -> str | None:
    return None if _is_number(value) else "expected a number"


def _uint32s(value: Any) -> bool:
    if isinstance(value, list):
        return all(_uint32s(item) for item in value)
    return _is_int(value) and 0 <= value < 2**32


def _rng(value: Any) -> str | None:
    if not isinstance(value, Mapping) or not isinstance(value.get("impl"), str) or "data" not in value:
        return "expected {'impl': a key implementation's name, 'data': a list of uint32}"
    if not isinstance(value["data"], list) or not _uint32s(value["data"]):
        return "expected its 'data' to be a list of uint32"
    return None


def _data_position(value: Any) -> str | None:
    if not isinstance(value, Mapping):
        return "expected an object"
    if not (_is_int(value.get("n_batches")) and value["n_batches"] >= 0):
        return f"expected 'n_batches' to be a non-negative int, found {value.get('n_batches')!r}"
    batch_size = value.get("batch_size")
    if batch_size is not None and not (_is_int(batch_size) and batch_size > 0):
        return f"expected 'batch_size' to be a positive int, found {batch_size!r}"
    states = value.get("iterator_states")
    if states is not None and not isinstance(states, list):
        return f"expected 'iterator_states' to be a list (one per process), found {type(states).__name__}"
    return None


def _metrics(value: Any) -> str | None:
    if not isinstance(value, Mapping) or not all(isinstance(group, Mapping) for group in value.values()):
        return "expected {group: {name: number}}"
    for group, values in value.items():
        for name, number in values.items():
            if number is not None and not _is_number(number):
                return f"expected {group}/{name} to be a number, found {number!r}"
    return None


def _best(value: Any) -> str | None:
    if not isinstance(value, Mapping) or not all(isinstance(value.get(key), str) for key in ("metric", "group")):
        return "expected {'metric': str, 'group': str, 'mode': 'min' or 'max'}"
    return None if value.get("mode") in ("min", "max") else f"expected mode 'min' or 'max', found {value.get('mode')!r}"


def _logical_axes(value: Any) -> str | None:
    if not isinstance(value, Mapping):
        return "expected {path: [axis name or null, ...]}"
    for path, names in value.items():
        if not isinstance(names, list) or not all(name is None or isinstance(name, str) for name in names):
            return f"expected the axes of {path} to be a list of names or null, found {names!r}"
    return None


_FIELDS: dict[str, Callable[[Any], str | None]] = {
    "step": _step,
    "run_id": _optional(_string),
    "loss": _optional(_number),
    "time": _optional(_number),
    "rng": _optional(_rng),
    "data_position": _optional(_data_position),
    "metrics": _optional(_metrics),
    "best": _optional(_best),
    "logical_axes": _optional(_logical_axes),
    "environment": _optional(lambda value: None if isinstance(value, Mapping) else "expected a JSON object"),
}
"""Each known field's check (a problem, or `None`); `metadata` is the user's and any JSON."""


def read(where: Path, step_dir: Path) -> dict[str, Any]:
    """Reads a step's meta file as JSON and checks it (`validate`): every store's read of its meta.

    Args:
        where: the file (orbax's `<step>/meta/metadata`, or a store's own `meta.json`).
        step_dir: the step's directory, to name in errors.

    Raises:
        FileNotFoundError: the file is not there: each store says what that
            means (a step deleted meanwhile, not a flaxstate step, or damage).
        DamagedCheckpointError: it is not JSON, or not a valid meta.
        CheckpointError: written by a newer flaxstate.
    """
    text = where.read_text()
    try:
        meta = json.loads(text)
    except ValueError as error:
        raise DamagedCheckpointError(f"{where} is not valid JSON ({error}): the step is damaged") from error
    return validate(meta, step_dir, where)


def validate(meta: Any, step_dir: Path, where: Path | None = None) -> dict[str, Any]:
    """Returns a step's `meta`, checked against the format (types included).

    Args:
        meta: what was read from `<step_dir>/meta/metadata`.
        step_dir: the step's directory, to name in errors.
        where: the file it was read from (`<step_dir>/meta/metadata` by default).

    Raises:
        DamagedCheckpointError: a field is missing or of the wrong type,
            naming the file, the field and what was found.
        CheckpointError: the checkpoint was written by a newer flaxstate
            (not damage: a reader never falls back past it).
    """
    where = where or step_dir / "meta" / FILE

    def damaged(problem: str) -> DamagedCheckpointError:
        return DamagedCheckpointError(f"{where} does not hold a valid flaxstate checkpoint meta: {problem}")

    if not isinstance(meta, Mapping):
        raise damaged(f"expected a JSON object, found {type(meta).__name__}")
    version: Any = meta.get("format_version")
    if not (_is_int(version) and version >= 1):
        raise damaged(f"format_version is {version!r}, expected a positive int")
    if version not in formats.FORMATS:
        raise CheckpointError(
            f"{step_dir} was written by a newer flaxstate (checkpoint format {version}); "
            f"this flaxstate reads formats 1 to {formats.CURRENT.version}. Upgrade flaxstate to read it."
        )
    if "step" not in meta:
        raise damaged("it has no step")
    for field, check in _FIELDS.items():
        if field in meta and (problem := check(meta[field])) is not None:
            raise damaged(f"{field} is {_short(meta[field])}: {problem}")
    return formats.FORMATS[version].upgrade(meta)


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."
