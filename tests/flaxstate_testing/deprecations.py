"""flaxstate's deprecation warnings, as a user's code meets them: each once a process, pointing at the caller."""

import contextlib
import warnings
from collections.abc import Iterator

from flaxstate import settings

OURS = "deprecated and will be removed in a later release: give "
"""What each of flaxstate's deprecation warnings says (`flaxstate.settings.deprecated`)."""


@contextlib.contextmanager
def fresh() -> Iterator[list[warnings.WarningMessage]]:
    """Within it, flaxstate's deprecated keywords warn as in a new process (none warned of yet), and every
    `DeprecationWarning` of flaxstate's is recorded in the list it yields (whatever the filters outside)."""
    kept = set(settings._WARNED)
    settings._WARNED.clear()
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            found: list[warnings.WarningMessage] = []
            yield found
            found.extend(
                warning
                for warning in caught
                if issubclass(warning.category, DeprecationWarning) and OURS in str(warning.message)
            )
    finally:
        settings._WARNED.clear()
        settings._WARNED.update(kept)
