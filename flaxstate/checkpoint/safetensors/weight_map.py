"""One table between a model's params and a model family's safetensors files, read both ways.

A `WeightMap` says, for each params tree path, which tensor of the files
holds it and how the file lays it out: `{"layers/{i}/attn/q/kernel":
("model.layers.{i}.self_attn.q_proj.weight", "(h d) e -> e h d")}`. An
import (`SafetensorsReader(map=...)`) reads the file's tensor and
rearranges it with the layout, an einops pattern from the file's array to
the tree's; an export (`export_safetensors(map=...)`) applies it backwards.
The layout's sizes come from the tree's side (the target's shapes on
import, the source's on export), so a layout names only the axes' letters.
Two tree paths that name one file tensor are tied: an import fills both
from it, an export writes it once.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, NamedTuple

import jax
import numpy as np

from flaxstate import extras

_PLACEHOLDER = re.compile(r"\{([A-Za-z_][A-Za-z0-9_]*)\}")
_SEGMENT = r"[A-Za-z0-9_]+"
"""What one `{name}` matches: one segment of a path or a file name, digits or a word."""
_GROUP = re.compile(r"\([^()]*\)|\.\.\.|[^\s()]+")


def _einops(what: str) -> Any:
    return extras.require("einops", "safetensors", what)


@dataclasses.dataclass(frozen=True)
class Layout:
    """An einops pattern from a file's array to the tree's (`"(h d) e -> e h d"`), its sizes from the tree's shape.

    Attributes:
        pattern: the pattern, file side first.
    """

    pattern: str

    def __post_init__(self) -> None:
        sides = self.pattern.split("->")
        if len(sides) != 2:
            raise ValueError(
                f"WeightMap: the layout {self.pattern!r} is not an einops pattern 'file axes -> tree axes' (one '->'), "
                "e.g. '(h d) e -> e h d' or 'o i -> i o'."
            )
        names = [set(re.findall(r"[A-Za-z_][A-Za-z0-9_]*", side)) for side in sides]
        if names[0] != names[1]:
            raise ValueError(
                f"WeightMap: the layout {self.pattern!r} names {sorted(names[0])} on the file's side and "
                f"{sorted(names[1])} on the tree's; a layout rearranges the same axes, so both sides name the same."
            )

    @property
    def _file_side(self) -> str:
        return self.pattern.split("->")[0].strip()

    @property
    def _tree_side(self) -> str:
        return self.pattern.split("->")[1].strip()

    @property
    def backwards(self) -> str:
        """The pattern from the tree's array to the file's."""
        return f"{self._tree_side} -> {self._file_side}"

    def sizes(self, tree_shape: Sequence[int]) -> dict[str, int]:
        """The sizes of the axes that stand alone on the tree's side, read from `tree_shape`."""
        groups = _GROUP.findall(self._tree_side)
        if "..." in groups:
            at = groups.index("...")
            placed = list(zip(groups[:at], tree_shape, strict=False))
            tail = groups[at + 1 :]
            placed += list(zip(tail, tree_shape[len(tree_shape) - len(tail) :], strict=False)) if tail else []
        else:
            placed = list(zip(groups, tree_shape, strict=False))
        return {group: int(size) for group, size in placed if group.isidentifier()}

    def file_shape(self, tree_shape: Sequence[int], dtype: Any = np.float32) -> tuple[int, ...]:
        """The shape the file holds for a tree array of `tree_shape`.

        Raises:
            ValueError: the layout does not fit the shape (its axes' count, or sizes that do not divide), with
                einops' reason.
        """
        einops = _einops("WeightMap")
        try:
            out = jax.eval_shape(
                lambda x: einops.rearrange(x, self.backwards, **self.sizes(tree_shape)),
                jax.ShapeDtypeStruct(tuple(tree_shape), dtype),
            )
        except einops.EinopsError as error:
            raise ValueError(" ".join(str(error).split())) from None
        return tuple(out.shape)

    def to_tree(self, array: np.ndarray, tree_shape: Sequence[int]) -> np.ndarray:
        """The file's array (or the part of it that `file_index` gave) as the tree holds it."""
        return np.asarray(_einops("SafetensorsReader").rearrange(array, self.pattern, **self.sizes(tree_shape)))

    def to_file(self, array: np.ndarray) -> np.ndarray:
        """The tree's array as the file holds it."""
        return np.asarray(_einops("export_safetensors").rearrange(array, self.backwards, **self.sizes(np.shape(array))))

    def file_index(self, index: Sequence[slice], tree_shape: Sequence[int]) -> tuple[slice, ...] | None:
        """The slices of the file's tensor that hold the tree's part `index`, or `None` where that part is not one
        block of the file (then the tensor is read whole).

        A part is one block where the tree's side names its axes one by one and each of the file's groups
        `(a b c)` is cut only in one axis, the axes before it taken one index each and those after it whole: a
        q projection `(h d) e -> e h d` cut in heads or in the embedding reads only its rows.
        """
        tree_groups = _GROUP.findall(self._tree_side)
        file_groups = [group.strip("()").split() for group in _GROUP.findall(self._file_side)]
        if not all(group.isidentifier() for group in tree_groups) or len(tree_groups) != len(tree_shape):
            return None
        if not all(name.isidentifier() for group in file_groups for name in group):
            return None
        sizes = dict(zip(tree_groups, (int(size) for size in tree_shape), strict=True))
        ranges = {}
        for name, cut in zip(tree_groups, tuple(index) + (slice(None),) * (len(tree_groups) - len(index)), strict=True):
            start, stop, step = cut.indices(sizes[name])
            if step != 1:
                return None
            ranges[name] = (start, max(start, stop))
        slices = []
        for group in file_groups:
            partial = [i for i, name in enumerate(group) if ranges[name] != (0, sizes[name])]
            last = partial[-1] if partial else 0
            if any(ranges[name][1] - ranges[name][0] != 1 for name in group[:last]):
                return None
            stride = int(np.prod([sizes[name] for name in group[last + 1 :]], dtype=np.int64))
            start = sum(
                ranges[name][0] * int(np.prod([sizes[after] for after in group[i + 1 :]], dtype=np.int64))
                for i, name in enumerate(group)
            )
            length = (ranges[group[last]][1] - ranges[group[last]][0]) * stride if group else 1
            slices.append(slice(start, start + length))
        return tuple(slices)


TRANSPOSED = Layout("o i -> i o")
"""A 2-D kernel stored `(out, in)`: what `transpose=` names."""


@dataclasses.dataclass(frozen=True)
class Entry:
    """Where one tree path lives in the files: the tensor's name, and its layout there (`None`: as the tree's)."""

    name: str
    layout: Layout | None = None


class Pair(NamedTuple):
    """One row of `WeightMap.pairs`: a tree path and its shape, its tensor's name in the files and shape there."""

    path: str
    shape: tuple[int, ...]
    name: str
    file_shape: tuple[int, ...]
    layout: Layout | None

    def __str__(self) -> str:
        through = f"  ({self.layout.pattern})" if self.layout is not None else ""
        return f"{self.path} {list(self.shape)} <-> {self.name} {list(self.file_shape)}{through}"


@dataclasses.dataclass(frozen=True)
class _Rule:
    tree: str
    file: str
    layout: Layout | None
    match: re.Pattern[str]


class WeightMap:
    """One table between params tree paths and safetensors tensor names, read both ways, with layouts.

    `rules` maps a tree path pattern to a file name pattern, or to `(file
    name pattern, layout)`. Patterns hold `{name}` placeholders, each
    matching one segment (digits or a word), the same names on both sides.
    A layout is an einops pattern from the file's array to the tree's; its
    sizes are the tree's. Two tree paths whose rules give one name are tied.

    Example:
        >>> qwen = WeightMap({
        ...     "embed/embedding": "model.embed_tokens.weight",
        ...     "lm_head/kernel": ("model.embed_tokens.weight", "v e -> e v"),
        ...     "layers/{i}/attn/q/kernel": ("model.layers.{i}.self_attn.q_proj.weight", "(h d) e -> e h d"),
        ... })
        >>> qwen.entry("layers/3/attn/q/kernel")
        Entry(name='model.layers.3.self_attn.q_proj.weight', layout=Layout(pattern='(h d) e -> e h d'))
    """

    def __init__(self, rules: Mapping[str, str | Sequence[str]], *, skip: Sequence[str] = ()) -> None:
        """Checks the table once.

        Args:
            rules: `{tree path pattern: file name pattern | (file name pattern, layout)}`.
            skip: file name patterns of tensors the model does not hold (HF's rotary `inv_freq`): an import
                leaves them unread instead of refusing the files.

        Raises:
            ValueError: a rule that is not a pattern (or a pattern and a layout), a placeholder on one side only,
                one named twice in a pattern, or a layout that is not an einops pattern of the same axes.
        """
        if not isinstance(rules, Mapping) or not rules:
            raise ValueError(
                "WeightMap takes a dict {tree path pattern: file name pattern | (file name pattern, layout)}; got "
                f"{type(rules).__name__} {rules!r}."
            )
        self._rules = tuple(self._rule(tree, value) for tree, value in rules.items())
        if isinstance(skip, str):
            skip = (skip,)
        self._skip = tuple(_compiled(pattern, f"WeightMap skip {pattern!r}") for pattern in skip)
        self.rules = {rule.tree: rule.file if rule.layout is None else (rule.file, rule.layout.pattern)
                      for rule in self._rules}  # fmt: skip
        """The table as given (each layout as its pattern): what `to_json` writes."""
        self.skip = tuple(skip)

    @staticmethod
    def _rule(tree: Any, value: Any) -> _Rule:
        if isinstance(value, str):
            file, layout = value, None
        elif isinstance(value, Sequence) and len(value) == 2 and all(isinstance(part, str) for part in value):
            file, layout = value[0], Layout(value[1])
        else:
            raise ValueError(
                f"WeightMap: the rule of {tree!r} is {value!r}; give a file name pattern, or (file name pattern, "
                "layout) such as ('model.layers.{i}.self_attn.q_proj.weight', '(h d) e -> e h d')."
            )
        if not isinstance(tree, str):
            raise ValueError(f"WeightMap: the tree path pattern {tree!r} is not a string.")
        match = _compiled(tree, f"WeightMap: the tree path pattern {tree!r}")
        _compiled(file, f"WeightMap: the file name pattern {file!r}")
        names = set(_PLACEHOLDER.findall(tree)), set(_PLACEHOLDER.findall(file))
        if names[0] != names[1]:
            raise ValueError(
                f"WeightMap: {tree!r} -> {file!r} has the placeholders {sorted(names[0])} on the tree's side and "
                f"{sorted(names[1])} on the file's; a table that reads both ways names the same on both."
            )
        return _Rule(tree, file, layout, match)

    @classmethod
    def from_json(cls, path: str | os.PathLike[str]) -> WeightMap:
        """Reads a table from a JSON file: one object `{tree pattern: file pattern | [file pattern, layout]}`.

        Raises:
            ValueError: a file that is not such an object, naming it.
        """
        try:
            rules = json.loads(Path(path).read_text())
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as error:
            raise ValueError(f"the weight map {path} cannot be read as JSON: {error}.") from None
        if not isinstance(rules, dict):
            raise ValueError(
                f"the weight map {path} holds a JSON {type(rules).__name__}; it holds one object "
                '{"tree path pattern": "file name pattern" | ["file name pattern", "layout"]}.'
            )
        try:
            return cls(rules)
        except ValueError as error:
            raise ValueError(f"the weight map {path}: {error}") from None

    def to_json(self) -> str:
        """The table as the JSON that `from_json` and `flaxstate export --map` read."""
        return json.dumps(self.rules, indent=2) + "\n"

    def __repr__(self) -> str:
        return f"WeightMap({self.rules!r}{f', skip={self.skip!r}' if self.skip else ''})"

    def entry(self, path: str) -> Entry | None:
        """Where a tree path lives in the files, or `None` where no rule covers it.

        Raises:
            ValueError: two rules that cover the path, naming both.
        """
        found = [(rule, match) for rule in self._rules if (match := rule.match.fullmatch(path))]
        if len(found) > 1:
            raise ValueError(
                f"WeightMap: the tree path {path!r} is covered by two rules, {found[0][0].tree!r} and "
                f"{found[1][0].tree!r}; narrow one so that each path has one."
            )
        if not found:
            return None
        rule, match = found[0]
        name = _PLACEHOLDER.sub(lambda placeholder: match.group(placeholder.group(1)), rule.file)
        return Entry(name, rule.layout)

    def pairs(self, params: Any) -> list[Pair]:
        """Every tree path of `params` beside its tensor in the files, both shapes: a dry run of the map.

        Nothing is read or written: check a map against the model before a long export or import (`params`: the
        params' tree, of arrays or `jax.ShapeDtypeStruct`s, e.g. `nnx.state(model, nnx.Param)` or
        `jax.eval_shape(model.init, ...)["params"]`).

        Raises:
            StateMismatchError: tree paths no rule covers, and layouts that do not fit their params, naming
                each path with its shape (and the tensor's name).
        """
        from flaxstate import tree_paths
        from flaxstate.train_state import StateMismatchError

        pairs, uncovered, unfit = [], [], []
        for path, leaf in tree_paths.flatten(params).items():
            shape, dtype = tree_paths.shape_and_dtype(leaf)
            entry = self.entry(path)
            if entry is None:
                uncovered.append(f"{path} {list(shape)}")
                continue
            layout = entry.layout
            try:
                file_shape = layout.file_shape(shape, dtype) if layout is not None else shape
            except ValueError as error:
                unfit.append(f"{path} {list(shape)} -> {entry.name}: {layout.pattern if layout else ''!r} ({error})")
                continue
            pairs.append(Pair(path, shape, entry.name, file_shape, layout))
        problems = [
            *([f"no rule covers {', '.join(uncovered)}"] if uncovered else ()),
            *([f"the layout does not fit: {', '.join(unfit)}"] if unfit else ()),
        ]
        if problems:
            raise StateMismatchError(f"the WeightMap does not fit the params: {'; '.join(problems)}.")
        return pairs

    def skips(self, name: str) -> bool:
        """Whether the table says to leave the file's tensor `name` unread."""
        return any(pattern.fullmatch(name) for pattern in self._skip)


def _compiled(pattern: Any, what: str) -> re.Pattern[str]:
    """A pattern with `{name}` placeholders as a regex of the names it matches.

    Raises:
        ValueError: not a string, or a placeholder named twice.
    """
    if not isinstance(pattern, str) or not pattern:
        raise ValueError(f"{what} is not a non-empty string.")
    names = _PLACEHOLDER.findall(pattern)
    if len(names) != len(set(names)):
        raise ValueError(f"{what} names a placeholder twice; each {{name}} stands for one segment, once.")
    parts = _PLACEHOLDER.split(pattern)  # literal, name, literal, name, ..., literal
    return re.compile(
        "".join(re.escape(part) if i % 2 == 0 else f"(?P<{part}>{_SEGMENT})" for i, part in enumerate(parts))
    )
