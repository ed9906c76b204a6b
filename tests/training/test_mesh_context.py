"""The caller's mesh context (`jax.set_mesh`) and meshes whose shardings are types (`jax.make_mesh`'s Explicit axes).

A model written the way JAX now teaches names shardings as it computes
(`reshard`, `out_sharding=P(...)`, a bare `PartitionSpec`): it traces only
under a mesh context, which the loop carries onto every thread that traces
its programs. One CPU device each: a mesh of one device needs no collectives.
"""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from flaxstate_testing import toy
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

import flaxstate as fs
from flaxstate import tree_paths

RULES = [("batch", "fsdp")]
N_STEPS = 4


def explicit_mesh() -> Mesh:
    return jax.make_mesh((1,), ("fsdp",))  # Explicit axes by default


def auto_mesh() -> Mesh:
    return Mesh(np.asarray(jax.devices()[:1]), ("fsdp",))


class LinenMLP(nn.Module):
    """Two layers; `style` says how the model names its shardings: "explicit" (`reshard` and `out_sharding=`, an
    Explicit mesh's way), "constraint" (a bare `PartitionSpec` in `with_sharding_constraint`, an Auto mesh's), or
    None (names none)."""

    style: str | None = None

    @nn.compact
    def __call__(self, x):
        first = self.param("first", nn.initializers.lecun_normal(), (x.shape[-1], 8))
        second = self.param("second", nn.initializers.lecun_normal(), (8, 1))
        return _forward(self.style, x, first, second)


class NnxMLP(nnx.Module):
    """`LinenMLP` as an NNX module."""

    def __init__(self, style: str | None, *, rngs: nnx.Rngs):
        self.style = style
        self.first = nnx.Param(nnx.initializers.lecun_normal()(rngs.params(), (4, 8)))
        self.second = nnx.Param(nnx.initializers.lecun_normal()(rngs.params(), (8, 1)))

    def __call__(self, x):
        return _forward(self.style, x, self.first[...], self.second[...])


def _forward(style, x, first, second):
    if style == "explicit":
        x = jax.sharding.reshard(x, P("fsdp", None))
        hidden = nn.relu(jnp.dot(x, first, out_sharding=P("fsdp", None)))
        return jnp.dot(hidden, second, out_sharding=P("fsdp", None))[:, 0]
    if style == "constraint":
        x = jax.lax.with_sharding_constraint(x, P("fsdp", None))  # a bare spec: only under a mesh context
    return (nn.relu(x @ first) @ second)[:, 0]


def make_loop(kind: str, style: str | None, **where):
    """A loop of the linen or NNX MLP over the same batches, its params started alike."""
    data = toy.batches(N_STEPS, 8)
    if kind == "linen":
        model = LinenMLP(style)
        task = fs.TrainTask(apply=model.apply, optimizer=optax.adam(1e-2), loss=toy.mse, data=data)
        return fs.TrainLoop(model.init, task, 0, n_steps=N_STEPS, n_steps_per_checkpoint=2, stdout=False, **where)
    module = NnxMLP(style, rngs=nnx.Rngs(0))
    task = fs.TrainTask(apply=module, optimizer=optax.adam(1e-2), loss=toy.mse, data=data)
    return fs.TrainLoop(module, task, 0, n_steps=N_STEPS, n_steps_per_checkpoint=2, stdout=False, **where)


def final_params(loop) -> dict[str, np.ndarray]:
    records = list(loop)
    assert [record.step for record in records] == [2, N_STEPS]
    return {path: np.asarray(value) for path, value in tree_paths.flatten(records[-1].state.params).items()}


@pytest.mark.parametrize("kind", ["linen", "nnx"])
@pytest.mark.parametrize(
    ("mesh", "style"), [(explicit_mesh, "explicit"), (auto_mesh, "constraint")], ids=["Explicit", "Auto"]
)
def test_a_model_that_names_shardings_trains_inside_jax_set_mesh_without_mesh_as_the_plain_model_does(
    kind, mesh, style
):
    # The model's specs resolve only under a mesh context: the loop compiles on threads of its own, where the
    # caller's `jax.set_mesh` was absent ("Using PartitionSpec when you are not under a mesh context").
    with jax.set_mesh(mesh()):
        loop = make_loop(kind, style, axis_rules=RULES)
    trained = final_params(loop)  # iterated outside the context: the loop carries its own
    plain = final_params(make_loop(kind, None, mesh=auto_mesh(), axis_rules=RULES))
    assert trained.keys() == plain.keys() and len(trained) == 2
    for path, value in plain.items():
        np.testing.assert_array_equal(trained[path], value, err_msg=path)


@pytest.mark.parametrize("kind", ["linen", "nnx"])
def test_an_explicit_mesh_given_as_mesh_is_traced_under_it_without_the_caller_s_context(kind):
    trained = final_params(make_loop(kind, "explicit", mesh=explicit_mesh(), axis_rules=RULES))
    plain = final_params(make_loop(kind, None, mesh=auto_mesh(), axis_rules=RULES))
    for path, value in plain.items():
        np.testing.assert_array_equal(trained[path], value, err_msg=path)


def test_the_evaluation_of_a_model_that_names_shardings_runs_under_the_loop_s_mesh():
    model = LinenMLP("explicit")
    with jax.set_mesh(explicit_mesh()):
        evaluate = fs.EvalLoop(
            fs.EvalTask(apply=model.apply, metrics={"loss": toy.mse}, data=toy.batches(2, 8)), 0, axis_rules=RULES
        )
        loop = make_loop("linen", "explicit", axis_rules=RULES)
    summary = evaluate(next(iter(loop)))
    assert np.isfinite(summary.metrics["eval"]["loss"])


def test_a_mesh_that_differs_from_the_context_s_is_refused_naming_both():
    other = jax.make_mesh((1,), ("data",))
    with jax.set_mesh(explicit_mesh()):
        with pytest.raises(ValueError, match=r"mesh= \(\{'data': 1\} \(Explicit\)\).*jax\.set_mesh.*\{'fsdp': 1\}"):
            make_loop("linen", None, mesh=other, axis_rules=[("batch", "data")])
        partitioning = fs.Partitioning(mesh=other, axis_rules=[("batch", "data")])
        with pytest.raises(ValueError, match=r"partitioning\.mesh .*'data'.*\{'fsdp': 1\}"):
            make_loop("linen", None, partitioning=partitioning)


def test_the_context_s_mesh_without_axis_rules_is_refused_naming_what_to_pass():
    with jax.set_mesh(explicit_mesh()):
        with pytest.raises(ValueError, match=r"inside jax\.set_mesh\(\{'fsdp': 1\} \(Explicit\)\).*axis_rules="):
            make_loop("linen", None)
        with pytest.raises(ValueError, match="axis_rules="):
            fs.global_batches(toy.batches(2, 8)[0], 4)


def test_the_same_mesh_given_inside_its_context_and_devices_inside_any_are_taken():
    mesh = explicit_mesh()
    with jax.set_mesh(mesh):
        assert final_params(make_loop("linen", "explicit", mesh=mesh, axis_rules=RULES))
        assert final_params(make_loop("linen", None, devices=jax.devices()[:1]))


@pytest.mark.parametrize("kind", ["linen", "nnx"])
@pytest.mark.parametrize(
    ("mesh", "style"), [(explicit_mesh, "explicit"), (auto_mesh, "constraint")], ids=["Explicit", "Auto"]
)
def test_xla_s_flops_at_k_steps_a_dispatch_come_from_the_programs_it_runs_under_the_mesh(kind, mesh, style):
    # At K = 2 XLA's count of a step comes from the program of 2 steps the run dispatches (with microbatches,
    # scaled by their loop factor from the one-step update lowered under the loop's mesh): no one-step program
    # is compiled for it, and it counts what the one-step update of a K = 1 run counts.
    counts = {}
    for per_dispatch in (1, 2):
        with jax.set_mesh(mesh()):
            loop = make_loop(kind, style, axis_rules=RULES, n_steps_per_dispatch=per_dispatch, n_microbatches=2)
        records = list(loop)
        counts[per_dispatch] = records[-1].xla_flops_per_step
        assert counts[per_dispatch] == records[0].xla_flops_per_step
        # The one-step update that XLA's count compiles at K = 1 (a record's, with gradients: the K = 1 run
        # dispatches it) is not made at K = 2.
        assert ("update of 1 steps, gradients" in loop.program.made()) == (per_dispatch == 1)
    assert counts[1] is not None and counts[2] == pytest.approx(counts[1], rel=0.02)
