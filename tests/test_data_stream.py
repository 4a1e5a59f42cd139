"""Streamed json_file / hf_datasets data: the packed token stream against a naive packer, the shuffle buffer as a
permutation, bitwise resume from the middle of a stream, and memory that does not grow with the corpus."""

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

from glm5f.data import IGNORE_INDEX, ByteTokenizer, make_source
from glm5f.metrics import read_metrics
from train import main, train

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TINY = ["--model.preset", "glm5-tiny", "--data.type", "json_file", "--data.batch_size", "2", "--data.seq_len", "32",
        "--optim.warmup_steps", "0", "--eval.every", "0"]


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
    args = TINY + ["--data.path", path, "--data.shuffle_buffer", "7", "--train.steps", "6"]
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
    assert main(TINY + ["--data.path", str(bad), "--data.shuffle_buffer", "4", "--train.steps", "40",
                        "--checkpoint.dir", str(tmp_path / "r")]) == 1
    assert f"error: {bad}:31: not valid JSON" in capsys.readouterr().err
    assert main(TINY + ["--data.path", str(bad), "--data.shuffle_buffer", "0", "--checkpoint.dir",
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
