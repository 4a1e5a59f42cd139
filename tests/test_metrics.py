"""metrics.jsonl across resumes: a last line cut off by a killed run is dropped with a warning, not a traceback; the
loss curve PNG, read back pixel by pixel."""

import dataclasses
import io
import json
import os
import types

import matplotlib.image
import numpy as np
import pytest

from conftest import run_script
from glm5f.run.metrics import MetricsLog, plot_losses, read_metrics
from train import main

TINY = ["--model.preset", "glm5-tiny", "--data.type", "synthetic", "--data.batch_size", "2", "--data.seq_len", "32",
        "--eval.every", "0", "--optim.warmup_steps", "2"]


def test_resume_drops_a_cut_off_last_line_with_a_warning(tmp_path, capsys):
    run = ["--checkpoint.dir", str(tmp_path)]
    assert main(TINY + run + ["--train.steps", "2"]) == 0
    metrics = tmp_path / "metrics.jsonl"
    with open(metrics, "a") as f:
        f.write('{"step": 3, "loss": 6.21')  # the run died while writing step 3's record
    capsys.readouterr()
    assert main(TINY + run + ["--train.steps", "4", "--checkpoint.resume", "latest"]) == 0
    err = capsys.readouterr().err
    assert (f"warning: {metrics}:3: dropping its last line, cut off (24 bytes of an unfinished record: the run "
            f"writing it was stopped mid-line)") in err
    assert [r["step"] for r in read_metrics(tmp_path)] == [1, 2, 3, 4]
    assert all(line.endswith("}") for line in metrics.read_text().splitlines())


def test_a_damaged_line_before_the_last_is_an_error_naming_it(tmp_path):
    path = tmp_path / "metrics.jsonl"
    path.write_text(json.dumps({"step": 1, "loss": 2.0}) + "\n" + '{"step": 2, "lo\n' +
                    json.dumps({"step": 3, "loss": 1.0}) + "\n")
    with pytest.raises(ValueError, match=rf"{path}:2: not a JSON record"):
        read_metrics(str(path))
    with pytest.raises(ValueError, match=rf"{path}:2: not a JSON record"):
        MetricsLog(str(tmp_path), resume_step=3).write({"step": 4, "loss": 0.5})


def pixels_of(png, colour: str) -> np.ndarray:
    """(row, column) of every pixel of the PNG within 0.1 (per RGB channel) of the colour '#rrggbb'."""
    rgb = matplotlib.image.imread(png)[..., :3]
    want = np.array([int(colour[i:i + 2], 16) / 255 for i in (1, 3, 5)])
    return np.argwhere(np.abs(rgb - want).max(axis=-1) < 0.1)


def check_loss_png(png, colours: list[str], rising: bool = False) -> None:
    """The loss PNG as plot_losses draws it: 7 x 4 inches at 120 dpi, not blank, and each run's curve in its colour
    falling from left to right (the losses fall; `rising`: climbing, as a reward does): its pixels in the left third
    of its width lie higher (smaller rows) than those in the right third (lower, when rising)."""
    rgba = matplotlib.image.imread(png)
    assert rgba.shape[:2] == (480, 840)
    assert (rgba[..., :3].min(axis=-1) < 0.9).mean() > 0.01  # not a blank (white) canvas
    for colour in colours:
        at = pixels_of(png, colour)
        assert len(at) > 200, colour  # a curve, not the legend's sample line alone
        left, right = np.percentile(at[:, 1], [33, 67])
        higher_left = np.median(at[at[:, 1] <= left, 0]) < np.median(at[at[:, 1] >= right, 0])
        assert higher_left != rising, colour


def test_loss_png_draws_each_run_s_falling_curve(tmp_path):
    """Two runs, the first with held-out losses: each run's training curve is drawn in matplotlib's first and
    second cycle colours and falls as its losses do."""
    runs = {name: [{"step": i, "loss": 6.0 - (4.0 - k) * i / 40} | ({"eval_loss": 6.2 - 3 * i / 40} if i % 10 == 0
                                                                  and k == 0 else {}) for i in range(1, 41)]
            for k, name in enumerate(["a", "b"])}
    png = tmp_path / "loss.png"
    assert plot_losses(runs, str(png)) is True
    check_loss_png(png, ["#1f77b4", "#ff7f0e"])


def test_compare_runs_png_into_a_directory(tmp_path):
    pytest.importorskip("matplotlib")
    for name in ("a", "b"):
        (tmp_path / name).mkdir()
        (tmp_path / name / "metrics.jsonl").write_text(json.dumps({"step": 1, "loss": 2.0}) + "\n")
    (tmp_path / "plots").mkdir()
    out = run_script("scripts/compare_runs.py", str(tmp_path / "a"), str(tmp_path / "b"), "--png", str(tmp_path / "plots"))
    assert out.returncode == 0 and f"plot: {tmp_path / 'plots' / 'compare.png'}" in out.stdout, out.stderr
    assert os.listdir(tmp_path / "plots") == ["compare.png"] and not (tmp_path / "plots.png").exists()


def test_compare_runs_plots_another_metric(tmp_path):
    """--metric reward: the rows compare rewards, and the PNG draws each run's rising reward curve."""
    pytest.importorskip("matplotlib")
    for k, name in enumerate(("a", "b")):
        (tmp_path / name).mkdir()
        (tmp_path / name / "metrics.jsonl").write_text("".join(
            json.dumps({"step": i, "loss": 1.0, "reward": (0.1 + k * 0.2) * i}) + "\n" for i in range(1, 41)))
    png = tmp_path / "reward.png"
    out = run_script("scripts/compare_runs.py", str(tmp_path / "a"), str(tmp_path / "b"), "--metric", "reward",
                     "--png", str(png))
    assert out.returncode == 0, out.stderr
    row = next(line for line in out.stdout.splitlines() if line.startswith("b "))
    assert row.split()[1:] == ["reward", "40", f"{0.2 * 20.5:.3e}", f"{0.2 * 40:.3e}"], row
    check_loss_png(png, ["#1f77b4", "#ff7f0e"], rising=True)


def test_compare_runs_of_one_run_says_its_curve(tmp_path):
    """One run: no empty table of differences, but the run's own curve in one line."""
    (tmp_path / "a").mkdir()
    (tmp_path / "a" / "metrics.jsonl").write_text("".join(
        json.dumps({"step": i, "loss": 1.0, "reward": 0.5 * i}) + "\n" for i in range(1, 5)))
    out = run_script("scripts/compare_runs.py", str(tmp_path / "a"), "--metric", "reward")
    assert out.returncode == 0, out.stderr
    assert out.stdout.splitlines() == ["a: reward 0.5000 (step 1) -> 2.0000 (step 4), min 0.5000, max 2.0000 over 4 "
                                       "steps; pass more runs to compare them with it"]


def test_a_huge_reward_or_loss_is_one_short_word_on_the_console(tmp_path, capsys):
    """The progress line (which shows GRPO's reward) and the run's last lines print 1e300 as 1.0000e+300, not as its
    301 digits."""
    from configs import Config
    from glm5f.parallel.layout import Layout
    from glm5f.objectives import OBJECTIVES
    from glm5f.run.finish import report
    from glm5f.run.metrics import Progress

    rec = {"step": 1, "loss": 3e300, "lr": 1e-3, "grad_norm": 2e300, "tokens_per_s": 10.0, "reward": -1e300}
    stream = io.StringIO()
    Progress(1, stream=stream).update(1, rec)
    line = stream.getvalue()
    assert "loss 3.0000e+300 " in line and "gnorm 2.000e+300 " in line and "reward -1.0000e+300" in line
    assert len(line) < 120, line
    (tmp_path / "metrics.jsonl").write_text(json.dumps(rec) + "\n" + json.dumps({**rec, "step": 2, "loss": 0.5,
                                                                                  "reward": 0.25}) + "\n")
    said = []
    cfg = Config(checkpoint=dataclasses.replace(Config().checkpoint, dir=str(tmp_path)))
    report(types.SimpleNamespace(cfg=cfg, layout=Layout("cpu"), say=said.append, row=OBJECTIVES["grpo"]))
    assert "done: loss 3.0000e+300 (step 1) -> 0.5000 (step 2)" in said
    assert "reward: -1.0000e+300 (step 1) -> 0.2500 (step 2)" in said
