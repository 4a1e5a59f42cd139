"""scripts/generate.py from the command line: what a chat answers, one-shot and interactive, for the same turns."""

import io
import json

from conftest import RUN_64, run_script
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


def test_generate_device_auto_and_a_chat_with_system_messages_and_turns_from_stdin(tmp_path):
    run_dir = tmp_path / "run"
    assert main(["--model.preset", "glm5-tiny", "--data.type", "chat", *RUN_64, "--checkpoint.dir", str(run_dir)]) == 0
    out = run_script("scripts/generate.py", str(run_dir), "--device", "auto", "--prompt", "The", "--max-tokens", "4")
    assert out.returncode == 0 and out.stdout.startswith("The"), out.stderr
    talk = tmp_path / "talk.json"
    talk.write_text(json.dumps([{"role": "user", "content": "2+2?"}, {"role": "assistant", "content": "4"}]))
    messages = generate.conversation("Be brief.", str(talk), "and 3+3?")
    assert [m["role"] for m in messages] == ["system", "user", "assistant", "user"]
    cfg, _, _, tokens = generate.load(str(run_dir))
    fmt = generate.chat_format(tokens, None, cfg.vocab_size)
    ids = fmt.ids(messages, add_generation_prompt=True)
    assert fmt.tok.decode(ids) == ("[gMASK]<sop><|system|>Be brief.<|user|>2+2?<|assistant|><think></think>4"
                                   "<|user|>and 3+3?<|assistant|>")
    out = run_script("scripts/generate.py", str(run_dir), "--chat", "--system", "Be brief.", "--messages", str(talk),
              "--prompt", "and 3+3?", "--max-tokens", "6")
    assert out.returncode == 0 and out.stderr == "", out.stderr
    out2 = run_script("scripts/generate.py", str(run_dir), "--chat", "--system", "Be brief.", "--messages", str(talk),
               "--interactive", "--max-tokens", "6", stdin="and 3+3?\n\nagain?\n")
    assert out2.returncode == 0 and out2.stdout.startswith(out.stdout) and len(out2.stdout) > len(out.stdout), \
        (out.stdout, out2.stdout)  # the first answer as the one-shot one's, then a second
