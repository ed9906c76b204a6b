"""One small collective of JSON values: in one process it is the value itself.

Several processes' are in tests/checkpoint/tiers/test_restart_processes.py."""

from flaxstate import collectives


def test_one_process_gathers_its_own_value_unchanged():
    value = {"held": [[4, "run"]], "note": None, "newest": 4}
    assert collectives.allgather_json(value) == [value]
    assert collectives.allgather_json(None) == [None]
