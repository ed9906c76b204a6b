"""The run's environment with every checkpoint, and `flaxstate diff` of two checkpoints."""

import flax.linen as nn
import jax
import pytest
from flaxstate_testing import toy
from flaxstate_testing.loops import make_loop

import flaxstate as fs
from flaxstate.checkpoint.stores.orbax_manager import CheckpointStore
from flaxstate.cli import main
from flaxstate.run_record import environment


def stored_session(run_dir):
    """The session of a loop like the one that wrote `run_dir` (its devices and mesh)."""
    return make_loop(n_steps=4, every=4).next_checkpoint().session


def write(run_dir, loop, **writer_options):
    with fs.CheckpointFileWriter(run_dir, keep=5, **writer_options) as writer:
        return [writer(record) for record in loop]


def test_every_checkpoint_stores_the_environment_and_show_prints_it(tmp_path, capsys):
    write(tmp_path, make_loop(n_steps=4, every=4))
    with CheckpointStore(tmp_path, read_only=True) as store:
        stored = store.read_meta(4)["environment"]
    assert stored == environment.describe(stored_session(tmp_path))
    assert main(["show", str(tmp_path)]) == 0
    shown = capsys.readouterr().out
    assert f'"jax": "{jax.__version__}"' in shown and f'"flax": "{stored["versions"]["flax"]}"' in shown
    assert '"processes": 1' in shown and '"device_kind": "cpu"' in shown and '"command"' in shown
    assert '"xla": {' in shown and '"flags": {' in shown and '"jax_enable_x64": false' in shown


def test_a_resume_in_another_environment_logs_each_entry_that_changed(tmp_path, caplog, monkeypatch):
    write(tmp_path, make_loop(n_steps=4, every=4))
    monkeypatch.setattr(environment, "PACKAGES", (*environment.PACKAGES, "numpy"))  # a package now listed
    resumed = make_loop(init=fs.CheckpointFileReader(tmp_path, target=toy.MLP().init), n_steps=8, every=4)
    write(tmp_path, resumed)
    assert "the resumed run's environment differs from the checkpoint at step 4" in caplog.text
    assert "versions/numpy: '(absent)' -> " in caplog.text


def test_a_change_of_xla_flags_or_preset_between_two_checkpoints_is_named_by_diff(tmp_path, capsys, monkeypatch):
    # The environment keeps the flags of the process's environment (XLA read them at its start: a process that
    # sets others later changes what is recorded only, which serves to write two checkpoints of two settings).
    monkeypatch.delenv("XLA_FLAGS", raising=False)
    monkeypatch.delenv("FLAXSTATE_XLA_PRESET", raising=False)
    write(tmp_path / "a", make_loop(n_steps=4, every=4))
    monkeypatch.setenv("XLA_FLAGS", "--xla_gpu_enable_latency_hiding_scheduler=true")
    monkeypatch.setenv("FLAXSTATE_XLA_PRESET", "hopper")
    write(tmp_path / "b", make_loop(n_steps=4, every=4))
    assert main(["diff", str(tmp_path / "a"), str(tmp_path / "b")]) == 1
    out = capsys.readouterr().out
    assert "xla/preset: '(absent)' -> 'hopper'" in out, out
    assert "xla/flags/--xla_gpu_enable_latency_hiding_scheduler: '(absent)' -> 'true'" in out, out


def test_git_commit_is_none_outside_a_repository(tmp_path):
    assert environment.git_commit(str(tmp_path)) is None


def test_diff_the_same_checkpoint_is_exit_0_and_two_steps_exit_1_largest_change_first(tmp_path, capsys):
    write(tmp_path, make_loop(n_steps=8, every=4))
    assert main(["diff", str(tmp_path), str(tmp_path)]) == 0
    assert "the same (" in capsys.readouterr().out
    assert main(["diff", str(tmp_path), str(tmp_path), "--step-a", "4"]) == 1
    out = capsys.readouterr().out
    assert "arrays whose values differ" in out and "they differ" in out
    changes = [float(line.split()[-1]) for line in out.splitlines() if line.startswith("  target/")]
    assert changes and changes == sorted(changes, reverse=True)


class Renamed(nn.Module):
    @nn.compact
    def __call__(self, x):
        x = nn.tanh(nn.Dense(16, name="hidden")(x))
        return nn.Dense(1)(x)[:, 0]


def test_diff_names_renamed_layers_and_changed_metadata_and_a_missing_directory_is_exit_2(tmp_path, capsys):
    write(tmp_path / "a", make_loop(n_steps=4, every=4), metadata={"lr": 0.1})
    write(tmp_path / "b", make_loop(model=Renamed(), n_steps=4, every=4), metadata={"lr": 0.2})
    assert main(["diff", str(tmp_path / "a"), str(tmp_path / "b")]) == 1
    out = capsys.readouterr().out
    assert "metadata:\n  lr: 0.1 -> 0.2" in out
    only_a = out.split("arrays only in A:")[1].split("arrays only in B:")[0]
    only_b = out.split("arrays only in B:")[1]
    assert "target/Dense_1/kernel" in only_a and "target/hidden/kernel" in only_b  # flax renumbers the output layer
    assert "target/Dense_1/kernel" not in only_b and "target/hidden/kernel" not in only_a
    assert main(["diff", str(tmp_path / "a"), str(tmp_path / "missing")]) == 2
    assert "missing does not exist" in capsys.readouterr().err


@pytest.mark.parametrize("missing_step", [99])
def test_diff_of_a_step_that_is_not_there_is_exit_2(tmp_path, capsys, missing_step):
    write(tmp_path, make_loop(n_steps=4, every=4))
    assert main(["diff", str(tmp_path), str(tmp_path), "--step-b", str(missing_step)]) == 2
    assert f"no checkpoint at step {missing_step}" in capsys.readouterr().err
