"""What a save running in the background costs the training, and where that comes from.

One process, `checkpoint.py`'s model (about 50 MB of state: params and adam
moments), a record every `--every` steps, rounds of `--records` records,
the contenders alternating round by round (medians over `--rounds`):

- "no saves": the records go to no writer;
- "flaxstate, no saves": a `CheckpointFileWriter` that saves none of them
  (it logs each record in its ledger): what a flaxstate save costs is
  measured beyond it, so that the writer's own work each record is not
  counted as the saves';
- "flaxstate, every 4th record": a `CheckpointFileWriter` that saves one record in four (its save runs in a
  thread of its own, below the loop's priority, while the next records train);
- "flaxstate, continuous": `every=fs.Continuous()` (a record whenever no save is in flight);
- "orbax async, every 4th record": plain orbax, `CheckpointManager` with its own asynchronous save, of the
  same records' states.

For each: milliseconds a step, milliseconds of training each save costs
beyond the round without saves (its call's blocking and its drag on the
steps; the median over rounds of each round's difference from that round's
base, with their range: a save's cost is a few percent of a round, and
rounds vary), and for flaxstate the drag that its goodput ledger measured
(`save_drag`: the records' step time while a save ran against while none
did). Then the CPU time of one save with the loop idle (the process's CPU
seconds over the save), which is what a save takes from the cores training
uses.

    python benchmarks/save_drag.py [--rounds 5] [--every 10] [--records 16]
"""

from __future__ import annotations

import argparse
import dataclasses
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import jax
import orbax.checkpoint as ocp

sys.path.insert(0, str(Path(__file__).parent))
import checkpoint as bench  # noqa: E402  (the model and loop of benchmarks/checkpoint.py)

import flaxstate as fs  # noqa: E402
from flaxstate.run_record import goodput, ledger  # noqa: E402


class Contender:
    """A loop and what it does with each record: `take(record, index)` returns the seconds its call blocked."""

    def __init__(self, name: str, every: int, workdir: Path) -> None:
        self.name = name
        self.loop = bench.make_loop(every)
        self.saves = 0
        """Plain orbax's saves (flaxstate's are its ledger's)."""
        self.blocking: list[float] = []
        self.directory = workdir / name.replace(" ", "-").replace(",", "")
        self.writer: Any = None
        self.manager: Any = None
        if name.startswith("flaxstate"):  # every 4th record: the others passed over, each logged in its ledger
            continuous = "continuous" in name
            every = fs.Continuous() if continuous else fs.EverySeconds(1e9)
            self.writer = fs.CheckpointFileWriter(self.directory, keep=2, every=every)
        elif name.startswith("orbax"):
            self.manager = ocp.CheckpointManager(self.directory, options=ocp.CheckpointManagerOptions(max_to_keep=2))

    def take(self, record: fs.Checkpoint, index: int) -> None:
        """Hands the record on (one in four saved, by asking for it, where the name says so)."""
        chosen = "every 4th" not in self.name or index % 4 == 3
        start = time.perf_counter()
        if self.writer is not None:
            self.writer(dataclasses.replace(record, requested=chosen and "every 4th" in self.name))
        elif self.manager is not None and chosen:
            self.manager.save(int(record.step), args=ocp.args.StandardSave(record.state.state_dict()))
            self.saves += 1
            self.blocking.append(time.perf_counter() - start)

    def saved(self) -> list[dict[str, Any]]:
        """flaxstate's saves, as its ledger logged them."""
        return [event for event in ledger.read_events(self.directory / ledger.FILENAME) if event["event"] == "save"]

    def count(self) -> int:
        return len(self.saved()) if self.writer is not None else self.saves

    def finish(self) -> None:
        if self.writer is not None:
            self.writer.wait()
        if self.manager is not None:
            self.manager.wait_until_finished()


def cpu_of_one_save(contender: Contender, record: fs.Checkpoint, step: int) -> tuple[float, float]:
    """The process's CPU seconds and the wall seconds of one save, the loop idle."""
    contender.finish()
    wall, cpu = time.perf_counter(), time.process_time()
    if contender.writer is not None:
        contender.writer(dataclasses.replace(record, step=step, requested=True))
    else:
        contender.manager.save(step, args=ocp.args.StandardSave(record.state.state_dict()))
    contender.finish()
    return time.process_time() - cpu, time.perf_counter() - wall


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--every", type=int, default=10, help="steps a record")
    parser.add_argument("--records", type=int, default=16, help="records a round")
    args = parser.parse_args()
    workdir = Path(tempfile.mkdtemp(prefix="flaxstate-drag-"))
    names = [
        "no saves",
        "flaxstate, no saves",
        "flaxstate, every 4th record",
        "flaxstate, continuous",
        "orbax async, every 4th record",
    ]
    base_of = {name: "flaxstate, no saves" if name.startswith("flaxstate") else "no saves" for name in names}
    try:
        contenders = [Contender(name, args.every, workdir) for name in names]
        for contender in contenders:  # compiled, warm, and the writers' first save (claims) made
            contender.take(contender.loop.next_checkpoint(), 3)
            contender.finish()
        seconds: dict[str, list[float]] = {name: [] for name in names}
        per_save: dict[str, list[float]] = {name: [] for name in names}
        for round_index in range(args.rounds):
            shift = round_index % len(contenders)
            for contender in contenders[shift:] + contenders[:shift]:
                saves_before = contender.count()
                start = time.perf_counter()
                for index in range(args.records):
                    contender.take(contender.loop.next_checkpoint(), index)
                elapsed = time.perf_counter() - start
                contender.finish()  # untimed: a round never slows the next contender
                seconds[contender.name].append(elapsed)
                per_save[contender.name].append(contender.count() - saves_before)
        steps = args.every * args.records
        print(
            f"jax {jax.__version__}, orbax {ocp.__version__}, {jax.devices()[0].device_kind}, state "
            f"{bench.state_bytes(contenders[0].loop.state) / 2**20:.0f} MiB, a record every {args.every} steps, "
            f"{args.records} records a round, medians of {args.rounds} rounds"
        )
        print(
            f"\n{'':32} {'ms a step':>10} {'saves a round':>14} {'ms a save costs':>16} {'range':>15} "
            f"{'of it blocking':>15} {'ledger drag a save':>19}"
        )
        for contender in contenders:
            median = statistics.median(seconds[contender.name])
            n_saves = statistics.median(per_save[contender.name])
            base = seconds[base_of[contender.name]]
            costs = sorted(
                (each - under) / saves * 1e3
                for each, under, saves in zip(seconds[contender.name], base, per_save[contender.name], strict=True)
                if saves
            )
            cost = statistics.median(costs) if costs else 0.0
            spread = f"{costs[0]:.0f} to {costs[-1]:.0f}" if costs else "-"
            flaxstate = contender.writer is not None
            blocking_times = [save["blocking"] for save in contender.saved()] if flaxstate else contender.blocking
            blocking = statistics.median(blocking_times) * 1e3 if blocking_times else 0.0
            drag = "-"
            if contender.writer is not None and n_saves:
                report = goodput.report(ledger.read_events(contender.directory / ledger.FILENAME))["total"]
                drag = f"{report['save_drag'] / max(contender.count(), 1) * 1e3:.1f}"
            print(
                f"{contender.name:32} {median / steps * 1e3:>10.2f} {n_saves:>14.0f} {cost:>16.1f} {spread:>15} "
                f"{blocking:>15.1f} {drag:>19}"
            )
        record = contenders[0].loop.next_checkpoint()
        print(f"\n{'one save, the loop idle':32} {'CPU ms':>10} {'wall ms':>10}")
        for contender in (contenders[2], contenders[4]):  # flaxstate's and orbax's, every 4th record
            cpus, walls = [], []
            for index in range(args.rounds):
                cpu, wall = cpu_of_one_save(contender, record, 10**6 + index)
                cpus.append(cpu)
                walls.append(wall)
            print(f"{contender.name.split(',')[0]:32} {statistics.median(cpus) * 1e3:>10.1f} "
                  f"{statistics.median(walls) * 1e3:>10.1f}")  # fmt: skip
        for contender in contenders:
            if contender.writer is not None:
                contender.writer.close()
            if contender.manager is not None:
                contender.manager.close()
    finally:
        shutil.rmtree(workdir, ignore_errors=True)


if __name__ == "__main__":
    main()
