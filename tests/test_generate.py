"""scripts/generate.py from the command line: what a chat answers, one-shot and interactive, for the same turns."""

import io

from scripts import generate
from train import main

RUN = ["--model.preset", "glm5-tiny", "--data.type", "chat", "--data.batch_size", "2", "--data.seq_len", "64",
       "--train.steps", "1", "--eval.every", "0"]


def test_interactive_chat_answers_the_prompt_first(tmp_path, capsys, monkeypatch):
    run_dir = str(tmp_path / "run")
    assert main(RUN + ["--checkpoint.dir", run_dir]) == 0
    capsys.readouterr()
    chat = [run_dir, "--chat", "--system", "Be brief.", "--max-tokens", "6"]
    assert generate.main(chat + ["--prompt", "2+2?"]) == 0
    one_shot = capsys.readouterr().out
    monkeypatch.setattr("sys.stdin", io.StringIO(""))
    assert generate.main(chat + ["--prompt", "2+2?", "--interactive"]) == 0
    assert capsys.readouterr().out == one_shot  # before: no turn at all, the prompt dropped
    monkeypatch.setattr("sys.stdin", io.StringIO("and 3+3?\n"))
    assert generate.main(chat + ["--prompt", "2+2?", "--interactive"]) == 0
    both = capsys.readouterr().out
    assert both.startswith(one_shot) and len(both) > len(one_shot)  # the prompt's answer, then stdin's turn's
