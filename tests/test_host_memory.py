"""A process's host memory in `fs.plan`: each kind from the state's shardings, and the prediction against a
measurement of a fresh process's peak resident memory (a subprocess each)."""

import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flaxstate_testing import toy

import flaxstate as fs
from flaxstate import host_memory

RULES = [("batch", "fsdp"), ("hidden", "fsdp")]
MODEL = toy.ShardedMLP(width=64)


def task():
    data = [(np.ones((8, 4), np.float32), np.zeros((8,), np.float32))] * 2
    return fs.TrainTask(
        apply=MODEL.apply, optimizer=optax.adam(1e-3), loss=lambda y, t: jnp.mean((y - t) ** 2), data=data
    )


def plan(**kwargs):
    return fs.plan(MODEL.init, task(), target="cpu:4", mesh_shape={"fsdp": 4}, axis_rules=RULES, **kwargs)


def test_a_budget_bounds_the_plan_s_save_and_restore_as_an_int_or_an_object_and_refuses_what_the_writer_refuses():
    smallest = fs.HostMemoryBudget(32 * 2**10)  # the writer's minimum
    assert plan(host_memory_budget=smallest.bytes).per_host == plan(host_memory_budget=smallest).per_host
    # A state of 1 GiB, on a TPU's host (its devices' memory is not the host's): the budget bounds a save, a peer
    # exchange and a restore's reads to itself and the allowance.
    state = 2**30
    options = {"record_memory": "host", "replicated": False, "tier": fs.LocalTier("/dev/shm/run", peers=1)}
    free = host_memory.per_host(state, state // 4, devices=None, budget=fs.HostMemoryBudget(), **options)
    bounded = host_memory.per_host(state, state // 4, devices=None, budget=smallest, **options)
    most = smallest.bytes + host_memory.BUDGET_ALLOWANCE
    assert bounded["save"] == bounded["peers"] == bounded["restore"] == most
    assert free["save"] > most and free["peers"] > most and free["restore"] > most
    for owner, door in [
        ("plan", lambda budget: plan(host_memory_budget=budget)),
        ("CheckpointFileWriter", lambda budget: fs.CheckpointFileWriter("/nonexistent/run", host_memory_budget=budget)),
    ]:  # one check: a budget the plan takes, the writer takes, and one that either refuses, both refuse
        with pytest.raises(ValueError, match=f"{owner} host_memory_budget must be an int of at least 32768, got 32767"):
            door(smallest.bytes - 1)


def test_peer_copies_without_a_local_tier_are_refused_by_the_plan_as_by_the_writer(tmp_path):
    with pytest.raises(ValueError, match=r"plan got peers=1 without a local tier.*local_tier=fs.LocalTier"):
        plan(peers=1)
    with pytest.raises(ValueError, match=r"peers=1 keeps copies of each process's local tier; it needs per_process"):
        fs.CheckpointFileWriter(tmp_path / "persistent", peers=1)
    keywords, tier = (
        plan(local_dir="/dev/shm/run", local_keep=2, peers=1),
        plan(local_dir=fs.LocalTier("/dev/shm/run", 1, 2)),
    )
    assert keywords.per_host == tier.per_host


def test_a_host_too_small_does_not_fit_and_is_told_what_to_change():
    fitting = plan()
    total = fitting.per_host["total"]
    assert plan(host_memory=total).fits_host is True and plan(host_memory=total).host_advice is None
    small = plan(host_memory=total - 1)
    assert small.fits_host is False
    assert "host memory does not fit" in small.host_advice and "record_memory='device'" in small.host_advice
    assert "does NOT fit" in str(small) and small.host_advice in str(small)
