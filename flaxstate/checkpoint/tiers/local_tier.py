"""The local tier, stated once: its directory, the peer copies it keeps, and how many steps.

    >>> import flaxstate as fs
    >>> tier = fs.LocalTier("/dev/shm/run", peers=1, keep=2)
    >>> tier.peers, tier.keep
    (1, 2)

One object for the three places that meet a local tier: the writer that
saves it (`CheckpointFileWriter(tier)`), the reader's list of tiers
(`CheckpointFileReader([tier, persistent_dir])`) and the plan that counts
its host memory (`fs.plan(..., local_tier=tier)`). The older keywords,
deprecated, build one at each door: `CheckpointFileWriter(local_dir, keep=K,
per_process=True, peers=N)` is `CheckpointFileWriter(LocalTier(local_dir,
peers=N, keep=K))`, and `fs.plan(local_dir=d, local_keep=K, peers=N)` is
`fs.plan(local_tier=LocalTier(d, peers=N, keep=K))`; a plain `local_dir`
first in the reader's list is `LocalTier(local_dir)`.
"""

from __future__ import annotations

import dataclasses
import os

from flaxstate import settings
from flaxstate.locations import local_path


@dataclasses.dataclass(frozen=True)
class LocalTier:
    """A local tier: each process saves the arrays its devices hold into `directory/process-<index>/`, on its own
    host (`/dev/shm/run`, a local SSD), with no barrier and no shared filesystem
    (`flaxstate.checkpoint.stores.local`).

    Args:
        directory: a local or mounted directory (not a bucket URL), made absolute.
        peers: also keep the parts of this many other processes, on other hosts where there are, so that a
            replaced host's parts come back from a peer (`flaxstate.checkpoint.tiers.peers`); below the process
            count, which the writer checks.
        keep: how many of the newest steps each process keeps.

    Raises:
        ValueError: a bucket URL, `peers` not a count (0, 1, ...), or `keep` below 1.
    """

    directory: str | os.PathLike[str]
    """Stored as an absolute `Path`."""
    peers: int = 0
    keep: int = 1

    def __post_init__(self) -> None:
        if not isinstance(self.directory, str | os.PathLike):
            raise ValueError(f"LocalTier directory must be a local path, got {self.directory!r}.")
        object.__setattr__(self, "directory", local_path(self.directory, "LocalTier"))
        object.__setattr__(self, "peers", settings.count("LocalTier", "peers", self.peers, minimum=0))
        object.__setattr__(self, "keep", settings.count("LocalTier", "keep", self.keep))

    def __repr__(self) -> str:
        return f"LocalTier({os.fspath(self.directory)!r}, peers={self.peers}, keep={self.keep})"


class Unset(int):
    """A door's default for `keep` or `peers` (1, 0), told apart from the same number given: beside a `LocalTier`,
    a `keep=1` given says otherwise than `LocalTier(d, keep=3)`, the default does not."""

    def __repr__(self) -> str:
        return int.__repr__(self)


KEEP = Unset(1)
"""The doors' default `keep` (a writer's, `fs.plan`'s `local_keep`)."""
PEERS = Unset(0)
"""The doors' default `peers`."""


def settings_of(tier: LocalTier, owner: str, *, keep: int, peers: int, names: tuple[str, str]) -> tuple[int, int]:
    """The `keep` and `peers` of a door given a `LocalTier`: the tier's, where the door's own keywords (named
    `names`) are left out (`KEEP`, `PEERS`) or say the same.

    Raises:
        ValueError: a keyword given that says otherwise than the tier, naming both.
    """
    for name, given, held in ((names[0], keep, tier.keep), (names[1], peers, tier.peers)):
        if not isinstance(given, Unset) and given != held:
            raise ValueError(
                f"{owner} got {tier!r} and {name}={given!r}: the tier says {held}. Give it to the LocalTier "
                f"and leave {name} out."
            )
    return tier.keep, tier.peers
