"""glm5f/data/files.py: every data type that reads records reads the same rows from parquet as from JSON lines, and a
folder as the concatenation of its files; verl's RL rows and TRL's conversational preference rows; refusals."""

import json
import sys

import pytest
import torch

import glm5f
from glm5f.data import chat
from glm5f.data.files import FolderReader
from glm5f.data.pairs import PairSource, read_pairs
from glm5f.data.rollouts import file_group_size, read_groups, rollout_batch
from glm5f.data.sources import make_source
from glm5f.data.tokens import make_tokenizer
from glm5f.posttrain import sampler
from glm5f.posttrain.grpo import RLConfig
from train import main

pa = pytest.importorskip("pyarrow")
pq = pytest.importorskip("pyarrow.parquet")

TOK = make_tokenizer(None)
FMT = chat.ChatFormat.load(None)
TINY = ["--model.preset", "glm5-tiny", "--train.steps", "1", "--data.batch_size", "2", "--data.seq_len", "32"]


def write_jsonl(path, recs) -> str:
    path.write_text("".join(json.dumps(r) + "\n" for r in recs))
    return str(path)


def write_parquet(path, recs, row_group_size=2) -> str:
    """The records as parquet written by pyarrow: one column per field any record has (null where a record lacks
    it), small row groups so reading crosses their boundaries."""
    pq.write_table(pa.Table.from_struct_array(pa.array(recs)), path, row_group_size=row_group_size)
    return str(path)


def folder(tmp_path, name, recs, write, suffix, cut):
    """`recs` split at `cut` into two files of a folder, named so that sorting puts the first part first."""
    d = tmp_path / name
    d.mkdir()
    write(d / f"part-10{suffix}", recs[cut:])
    write(d / f"part-02{suffix}", recs[:cut])
    (d / "README.md").write_text("not data")
    return str(d)


def batches(src, n=4) -> list[dict]:
    return [src.next_batch() for _ in range(n)]


def assert_same_batches(a: list[dict], b: list[dict]):
    assert len(a) == len(b)
    for x, y in zip(a, b):
        assert x.keys() == y.keys()
        for k in x:
            torch.testing.assert_close(x[k], y[k], rtol=0, atol=0, equal_nan=True)


SFT = [{"text": "some words to learn"}, {"prompt": "2+2=", "response": "4"}, {"input_ids": [1, 5, 9, 2]},
       {"text": "another document"}, {"input_ids": [3, 4, 5], "labels": [-100, 4, 5]},
       {"prompt": "capital of France?", "response": "Paris"}, {"text": "the end"}]
CHATS = [{"messages": [{"role": "user", "content": f"question {i}"}, {"role": "assistant", "content": f"answer {i}"}]}
         for i in range(5)]
CHATS += [{"messages": [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"},
                        {"role": "assistant", "content": "yo"}]}]


@pytest.mark.parametrize("kind,recs", [("json_file", SFT), ("chat", CHATS)])
def test_a_stream_reads_parquet_and_folders_as_the_same_rows_as_json_lines(tmp_path, kind, recs):
    common = dict(vocab_size=512, batch_size=2, seq_len=24, seed=3, shuffle_buffer=3)
    want = batches(make_source(kind, path=write_jsonl(tmp_path / "all.jsonl", recs), **common))
    paths = [write_parquet(tmp_path / "all.parquet", recs),
             folder(tmp_path, "pq", recs, write_parquet, ".parquet", 4),
             folder(tmp_path, "js", recs, write_jsonl, ".jsonl", 2)]
    for path in paths:
        assert_same_batches(batches(make_source(kind, path=path, **common)), want)
    # a resume in the middle of a folder (the shuffle buffer holding records of both files) goes on as before
    src = make_source(kind, path=paths[1], **common)
    batches(src, 2)
    again = make_source(kind, path=paths[1], **common)
    again.load_state_dict(src.state_dict())
    assert_same_batches(batches(again, 3), want[2:] + batches(make_source(kind, path=paths[0], **common), 5)[4:])


@pytest.mark.parametrize("write,suffix", [(write_parquet, ".parquet"), (write_jsonl, ".jsonl")])
def test_a_changed_folder_relocates_records_by_their_index(tmp_path, write, suffix):
    """--data.allow_changed: a position taken before a record was added to the folder's first file points at the
    records with the same indices in the folder as it is now."""
    d = folder(tmp_path, "d", SFT, write, suffix, 3)
    reader = FolderReader(d)
    locs = [got[0] for got in iter(reader.read, None)]
    assert [reader.parse(loc, p) for loc, p in zip(locs, reader.payloads(locs))] == SFT
    now = [{"text": "new first record"}] + SFT
    write(tmp_path / "d" / f"part-02{suffix}", now[:4])
    moved, end = FolderReader(d).relocate(locs + [reader.next_loc])  # the next record's index: the added one's
    assert [reader.parse(loc, p) for loc, p in zip(moved, reader.payloads(moved))] == now
    fresh = FolderReader(d)
    fresh.seek(moved[-2])
    assert fresh.read()[0] == moved[-2] and fresh.parse(*fresh.read()) == now[-1] and fresh.read() is None
    fresh.seek(end)
    assert fresh.read() is None


PAIRS = [{"prompt": "2+2=", "chosen": "4", "rejected": "5"},
         {"messages": [{"role": "user", "content": "hi"}], "chosen": "hello", "rejected": "go away"},
         {"prompt": "sky?", "chosen": "blue", "rejected": "green"}]
GROUPS = [{"prompt": "hi", "completions": [{"text": "a", "reward": 1.0}, {"ids": [7, 8], "reward": 0.0,
                                                                          "logprobs": [-0.5, -1.0]}]},
          {"prompt_ids": [1, 2, 3], "completions": [{"ids": [4], "reward": 0.5, "loss_mask": [1]},
                                                    {"text": "b", "reward": 2.0, "finish_reason": "length"}]},
          {"messages": [{"role": "user", "content": "q"}], "completions": [{"text": "x", "reward": 0.0},
                                                                           {"text": "yy", "reward": 1.0}]}]
PROMPTS = [{"prompt": "hi", "answer": 3}, {"prompt_ids": [256, 104, 105], "tags": ["x"]},
           {"messages": [{"role": "user", "content": "hi"}], "level": "easy"}]


def test_preference_rollouts_and_prompts_read_parquet_and_folders_as_json_lines(tmp_path):
    readers = [(PAIRS, lambda p: [(x.chosen, x.rejected) for x in read_pairs(p, TOK, FMT)]),
               (GROUPS, lambda p: rollout_batch(read_groups(p, TOK, FMT), 16, 0)),
               (PROMPTS, lambda p: [(x.ids, x.text, x.stops, x.fields) for x in sampler.read_prompts(p, TOK, FMT)])]
    for i, (recs, read) in enumerate(readers):
        want = read(write_jsonl(tmp_path / f"{i}.jsonl", recs))
        for path in (write_parquet(tmp_path / f"{i}.parquet", recs),
                     folder(tmp_path, f"pq{i}", recs, write_parquet, ".parquet", 1),
                     folder(tmp_path, f"js{i}", recs, write_jsonl, ".jsonl", 2)):
            got = read(path)
            if isinstance(want, dict):
                assert_same_batches([got], [want])
                assert file_group_size(path) == 2  # the plan's rows per group, from the first record
            else:
                assert got == want


def test_a_parquet_record_is_named_by_its_file_and_row(tmp_path):
    path = write_parquet(tmp_path / "p.parquet", [PAIRS[0], PAIRS[2], {"prompt": "a", "chosen": "b"}])
    with pytest.raises(ValueError, match=rf"^{path}:row 2: a preference record needs 'prompt'"):
        read_pairs(path, TOK)
    d = folder(tmp_path, "sft", [{"text": "a"}, {"text": "b"}, {"prompt": "no response"}], write_parquet,
               ".parquet", 1)
    with pytest.raises(ValueError, match=rf"^{d}/part-10.parquet:row 1: a record needs 'text'"):
        make_source("json_file", path=d, vocab_size=512, batch_size=2, seq_len=16)


def write_mixed(tmp_path):
    d = tmp_path / "mixed"
    d.mkdir()
    write_jsonl(d / "a.jsonl", SFT[:2])
    write_parquet(d / "b.parquet", SFT[2:])
    return str(d)


def test_a_folder_mixing_kinds_or_without_data_is_refused_in_one_line(tmp_path, capsys):
    d = write_mixed(tmp_path)
    message = (f"--data.path {d}: the folder mixes JSON-lines files (a.jsonl) and parquet files (b.parquet), and "
               f"reads as one stream of one kind; move one kind to another folder")
    for read in (lambda: read_pairs(d, TOK), lambda: make_source("json_file", path=d, vocab_size=512, batch_size=2,
                                                                    seq_len=16)):
        with pytest.raises(ValueError) as e:
            read()
        assert str(e.value) == message
    assert main(TINY + ["--data.path", d, "--checkpoint.dir", str(tmp_path / "run")]) == 1
    assert capsys.readouterr().err == f"error: {message}\n" and not (tmp_path / "run").exists()
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match="the folder holds no data file"):
        read_groups(str(tmp_path / "empty"), TOK)


def test_parquet_without_pyarrow_says_which_extra_to_install(tmp_path, monkeypatch, capsys):
    path = write_parquet(tmp_path / "d.parquet", SFT)
    monkeypatch.setitem(sys.modules, "pyarrow", None)  # `import pyarrow.parquet` then raises ImportError
    monkeypatch.setitem(sys.modules, "pyarrow.parquet", None)
    with pytest.raises(ImportError, match=r"pip install 'glm5f\[parquet\]'"):
        read_pairs(path, TOK)
    assert main(TINY + ["--data.path", path, "--checkpoint.dir", str(tmp_path / "run")]) == 1
    err = capsys.readouterr().err
    assert err.startswith(f"error: --data.path {path} is parquet") and "glm5f[parquet]" in err
    assert err.count("\n") == 1


def verl_rows():
    """Rows shaped as verl's gsm8k preprocessing writes them."""
    return [{"data_source": "openai/gsm8k", "prompt": [{"role": "user", "content": f"What is {a} + {b}? Let's think."}],
             "ability": "math", "reward_model": {"style": "rule", "ground_truth": str(a + b)},
             "extra_info": {"split": "train", "index": i, "answer": f"{a} + {b} = {a + b} #### {a + b}",
                            "question": f"What is {a} + {b}?"}} for i, (a, b) in enumerate([(3, 4), (40, 32)])]


def test_verl_rl_rows_give_the_reward_the_prompt_tokens_and_the_ground_truth(tmp_path):
    rows = verl_rows()
    prompts = sampler.read_prompts(write_parquet(tmp_path / "train.parquet", rows), TOK, FMT)
    seen = []

    def reward(**kwargs):
        seen.append(kwargs)
        return 0.0

    cfg = glm5f.preset("glm5-tiny")
    params = glm5f.init_params(cfg, 0, torch.float32)
    sampler.sample_groups(params, cfg, prompts, RLConfig(group_size=2, max_new_tokens=2), reward, TOK, TOK.pad_id,
                          torch.Generator().manual_seed(0))
    assert len(seen) == 4
    for k, s in enumerate(seen):
        row = rows[k // 2]
        assert s["prompt_ids"] == FMT.ids(row["prompt"], add_generation_prompt=True)
        assert s["prompt"] == FMT.render(row["prompt"], add_generation_prompt=True)[0]
        assert s["ground_truth"] == row["reward_model"]["ground_truth"] == ["7", "72"][k // 2]
        assert {f: s[f] for f in ("data_source", "extra_info", "reward_model", "ability")} == \
            {f: row[f] for f in ("data_source", "extra_info", "reward_model", "ability")}
        assert s["messages"] == row["prompt"]  # a chat record's messages reach the reward (glm5f's form)


USER = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "2+2?"}]
GOOD, BAD = [{"role": "assistant", "content": "4"}], [{"role": "assistant", "content": "5, I think"}]


def test_trl_conversational_and_implicit_prompt_rows_give_the_explicit_records_pairs(tmp_path):
    turn = [{"role": "assistant", "content": "hi"}, {"role": "user", "content": "and 3+3?"}]
    explicit = [{"messages": USER, "chosen": GOOD, "rejected": BAD},
                {"messages": USER + turn, "chosen": BAD, "rejected": GOOD}]
    conversational = [{"prompt": r["messages"], "chosen": r["chosen"], "rejected": r["rejected"]} for r in explicit]
    implicit = [{"chosen": r["messages"] + r["chosen"], "rejected": r["messages"] + r["rejected"]} for r in explicit]
    want = [(p.chosen, p.rejected) for p in read_pairs(write_jsonl(tmp_path / "e.jsonl", explicit), TOK, FMT)]
    for name, recs in (("c", conversational), ("i", implicit)):
        got = read_pairs(write_parquet(tmp_path / f"{name}.parquet", recs), TOK, FMT)
        assert [(p.chosen, p.rejected) for p in got] == want
    for r, (chosen, rejected) in zip(explicit, want):  # the prompt rendered with a generation prompt, then the answer
        prompt = FMT.ids(r["messages"], add_generation_prompt=True)
        for ex, answer in ((chosen, r["chosen"]), (rejected, r["rejected"])):
            assert ex == FMT.example(r["messages"] + answer, train_on="last")
            assert ex.ids[:len(prompt)] == prompt and set(ex.labels[:len(prompt)]) == {-100}


def test_trl_standard_implicit_prompt_rows_split_at_the_last_shared_space(tmp_path):
    """{"chosen": "The sky is blue.", "rejected": "The sky is green."} reads as prompt "The sky is" and answers
    " blue." / " green." (TRL's dataset-format example), the same pair as the explicit record."""
    implicit = [{"chosen": "The sky is blue.", "rejected": "The sky is green."},
                {"chosen": "2 + 2 = 4", "rejected": "2 + 2 = 5"}]
    explicit = [{"prompt": "The sky is", "chosen": " blue.", "rejected": " green."},
                {"prompt": "2 + 2 =", "chosen": " 4", "rejected": " 5"}]
    got = read_pairs(write_jsonl(tmp_path / "i.jsonl", implicit), TOK, FMT)
    want = read_pairs(write_jsonl(tmp_path / "e.jsonl", explicit), TOK, FMT)
    assert [(p.chosen, p.rejected) for p in got] == [(p.chosen, p.rejected) for p in want]


@pytest.mark.parametrize("rec,message", [
    ({"chosen": GOOD, "rejected": BAD}, "these share no leading message"),
    ({"chosen": "blue sky", "rejected": "green sky"}, "whose common beginning (up to a space) is the prompt"),
    ({"chosen": USER + GOOD, "rejected": USER}, "leave no answer after the messages they share"),
    ({"prompt": USER, "messages": USER, "chosen": GOOD, "rejected": BAD}, "gives its prompt twice ('prompt' and "
                                                                         "'messages')"),
    ({"prompt": "a", "chosen": "b", "rejected": "c", "chosen_ids": [1]}, "mixes token ids ('chosen_ids') with text"),
    ({"prompt": "a", "chosen": "b", "rejected": "c", "labels": [1]}, "field(s) 'labels' a preference record does"),
])
def test_bad_conversational_preference_rows_are_refused_at_their_line(tmp_path, rec, message):
    path = write_jsonl(tmp_path / "p.jsonl", [PAIRS[0], rec])
    with pytest.raises(ValueError) as e:
        read_pairs(path, TOK, FMT)
    assert str(e.value).startswith(f"{path}:2: ") and message in str(e.value)


def test_a_ground_truth_given_twice_differently_is_refused(tmp_path):
    row = {**verl_rows()[0], "ground_truth": "8"}
    path = write_jsonl(tmp_path / "p.jsonl", [row])
    with pytest.raises(ValueError, match=rf"^{path}:1: 'ground_truth' \"8\" and 'reward_model.ground_truth' \"7\" "
                                         rf"differ; keep one"):
        sampler.read_prompts(path, TOK, FMT)


def test_a_preference_token_id_outside_the_vocabulary_is_named_at_its_line(tmp_path):
    recs = [{"prompt_ids": [1, 2], "chosen_ids": [3], "rejected_ids": [4]},
            {"prompt_ids": [1, 2], "chosen_ids": [3], "rejected_ids": [5, 600]},
            {"prompt_ids": [700], "chosen_ids": [3], "rejected_ids": [4]}]
    for i, message in ((2, "the rejected answer has token id 600 (position 3 of the rejected sequence) outside "
                           "[0, vocab_size=512)"), (3, "the prompt has token id 700 (position 0 of the chosen")):
        path = write_parquet(tmp_path / f"{i}.parquet", [recs[0], recs[i - 1]])
        with pytest.raises(ValueError) as e:
            PairSource(read_pairs(path, TOK), 1, 16, 512, 0, 0)
        assert str(e.value).startswith(f"{path}:row 1: {message}")
