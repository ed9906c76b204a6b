"""A resume that proves itself: each resume's replay checked against the fingerprints that earlier sessions logged.

A session that resumes from step s of a run that had reached step e > s
trains steps s+1..e again. The goodput ledger (`flaxstate.run_record.ledger`)
keeps each record's fingerprints (`flaxstate.run_record.fingerprints`): of the state at
its step, and of the batches trained since the previous record. The audit of
a resume compares, step by step, the records it replays with the newest
earlier session's records of the same steps:

- the restored state against the record that saved it (a partial or wrong
  restore shows there, before any step);
- at each replayed record, the batches first (compared where both records
  cover the same steps), then the state.

Its verdict names the first step that differs and why: `"data differs"` (the
batches differ: the data did not resume where it was), `"state differs"`
(the same batches, or batches not comparable, and another state: a changed
program or setting, a nondeterministic kernel, a partial restore),
`"bit-exact"` (every replayed record's state was compared, and equal),
`"unverified"` (nothing differs, but some replayed records had no state
fingerprint to compare with: records of a flaxstate before fingerprints, or
with them off; `not_compared` says how many), or `"nothing replayed"` (the
resume started at the newest step reached, or the records fall at other
steps). A state fingerprint is what verifies a step: equal batches alone do
not (another learning rate trains other bits on them). The audit reports; it
never stops a run. A resumed session whose programs were compiled anew (not
loaded from the compilation cache that `flaxstate launch` keeps: on a GPU,
autotuned anew, which may pick other kernels) says so after its verdict.
The writer of the run directory logs each resume's verdict in one line and keeps it in the ledger (`audit` events);
`flaxstate audit RUN` prints every resume's verdict from the records.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Sequence
from typing import Any

from flaxstate.run_record.goodput import SessionEvents, sessions_of

BIT_EXACT = "bit-exact"
DATA_DIFFERS = "data differs"
STATE_DIFFERS = "state differs"
NOTHING_REPLAYED = "nothing replayed"
UNVERIFIED = "unverified"
COMPILED = "compiled"
"""`Resume.programs` of a session that compiled its programs anew (`flaxstate.training.compiling.COMPILED`)."""
VERDICTS = (BIT_EXACT, DATA_DIFFERS, STATE_DIFFERS, NOTHING_REPLAYED, UNVERIFIED)

_WHY = {
    DATA_DIFFERS: "the batches differ (data position)",
    STATE_DIFFERS: "the batches are the same and the state differs (a changed program, settings or nondeterminism)",
}


@dataclasses.dataclass(frozen=True)
class Resume:
    """One resume's verdict.

    Attributes:
        session: the resumed session's number in the ledger (the first is 1).
        from_step: the step it resumed from.
        replayed: the first and last step of the replay that it compared, or `None`.
        verdict: one of `VERDICTS`.
        first_different_step: the first step whose fingerprints differ, or `None`.
        against: the number of the session whose records the first difference was compared with, or `None`.
        restore_differs: whether the restored state itself differs from the record that saved it.
        data_compared: whether any batches were compared (records covering the same steps).
        compared: how many replayed records' states were compared.
        not_compared: how many replayed records had no state fingerprint to compare with (theirs or the
            earlier session's): a replay with any is `"unverified"`, never `"bit-exact"`.
        programs: where the resumed session's programs came from (`Session.programs`: `"cache"` or
            `"compiled"`; `None`: unknown, a ledger of an earlier flaxstate).
    """

    session: int
    from_step: int
    replayed: tuple[int, int] | None
    verdict: str
    first_different_step: int | None = None
    against: int | None = None
    restore_differs: bool = False
    data_compared: bool = True
    compared: int = 0
    not_compared: int = 0
    programs: str | None = None

    @property
    def differs(self) -> bool:
        """Whether the replay differs."""
        return self.verdict in (DATA_DIFFERS, STATE_DIFFERS)

    @property
    def verified(self) -> bool:
        """Whether the replay was checked whole: bit-exact, or nothing to replay."""
        return self.verdict in (BIT_EXACT, NOTHING_REPLAYED)

    def line(self) -> str:
        """The verdict in one line: `resume audit: steps 41-57 replayed bit for bit`, or names the first
        different step, the session it differs from and why; and where the resume compiled its programs anew,
        says so (`; its programs were compiled anew, not loaded from the compilation cache`)."""
        if self.programs == COMPILED and self.verdict != NOTHING_REPLAYED:
            return f"{self._verdict_line()}; its programs were compiled anew, not loaded from the compilation cache"
        return self._verdict_line()

    def _verdict_line(self) -> str:
        if self.verdict == BIT_EXACT and self.replayed is not None:
            first, last = self.replayed
            return f"resume audit: steps {first}-{last} replayed bit for bit"
        if self.verdict == UNVERIFIED and self.replayed is not None:
            first, last = self.replayed
            records = "record" if self.not_compared == 1 else "records"
            return (
                f"resume audit: steps {first}-{last} replayed, not verified: {self.not_compared} of "
                f"{self.compared + self.not_compared} {records} had no state fingerprint to compare with (records "
                f"of an earlier flaxstate, or fingerprints off); {self.compared} compared equal"
            )
        if self.verdict == NOTHING_REPLAYED:
            return f"resume audit: nothing replayed (resumed from step {self.from_step}, the newest step reached)"
        why = _WHY[self.verdict]
        if self.restore_differs:
            why = "the restored state differs from the one saved (a partial or wrong restore)"
        elif self.verdict == STATE_DIFFERS and not self.data_compared:
            why = "the state differs (the batches were not compared: records at other steps)"
        return f"resume audit: step {self.first_different_step} differs from session {self.against}: {why}"

    def to_json(self) -> dict[str, Any]:
        """The JSON that `flaxstate audit --json` lists and the ledger's `audit` event holds."""
        return {
            "session": self.session,
            "from_step": self.from_step,
            "replayed": list(self.replayed) if self.replayed is not None else None,
            "verdict": self.verdict,
            "first_different_step": self.first_different_step,
            "against": self.against,
            "compared": self.compared,
            "not_compared": self.not_compared,
            "programs": self.programs,
        }


def _newest(sessions: Sequence[SessionEvents]) -> dict[int, tuple[int, dict[str, Any]]]:
    """Each step recorded by `sessions`, with the newest session's record of it and that session's number."""
    by_step: dict[int, tuple[int, dict[str, Any]]] = {}
    for number, session in enumerate(sessions, start=1):
        for record in session.records:
            by_step[int(record["step"])] = (number, record)
    return by_step


def _differs(mine: Any, theirs: Any) -> bool | None:
    """Whether two fingerprints differ (`None`: one of them is unknown)."""
    return None if mine is None or theirs is None else mine != theirs


def verdict(earlier: Sequence[SessionEvents], session: SessionEvents, number: int) -> Resume | None:
    """The audit of `session` (the `number`-th) against the `earlier` ones, from its records so far.

    Returns:
        `None` for a session that started fresh.
    """
    resume = _compare(earlier, session, number)
    return None if resume is None else dataclasses.replace(resume, programs=session.start.get("programs"))


def _compare(earlier: Sequence[SessionEvents], session: SessionEvents, number: int) -> Resume | None:
    restored = session.start.get("restored_step")
    if restored is None:
        return None
    start = int(restored)
    saved = _newest(earlier)
    if start in saved:
        against, record = saved[start]
        if _differs(session.start.get("restored_fp"), record.get("state_fp")):
            return Resume(number, start, None, STATE_DIFFERS, start, against, restore_differs=True)
    reached = max(saved, default=start)
    replayed: list[int] = []
    not_compared = 0
    data_compared = False
    for record in session.records:
        step = int(record["step"])
        if step <= start or step > reached or step not in saved:
            continue
        against, theirs = saved[step]
        same_span = record.get("from") is not None and record.get("from") == theirs.get("from")
        data = _differs(record.get("data_fp"), theirs.get("data_fp")) if same_span else None
        data_compared = data_compared or data is not None
        state = _differs(record.get("state_fp"), theirs.get("state_fp"))
        not_compared += state is None
        replayed.append(step)
        if data or state:
            return Resume(
                number,
                start,
                (start + 1, step),
                DATA_DIFFERS if data else STATE_DIFFERS,
                first_different_step=step,
                against=against,
                data_compared=data_compared,
                compared=len(replayed) - not_compared,
                not_compared=not_compared,
            )
    if not replayed:
        return Resume(number, start, None, NOTHING_REPLAYED)
    return Resume(
        number,
        start,
        (start + 1, replayed[-1]),
        UNVERIFIED if not_compared else BIT_EXACT,
        data_compared=data_compared,
        compared=len(replayed) - not_compared,
        not_compared=not_compared,
    )


def replay_end(earlier: Sequence[SessionEvents]) -> int | None:
    """The newest step that the `earlier` sessions recorded (a resumed session's replay ends there), or `None`."""
    steps = [int(record["step"]) for each in earlier for record in each.records]
    return max(steps, default=None)


def resumes(events: Iterable[dict[str, Any]]) -> list[Resume]:
    """Every resume's verdict in a ledger's events (the newest run's), oldest first."""
    sessions = sessions_of(events)
    verdicts = (verdict(sessions[:index], session, index + 1) for index, session in enumerate(sessions))
    return [each for each in verdicts if each is not None]
