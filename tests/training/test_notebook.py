"""The loop in a real Jupyter kernel (ipykernel, driven by jupyter_client), as a user's notebook runs it.

The cell that makes the writer and the loop is run again (the most common
thing a notebook user does); a training cell prints no warning without
ipywidgets; a wrong `init` names the call the loop made; a loop whose
construction failed leaves no thread behind; `fs.plot` shows a run's curves
inline.
"""

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

    def run(self, cell: str, timeout: float = 240) -> tuple[str, str, tuple[str, str] | None]:
        out, err, error = [], [], []
        self.shown = []

        def collect(message):
            kind, content = message["msg_type"], message["content"]
            if kind == "stream":
                (out if content["name"] == "stdout" else err).append(content["text"])
            elif kind in ("display_data", "execute_result"):  # rich shows its warnings as displays in a kernel
                out.append(content["data"].get("text/plain", ""))
                self.shown.append(set(content["data"]))
            elif kind == "error":
                error.append((content["ename"], content["evalue"]))

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
