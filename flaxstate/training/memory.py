"""What a run holds in memory, as a record reports it: the devices' peak, and this process's resident host memory.

The devices' figure is the backend's own (`jax.Device.memory_stats()`,
`peak_bytes_in_use`), summed over this process's devices of the loop's mesh;
a backend that keeps none (a CPU) gives `None`, never a guess. JAX offers no
way to reset that peak, so it is the highest since the process started: a
record whose step needed more than any before shows the rise.

The host's figures are this process's resident set now and its peak since
the process started, read from the operating system (`/proc/self/statm`,
`getrusage`); `None` where it says nothing.
"""

from __future__ import annotations

import os
import resource
import sys
from collections.abc import Sequence

import jax


def device_peak(devices: Sequence[jax.Device]) -> int | None:
    """The bytes in use at each of `devices`' peak, summed (`None` where any device reports none)."""
    total = 0
    for device in devices:
        try:
            stats = device.memory_stats()
        except Exception:  # a backend that implements none raises (its error class is not public)
            return None
        peak = stats.get("peak_bytes_in_use") if stats else None
        if peak is None:
            return None
        total += int(peak)
    return total


def host_resident() -> int | None:
    """This process's resident bytes now (`None` where `/proc` is missing: not Linux)."""
    try:
        with open("/proc/self/statm", "rb") as statm:
            return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return None


def host_peak() -> int | None:
    """This process's peak resident bytes since it started (`getrusage`: KiB on Linux, bytes on macOS).

    Linux updates the peak lazily, so it is never less than the resident bytes read just after it.
    """
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    peak = peak if sys.platform == "darwin" else peak * 1024
    known = [size for size in (peak, host_resident()) if size]
    return int(max(known)) if known else None


def reset_host_peak() -> bool:
    """Makes this process's peak resident set its current one (Linux's `/proc/self/clear_refs`, value 5).

    Returns whether it could (`host_peak_since_reset` then reads the peak from here on).
    """
    try:
        with open("/proc/self/clear_refs", "w") as clear_refs:
            clear_refs.write("5")
    except OSError:
        return False
    return True


def host_peak_since_reset() -> int | None:
    """This process's peak resident bytes since `reset_host_peak` (`VmHWM`; `getrusage`'s is never reset)."""
    try:
        with open("/proc/self/status") as status:
            fields = dict(line.split(":", 1) for line in status if ":" in line)
        return int(fields["VmHWM"].split()[0]) * 1024
    except (OSError, KeyError, ValueError, IndexError):
        return None
