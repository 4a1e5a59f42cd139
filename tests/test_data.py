"""glm5f/data/: packing, prompt masking and the sources (text, json_file, hf_datasets, preset_pt, a tokenizer);
streamed files against a naive packer, the shuffle buffer, resume mid-stream, memory that does not grow with the
corpus; held-out documents (--eval.split_fraction: tests/test_data_held_out.py); and data that would train on the
wrong thing, or on nothing, as an `error:` line naming where."""

import gzip
import json
import os
import subprocess
import sys
import textwrap

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import glm5f
from conftest import bpe_tokenizer, run_error, write_records
from glm5f.ckpt import checkpoint
from glm5f.data import ByteTokenizer, IGNORE_INDEX, embedded_documents, infer_data_type, make_source
from glm5f.run.metrics import read_metrics
from train import main, train

TINY = ["--model.preset", "glm5-tiny", "--data.batch_size", "2", "--data.seq_len", "32", "--eval.every", "0",
        "--train.steps", "2", "--optim.warmup_steps", "2"]
SYNTHETIC_TINY = ["--model.preset", "glm5-tiny", "--data.type", "synthetic", "--data.batch_size", "2",
                  "--data.seq_len", "32"]
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
STREAM_TINY = ["--model.preset", "glm5-tiny", "--data.type", "json_file", "--data.batch_size", "2", "--data.seq_len",
               "32", "--optim.warmup_steps", "0", "--eval.every", "0"]


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
    (["--data.type", "json_file", "--data.path", "{d}/b.pt"], "--data.type json_file reads JSON lines or parquet, "
                                                              "but --data.path {d}/b.pt is a .pt file"),
    (["--data.type", "preset_pt", "--data.path", "{d}/my.jsonl"], "--data.type preset_pt reads torch.save batches, "
                                                                  "but --data.path {d}/my.jsonl is JSON"),
    (["--data.path", "{d}/notes.txt"], "cannot tell the type of --data.path {d}/notes.txt from its name"),
    (["--data.path", "{d}/docs"], "--data.path {d}/docs is a directory but not a datasets.save_to_disk output (no "
                                  "dataset_info.json or dataset_dict.json in it) and holds no data file"),
])
def test_a_path_the_data_type_does_not_read_is_an_error(tmp_path, capsys, args, message):
    write_records(tmp_path / "my.jsonl", [{"text": "x"}])
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "README.md").write_text("not data")
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
    assert "resuming at the saved position as it is (--data.allow_changed: the same record numbers)" in \
        capsys.readouterr().err
    assert [r["step"] for r in read_metrics(tmp_path / "run")] == [1, 2, 3, 4]


def test_allow_changed_resumes_a_changed_jsonl_at_the_same_record_numbers(tmp_path):
    """Records put before the saved position move every byte offset; --data.allow_changed takes the position as
    record numbers: the resumed source reads what a fresh one over the new file reads after as many batches (every
    record 12 tokens long, so record numbers are the whole position)."""
    data = tmp_path / "d.jsonl"
    old = [{"input_ids": [1 + i % 9] * 12} for i in range(40)]
    write_records(data, old)
    kw = dict(vocab_size=512, batch_size=2, seq_len=16, shuffle_buffer=8, allow_changed=True, warn=lambda m: None)
    saved = make_source("json_file", path=str(data), **kw)
    for _ in range(5):
        saved.next_batch()
    state = saved.state_dict()
    write_records(data, [{"input_ids": [300 + i] * 12} for i in range(3)] + old)
    resumed, fresh = (make_source("json_file", path=str(data), **kw) for _ in range(2))
    resumed.load_state_dict(state)
    for _ in range(5):
        fresh.next_batch()
    for _ in range(6):  # past the end of the file: a second epoch
        a, b = resumed.next_batch(), fresh.next_batch()
        assert all(torch.equal(a[k], b[k]) for k in a)
    write_records(data, old[:4])  # now shorter than the position: the epoch ends there, the next one starts
    short = make_source("json_file", path=str(data), **kw)
    short.load_state_dict(state)
    assert set(torch.cat([short.next_batch()["input_ids"] for _ in range(4)]).unique().tolist()) <= {1, 2, 3, 4}


def test_bad_data_is_reported(tmp_path, capsys):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "fine"}\n\n{"text": "broken"\n')
    with pytest.raises(ValueError, match=rf"{bad}:3: not valid JSON"):
        make_source("json_file", vocab_size=512, batch_size=2, seq_len=16, path=str(bad))
    assert main(["--data.type", "json_file", "--data.path", str(bad), "--checkpoint.dir", str(tmp_path / "r")]) == 1
    assert f"{bad}:3: not valid JSON" in capsys.readouterr().err
    assert not (tmp_path / "r" / "checkpoints").exists()
    (tmp_path / "keys.jsonl").write_text('{"words": "no"}\n')
    with pytest.raises(ValueError, match="keys.jsonl:1: a record needs 'text'"):
        make_source("json_file", vocab_size=512, batch_size=2, seq_len=16, path=str(tmp_path / "keys.jsonl"))
    with pytest.raises(FileNotFoundError, match="no such file"):
        make_source("json_file", vocab_size=512, batch_size=2, seq_len=16, path=str(tmp_path / "missing.jsonl"))
    (tmp_path / "empty.jsonl").write_text("\n\n")
    with pytest.raises(ValueError, match="dataset is empty"):
        make_source("json_file", vocab_size=512, batch_size=2, seq_len=16, path=str(tmp_path / "empty.jsonl"))
    (tmp_path / "ids.jsonl").write_text('{"input_ids": [1, 2, 600]}\n')
    with pytest.raises(ValueError, match="token id 600 outside \\[0, vocab_size=512\\)"):
        make_source("json_file", vocab_size=512, batch_size=2, seq_len=16, path=str(tmp_path / "ids.jsonl"))
    with pytest.raises(ValueError, match="raise --model.vocab_size to at least 259"):
        make_source("text", vocab_size=100, batch_size=2, seq_len=16)
    torch.save([{"input_ids": torch.tensor([[1, 2, 999]])}], tmp_path / "b.pt")
    with pytest.raises(ValueError, match="outside \\[0, vocab_size=512\\)"):
        make_source("preset_pt", vocab_size=512, batch_size=2, seq_len=16, path=str(tmp_path / "b.pt"))


def test_unused_tokenizer_warns(tmp_path, capsys):
    tok = bpe_tokenizer(tmp_path)
    assert main(SYNTHETIC_TINY + ["--model.tokenizer_path", tok, "--train.steps", "1", "--optim.warmup_steps", "1",
                        "--checkpoint.dir", str(tmp_path / "run")]) == 0
    err = capsys.readouterr().err
    assert [line for line in err.splitlines() if "warning" in line] == [
        f"warning: --model.tokenizer_path {tok} is not used: --data.type synthetic does not tokenize text"]
    ids = write_records(tmp_path / "ids.jsonl", [{"input_ids": [1, 2, 3]}, {"input_ids": [4, 5]}])
    text = write_records(tmp_path / "text.jsonl", [{"input_ids": [1, 2, 3]}, {"text": "the cat"}])
    for kind, path, tokenizer, expected in [
            ("synthetic", None, tok, f"--model.tokenizer_path {tok} is not used: --data.type synthetic does not "
                                     f"tokenize text"),
            ("json_file", ids, tok, f"--model.tokenizer_path {tok} is not used: every record holds input_ids "
                                    f"already"),
            ("synthetic", None, None, None), ("json_file", ids, None, None), ("json_file", text, tok, None)]:
        seen = []
        make_source(kind, vocab_size=512, batch_size=1, seq_len=8, path=path, tokenizer_path=tokenizer,
                    warn=seen.append)
        assert seen == ([expected] if expected else []), (kind, path, tokenizer)


def test_packing_positions_and_prompt_masking():
    tok = ByteTokenizer()
    src = make_source("text", vocab_size=512, batch_size=3, seq_len=64)
    b = src.next_batch()
    starts = b["input_ids"] == tok.bos_id
    assert torch.all(b["position_ids"][starts] == 0)  # positions restart at each document
    assert torch.all(b["labels"][starts] == glm5f.IGNORE_INDEX)  # no prediction across documents
    state = src.state_dict()
    nxt = src.next_batch()
    src.load_state_dict(state)
    again = src.next_batch()
    assert all(torch.equal(nxt[k], again[k]) for k in nxt)


def test_json_prompt_response_and_unpacked_rows(tmp_path):
    f = tmp_path / "pr.jsonl"
    f.write_text(json.dumps({"prompt": "ab", "response": "cd"}) + "\n")
    b = make_source("json_file", vocab_size=512, batch_size=1, seq_len=8, path=str(f), pack=False).next_batch()
    tok = ByteTokenizer()
    assert b["input_ids"][0].tolist() == [tok.bos_id, 97, 98, 99, 100, tok.eos_id, tok.pad_id, tok.pad_id]
    assert b["labels"][0].tolist() == [-100, -100, -100, 99, 100, tok.eos_id, -100, -100]
    assert b["attention_mask"][0].tolist() == [1] * 6 + [0] * 2


def test_preset_batches_replay_in_order(tmp_path):
    batches = [{"input_ids": torch.full((2, 5), i), "labels": torch.full((2, 5), -100)} for i in range(3)]
    torch.save(batches, tmp_path / "b.pt")
    src = make_source("preset_pt", vocab_size=16, batch_size=2, seq_len=5, path=str(tmp_path / "b.pt"))
    assert [int(src.next_batch()["input_ids"][0, 0]) for _ in range(4)] == [0, 1, 2, 0]


def test_tokenizer_file(tmp_path):
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(bpe_tokenizer(tmp_path))
    data = tmp_path / "d.jsonl"
    data.write_text(json.dumps({"text": "the cat sat"}) + "\n")
    b = make_source("json_file", vocab_size=64, batch_size=1, seq_len=6, path=str(data), tokenizer_path=str(tmp_path),
                    pack=False).next_batch()
    assert b["input_ids"][0].tolist()[0] == tok.token_to_id("<s>")
    assert tok.decode(b["input_ids"][0].tolist()[1:4]) == "the cat sat"
    assert b["input_ids"][0].tolist()[4] == tok.token_to_id("</s>")


def test_hf_datasets_from_disk(tmp_path):
    import datasets

    datasets.Dataset.from_dict({"text": ["hello world", "a second document"]}).save_to_disk(str(tmp_path / "one"))
    b = make_source("hf_datasets", vocab_size=512, batch_size=2, seq_len=12, path=str(tmp_path / "one"),
                    shuffle_buffer=1).next_batch()
    # packed in the dataset's order: bos "hello world", then its eos, bos and the start of the second document
    assert b["input_ids"].tolist() == [[256, *b"hello world"], [257, 256, *b"a second d"]]
    splits = datasets.DatasetDict({"train": datasets.Dataset.from_dict({"prompt": ["q"], "response": ["a"]}),
                                   "test": datasets.Dataset.from_dict({"prompt": ["x"], "response": ["y"]})})
    splits.save_to_disk(str(tmp_path / "two"))
    with pytest.raises(ValueError, match="choose one with --data.split"):
        make_source("hf_datasets", vocab_size=512, batch_size=1, seq_len=8, path=str(tmp_path / "two"))
    b = make_source("hf_datasets", vocab_size=512, batch_size=1, seq_len=8, path=str(tmp_path / "two"),
                    split="test", pack=False).next_batch()
    assert b["input_ids"][0, :4].tolist() == [256, ord("x"), ord("y"), 257]
    assert b["labels"][0, :4].tolist() == [-100, -100, ord("y"), 257]


def test_labels_outside_vocab_are_an_error_line(tmp_path, capsys):
    data = tmp_path / "lab.jsonl"
    data.write_text(json.dumps({"input_ids": list(range(1, 9)), "labels": [1, 2, 3, 9999, 5, 6, 7, 8]}) + "\n")
    err = run_error(capsys, "--data.type", "json_file", "--data.path", str(data), "--checkpoint.dir",
                    str(tmp_path / "r"))
    assert f"error: {data}: example 0 has label 9999 outside [0, vocab_size=512) (use -100 where no loss" in err
    torch.save([{"input_ids": torch.ones(2, 8, dtype=torch.long), "labels": torch.full((2, 8), 9999)}],
               tmp_path / "lab.pt")
    err = run_error(capsys, "--data.type", "preset_pt", "--data.path", str(tmp_path / "lab.pt"), "--checkpoint.dir",
                    str(tmp_path / "r"))
    assert f"error: {tmp_path / 'lab.pt'}: batch 0 has label 9999 outside [0, vocab_size=512)" in err
    assert not (tmp_path / "r").exists()


def test_broken_tokenizer_json_is_an_error_line(tmp_path, capsys):
    tok = tmp_path / "tokenizer.json"
    tok.write_text('{"model": {"bad"\n')
    err = run_error(capsys, "--model.tokenizer_path", str(tmp_path), "--checkpoint.dir", str(tmp_path / "r"))
    assert f"error: --model.tokenizer_path {tok}: not a readable tokenizer.json (" in err
    assert not (tmp_path / "r").exists()


def test_preset_pt_that_is_not_a_torch_file(tmp_path, capsys):
    import argparse
    (tmp_path / "notes.pt").write_text("hello")
    torch.save([{"input_ids": torch.ones(2, 8, dtype=torch.long), "x": argparse.Namespace()}], tmp_path / "obj.pt")
    for name, why in [("notes.pt", "not a file written by torch.save"),
                      ("obj.pt", "it holds a Python object (argparse.Namespace), not only tensors")]:
        err = run_error(capsys, "--data.type", "preset_pt", "--data.path", str(tmp_path / name), "--checkpoint.dir",
                        str(tmp_path / "r"))
        assert f"error: --data.path {tmp_path / name}: cannot read it as --data.type preset_pt batches: {why}" in err
        assert "weights_only" not in err and "Traceback" not in err
    assert not (tmp_path / "r").exists()


def test_held_out_documents_are_never_in_a_training_batch():
    docs, train_docs, held = embedded_documents(), embedded_documents("train"), embedded_documents("eval")
    assert len(held) == len(docs) // 20 and sorted(train_docs + held) == sorted(docs)
    src = make_source("text", vocab_size=512, batch_size=16, seq_len=128)
    tokens, epoch_tokens = [], sum(len(ex.ids) for ex in src.examples)
    while len(tokens) < epoch_tokens + 16 * 128:  # a whole epoch, packed as training sees it
        tokens += src.next_batch()["input_ids"].flatten().tolist()
    stream = bytes(t for t in tokens if t < 256)
    for text in train_docs[:5]:
        assert text.encode() in stream  # the check can see a document
    for text in held:
        assert text.encode() not in stream and text.encode()[:200] not in stream


def write_lines(path, records) -> str:
    opener = gzip.open if str(path).endswith(".gz") else open
    with opener(path, "wt", encoding="utf-8") as f:
        f.write("".join(json.dumps(r) + "\n" for r in records))
    return str(path)


def naive_rows(records, batch_size, seq_len, pack, n_batches):
    """The batches a packer must produce from `records` read in file order, epoch after epoch, written directly
    from the format: bos + text + eos (prompt tokens labelled IGNORE_INDEX), the first label of every document
    ignored, positions counting from 0 in each document."""
    tok = ByteTokenizer()
    docs = []
    for r in records:
        if "input_ids" in r:
            ids, labels = list(r["input_ids"]), list(r.get("labels", r["input_ids"]))
        elif "prompt" in r:
            head = [tok.bos_id, *r["prompt"].encode()]
            tail = [*r["response"].encode(), tok.eos_id]
            ids, labels = head + tail, [IGNORE_INDEX] * len(head) + tail
        else:
            ids = [tok.bos_id, *r["text"].encode(), tok.eos_id]
            labels = list(ids)
        if any(t != IGNORE_INDEX for t in labels[1:]):  # a document with nothing to learn is skipped
            docs.append((ids, [IGNORE_INDEX] + labels[1:], list(range(len(ids)))))
    rows, need = [], batch_size * n_batches
    if pack:
        stream = ([], [], [])
        while len(stream[0]) < need * seq_len:
            for d in docs:
                for s, part in zip(stream, d):
                    s.extend(part)
        rows = [tuple(s[i * seq_len:(i + 1) * seq_len] for s in stream) + ([1] * seq_len,) for i in range(need)]
    else:
        while len(rows) < need:
            for ids, labels, pos in docs:
                n, pad = min(len(ids), seq_len), seq_len - min(len(ids), seq_len)
                rows.append((ids[:n] + [tok.pad_id] * pad, labels[:n] + [IGNORE_INDEX] * pad,
                             pos[:n] + list(range(n, seq_len)), [1] * n + [0] * pad))
    keys = ["input_ids", "labels", "position_ids", "attention_mask"]
    return [{k: torch.tensor([r[j] for r in rows[b * batch_size:(b + 1) * batch_size]]) for j, k in enumerate(keys)
             if pack is False or k != "attention_mask"} for b in range(n_batches)]


records_st = st.lists(st.one_of(
    st.builds(lambda t: {"text": t}, st.text(st.characters(codec="utf-8"), max_size=12)),
    st.builds(lambda p, r: {"prompt": p, "response": r}, st.text(max_size=6), st.text(min_size=1, max_size=6)),
    st.builds(lambda ids: {"input_ids": ids}, st.lists(st.integers(0, 258), max_size=9)),
    st.builds(lambda ids: {"input_ids": ids, "labels": [IGNORE_INDEX] * (len(ids) // 2) + ids[len(ids) // 2:]},
              st.lists(st.integers(0, 258), min_size=1, max_size=9))), min_size=1, max_size=8).filter(
    lambda rs: any("input_ids" not in r or any(t != IGNORE_INDEX for t in r.get("labels", r["input_ids"])[1:])
                   for r in rs))


@settings(max_examples=40, deadline=None)
@given(records=records_st, batch_size=st.integers(1, 3), seq_len=st.integers(2, 11), pack=st.booleans(),
       gz=st.booleans())
def test_unshuffled_stream_is_the_naive_packing(tmp_path_factory, records, batch_size, seq_len, pack, gz):
    path = write_lines(tmp_path_factory.mktemp("d") / ("d.jsonl.gz" if gz else "d.jsonl"), records)
    src = make_source("json_file", vocab_size=259, batch_size=batch_size, seq_len=seq_len, path=path, pack=pack,
                      shuffle_buffer=1)
    for got, want in zip([src.next_batch() for _ in range(4)], naive_rows(records, batch_size, seq_len, pack, 4)):
        assert got.keys() == want.keys()
        for k in want:
            assert got[k].tolist() == want[k].tolist(), k


def drawn_records(n_records, buffer, epochs, seed=0, tmp_path=None):
    """The record indices a json_file source packs, in order (each record, two tokens, one unpacked row)."""
    path = write_lines(tmp_path / f"n{n_records}.jsonl", [{"input_ids": [i, i]} for i in range(n_records)])
    src = make_source("json_file", vocab_size=259, batch_size=1, seq_len=2, path=path, pack=False,
                      shuffle_buffer=buffer, seed=seed)
    return [int(src.next_batch()["input_ids"][0, 0]) for _ in range(n_records * epochs)]


@pytest.mark.parametrize("n_records,buffer", [(1, 1), (7, 1), (10, 3), (25, 8), (12, 12), (5, 100)])
def test_buffered_shuffle_is_a_permutation_per_epoch(tmp_path, n_records, buffer):
    order = drawn_records(n_records, buffer, epochs=3, tmp_path=tmp_path)
    epochs = [order[e * n_records:(e + 1) * n_records] for e in range(3)]
    for e in epochs:
        assert sorted(e) == list(range(n_records))
        # a record enters the buffer only once the buffer has room, so draw t is one of the first t + buffer
        assert all(r < t + buffer for t, r in enumerate(e))
    if buffer == 1:
        assert epochs[0] == list(range(n_records))
    elif n_records > 5:
        assert epochs[0] != list(range(n_records)) and epochs[0] != epochs[1]  # it does shuffle, differently
        assert drawn_records(n_records, buffer, 1, seed=1, tmp_path=tmp_path) != epochs[0]


@pytest.mark.parametrize("name,pack", [("d.jsonl", True), ("d.jsonl.gz", False)])
def test_source_state_resumes_mid_stream(tmp_path, name, pack):
    g = torch.Generator().manual_seed(0)
    records = [{"text": "x" * int(torch.randint(1, 30, (1,), generator=g))} for _ in range(40)]
    path = write_lines(tmp_path / name, records)
    kw = dict(vocab_size=259, batch_size=3, seq_len=16, path=path, pack=pack, shuffle_buffer=5, seed=3)
    straight = make_source("json_file", **kw)
    batches = [straight.next_batch() for _ in range(30)]  # over two epochs
    for stop in (1, 7, 13):
        first = make_source("json_file", **kw)
        for _ in range(stop):
            first.next_batch()
        state = first.state_dict()
        assert state["buffer"].shape[1] == 3 and len(state["buffer"]) <= 5  # locations, not the records
        resumed = make_source("json_file", **kw)
        resumed.load_state_dict(state)
        for want in batches[stop:stop + 12]:
            got = resumed.next_batch()
            assert all(torch.equal(got[k], want[k]) for k in want)


def test_hf_datasets_stream_and_resume(tmp_path):
    import datasets

    texts = [f"document {i} " * (i % 4 + 1) for i in range(20)]
    datasets.Dataset.from_dict({"text": texts}).save_to_disk(str(tmp_path / "ds"))
    kw = dict(vocab_size=259, batch_size=2, seq_len=24, path=str(tmp_path / "ds"))
    unshuffled = make_source("hf_datasets", shuffle_buffer=1, pack=False, **kw)
    rows = [unshuffled.next_batch()["input_ids"][0].tolist() for _ in range(2)]
    assert bytes(t for t in rows[0] if t < 256).decode() == texts[0][:22]
    straight = make_source("hf_datasets", shuffle_buffer=4, **kw)
    batches = [straight.next_batch() for _ in range(12)]
    part = make_source("hf_datasets", shuffle_buffer=4, **kw)
    for _ in range(5):
        part.next_batch()
    resumed = make_source("hf_datasets", shuffle_buffer=4, **kw)
    resumed.load_state_dict(part.state_dict())
    for want in batches[5:]:
        got = resumed.next_batch()
        assert all(torch.equal(got[k], want[k]) for k in want)


def test_resume_from_the_middle_of_a_stream_is_bitwise(tmp_path):
    g = torch.Generator().manual_seed(1)
    path = write_lines(tmp_path / "d.jsonl", [
        {"text": " ".join(str(int(x)) for x in torch.randint(0, 50, (int(torch.randint(3, 25, (1,), generator=g)),),
                                                              generator=g))} for _ in range(60)])
    args = STREAM_TINY + ["--data.path", path, "--data.shuffle_buffer", "7", "--train.steps", "6"]
    straight = train(Config_of(*args, "--checkpoint.every", "3", "--checkpoint.dir", str(tmp_path / "straight")))
    middle = tmp_path / "straight" / "checkpoints" / "step_00000003"
    data_state = torch.load(middle / "extra.pt", weights_only=True)["data"]
    assert 7 < data_state["next"][2] < 60 and data_state["offset"] > 0  # inside the file and inside a record
    train(Config_of(*args, "--checkpoint.dir", str(tmp_path / "resumed"), "--checkpoint.resume", str(middle)))
    resumed = read_metrics(tmp_path / "resumed")
    assert [r["step"] for r in resumed] == [4, 5, 6]
    assert [r["loss"] for r in resumed] == [r["loss"] for r in straight[3:]]
    assert [r["grad_norm"] for r in resumed] == [r["grad_norm"] for r in straight[3:]]


def Config_of(*args):
    import tyro

    from configs import Config
    return tyro.cli(Config, args=list(args), use_underscores=True)


def test_a_bad_record_deep_in_the_stream_is_an_error_line(tmp_path, capsys):
    bad = tmp_path / "bad.jsonl"
    bad.write_text("".join(json.dumps({"text": f"r{i}"}) + "\n" for i in range(30)) + '{"text": 1\n')
    make_source("json_file", vocab_size=259, batch_size=2, seq_len=16, path=str(bad), shuffle_buffer=4)  # not yet
    assert main(STREAM_TINY + ["--data.path", str(bad), "--data.shuffle_buffer", "4", "--train.steps", "40",
                        "--checkpoint.dir", str(tmp_path / "r")]) == 1
    assert f"error: {bad}:31: not valid JSON" in capsys.readouterr().err
    assert main(STREAM_TINY + ["--data.path", str(bad), "--data.shuffle_buffer", "0", "--checkpoint.dir",
                        str(tmp_path / "z")]) == 1
    assert "--data.shuffle_buffer must be >= 1" in capsys.readouterr().err


RSS_CHILD = textwrap.dedent("""
    import sys
    from configs import Config
    import tyro
    from train import train
    def run(path, run_dir):
        train(tyro.cli(Config, use_underscores=True, args=[
            "--model.preset", "glm5-tiny", "--data.type", "json_file", "--data.path", path, "--data.batch_size", "2",
            "--data.seq_len", "32", "--train.steps", "3", "--optim.warmup_steps", "0", "--eval.every", "0",
            "--checkpoint.every", "0", "--checkpoint.dir", run_dir]))
        # VmHWM, not ru_maxrss: Linux carries ru_maxrss across execve (this process starts from pytest's size)
        with open("/proc/self/status") as f:
            return next(int(l.split()[1]) * 1024 for l in f if l.startswith("VmHWM:"))
    run(sys.argv[1], sys.argv[3] + "/warm")  # what a second run in one process adds is not the data's
    base = run(sys.argv[1], sys.argv[3] + "/tiny")
    big = run(sys.argv[2], sys.argv[3] + "/big")
    print("RSS_GROWTH", big - base)
""")


def rss_growth(tmp_path, megabytes: int) -> int:
    """Peak-RSS growth (bytes) of a few train steps on a `megabytes` JSONL file over the same run on a tiny one
    (all in one fresh process: the tiny run twice, then the big one)."""
    line = "".join(json.dumps({"text": f"document {i}: " + "lorem ipsum dolor sit amet " * 6}) + "\n"
                   for i in range(4000))
    chunk = line.encode() * max(1, (1 << 24) // len(line))  # ~16 MB
    with open(tmp_path / "big.jsonl", "wb") as f:
        for _ in range(max(1, (megabytes << 20) // len(chunk))):
            f.write(chunk)
    (tmp_path / "tiny.jsonl").write_text(line[:2000].rsplit("\n", 1)[0] + "\n")
    out = subprocess.run([sys.executable, "-c", RSS_CHILD, str(tmp_path / "tiny.jsonl"), str(tmp_path / "big.jsonl"),
                          str(tmp_path)], cwd=ROOT, capture_output=True, text=True, timeout=1800,
                         env={**os.environ, "PYTHONPATH": ROOT, "OMP_NUM_THREADS": "1"})
    assert out.returncode == 0, out.stderr[-3000:]
    size = os.path.getsize(tmp_path / "big.jsonl")
    growth = int(out.stdout.split("RSS_GROWTH")[-1])
    print(f"{size / 2**20:.0f} MB of JSONL: peak RSS growth {growth / 2**20:.1f} MB")
    return growth


def test_memory_does_not_grow_with_the_corpus(tmp_path):
    assert rss_growth(tmp_path, 48) < 15 << 20  # 300 MB per GB; reading the corpus whole takes >50x that


@pytest.mark.slow
def test_memory_does_not_grow_with_a_1gb_corpus(tmp_path):
    assert rss_growth(tmp_path, 1024) < 300 << 20


def test_records_with_an_empty_text_are_counted_in_one_warning(tmp_path):
    data = write_records(tmp_path / "d.jsonl", [{"text": "some words"}, {"text": ""}, {"text": " "},
                                                {"prompt": "q", "response": ""}])
    said = []
    make_source("json_file", vocab_size=512, batch_size=2, seq_len=16, path=data, warn=said.append)
    assert said == [f"2 of 4 records have an empty text (the first at {data}:2); each trains only on its "
                    f"end-of-sequence token",
                    f"1 of 4 records have an empty response (the first at {data}:4); each trains only on its "
                    f"end-of-sequence token"]


def test_a_plain_record_in_a_chat_file_is_an_error_at_its_line(tmp_path):
    from glm5f.data import make_source

    path = tmp_path / "chat.jsonl"
    path.write_text(json.dumps({"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}]})
                    + "\n" + json.dumps({"text": "a plain document"}) + "\n")
    with pytest.raises(ValueError, match=f"{path}:2: --data.type chat reads chat records"):
        make_source("chat", path=str(path), vocab_size=512, batch_size=1, seq_len=64)
    make_source("json_file", path=str(path), vocab_size=512, batch_size=1, seq_len=64)  # mixed on purpose: read
