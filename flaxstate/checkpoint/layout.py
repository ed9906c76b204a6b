"""The layout of a checkpoint on disk: its items, their handlers, and the JSON forms of what `meta` holds.

A step is a standard orbax `CheckpointManager` step directory, `<dir>/<step>/`,
with three items that plain orbax reads:

- `model`: `{"target": params, "flax_mutables": collections}` (a PyTree item);
- `optimizer`: `{"step": step, "param_states": optax state}` (a PyTree item);
- `meta`: JSON: format version, step, rng, data position, metrics, metadata
  (checked on read by `flaxstate.checkpoint.meta`).

Format 1 stored the whole state dict as one item, `state`; each format's
items, and how an older one is read, are `flaxstate.checkpoint.formats`'.
Names orbax never lists: a save in progress (or one that failed or was
killed), `<step>.orbax-checkpoint-tmp`, and a damaged step a writer set
aside, `<step>.damaged`.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import jax
import numpy as np
import orbax.checkpoint as ocp

from flaxstate import settings, tree_paths
from flaxstate.checkpoint import budget
from flaxstate.checkpoint.errors import CheckpointError
from flaxstate.train_state import StateMismatchError

MODEL, OPTIMIZER, META = "model", "optimizer", "meta"

Rename = Mapping[str, str] | Callable[[str], str] | None
"""Regex rules from stored '/'-joined paths to a template's: `{old: new}`, or a function of a path."""
LEGACY_STATE = "state"
"""Format 1 stored the whole state dict as one item, `state`; it is upgraded on read."""

LEGACY_RUN_ID = "format-2"
"""The run id that checkpoints of formats 1 and 2 (written before runs had ids) read as."""

SET_ASIDE = ".damaged"
"""The suffix a writer gives a damaged step's directory (`10.damaged`): a name orbax does not list."""

TMP_MARK = ".orbax-checkpoint-tmp"
"""What orbax's temporary directory of a save in progress (or of one that failed or was killed) holds in its name."""


@dataclasses.dataclass(frozen=True)
class StoredCheckpoint:
    """What a read gives back (of either tier): the state dict (state-dict layout) and the JSON meta."""

    state_dict: dict[str, Any]
    meta: dict[str, Any]


def handlers(host_memory_budget: budget.HostMemoryBudget = budget.UNBOUNDED) -> dict[str, Any]:
    """orbax's handler of each item of a step; with a budget, arrays written and read within it (`budget`)."""

    def arrays() -> ocp.PyTreeCheckpointHandler:
        return ocp.PyTreeCheckpointHandler(use_compression=False, **host_memory_budget.handler_options())

    return {MODEL: arrays(), OPTIMIZER: arrays(), META: ocp.JsonCheckpointHandler(), LEGACY_STATE: arrays()}


def encode_rng(rng: jax.Array | None) -> dict[str, Any] | None:
    """Returns a random key as JSON: its implementation and its data."""
    if rng is None:
        return None
    return {"impl": str(jax.random.key_impl(rng)), "data": np.asarray(jax.random.key_data(rng)).tolist()}


def decode_rng(encoded: Mapping[str, Any] | None) -> jax.Array | None:
    """Returns the random key that `encode_rng` encoded."""
    if encoded is None:
        return None
    data: Any = np.asarray(encoded["data"], dtype=np.uint32)  # numpy: JAX's stubs name only its own arrays
    return jax.random.wrap_key_data(data, impl=encoded["impl"])


def to_json(value: Any) -> Any:
    """Returns a dict, dataclass or plain value as JSON-ready data (numpy scalars as the Python numbers they hold).

    Raises:
        CheckpointError: it is not JSON-serializable.
    """
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        value = dataclasses.asdict(value)
    try:
        return json.loads(json.dumps(value, default=settings.plain))
    except TypeError as error:
        raise CheckpointError(
            f"metadata must be JSON-serializable (a dict or dataclass of plain values): {error}"
        ) from error


def renamed_against(
    stored_flat: Mapping[str, Any], template: Mapping[str, Any] | None, rename: Rename, with_optimizer: bool, what: str
) -> tuple[dict[str, str], dict[str, Any]]:
    """A step's stored paths against a template: each stored path's new path (by `rename`), and the template's leaves.

    Returns:
        `{stored path: template path}` and the template's flat leaves (the
        optimizer's left out without `with_optimizer`; empty without a template).

    Raises:
        StateMismatchError: the renamed stored tree differs from the template's, naming every differing path.
    """
    renamed = tree_paths.rename(stored_flat, rename)
    new_path = dict(zip(stored_flat, renamed, strict=True))
    expected: dict[str, Any] = {}
    if template is not None:
        expected = tree_paths.flatten(template)
        if not with_optimizer:
            expected = {k: v for k, v in expected.items() if not k.startswith("state/")}
        difference = tree_paths.diff(expected, renamed)
        if difference:
            params = {path for path in expected if path.startswith("target/")}
            if params and not params & renamed.keys():  # not one parameter in common: another model's checkpoints
                advice = (
                    "\nIt holds another model's checkpoints (none of this model's parameter paths is in it, as for a "
                    "linen model's run read by an NNX module): give this run a directory of its own (another "
                    "output_dir), or restore into the model it was saved from. rename= maps the paths of an earlier "
                    "layout of the same model."
                )
            else:
                advice = "\nRestore into the model it was saved from, or map old paths to new ones with rename=."
            raise StateMismatchError(f"{what} does not match the model:\n" + difference.describe() + advice)
    return new_path, expected


def state_dict_of(flat: Mapping[str, Any]) -> dict[str, Any]:
    """The state dict of `{path: leaf}`, with the entries that hold no leaf (an empty collection) as `{}`."""
    tree = tree_paths.unflatten(flat)
    for entry in ("target", "flax_mutables", "state"):
        tree.setdefault(entry, {})
    return tree


def is_empty_or_missing(directory: Path) -> bool:
    """Whether a directory does not exist (or vanishes as it is listed) or holds no checkpoint steps at all."""
    try:
        return not directory.is_dir() or not any(entry.name.isdigit() for entry in directory.iterdir())
    except (FileNotFoundError, NotADirectoryError):
        return True


def is_step_entry(name: str) -> bool:
    """Whether a directory's entry is one of a writer's steps: a step (`10`), orbax's temporary directory of one
    (`10.orbax-checkpoint-tmp...`), or one set aside (`10.damaged`), rather than another writer's directory."""
    return name.split(".")[0].isdigit()
