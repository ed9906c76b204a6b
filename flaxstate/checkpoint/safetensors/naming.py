"""How an export or an import names its tensors: `rename`'s `(regex, replacement)` pairs, or a `WeightMap`."""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from flaxstate.checkpoint.safetensors.weight_map import WeightMap

Rename = Sequence[tuple[str, str]] | None


def renamer(rename: Rename, owner: str) -> Callable[[str], str] | None:
    """`rename`'s pairs as one function of a path (for `tree_paths.rename`), or `None` without any.

    Raises:
        ValueError: `rename` is not a list of `(regex, replacement)` pairs.
    """
    if rename is None:
        return None
    if isinstance(rename, Mapping) or isinstance(rename, str):
        raise ValueError(
            f"{owner} rename is a list of (regex, replacement) pairs, applied in order; got "
            f"{type(rename).__name__} {rename!r}."
        )
    rules = []
    for rule in rename:
        if not (isinstance(rule, tuple | list) and len(rule) == 2 and all(isinstance(part, str) for part in rule)):
            raise ValueError(f"{owner} rename: each rule is a (regex, replacement) pair; got {rule!r}.")
        rules.append((re.compile(rule[0]), rule[1]))

    def renamed(path: str) -> str:
        for pattern, replacement in rules:
            path = pattern.sub(replacement, path)
        return path

    return renamed


def checked_map(map: Any, rename: Rename, transpose: str | None, owner: str) -> WeightMap | None:  # noqa: A002
    """`map=` as a `WeightMap` (a dict of rules is made one), or `None`.

    Raises:
        ValueError: `map` beside `rename` or `transpose`, or rules a `WeightMap` refuses.
    """
    if map is None:
        return None
    if rename is not None or transpose is not None:
        raise ValueError(
            f"{owner} takes map= or rename=/transpose=, not both: map= is their general form; put the renames and "
            "transposes in its rules (a transpose is the layout 'o i -> i o')."
        )
    return map if isinstance(map, WeightMap) else WeightMap(map)
