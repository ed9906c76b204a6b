"""What every record carries that the recording module makes: the loss-scale metrics and the process's session."""

import os
import secrets
import time

import jax
import optax
import pytest
from flax import nnx
from flax.training.dynamic_scale import DynamicScale
from flaxstate_testing import loops, nnx_models, toy

import flaxstate as fs
from flaxstate.sharding import Partitioning
from flaxstate.train_state import FlaxOptimTrainState
from flaxstate.training import placement, recording
from flaxstate.training.scaling import LossScale


def test_loss_scaling_metrics_come_from_the_state_and_none_without_scaling():
    state = FlaxOptimTrainState.create(optax.sgd(0.1), {"params": {"w": jax.numpy.ones(2)}})
    assert recording.scaling_metrics(state) == {}
    scaled = state.replace(loss_scale=LossScale.create(DynamicScale(scale=4.0)).after(jax.numpy.asarray(False)))
    assert recording.scaling_metrics(scaled) == {"train": {"loss_scale": 2.0, "skipped_steps": 1}}


def test_a_session_names_the_process_s_start_its_restore_and_its_devices():
    where = placement.create(Partitioning(devices=jax.devices()[:1]))
    session = recording.session(where, restore_seconds=0.5, restored_step=40)
    assert session.started <= time.time() and session.startup >= 0
    assert (session.restore, session.restored_step) == (0.5, 40)
    assert session.n_devices == 1 and session.n_processes == jax.process_count()
    assert session.device_kind == jax.devices()[0].device_kind and session.mesh == dict(where.mesh.shape)


@pytest.mark.parametrize("api", ["linen", "nnx"])
def test_a_session_says_whether_its_programs_came_from_the_compilation_cache(api):
    """The tests' processes share a persistent compilation cache (conftest): a model of a width no other test
    trains, at a learning rate drawn for this test (a cache kept between sessions, conftest's KEPT_CACHE, holds
    what earlier sessions compiled), is compiled by its first loop, and its second loop, alike, loads every
    program from the cache."""
    assert os.environ.get("JAX_COMPILATION_CACHE_DIR"), "the test session's compilation cache (conftest)"
    width = {"linen": 37, "nnx": 41}[api]
    rate = 1e-2 * (1 + secrets.randbelow(2**20) / 2**21)  # a constant of the programs: 2**20 float32 values

    def first_session():
        if api == "linen":
            optimizer = optax.adam(rate)
            loop = loops.make_loop(model=toy.MLP(width=width), optimizer=optimizer, n_steps=2, every=2, per_dispatch=2)
        else:
            model = nnx_models.MLP(nnx.Rngs(0), width=width)
            task = fs.TrainTask(apply=model, optimizer=optax.adam(rate), loss=toy.mse, data=toy.batches(40, 8))
            loop = fs.TrainLoop(model, task, jax.random.key(0), n_steps=2, n_steps_per_checkpoint=1, stdout=False)
        return [record.session for record in loop][0]

    compiled, cached = first_session(), first_session()
    assert compiled.programs == "compiled", compiled
    assert cached.programs == "cache", cached
