"""Tree paths: '/'-joined names for the leaves of nested dicts, and structure diffs.

One place for the two things that both the train state and the checkpoint
readers need: naming every leaf of a tree by its path, and telling a user in
one error which paths of a tree differ from the ones expected.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import jax
import numpy as np

_MAX_LISTED = 20


def key_name(key: Any) -> str:
    """Returns the name of one step of a `jax.tree_util` key path."""
    for attribute in ("key", "name", "idx"):
        if hasattr(key, attribute):
            return str(getattr(key, attribute))
    return str(key)


def path_name(key_path: Iterable[Any]) -> str:
    """Returns the '/'-joined name of a `jax.tree_util` key path."""
    return "/".join(key_name(key) for key in key_path)


def flatten(tree: Any, is_leaf: Callable[[Any], bool] | None = None) -> dict[str, Any]:
    """Returns `{path: leaf}` for every leaf of `tree`, paths '/'-joined.

    Raises:
        ValueError: two leaves whose paths join to one name (a key that holds '/', as linen allows:
            `{"enc/proj": {"kernel"}}` beside `{"enc": {"proj": {"kernel"}}}`), naming both; one would be lost.
    """
    leaves = jax.tree_util.tree_flatten_with_path(tree, is_leaf=is_leaf)[0]
    flat = {path_name(key_path): leaf for key_path, leaf in leaves}
    if len(flat) < len(leaves):
        seen: dict[str, Any] = {}
        for key_path, _ in leaves:
            name = path_name(key_path)
            if name in seen:
                raise ValueError(
                    f"two leaves of the tree join to the path {name!r}: {_keys(seen[name])} and {_keys(key_path)} "
                    "(a key holds '/'); rename one of them so that every '/'-joined path names one leaf."
                )
            seen[name] = key_path
    return flat


def _keys(key_path: Iterable[Any]) -> str:
    """A key path as its keys, e.g. `['enc/proj']['kernel']`."""
    return "".join(f"[{key_name(key)!r}]" for key in key_path)


def unflatten(flat: Mapping[str, Any]) -> dict[str, Any]:
    """Builds nested dicts from `{path: leaf}`, the inverse of `flatten` on dicts."""
    tree: dict[str, Any] = {}
    for path, leaf in flat.items():
        node = tree
        *parents, name = path.split("/")
        for parent in parents:
            node = node.setdefault(parent, {})
        node[name] = leaf
    return tree


def shape_and_dtype(leaf: Any) -> tuple[tuple[int, ...], np.dtype]:
    """Returns the shape and dtype of an array-like leaf (arrays, scalars, specs)."""
    if hasattr(leaf, "shape") and hasattr(leaf, "dtype"):
        return tuple(leaf.shape), np.dtype(leaf.dtype)
    array = np.asarray(leaf)
    return tuple(array.shape), array.dtype


@dataclasses.dataclass(frozen=True)
class StructureDiff:
    """What differs between the tree that was expected and the one found."""

    missing: tuple[str, ...] = ()
    unexpected: tuple[str, ...] = ()
    mismatched: tuple[str, ...] = ()

    def __bool__(self) -> bool:
        return bool(self.missing or self.unexpected or self.mismatched)

    def describe(self) -> str:
        """Returns one line per kind of difference, each naming its paths."""
        lines = []
        for label, paths in (
            ("missing (expected, not found)", self.missing),
            ("unexpected (found, not expected)", self.unexpected),
            ("shape or dtype mismatched", self.mismatched),
        ):
            if paths:
                shown = list(paths[:_MAX_LISTED])
                if len(paths) > _MAX_LISTED:
                    shown.append(f"... and {len(paths) - _MAX_LISTED} more")
                lines.append(f"  {label}: " + ", ".join(shown))
        return "\n".join(lines)


def diff(expected: Any, found: Any) -> StructureDiff:
    """Compares two trees path by path: names, shapes and dtypes.

    Args:
        expected: the tree that the caller needs (arrays or `ShapeDtypeStruct`s).
        found: the tree that was given (arrays or array metadata).

    Returns:
        a `StructureDiff`, falsy when the trees agree.
    """
    expected_flat = expected if isinstance(expected, dict) and _is_flat(expected) else flatten(expected)
    found_flat = found if isinstance(found, dict) and _is_flat(found) else flatten(found)
    mismatched = []
    for path in sorted(expected_flat.keys() & found_flat.keys()):
        want_shape, want_dtype = shape_and_dtype(expected_flat[path])
        got_shape, got_dtype = shape_and_dtype(found_flat[path])
        if want_shape != got_shape or want_dtype != got_dtype:
            mismatched.append(f"{path} (expected {want_dtype}{list(want_shape)}, found {got_dtype}{list(got_shape)})")
    return StructureDiff(
        missing=tuple(sorted(expected_flat.keys() - found_flat.keys())),
        unexpected=tuple(sorted(found_flat.keys() - expected_flat.keys())),
        mismatched=tuple(mismatched),
    )


def _is_flat(tree: dict[str, Any]) -> bool:
    return all(not isinstance(value, Mapping) for value in tree.values())


def rename(flat: Mapping[str, Any], rules: Mapping[str, str] | Callable[[str], str] | None) -> dict[str, Any]:
    """Renames the paths of a flat tree by regex rules (old pattern -> new).

    Args:
        flat: `{path: leaf}`, as `flatten` returns.
        rules: `{pattern: replacement}` applied with `re.sub` in order, or a
            function of a path; `None` keeps the paths.

    Returns:
        the renamed `{path: leaf}`.

    Raises:
        ValueError: when two paths are renamed to the same one.
    """
    if rules is None:
        return dict(flat)
    if callable(rules):
        rename_path = rules
    else:
        compiled = [(re.compile(pattern), replacement) for pattern, replacement in rules.items()]

        def rename_path(path: str) -> str:
            for pattern, replacement in compiled:
                path = pattern.sub(replacement, path)
            return path

    renamed: dict[str, Any] = {}
    sources: dict[str, str] = {}
    for path, leaf in flat.items():
        new_path = rename_path(path)
        if new_path in renamed:
            raise ValueError(
                f"rename maps both {sources[new_path]!r} and {path!r} to {new_path!r}; "
                "make the patterns map each old path to a different new one."
            )
        renamed[new_path] = leaf
        sources[new_path] = path
    return renamed
