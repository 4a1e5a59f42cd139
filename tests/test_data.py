"""Data that would train on the wrong thing, or on nothing, is an `error:` line naming where; the data type follows
from the path; a resume notices that the data changed under its checkpoint."""

import gzip
import json
import os

import pytest
import torch

from glm5f import checkpoint
from glm5f.data import IGNORE_INDEX, infer_data_type, make_source
from glm5f.metrics import read_metrics
from train import main

TINY = ["--model.preset", "glm5-tiny", "--data.batch_size", "2", "--data.seq_len", "32", "--eval.every", "0",
        "--train.steps", "2", "--optim.warmup_steps", "2"]


def write_records(path, records) -> str:
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return str(path)


@pytest.mark.parametrize("record,field,found", [({"prompt": "q", "response": None}, "response", "null (null)"),
                                                ({"text": 12345}, "text", "a number (12345)"),
                                                ({"prompt": ["a"], "response": "b"}, "prompt", 'a list (["a"])')])
def test_a_field_of_the_wrong_type_is_an_error_naming_file_line_and_type(tmp_path, capsys, record, field, found):
    data = write_records(tmp_path / "d.jsonl", [{"text": "fine"}, record])
    assert main(TINY + ["--data.path", data, "--checkpoint.dir", str(tmp_path / "run")]) == 1
    err = capsys.readouterr().err
    assert f"error: {data}:2: field '{field}' must be a string, found {found}" in err
    assert not (tmp_path / "run").exists()


def test_records_with_nothing_to_learn_are_an_error_before_step_1_or_a_counted_warning(tmp_path, capsys):
    one_token = write_records(tmp_path / "one.jsonl", [{"input_ids": [5]}, {"input_ids": []},
                                                         {"input_ids": [1, 2, 3], "labels": [-100, -100, -100]}])
    assert main(TINY + ["--data.path", one_token, "--checkpoint.dir", str(tmp_path / "a")]) == 1
    err = capsys.readouterr().err
    assert (f"error: {one_token}: nothing to learn: none of its 3 records has a token to predict (each has at most "
            f"one token, or every label -100)") in err
    assert not (tmp_path / "a").exists()
    some = write_records(tmp_path / "some.jsonl", [{"text": "a fine record"}, {"input_ids": [7]},
                                                     {"input_ids": [3, 4], "labels": [-100, -100]}, {"text": "more"}])
    assert main(TINY + ["--data.path", some, "--checkpoint.dir", str(tmp_path / "b")]) == 0
    err = capsys.readouterr().err
    assert (f"warning: 2 of 4 records have no token to learn (at most one token, or every label -100; the first at "
            f"{some}:2): they are skipped") in err
    # fixed batches whose labels are all ignored: stopped before the first step, nothing written
    ids = torch.randint(0, 100, (2, 8))
    torch.save([{"input_ids": ids, "labels": torch.full_like(ids, IGNORE_INDEX)}], tmp_path / "b.pt")
    assert main(TINY + ["--data.path", str(tmp_path / "b.pt"), "--checkpoint.dir", str(tmp_path / "c")]) == 1
    assert (f"error: {tmp_path / 'b.pt'}: the batch of step 1 holds no token to learn" in capsys.readouterr().err)
    assert not (tmp_path / "c").exists()


def test_the_data_type_follows_from_the_path(tmp_path, capsys):
    data = write_records(tmp_path / "my.jsonl", [{"text": "some words to learn"}] * 4)
    assert main(TINY + ["--data.path", data, "--checkpoint.dir", str(tmp_path / "run")]) == 0
    assert "json_file data" in capsys.readouterr().out
    meta = checkpoint.read_meta(checkpoint.latest(str(tmp_path / "run")))
    assert meta["run"]["data"]["type"] == "json_file" and meta["run"]["data"]["path"] == data
    torch.save([{"input_ids": torch.ones(2, 8, dtype=torch.long)}], tmp_path / "b.pt")
    (tmp_path / "ds").mkdir()
    (tmp_path / "ds" / "dataset_info.json").write_text("{}")
    assert [infer_data_type(p) for p in (None, data, data + ".gz", str(tmp_path / "b.pt"), str(tmp_path / "ds"))] \
        == ["text", "json_file", "json_file", "preset_pt", "hf_datasets"]


@pytest.mark.parametrize("args,message", [
    (["--data.type", "text", "--data.path", "{d}/my.jsonl"], "--data.type text reads no file, so --data.path "
                                                             "{d}/my.jsonl would be ignored"),
    (["--data.type", "json_file", "--data.path", "{d}/b.pt"], "--data.type json_file reads JSONL, but --data.path "
                                                              "{d}/b.pt is a .pt file"),
    (["--data.type", "preset_pt", "--data.path", "{d}/my.jsonl"], "--data.type preset_pt reads torch.save batches, "
                                                                  "but --data.path {d}/my.jsonl is JSON"),
    (["--data.path", "{d}/notes.txt"], "cannot tell the type of --data.path {d}/notes.txt from its name"),
    (["--data.path", "{d}"], "--data.path {d} is a directory but not a datasets.save_to_disk output"),
])
def test_a_path_the_data_type_does_not_read_is_an_error(tmp_path, capsys, args, message):
    write_records(tmp_path / "my.jsonl", [{"text": "x"}])
    assert main(TINY + [a.format(d=tmp_path) for a in args] + ["--checkpoint.dir", str(tmp_path / "run")]) == 1
    assert f"error: invalid configuration:\n  - {message.format(d=tmp_path)}" in capsys.readouterr().err
    assert not (tmp_path / "run").exists()


def test_a_truncated_gzip_file_is_an_error_naming_it(tmp_path, capsys):
    records = [{"text": f"record number {i} " * 20} for i in range(400)]
    whole = gzip.compress("".join(json.dumps(r) + "\n" for r in records).encode())
    cut = tmp_path / "d.jsonl.gz"
    cut.write_bytes(whole[:len(whole) // 2])
    with pytest.raises(ValueError, match=rf"{cut}:\d+: the gzip file ends in the middle of its data \(truncated"):
        make_source("json_file", vocab_size=512, batch_size=2, seq_len=16, path=str(cut), shuffle_buffer=10_000)
    assert main(TINY + ["--data.path", str(cut), "--checkpoint.dir", str(tmp_path / "run")]) == 1
    assert f"error: {cut}:" in capsys.readouterr().err


def test_a_missing_eval_path_names_the_eval_flag(tmp_path, capsys):
    missing = tmp_path / "held-out.jsonl"
    assert main(TINY + ["--data.type", "synthetic", "--eval.path", str(missing), "--eval.every", "1",
                        "--checkpoint.dir", str(tmp_path / "run")]) == 1
    err = capsys.readouterr().err
    assert f"error: --eval.path '{missing}': no such file" in err and "--data.path" not in err


def test_resume_after_the_data_file_changed_is_an_error_unless_allowed(tmp_path, capsys):
    data = tmp_path / "d.jsonl"
    write_records(data, [{"text": f"record {i} with some words"} for i in range(30)])
    run = ["--data.path", str(data), "--checkpoint.dir", str(tmp_path / "run")]
    assert main(TINY + run) == 0
    original = data.read_bytes()
    with open(data, "a") as f:
        f.write(json.dumps({"text": "one more"}) + "\n")
    resume = TINY + run + ["--train.steps", "4", "--checkpoint.resume", "latest"]
    assert main(resume) == 1
    err = capsys.readouterr().err
    size = os.path.getsize(data)
    assert (f"error: the data at {data} changed since the checkpoint was saved (d.jsonl had "
            f"{size - len(json.dumps({'text': 'one more'})) - 1} bytes, now {size}): the saved data position may no "
            f"longer point at the records it did. Resume with --data.allow_changed") in err
    assert [r["step"] for r in read_metrics(tmp_path / "run")] == [1, 2]
    data.write_bytes(original.replace(b"record 0 ", b"RECORD 0 "))  # same size, other content
    assert main(resume) == 1
    assert "d.jsonl has the same size" in capsys.readouterr().err
    assert main(resume + ["--data.allow_changed"]) == 0
    assert "resuming at the saved position as it is (--data.allow_changed)" in capsys.readouterr().err
    assert [r["step"] for r in read_metrics(tmp_path / "run")] == [1, 2, 3, 4]
