"""Trains an NNX module annotated as Flax's GSPMD guide does (`nnx.with_partitioning`) over a mesh of the
processes' devices (`fsdp`), the annotations its logical axes; prints one `result {json}` line from process 0:
the bytes of the kernel's shards each process holds against the kernel's, its partition spec, and the final
parameters (whole, gathered) and batch statistics.

With `"explicit": true`, the mesh is `jax.make_mesh`'s (Explicit axes), the module calls its layers with
`out_sharding=` as JAX's explicit sharding asks, and the data and the loop are made inside `jax.set_mesh` with no
`mesh=`. With `"eager": true` as well, the module is made with Flax's eager sharding (its default) inside that
`jax.set_mesh` and `nn.logical_axis_rules`, its parameters sharded as they are made."""

from __future__ import annotations

from flaxstate_testing.workers.common import print_sharded_result, setup

config = setup()

import flax.linen as nn  # noqa: E402
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from flax import nnx  # noqa: E402
from jax.experimental import multihost_utils  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

import flaxstate as fs  # noqa: E402
from flaxstate_testing import toy  # noqa: E402


class Annotated(nnx.Module):
    def __init__(self, rngs: nnx.Rngs) -> None:
        hidden = nnx.with_partitioning(nnx.initializers.lecun_normal(), ("embed", "hidden"))
        self.linear = nnx.Linear(4, 64, kernel_init=hidden, use_bias=False, rngs=rngs)
        self.norm = nnx.BatchNorm(64, rngs=rngs)
        out = nnx.with_partitioning(nnx.initializers.lecun_normal(), ("hidden", "embed"))
        self.out = nnx.Linear(64, 1, kernel_init=out, use_bias=False, rngs=rngs)

    def __call__(self, x: jax.Array) -> jax.Array:
        if EXPLICIT:  # the kernels' `fsdp` axis meets the batch's: the output's sharding is named, not inferred
            hidden = self.linear(x, out_sharding=P("fsdp", None))
            return self.out(nnx.relu(self.norm(hidden)), out_sharding=P("fsdp", None))[:, 0]
        return self.out(nnx.relu(self.norm(self.linear(x))))[:, 0]


EXPLICIT = bool(config.get("explicit"))


rules = (("batch", "fsdp"), ("hidden", "fsdp"), ("embed", None))
if config.get("eager"):  # Flax's eager sharding, on by default: made sharded, under the mesh and the logical rules
    with jax.set_mesh(jax.make_mesh((jax.device_count(),), ("fsdp",))), nn.logical_axis_rules(rules):
        module = Annotated(nnx.Rngs(0))
else:
    with nnx.use_eager_sharding(False):  # the annotations as metadata: the loop places the state
        module = Annotated(nnx.Rngs(0))
made = getattr(module.linear.kernel[...], "sharding", None)  # how the kernel was made: sharded, or a plain array
made_spec = [str(axis) for axis in made.spec] if isinstance(made, jax.sharding.NamedSharding) else None
examples = toy.batches(16, 8, seed=3)
x = np.concatenate([batch[0] for batch in examples])
y = np.concatenate([batch[1] for batch in examples])


def make_loop(**mesh):
    data = fs.global_batches((x, y), batch_size=8, axis_rules=rules, shuffle=False, **mesh)
    loss = lambda o, t: jnp.mean((o - t) ** 2)  # noqa: E731
    task = fs.TrainTask(apply=module, optimizer=optax.adam(1e-2), loss=loss, data=data)
    options = dict(n_steps=6, stdout=False, axis_rules=rules, record_memory="device")
    return fs.TrainLoop(init=module, task=task, rng=0, **options, **mesh)


if EXPLICIT:
    with jax.set_mesh(jax.make_mesh((jax.device_count(),), ("fsdp",))):
        loop = make_loop()
else:
    loop = make_loop(mesh=jax.sharding.Mesh(np.asarray(jax.devices()), ("fsdp",)))
record = list(loop)[-1]  # its state on the devices, where it lives
whole = multihost_utils.process_allgather(
    {"params": record.state.params, "batch_stats": record.state.flax_mutables["batch_stats"]}, tiled=True
)
print_sharded_result(record.state.params["linear"]["kernel"], whole, made_spec=made_spec)
