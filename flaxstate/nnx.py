"""Flax NNX models in the loop: a linen-style `(init, apply)` pair for an `nnx.Module`."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx


def _stream_tags(rest: nnx.State) -> list[str]:
    tags = {
        leaf.tag
        for leaf in jax.tree.leaves(rest, is_leaf=lambda x: isinstance(x, nnx.RngKey))
        if isinstance(leaf, nnx.RngKey)
    }
    return sorted(tags)


def nnx_functions(model: nnx.Module) -> tuple[Callable[..., dict[str, Any]], Callable[..., Any]]:
    """Turns an NNX module into the `(init, apply)` pair of a linen module.

    `init(rngs, *inputs)` returns the module's current variables as plain
    dicts: `{"params": ..., "batch_stats": ...}` (the module was initialized
    when it was built, from its own `nnx.Rngs`). `apply(variables, *inputs,
    rngs=None, mutable=False)` runs the module in training mode when given
    rngs or mutable collections (dropout on, batch statistics updated and
    returned as `(outputs, {"batch_stats": ...})`), and in evaluation mode
    otherwise, as `TrainLoop` and `EvalLoop` call a linen module's apply.
    It takes numpy arrays (a record's) as well as jax arrays.

    Args:
        model: the NNX module.

    Returns:
        the `(init, apply)` pair.

    Example:
        >>> from flax import nnx
        >>> init, apply = nnx_functions(nnx.Linear(3, 2, rngs=nnx.Rngs(0)))
        >>> sorted(init(None, None))
        ['params']
    """
    split: Any = nnx.split(model, nnx.Param, nnx.BatchStat, ...)  # (graphdef, one state per filter)
    graphdef, params, batch_stats, rest = split
    tags = _stream_tags(rest)

    def init(rngs: Any, *inputs: Any) -> dict[str, Any]:
        variables = {"params": params.to_pure_dict()}
        if batch_stats:
            variables["batch_stats"] = batch_stats.to_pure_dict()
        return variables

    def apply(
        variables: Mapping[str, Any], *inputs: Any, rngs: Mapping[str, jax.Array] | None = None, mutable: Any = False
    ) -> Any:
        # As jax arrays: NNX updates variables in place, and a record's numpy arrays are read-only.
        variables = jax.tree.map(jnp.asarray, dict(variables))
        state_params = jax.tree.map(lambda x: x, params)
        nnx.replace_by_pure_dict(state_params, variables["params"])
        state_stats = jax.tree.map(lambda x: x, batch_stats)
        if "batch_stats" in variables:
            nnx.replace_by_pure_dict(state_stats, variables["batch_stats"])
        module = nnx.merge(graphdef, state_params, state_stats, jax.tree.map(lambda x: x, rest))
        training = bool(rngs) or bool(mutable)
        if training:
            module.train()
            if rngs and tags:
                key = next(iter(rngs.values()))
                seeds: dict[str, Any] = {tag: jax.random.fold_in(key, i) for i, tag in enumerate(tags)}
                nnx.reseed(module, **seeds)
        else:
            module.eval()
        outputs = module(*inputs)
        if not mutable:
            return outputs
        _, updated = nnx.split(module, nnx.BatchStat, ...)[:2]
        return outputs, ({"batch_stats": updated.to_pure_dict()} if batch_stats else {})

    return init, apply
