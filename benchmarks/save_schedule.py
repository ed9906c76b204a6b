"""What a writer's schedule costs a record besides its save: `SaveSchedule.note` and `due` for each policy, the
work the writer adds to every record (issue 100, item 1: "nothing a record needs runs when no consumer reads it").

    python benchmarks/save_schedule.py [--records 20000] [--rounds 7]

Each round notes and decides `--records` records of a schedule that has 8 saves behind it (their drag settled,
as a run's are), the policies in an order rotated every round; the table gives each policy's median of rounds in
microseconds a record, and its range.
"""

from __future__ import annotations

import argparse
import statistics
import time
import types

import flaxstate as fs
from flaxstate.checkpoint import schedule

POLICIES = {
    "EveryRecord (the default)": fs.EveryRecord,
    "EverySeconds(1e9)": lambda: fs.EverySeconds(1e9),
    "AutoInterval(mtbf=3600)": lambda: fs.AutoInterval(mtbf=3600.0),
}


def per_record(make: object, n_records: int) -> float:
    """Seconds a record of `n_records` records that `make()`'s policy decides, after 8 saves."""
    clock = time.monotonic
    saves = schedule.SaveSchedule(make(), clock)  # type: ignore[operator]
    record = types.SimpleNamespace(elapsed_time=0.01, productive_time=0.009, n_completed_steps=10)
    for step in range(8):
        saves.note(record)  # type: ignore[arg-type]
        saves.started(step, clock(), 0.001)
        saves.completed((step, 0.002))
    began = time.perf_counter()
    for _ in range(n_records):
        saves.note(record)  # type: ignore[arg-type]
        saves.due(False)
    return (time.perf_counter() - began) / n_records


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--records", type=int, default=20000)
    parser.add_argument("--rounds", type=int, default=7)
    args = parser.parse_args()
    names = list(POLICIES)
    seconds: dict[str, list[float]] = {name: [] for name in names}
    for round_ in range(args.rounds):
        for name in names[round_ % len(names) :] + names[: round_ % len(names)]:
            seconds[name].append(per_record(POLICIES[name], args.records))
    print(f"{'policy':<28} {'us a record':>12}  range")
    for name in names:
        values = [1e6 * s for s in seconds[name]]
        print(f"{name:<28} {statistics.median(values):>12.1f}  {min(values):.1f}-{max(values):.1f}")


if __name__ == "__main__":
    main()
