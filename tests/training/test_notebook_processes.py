"""The loop in a real Jupyter kernel (ipykernel, driven by jupyter_client), as a user's notebook runs it.

Tier 2 (tests/README.md): tests that start, kill or signal processes of their own, or run servers or commands.

The cell that makes the writer and the loop is run again (the most common
thing a notebook user does); a training cell prints no warning without
ipywidgets; a wrong `init` names the call the loop made; a loop whose
construction failed leaves no thread behind; `fs.plot` shows a run's curves
inline.
"""

import json
import textwrap

import pytest
from flaxstate_testing import processes

jupyter_client = pytest.importorskip("jupyter_client")  # the test extra installs it: a skip only outside it

SETUP = """
    import threading, jax, numpy as np, optax, flax.linen as nn
    import flaxstate as fs

    class MLP(nn.Module):
        @nn.compact
        def __call__(self, x):
            return nn.Dense(1)(nn.relu(nn.Dense(16)(x)))[:, 0]

    model = MLP()
    rng = np.random.RandomState(0)
    data = [(rng.randn(8, 4).astype(np.float32), rng.randn(8).astype(np.float32)) for _ in range(64)]
    task = fs.TrainTask(apply=model.apply, optimizer=optax.adam(1e-2), loss=lambda y, t: ((y - t) ** 2).mean(),
                        data=data)

    def watchdogs():
        return sum(thread.name == "flaxstate-watchdog" for thread in threading.enumerate())
"""

MAKE = """
    writer = fs.CheckpointFileWriter({run!r}, keep=2)
    loop = fs.TrainLoop(fs.CheckpointFileReader({run!r}, target=model.init), task, 0, n_steps_per_checkpoint=4)
"""

TRAIN = """
    for record in loop.run(loop.step + 8):
        writer(record)
    writer.wait()
    print("trained to", loop.step)
"""


class Kernel:
    """One ipykernel of this interpreter; `run(cell)` returns its stdout, stderr and error (name, value)."""

    def __init__(self) -> None:
        self.manager, self.client = jupyter_client.manager.start_new_kernel(
            kernel_name="python3", env=processes.worker_env()
        )
        self.shown: list[set[str]] = []
        """The MIME types of each display of the last cell run."""

    def run(
        self, cell: str, timeout: float = 240, interrupt_at: str | None = None
    ) -> tuple[str, str, tuple[str, str] | None]:
        """Runs a cell; with `interrupt_at`, presses Stop (SIGINT to the kernel) once stdout shows that text."""
        out, err, error = [], [], []
        self.shown = []
        self.traceback = ""
        pressed = []

        def collect(message):
            kind, content = message["msg_type"], message["content"]
            if kind == "stream":
                (out if content["name"] == "stdout" else err).append(content["text"])
                if interrupt_at and not pressed and interrupt_at in "".join(out):
                    pressed.append(True)
                    self.manager.interrupt_kernel()
            elif kind in ("display_data", "execute_result"):  # rich shows its warnings as displays in a kernel
                out.append(content["data"].get("text/plain", ""))
                self.shown.append(set(content["data"]))
            elif kind == "error":
                error.append((content["ename"], content["evalue"]))
                self.traceback = "\n".join(content["traceback"])

        self.client.execute_interactive(textwrap.dedent(cell), timeout=timeout, output_hook=collect)
        return "".join(out), "".join(err), error[0] if error else None

    def close(self) -> None:
        self.client.stop_channels()
        self.manager.shutdown_kernel(now=True)


@pytest.fixture
def kernel():
    started = Kernel()
    yield started
    started.close()


def test_a_notebook_runs_its_cells_again_without_a_trap(kernel, tmp_path):
    run = str(tmp_path / "run")
    assert kernel.run(SETUP)[2] is None
    for cell, expected in ((MAKE, None), (TRAIN, "trained to 8"), (MAKE, None), (TRAIN, "trained to 16")):
        out, err, error = kernel.run(cell.format(run=run))
        assert error is None, (cell, error, err)
        assert "ipywidgets" not in out + err  # rich's warning at every training cell
        if expected:
            assert expected in out, out
    # The second run of the cell: its writer took over from the first (said in one line), and resumed at step 8.
    listing = f"import pathlib; print(sorted(int(p.name) for p in pathlib.Path({run!r}).glob('[0-9]*')))"
    out, err, error = kernel.run(listing)
    assert out.strip() == "[12, 16]", (out, err)

    # The run's curves inline: fs.plot's figure as the cell's value shows as an image, and stays out of pyplot.
    curves = """
        summaries = fs.SummaryWriter({run!r} + "/events")
        for record in loop.run(loop.step + 8):
            summaries(record)
        summaries.close()
        fs.plot({run!r} + "/events")
    """
    out, err, error = kernel.run(curves.format(run=run))
    assert error is None, (error, err)
    assert any("image/png" in shown for shown in kernel.shown), kernel.shown
    assert "Axes>" in out, out  # the figure was the cell's value
    out, _, _ = kernel.run("import matplotlib.pyplot as plt; print(plt.get_fignums())")
    assert out.strip() == "[]", out

    before, _, _ = kernel.run("print(watchdogs())")
    out, err, error = kernel.run("fs.TrainLoop(init=lambda rng: model.init(rng, data[0][0]), task=task, rng=0)")
    assert error is not None and error[0] == "TypeError", (error, err)
    assert "TrainLoop calls init(rngs, *the first batch's inputs), here init({'params', 'dropout'}" in error[1]
    assert "takes (rng)" in error[1], error[1]
    after, _, _ = kernel.run("print(watchdogs())")
    assert after == before  # the failed construction left no watchdog thread running


def test_the_cell_run_again_says_it_took_over(kernel, tmp_path):
    run = str(tmp_path / "run")
    kernel.run(SETUP)
    kernel.run(MAKE.format(run=run))
    _, err, error = kernel.run(MAKE.format(run=run))
    assert error is None and "takes over" in err and "idle" in err, (error, err)
    kernel.run("old = writer")
    kernel.run(MAKE.format(run=run))
    _, _, error = kernel.run("old(next(iter(loop.run(4))))")
    assert error is not None and error[0] == "CheckpointError" and "was replaced by" in error[1], error


BIG = """
    import pathlib

    class Wide(nn.Module):  # 4.3M parameters, 52 MB with adam's moments: a save and a restore take a while
        @nn.compact
        def __call__(self, x):
            return nn.Dense(1)(nn.relu(nn.Dense(2048)(nn.relu(nn.Dense(2048)(x)))))[:, 0]

    wide = Wide()
    points = np.random.RandomState(1).randn(256, 4).astype(np.float32)
    wide_task = fs.TrainTask(apply=wide.apply, optimizer=optax.adam(1e-3), loss=lambda y, t: ((y - t) ** 2).mean(),
                             data=fs.global_batches((points, points[:, 0]), batch_size=16))

    def wide_loop(init, n_steps=60):
        return fs.TrainLoop(init, wide_task, 0, n_steps=n_steps, n_steps_per_checkpoint=10, stdout=False)

    def same(a, b):
        return all(jax.tree.leaves(jax.tree.map(lambda x, y: bool(np.array_equal(x, y)), a, b)))

    straight = wide_loop(wide.init)
    for expected in straight:
        pass
"""


def test_the_stop_button_in_a_run_a_save_and_a_restore_loses_nothing(kernel, tmp_path):
    run = str(tmp_path / "run")
    assert kernel.run(SETUP + BIG)[2] is None

    # 1. Stop during training: the loop stays usable and the next cell goes on from the step it reached.
    cell = f"""
        loop = wide_loop(fs.CheckpointFileReader({run!r}, target=wide.init))
        writer = fs.CheckpointFileWriter({run!r}, keep=2)
        for record in loop.run(60):
            writer(record)
            print("record", record.step, flush=True)
    """
    out, err, error = kernel.run(cell, interrupt_at="record 10")
    assert error is not None and error[0] == "KeyboardInterrupt", (error, out, err)
    out, _, _ = kernel.run("print(loop.step)")
    stopped_at = int(out)
    assert 10 <= stopped_at < 60, out

    # 2. Stop while a save is on its way: the save goes on, and the writer waits for it at the next call.
    cell = """
        record = loop.next_checkpoint()
        writer(record)
        print("saving", record.step, flush=True)
        writer.wait()
        print("saved")
    """
    out, err, error = kernel.run(cell, interrupt_at="saving")
    assert error is not None and error[0] == "KeyboardInterrupt", (error, out, err)
    assert "wait" in kernel.traceback, kernel.traceback  # it landed in the wait for the save
    listing = f"writer.wait(); print(record.step, sorted(int(p.name) for p in pathlib.Path({run!r}).glob('[0-9]*')))"
    out, err, error = kernel.run(listing)
    assert error is None, (error, err)
    step, steps = out.split(" ", 1)
    assert int(step) in json.loads(steps), out  # the interrupted save finished

    # 3. Stop during a restore, then the cell run again: the loop resumes and ends as the straight run.
    cell = f"""
        writer.close()
        print("restoring", flush=True)
        loop = wide_loop(fs.CheckpointFileReader({run!r}, target=wide.init))
        print("restored", loop.step)
    """
    out, err, error = kernel.run(cell, interrupt_at="restoring")
    assert error is not None and error[0] == "KeyboardInterrupt", (error, out, err)
    assert "restored" not in out, out
    cell = f"""
        loop = wide_loop(fs.CheckpointFileReader({run!r}, target=wide.init))
        writer = fs.CheckpointFileWriter({run!r}, keep=2)
        print("resumed at", loop.step)
        for record in loop.run(60):
            writer(record)
        writer.close()
        print("equal to the straight run:", same(record.state.params, expected.state.params), loop.step)
    """
    out, err, error = kernel.run(cell)
    assert error is None, (error, err)
    assert "equal to the straight run: True 60" in out, (out, err)

    # 4. The cell that makes the writer and the loop and trains a record, run again and again: from the second
    # run on, the threads, the live device arrays and their bytes stay where they were.
    cell = f"""
        writer = fs.CheckpointFileWriter({run!r}, keep=2)
        loop = wide_loop(fs.CheckpointFileReader({run!r}, target=wide.init), n_steps=10**6)
        record = writer(loop.next_checkpoint())  # not the cell's value: IPython keeps those (Out)
    """
    count = """
        writer.wait()  # the record's save, then the threads it used, settled for a second (10 s at most)
        import gc, time
        last, since, start = None, time.monotonic(), time.monotonic()
        while time.monotonic() - since < 1.0 and time.monotonic() - start < 10:
            if (now := threading.active_count()) != last:
                last, since = now, time.monotonic()
            time.sleep(0.05)
        gc.collect()
        print(threading.active_count(), len(jax.live_arrays()), sum(a.nbytes for a in jax.live_arrays()))
        print(sorted(thread.name for thread in threading.enumerate()))
    """
    counts = []
    for _ in range(3):
        _, err, error = kernel.run(cell)
        assert error is None, (error, err)
        out, _, _ = kernel.run(count)
        counts.append(out.strip().split("\n"))
    assert counts[1][0] == counts[2][0], counts
