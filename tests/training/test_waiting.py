"""The devices' wait for the host, counted from draw and dispatch boundaries with is_ready (no sync)."""

from flaxstate.training.waiting import DeviceWaitClock, WaitTimes


class Output:
    """A dispatch's output whose readiness the test sets."""

    def __init__(self, ready=False):
        self.ready = ready

    def is_ready(self):
        return self.ready


def test_draws_while_the_devices_compute_cost_nothing():
    clock, times, output = DeviceWaitClock(), WaitTimes(), Output()
    clock.dispatched(output)
    clock.drew(0.0, 1.0, times)
    clock.drew(1.0, 2.0, times)
    clock.dispatching(2.5, times)
    assert times == WaitTimes(idle=0.0, data=0.0)


def test_from_the_draw_that_sees_the_devices_idle_on_the_wait_is_counted_up_to_the_dispatch():
    clock, times, output = DeviceWaitClock(), WaitTimes(), Output()
    clock.dispatched(output)
    clock.drew(0.0, 1.0, times)  # busy at its end: overlapped
    output.ready = True
    clock.drew(1.0, 3.0, times)  # the devices finished during it: counted whole
    clock.drew(3.0, 4.0, times)
    clock.dispatching(4.5, times)  # half a second of host work after the draws: idle, not data
    assert times == WaitTimes(idle=3.5, data=3.0)
    clock.dispatched(Output())  # busy again
    clock.drew(5.0, 6.0, times)
    clock.dispatching(6.0, times)
    assert times == WaitTimes(idle=3.5, data=3.0)


def test_a_segment_starts_idle_once_the_devices_are_done():
    clock, times = DeviceWaitClock(), WaitTimes()
    clock.resume(10.0)  # nothing dispatched yet
    clock.drew(10.5, 11.0, times)
    clock.dispatching(11.25, times)
    assert times == WaitTimes(idle=1.25, data=0.5)
    clock.dispatched(Output(ready=False))
    clock.resume(20.0)  # resumed while the devices still compute (after an interruption): nothing yet
    clock.dispatching(20.5, times)
    assert times == WaitTimes(idle=1.25, data=0.5)


def test_idle_devices_first_seen_at_dispatch_count_nothing():
    clock, times = DeviceWaitClock(), WaitTimes()
    clock.dispatched(Output(ready=True))  # finished at some unseen moment
    clock.dispatching(5.0, times)
    assert times == WaitTimes()
