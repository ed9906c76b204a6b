"""What the processes offer of their local tiers at a restart, and which step their offers make whole.

Each process gathers every process's `Offer` (one small JSON all-gather,
`flaxstate.checkpoint.tiers.restart`), decodes each once, and asks the same
`Offers` the same questions, so every process reaches the same answer with
no further collective: which steps are whole, where a process's parts of a
step come from when its own directory lacks them (a peer's copy, or a
data-parallel replica's own step), and whose parts are lost.

A step is named with the run that saved it, `(step, run id)`: the same step
number of another run is another step.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import Any

Pair = tuple[int, str | None]
"""A local step and the run that saved it."""


@dataclasses.dataclass(frozen=True)
class Offer:
    """One process's offer.

    Attributes:
        held: the steps whole in its own directory that fit the restart's template.
        copies: the steps of other processes that it keeps as peer copies, by owner.
        needs: a fingerprint of the array parts its devices need (equal: data-parallel replicas), or `None`.
        note: why its newest step is not offered, or `None`.
        persistent: its view of the persistent tier's newest step.
        run: the persistent directory's run as it reads it.
        newest: its newest local step, offered or not.
    """

    held: frozenset[Pair] = frozenset()
    copies: Mapping[int, frozenset[Pair]] = dataclasses.field(default_factory=dict)
    needs: str | None = None
    note: str | None = None
    persistent: int | None = None
    run: str | None = None
    newest: int | None = None

    def to_json(self) -> dict[str, Any]:
        """The offer as the all-gather carries it (JSON: lists for pairs, strings for owners)."""
        return {
            "held": sorted([list(pair) for pair in self.held], key=_order),
            "copies": {
                str(owner): sorted([list(pair) for pair in pairs], key=_order) for owner, pairs in self.copies.items()
            },
            "needs": self.needs,
            "note": self.note,
            "persistent": self.persistent,
            "run": self.run,
            "newest": self.newest,
        }

    @classmethod
    def from_json(cls, payload: Mapping[str, Any]) -> Offer:
        """The offer that `to_json` gave, as another process gathered it."""
        return cls(
            held=frozenset(_pair(pair) for pair in payload["held"]),
            copies={int(owner): frozenset(_pair(pair) for pair in pairs) for owner, pairs in payload["copies"].items()},
            needs=payload["needs"],
            note=payload["note"],
            persistent=payload["persistent"],
            run=payload["run"],
            newest=payload["newest"],
        )


def _pair(value: Sequence[Any]) -> Pair:
    step, run = value
    return int(step), run


def _order(pair: Sequence[Any]) -> tuple[int, str]:
    return pair[0], pair[1] or ""


class Offers:
    """Every process's offer, in process order, and the answers that all processes read alike from them.

    Args:
        offers: one `Offer` a process, process 0 first.
    """

    def __init__(self, offers: Sequence[Offer]) -> None:
        self.offers = tuple(offers)
        n = len(self.offers)
        self._kept: list[dict[Pair, list[int]]] = [
            {  # owner's pair -> the processes that keep a copy of owner's parts of it, in order
                pair: [k for k in range(n) if pair in self.offers[k].copies.get(owner, frozenset())]
                for offer in self.offers
                for pair in offer.copies.get(owner, frozenset())
            }
            for owner in range(n)
        ]
        self._replicas: list[list[int]] = [  # the processes whose devices need exactly the parts that owner's do
            [k for k, other in enumerate(self.offers) if k != owner and other.needs == mine.needs]
            if mine.needs is not None
            else []
            for owner, mine in enumerate(self.offers)
        ]

    @property
    def persistent(self) -> int | None:
        """The persistent tier's newest step: the newest of the processes' views (`None`: none has one)."""
        return max((offer.persistent for offer in self.offers if offer.persistent is not None), default=None)

    @property
    def run(self) -> str | None:
        """The persistent directory's run (one shared directory: the first process's view that has one)."""
        return next((offer.run for offer in self.offers if offer.run is not None), None)

    @property
    def passed_over(self) -> bool:
        """Whether some process has a local step newer than the persistent tier's newest (or there is none)."""
        newest = [offer.newest for offer in self.offers if offer.newest is not None]
        persistent = self.persistent
        return bool(newest) and (persistent is None or max(newest) > persistent)

    def sources(self, owner: int, pair: Pair) -> list[tuple[int, bool]]:
        """Who keeps `owner`'s parts of `pair` besides `owner`: `(process, whether as a peer copy)`, copies first."""
        copies = [(k, True) for k in self._kept[owner].get(pair, [])]
        return copies + [(k, False) for k in self._replicas[owner] if pair in self.offers[k].held]

    def _candidates(self) -> set[Pair]:
        return set().union(*(offer.held for offer in self.offers), *(set(kept) for kept in self._kept))

    def lost(self, pair: Pair) -> list[int]:
        """The processes whose parts of `pair` neither their own directory nor any peer keeps."""
        return [j for j, offer in enumerate(self.offers) if pair not in offer.held and not self.sources(j, pair)]

    def whole(self) -> set[Pair]:
        """The steps whose every process's parts are kept: in its own directory, as a peer's copy, or by a replica."""
        return {pair for pair in self._candidates() if not self.lost(pair)}

    def transfers(self, pair: Pair) -> tuple[tuple[int, bool, int], ...]:
        """`(holder, as a copy, owner)` for each process that lacks `pair`: the first process that keeps its parts."""
        return tuple(
            (*self.sources(owner, pair)[0], owner) for owner, offer in enumerate(self.offers) if pair not in offer.held
        )

    def why_none_whole(self) -> str:
        """Why no step is whole: each process's note (or what it holds); counting peer copies, whose parts are lost."""
        notes = "; ".join(f"process {i}: {offer.note}" for i, offer in enumerate(self.offers) if offer.note)
        held = "; ".join(
            f"process {i} holds {sorted(s for s, _ in offer.held)}" for i, offer in enumerate(self.offers) if offer.held
        )
        why = f"no local step is whole on every process ({notes or held})"
        if any(self._kept):
            newest = max(self._candidates())
            why += (
                f"; counting peer copies, step {newest[0]} still lacks the parts of process "
                f"{', '.join(map(str, self.lost(newest)))}: neither its own directory nor a peer keeps them, as a copy "
                "or a replica's own step (more hosts lost than copies kept)"
            )
        return why
