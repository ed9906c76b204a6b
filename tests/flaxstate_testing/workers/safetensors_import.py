"""Starts an FSDP run of an annotated NNX module from a safetensors file (HF's (out, in) kernels) over a mesh of
the processes' devices; prints one `result {json}` line a process: the bytes it read of the file, whether the
kernel's shard it holds is the file's part, and the loss after two steps.

With `heads` ("heads" or "head_dim": the axis sharded), the kernels are 3-D (`(embed, heads, head_dim)`) and the
files hold them as HF does, `(heads * head_dim, embed)`: a `WeightMap` layout reads them."""

from __future__ import annotations

import json

from flaxstate_testing.workers.common import setup

config = setup()

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
import safetensors.numpy  # noqa: E402
from flax import nnx  # noqa: E402

import flaxstate as fs  # noqa: E402
from flaxstate_testing import toy  # noqa: E402


class Annotated(nnx.Module):
    def __init__(self, rngs: nnx.Rngs) -> None:
        hidden = nnx.with_partitioning(nnx.initializers.lecun_normal(), ("embed", "hidden"))
        self.linear = nnx.Linear(4, 64, kernel_init=hidden, use_bias=False, rngs=rngs)
        out = nnx.with_partitioning(nnx.initializers.lecun_normal(), ("hidden", "embed"))
        self.out = nnx.Linear(64, 1, kernel_init=out, use_bias=False, rngs=rngs)

    def __call__(self, x: jax.Array) -> jax.Array:
        return self.out(nnx.relu(self.linear(x)))[:, 0]


class Heads(nnx.Module):
    """Sharded in heads (`heads="heads"`: each part is one block of the file's rows) or in head_dim (each part is
    not: the file's tensor is read once, whole, by each process)."""

    def __init__(self, rngs: nnx.Rngs, cut: str) -> None:
        axes = ("hidden", None) if cut == "heads" else (None, "hidden")
        heads = nnx.with_partitioning(nnx.initializers.lecun_normal(), ("embed", *axes))
        self.linear = nnx.LinearGeneral(4, (8, 8), kernel_init=heads, use_bias=False, rngs=rngs)
        out = nnx.with_partitioning(nnx.initializers.lecun_normal(), (*axes, "embed"))
        self.out = nnx.LinearGeneral((8, 8), 1, axis=(-2, -1), kernel_init=out, use_bias=False, rngs=rngs)

    def __call__(self, x: jax.Array) -> jax.Array:
        return self.out(nnx.relu(self.linear(x)))[:, 0]


with nnx.use_eager_sharding(False):  # the annotations as metadata: the loop places the state
    module = Heads(nnx.Rngs(0), config["heads"]) if config.get("heads") else Annotated(nnx.Rngs(0))
mesh = jax.sharding.Mesh(np.asarray(jax.devices()), ("fsdp",))
rules = (("batch", "fsdp"), ("hidden", "fsdp"), ("embed", None))
examples = toy.batches(4, 8, seed=3)
x = np.concatenate([batch[0] for batch in examples])
y = np.concatenate([batch[1] for batch in examples])
data = fs.global_batches((x, y), batch_size=8, mesh=mesh, axis_rules=rules, shuffle=False)
task = fs.TrainTask(apply=module, optimizer=optax.adam(1e-2), loss=lambda o, t: jnp.mean((o - t) ** 2), data=data)
if config.get("heads"):
    heads = fs.WeightMap(
        {"linear/kernel": ("linear.weight", "(h d) e -> e h d"), "out/kernel": ("out.weight", "e (h d) -> h d e")}
    )
    reader = fs.SafetensorsReader(config["path"], module, map=heads)
else:
    reader = fs.SafetensorsReader(config["path"], module, rename=[(r"\.weight$", "/kernel")], transpose="kernel$")
loop = fs.TrainLoop(
    init=reader, task=task, rng=0, n_steps=2, stdout=False, mesh=mesh, axis_rules=rules, record_memory="device"
)
kernel = loop.state.params["linear"]["kernel"]
stored = safetensors.numpy.load_file(config["path"])["linear.weight"].T  # (in, out), as the params hold it
if config.get("heads"):  # (embed, heads, head_dim), by hand
    stored = stored.T.reshape(8, 8, 4).transpose(2, 0, 1)
shards_match = all(np.array_equal(np.asarray(shard.data), stored[shard.index]) for shard in kernel.addressable_shards)
read = reader.bytes_read
record = list(loop)[-1]
result = {"read": read, "shards_match": shards_match, "spec": [str(axis) for axis in kernel.sharding.spec]}
result["loss"] = float(record.loss)
print("result", json.dumps(result), flush=True)
