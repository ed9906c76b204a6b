"""What every record carries that the recording module makes: the loss-scale metrics and the process's session."""

import time

import jax
import optax
from flax.training.dynamic_scale import DynamicScale

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
