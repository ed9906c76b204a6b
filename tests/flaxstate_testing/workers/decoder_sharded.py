"""Trains `decoders.ExplicitDecoder` (jax-ml/bonsai's style: products that name their output's sharding, a KV cache
made with a `PartitionSpec`) FSDP over `jax.make_mesh`'s mesh of the processes' devices, set with `jax.set_mesh`
around the data and the loop (no `mesh=`); prints one `result {json}` line from process 0: the bytes of a
3-D attention kernel's shards each process holds against the kernel's, its partition spec, the mesh's axis types,
each record's loss, and the final parameters (whole, gathered)."""

from __future__ import annotations

from flaxstate_testing.workers.common import print_sharded_result, setup

config = setup()

import jax  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from flax import nnx  # noqa: E402
from jax.experimental import multihost_utils  # noqa: E402

import flaxstate as fs  # noqa: E402
from flaxstate_testing import decoders  # noqa: E402

with nnx.use_eager_sharding(False):  # the annotations as metadata: the loop places the state
    module = decoders.ExplicitDecoder(nnx.Rngs(0))
tokens = np.random.default_rng(5).integers(0, decoders.VOCAB, size=(16, 9)).astype(np.int32)


def loss(logits, targets):
    return optax.softmax_cross_entropy_with_integer_labels(logits, targets).mean()


with jax.set_mesh(jax.make_mesh((jax.device_count(),), ("fsdp",))):
    data = fs.global_batches(
        (tokens[:, :-1], tokens[:, 1:]), batch_size=4, axis_rules=decoders.EXPLICIT_RULES, shuffle=False
    )
    task = fs.TrainTask(apply=module, optimizer=optax.adam(1e-2), loss=loss, data=data)
    loop = fs.TrainLoop(
        init=module, task=task, rng=0, n_steps=6, n_steps_per_checkpoint=2, stdout=False, record_memory="device",
        axis_rules=decoders.EXPLICIT_RULES,
    )  # fmt: skip
    records = list(loop)
state = records[-1].state  # on the devices, where it lives (record_memory="device")
whole = multihost_utils.process_allgather(state.params, tiled=True)
kernel = fs.tree_paths.flatten(state.params)["layers/0/q/kernel"]
print_sharded_result(kernel, whole, losses=[float(record.loss) for record in records])
