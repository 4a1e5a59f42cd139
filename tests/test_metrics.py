"""metrics.jsonl across resumes: a last line cut off by a killed run is dropped with a warning, not a traceback."""

import json

import pytest

from glm5f.metrics import MetricsLog, read_metrics
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
