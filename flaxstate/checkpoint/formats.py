"""The on-disk formats of an orbax step: one object a version, holding its items and how it is read.

A state dict (`{"target", "flax_mutables", "state"}`) is stored as orbax
items, each holding the part of it under a prefix:

- format 1: one item, `state`, holding the whole state dict;
- formats 2 and 3: `model` (`target` and `flax_mutables`) and `optimizer`
  (`state`, read only when the optimizer is restored), so a model restores
  without opening the optimizer's arrays.

Format 3 added the run id to the meta; an older step reads as the run
`LEGACY_RUN_ID` (`Format.upgrade`). A reader asks `of(meta)` for a step's
format and never branches on the version itself.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from typing import Any

from flaxstate import tree_paths
from flaxstate.checkpoint.layout import LEGACY_RUN_ID, LEGACY_STATE, MODEL, OPTIMIZER, state_dict_of
from flaxstate.records import FORMAT_VERSION

OPTIMIZER_KEY = "state"
"""The state dict's entry of the optimizer's state (and, in training states, the EMA's and the loss scale's)."""


@dataclasses.dataclass(frozen=True)
class Item:
    """One orbax item of a step: its name, and which of the state dict's entries it holds.

    Attributes:
        name: the item's name in the step directory.
        holds: the state dict's top-level keys it holds as a dict of them
            (`("target", "flax_mutables")`), or one key whose value is the
            item itself (`"state"`: the optimizer's item).
    """

    name: str
    holds: tuple[str, ...] | str

    @property
    def prefix(self) -> str:
        """What the item's own paths get in the state dict (`"state/"` for the optimizer's)."""
        return f"{self.holds}/" if isinstance(self.holds, str) else ""

    @property
    def optimizer(self) -> bool:
        """Whether it holds only the optimizer's part (not opened when the optimizer is not restored)."""
        return self.holds == OPTIMIZER_KEY

    def part(self, state_dict: Mapping[str, Any]) -> Any:
        """What the item stores of a state dict."""
        if isinstance(self.holds, str):
            return dict(state_dict[self.holds])
        return {key: state_dict[key] for key in self.holds}

    def has(self, path: str) -> bool:
        """Whether a state-dict path is in this item."""
        top = path.split("/", 1)[0]
        return top == self.holds if isinstance(self.holds, str) else top in self.holds


@dataclasses.dataclass(frozen=True)
class Format:
    """One on-disk format version: its items, and what a read of an older version adds to its meta.

    Attributes:
        version: the format version that the meta names.
        items: the step's items.
        partial_reads: whether one array can be read alone (by path).
        legacy_fields: meta fields that steps of this version lack, with the
            value they read as.
    """

    version: int
    items: tuple[Item, ...]
    partial_reads: bool = True
    legacy_fields: Mapping[str, Any] = dataclasses.field(default_factory=dict)

    def read_items(self, with_optimizer: bool) -> tuple[Item, ...]:
        """The items a read opens (not the optimizer's without `with_optimizer`)."""
        return tuple(item for item in self.items if with_optimizer or not item.optimizer)

    def upgrade(self, meta: Mapping[str, Any]) -> dict[str, Any]:
        """A step's meta, with the fields its version lacks as they read (its run id, before format 3)."""
        return {**self.legacy_fields, **meta}

    def layout(self, trees: Mapping[str, Any], with_optimizer: bool, step: int) -> dict[str, Any]:
        """The stored items' trees (array metadata as leaves) in the state-dict layout.

        Raises:
            FileNotFoundError: an item the read needs is missing (damage, named).
        """
        items = self.read_items(with_optimizer)
        missing = [item.name for item in items if item.name not in trees]
        if missing:
            raise FileNotFoundError(f"the checkpoint of step {step} has no item {', '.join(missing)}")
        flat = self.join({item.name: tree_paths.flatten(dict(trees[item.name])) for item in items}, with_optimizer)
        return state_dict_of(flat)

    def join(self, flat_items: Mapping[str, Mapping[str, Any]], with_optimizer: bool) -> dict[str, Any]:
        """The state dict's flat paths from each read item's flat paths (the optimizer's left out without it)."""
        flat: dict[str, Any] = {}
        for item in self.read_items(with_optimizer):
            if item.name in flat_items:
                flat.update({item.prefix + path: value for path, value in flat_items[item.name].items()})
        if not with_optimizer:
            flat = {path: value for path, value in flat.items() if not path.startswith(OPTIMIZER_KEY + "/")}
        return flat

    def split(self, paths: Mapping[str, Any]) -> dict[str, dict[str, Any]]:
        """Each state-dict path's item and the path within it: `{item: {inner path: value}}`."""
        by_item: dict[str, dict[str, Any]] = {}
        for path, value in paths.items():
            item = next(item for item in self.items if item.has(path))
            by_item.setdefault(item.name, {})[path.removeprefix(item.prefix)] = value
        return by_item

    def save_items(self, state_dict: Mapping[str, Any], save: Callable[[Any], Any]) -> dict[str, Any]:
        """The items of a state dict, each made by `save` (an orbax save argument) from its part."""
        return {item.name: save(item.part(state_dict)) for item in self.items}


_WHOLE = Item(LEGACY_STATE, ("target", "flax_mutables", OPTIMIZER_KEY))
_MODEL = Item(MODEL, ("target", "flax_mutables"))
_OPTIMIZER = Item(OPTIMIZER, OPTIMIZER_KEY)

FORMATS: dict[int, Format] = {
    1: Format(1, (_WHOLE,), partial_reads=False, legacy_fields={"run_id": LEGACY_RUN_ID}),
    2: Format(2, (_MODEL, _OPTIMIZER), legacy_fields={"run_id": LEGACY_RUN_ID}),
    3: Format(3, (_MODEL, _OPTIMIZER)),
}
"""Every format this flaxstate reads, by version (the newest is the one it writes)."""

CURRENT = FORMATS[FORMAT_VERSION]
"""The format a save writes."""


def of(meta: Mapping[str, Any]) -> Format:
    """The format of a step, from its (validated) meta."""
    return FORMATS[int(meta["format_version"])]
