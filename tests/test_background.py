"""Saves left running in the background: waited for by wait_all, settle_all, and at the interpreter's exit."""

import threading

import pytest

from flaxstate import background


class Save:
    """A pending save that ends when told to, or fails."""

    def __init__(self, error=None):
        self.done = threading.Event()
        self.error = error
        self.waited = 0

    def wait(self):
        self.waited += 1
        self.done.wait(10)
        if self.error is not None:
            error, self.error = self.error, None
            raise error

    def settle(self):
        self.done.wait(10)


def test_wait_all_waits_for_every_save_before_it_raises_the_first_failure():
    failing, fine = Save(RuntimeError("disk full")), Save()
    for save in (failing, fine):
        background.track(save)
        save.done.set()
    try:
        with pytest.raises(RuntimeError, match="disk full"):
            background.wait_all()
        assert failing.waited == 1 and fine.waited == 1  # the second was waited for too
        background.wait_all()  # the failure was raised once
    finally:
        background.untrack(failing)
        background.untrack(fine)


def test_settle_all_keeps_a_failure_for_the_owner_and_an_untracked_save_is_not_waited_for():
    failing = Save(RuntimeError("disk full"))
    failing.done.set()
    background.track(failing)
    background.settle_all()
    assert failing.waited == 0 and failing.error is not None
    background.untrack(failing)
    background.wait_all()
    assert failing.waited == 0
