import matplotlib.figure
import matplotlib.pyplot as plt
import pytest
import tensorboardX

import flaxstate as fs


def write_events(directory, scalars):
    writer = tensorboardX.SummaryWriter(str(directory))
    for tag, points in scalars.items():
        for step, value in points:
            writer.add_scalar(tag, value, step)
    writer.close()


def test_plot_draws_a_panel_a_metric_and_a_line_a_group(tmp_path):
    write_events(
        tmp_path,
        {
            "train/loss": [(10, 1.0), (20, 0.5), (30, 0.25)],
            "eval/loss": [(20, 0.75), (30, 0.5)],
            "eval/acc": [(20, 0.5), (30, 0.75)],
        },
    )
    figure = fs.plot(tmp_path)
    assert isinstance(figure, matplotlib.figure.Figure)
    panels = {
        axis.get_title(): {
            line.get_label(): (list(line.get_xdata()), [float(v) for v in line.get_ydata()])
            for line in axis.get_lines()
        }
        for axis in figure.axes
    }
    assert panels == {
        "acc": {"eval": ([20, 30], [0.5, 0.75])},
        "loss": {"eval": ([20, 30], [0.75, 0.5]), "train": ([10, 20, 30], [1.0, 0.5, 0.25])},
    }
    assert plt.get_fignums() == []  # made without pyplot: a notebook cell run again leaves no figure behind


def test_plot_names_what_is_missing(tmp_path):
    with pytest.raises(FileNotFoundError, match="does not exist or is not a directory"):
        fs.plot(tmp_path / "missing")
    with pytest.raises(FileNotFoundError, match="holds no TensorBoard event files; write them with"):
        fs.plot(tmp_path)
    with pytest.raises(ValueError, match="not to gcs:// URLs"):
        fs.plot("gcs://bucket/run")
