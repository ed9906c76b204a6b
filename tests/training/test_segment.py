"""The steps from record to record, run by the segment runner over its real collaborators on one device."""

import jax
import numpy as np
import pytest
from flaxstate_testing import programs
from flaxstate_testing.programs import MODEL, X, Y

from flaxstate.run_record import fingerprints
from flaxstate.training import batching
from flaxstate.training.data import DataStream
from flaxstate.training.interrupts import Signals
from flaxstate.training.progress import ProgressDisplay
from flaxstate.training.segment import SegmentRunner
from flaxstate.training.watchdog import Watchdog


def runner(data, n_microbatches=1):
    where, program, state = programs.build(data, n_microbatches)
    watchdog = Watchdog(None)
    return SegmentRunner(
        program=program,
        placement=where,
        data=DataStream(data, "TrainTask"),
        signals=Signals(handle_preemption=False),
        progress=ProgressDisplay(False),
        n_microbatches=n_microbatches,
        state=state,
        rng=programs.RNG,
        watchdog=watchdog,
        global_batch=batching.global_spec(((X,), (Y,)), 8),
        loss_scaling=False,
    )


def test_a_segment_trains_its_dispatches_and_says_what_its_record_needs(monkeypatch):
    trainer = runner([(X, Y)] * 12)
    trained = trainer.train([2, 2, 1], total=10)  # K = 2 twice, then one step
    assert trainer.step == 5 and trained.n_steps == 5
    # A record's dispatch also gives its state's fingerprint, of one step as of K.
    assert fingerprints.text(trained.fingerprint) == fingerprints.text(fingerprints.of_state(trainer.leaves))
    assert trained.loss is not None and np.isfinite(trained.loss)
    assert jax.tree.structure(trained.grads) == jax.tree.structure(MODEL.init(jax.random.key(0), X)["params"])
    assert 0 <= trained.compile <= trained.elapsed and trained.waits.idle >= 0
    model_flops, xla_flops = trainer.flops_per_step
    assert model_flops is not None and model_flops > 0 and xla_flops is not None and xla_flops > 0
    again = trainer.train([1], total=10)
    assert trainer.step == 6 and again.n_steps == 1 and again.loss < trained.loss
    k_steps = trainer.train([1, 2], total=10)
    assert fingerprints.text(k_steps.fingerprint) == fingerprints.text(fingerprints.of_state(trainer.leaves))
    monkeypatch.setattr(fingerprints, "ENABLED", False)  # unfingerprinted records: none computed
    assert trainer.train([2], total=10).fingerprint is None


def test_a_non_finite_loss_is_raised_naming_its_step_and_a_batch_that_does_not_split_is_named():
    bad = X.copy()
    bad[0, 0] = np.nan
    trainer = runner([(X, Y), (X, Y), (bad, Y)])
    with pytest.raises(FloatingPointError, match="step 3"):
        trainer.train([1, 1, 1], total=3)
    with pytest.raises(ValueError, match="n_microbatches=3"):
        runner([(X, Y)], n_microbatches=3).check_batch(((X,), (Y,)))
