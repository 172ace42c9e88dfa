"""metrics.jsonl read back (one row per step, resume markers) and drawn: `python -m flame.plot` and the
`loss.png` every run writes at its checkpoints and its end."""

import json
import sys
from types import SimpleNamespace

import pytest

from flame import plot
from flame.run_metrics import MetricsFileError, read_run_metrics
from flame.train.metrics import MetricsLogger
from flame.train.trainer import Trainer
from tests.train.helpers import tiny_config

pytest.importorskip("matplotlib")
PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def record(step: int, loss: float) -> dict:
    return {"step": step, "loss": loss, "lr": 1e-3 * step, "grad_norm": 1.0 / step,
            "tokens": 100 * step, "tokens_per_s": 50.0}


def write_run(folder, rows) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "metrics.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))


def resumed_run(folder):
    """Steps 1-6 logged, a kill after step 6, a resume from the step-4 checkpoint that reaches step 5
    again and then step 7: steps 5 and 6 of the first attempt were undone."""
    rows = [record(s, 10.0 - s) for s in range(1, 7)] + [{"step": 4, "val_loss": 7.5}]
    rows += [{"step": 4, "resumed_from_step": 4}, record(5, 4.5), record(7, 4.0), {"step": 7, "val_loss": 4.2}]
    write_run(folder, rows)


def assert_png(path) -> None:
    from PIL import Image

    assert path.read_bytes()[:8] == PNG_SIGNATURE
    with Image.open(path) as image:
        image.verify()
    with Image.open(path) as image:
        assert image.format == "PNG" and min(image.size) > 100


def test_a_step_logged_again_after_a_resume_is_read_and_drawn_once(tmp_path):
    resumed_run(tmp_path / "run")
    metrics = read_run_metrics(tmp_path / "run")
    assert [r["step"] for r in metrics.train] == [1, 2, 3, 4, 5, 7]
    assert metrics.train[4]["loss"] == 4.5  # the resumed run's step 5, not the undone one
    assert [r["step"] for r in metrics.validation] == [4, 7] and metrics.resumed_from == [4]

    figure = plot.figure_of_runs([("run", metrics)])
    loss_panel = figure.axes[0]
    training, validation, resumed = loss_panel.lines
    assert list(training.get_xdata()) == [1, 2, 3, 4, 5, 7]
    assert list(training.get_ydata()) == [9.0, 8.0, 7.0, 6.0, 4.5, 4.0]
    assert list(validation.get_xdata()) == [4, 7]
    assert list(resumed.get_xdata()) == [4, 4]  # the vertical marker at the resumed step
    assert [axis.get_title() for axis in figure.axes] == [name for _, name in plot.PANELS]

    by_tokens = plot.figure_of_runs([("run", metrics)], x="tokens")
    assert list(by_tokens.axes[0].lines[0].get_xdata()) == [100, 200, 300, 400, 500, 700]
    assert list(by_tokens.axes[0].lines[1].get_xdata()) == [400.0, 700.0]


def test_plot_command_draws_several_runs_into_one_png(tmp_path, capsys):
    resumed_run(tmp_path / "a")
    write_run(tmp_path / "b", [record(s, 9.0 - s) for s in range(1, 9)] + ["cut by a ki"])
    (tmp_path / "b" / "metrics.jsonl").write_text(
        (tmp_path / "b" / "metrics.jsonl").read_text().replace('"cut by a ki"', '{"step": 9, "lo'))
    out = tmp_path / "compare.png"
    assert plot.main([str(tmp_path / "a"), str(tmp_path / "b" / "metrics.jsonl"), "--out", str(out),
                      "--x", "tokens"]) == 0
    assert_png(out)
    captured = capsys.readouterr()
    assert f"wrote {out}" in captured.out
    assert "metrics.jsonl:9 is not a metrics row" in captured.err

    labels = [line.get_label() for line in plot.figure_of_runs(
        [("a", read_run_metrics(tmp_path / "a")), ("b", read_run_metrics(tmp_path / "b"))]).axes[0].lines]
    assert labels == ["a", "a validation", "a resumed", "b"]


def test_plot_command_errors_are_one_line(tmp_path, capsys):
    assert plot.main([str(tmp_path / "nowhere"), "--out", str(tmp_path / "x.png")]) == 1
    assert "flame.plot: error:" in capsys.readouterr().err
    resumed_run(tmp_path / "run")
    assert plot.main([str(tmp_path / "run"), "--out", str(tmp_path / "x.notanimage")]) == 1
    assert "its suffix names no image format" in capsys.readouterr().err
    write_run(tmp_path / "empty", [{"step": 2, "val_loss": 3.0}])
    assert plot.main([str(tmp_path / "empty"), "--out", str(tmp_path / "x.png")]) == 1
    assert "nothing to plot" in capsys.readouterr().err
    assert not list(tmp_path.glob("*.png")) and not list(tmp_path.glob(".*tmp*"))
    with pytest.raises(MetricsFileError, match="does not exist"):
        read_run_metrics(tmp_path / "nowhere")


def test_a_run_writes_loss_png_and_marks_its_resume(tmp_path):
    dump = tmp_path / "run"
    cfg = tiny_config(dump, training={"steps": 4}, checkpoint={"enable": True, "interval": 2})
    Trainer(cfg).train(stop_at_step=2)  # "killed" after the step-2 checkpoint
    assert_png(dump / "loss.png")
    first = (dump / "loss.png").read_bytes()
    Trainer(cfg).train()
    assert_png(dump / "loss.png")
    rows = [json.loads(line) for line in (dump / "metrics.jsonl").read_text().splitlines()]
    assert {"step": 2, "resumed_from_step": 2} in rows
    assert [r["step"] for r in read_run_metrics(dump).train] == [1, 2, 3, 4]
    assert (dump / "loss.png").read_bytes() != first


def test_without_matplotlib_a_run_says_so_once_and_writes_no_plot(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "matplotlib.figure", None)  # import fails as if not installed
    messages = []
    monkeypatch.setattr("flame.train.metrics.logger.info", lambda *args: messages.append(args[0] % args[1:]))
    cfg = SimpleNamespace(enable_wandb=False, enable_tensorboard=False)
    logger = MetricsLogger(str(tmp_path), cfg, enabled=True, run_name="run", config_dict={})
    logger.log(record(1, 5.0), console=False)
    logger.write_plot()
    logger.write_plot()
    logger.close()
    assert len(messages) == 1 and "matplotlib is not installed" in messages[0]
    assert not (tmp_path / "loss.png").exists()
