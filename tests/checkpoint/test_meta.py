"""A step's meta checked on every read: a wrong field is damage naming the file and the field; a newer format is not."""

from pathlib import Path

import pytest

from flaxstate.checkpoint import meta
from flaxstate.checkpoint.damage import DamagedCheckpointError, is_damage
from flaxstate.checkpoint.errors import CheckpointError
from flaxstate.checkpoint.layout import LEGACY_RUN_ID
from flaxstate.records import FORMAT_VERSION

STEP_DIR = Path("/runs/a/10")
GOOD = {"format_version": FORMAT_VERSION, "step": 10, "run_id": "r", "rng": None, "metrics": {"eval": {"acc": 0.5}}}


def test_a_valid_meta_reads_as_it_is_and_an_older_format_reads_with_the_run_id_it_lacks():
    assert meta.validate(GOOD, STEP_DIR) == GOOD
    old = {"format_version": 2, "step": 10}
    assert meta.validate(old, STEP_DIR)["run_id"] == LEGACY_RUN_ID


@pytest.mark.parametrize(
    ("change", "named"),
    [
        ({"step": "ten"}, "step is 'ten': expected a non-negative int"),
        ({"format_version": "3"}, "format_version is '3'"),
        ({"rng": {"impl": "threefry2x32"}}, "rng is"),
        ({"metrics": {"eval": {"acc": "high"}}}, "expected eval/acc to be a number"),
        ({"data_position": {"n_batches": -1}}, "'n_batches' to be a non-negative int"),
        ({"best": {"metric": "loss", "group": "eval", "mode": "lowest"}}, "expected mode 'min' or 'max'"),
    ],
)
def test_a_field_of_the_wrong_type_is_damage_naming_the_file_and_the_field(change, named):
    with pytest.raises(DamagedCheckpointError) as raised:
        meta.validate({**GOOD, **change}, STEP_DIR)
    assert named in str(raised.value) and str(STEP_DIR / "meta" / meta.FILE) in str(raised.value)
    assert is_damage(raised.value)


def test_a_meta_without_a_step_or_not_an_object_is_damage_and_the_file_read_is_named():
    with pytest.raises(DamagedCheckpointError, match="it has no step"):
        meta.validate({"format_version": 3}, STEP_DIR)
    with pytest.raises(DamagedCheckpointError, match=r"/runs/a/10/meta.json .*expected a JSON object, found list"):
        meta.validate([], STEP_DIR, STEP_DIR / "meta.json")


def test_a_newer_format_is_refused_and_is_not_damage_so_no_reader_passes_over_it():
    with pytest.raises(CheckpointError, match="newer flaxstate .*Upgrade flaxstate") as raised:
        meta.validate({**GOOD, "format_version": FORMAT_VERSION + 1}, STEP_DIR)
    assert not is_damage(raised.value)
