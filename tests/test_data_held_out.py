"""--eval.split_fraction: every N-th record of --data.path held out for evaluation and never trained on, for JSONL
files, chat records and saved datasets (the same records whichever reader)."""

import json

import pytest

from conftest import RUN_64
from train import main


def test_eval_split_fraction_holds_out_every_nth_record_and_training_never_reads_it(tmp_path, capsys):
    from glm5f.data import make_eval_source, make_source

    path = tmp_path / "ids.jsonl"
    path.write_text("".join(json.dumps({"input_ids": [r] * 4}) + "\n" for r in range(1, 11)))
    common = dict(path=str(path), vocab_size=512, batch_size=1, seq_len=4, pack=False, shuffle_buffer=1,
                  held_out=0.2)
    train = make_source("json_file", **common)
    held = make_eval_source("json_file", train_path=common.pop("path"), **common)
    seen = lambda source, n: {int(source.next_batch()["input_ids"][0, 0]) for _ in range(n)}  # noqa: E731
    assert seen(train, 16) == {1, 2, 3, 4, 6, 7, 8, 9} and seen(held, 4) == {5, 10}
    chat = tmp_path / "chat.jsonl"
    chat.write_text("".join(json.dumps({"messages": [{"role": "user", "content": f"q{i}"},
                                                     {"role": "assistant", "content": f"answer {i}"}]}) + "\n"
                            for i in range(20)))
    assert main(["--model.preset", "glm5-tiny", "--data.type", "chat", "--data.path", str(chat), *RUN_64,
                 "--eval.split_fraction", "0.1", "--checkpoint.dir", str(tmp_path / "run")]) == 0
    assert "eval_loss" in json.loads((tmp_path / "run" / "metrics.jsonl").read_text().splitlines()[-1])


def test_eval_split_fraction_on_a_saved_dataset_holds_out_the_records_a_jsonl_file_would(tmp_path):
    """--eval.split_fraction on hf_datasets data (a datasets.save_to_disk directory, one of several splits chosen
    by --data.split): every N-th row of the training split is held out and never trained on, and the run's losses
    and eval_loss are those of the same records as a JSONL file."""
    datasets = pytest.importorskip("datasets")
    from glm5f.data import make_eval_source, make_source

    ids = datasets.DatasetDict({"train": datasets.Dataset.from_list([{"input_ids": [r] * 4} for r in range(1, 11)]),
                                "test": datasets.Dataset.from_list([{"input_ids": [99] * 4}])})
    ids.save_to_disk(str(tmp_path / "ids"))
    common = dict(vocab_size=512, batch_size=1, seq_len=4, pack=False, shuffle_buffer=1, held_out=0.2)
    train = make_source("hf_datasets", path=str(tmp_path / "ids"), split="train", **common)
    held = make_eval_source("hf_datasets", train_path=str(tmp_path / "ids"), train_split="train", **common)
    seen = lambda source, n: {int(source.next_batch()["input_ids"][0, 0]) for _ in range(n)}  # noqa: E731
    assert seen(train, 16) == {1, 2, 3, 4, 6, 7, 8, 9} and seen(held, 4) == {5, 10}
    records = [{"text": f"record {i}: " + "the quick brown fox " * (1 + i % 3)} for i in range(30)]
    datasets.DatasetDict({"train": datasets.Dataset.from_list(records), "test": datasets.Dataset.from_list(
        records[:3])}).save_to_disk(str(tmp_path / "text"))
    (tmp_path / "text.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    flags = ["--model.preset", "glm5-tiny", *RUN_64[:4], "--train.steps", "2", "--eval.split_fraction", "0.1"]
    assert main(flags + ["--data.path", str(tmp_path / "text"), "--data.split", "train",
                         "--checkpoint.dir", str(tmp_path / "hf")]) == 0
    assert main(flags + ["--data.path", str(tmp_path / "text.jsonl"), "--checkpoint.dir", str(tmp_path / "jsonl")]) == 0
    metrics = {name: [json.loads(line) for line in (tmp_path / name / "metrics.jsonl").read_text().splitlines()]
               for name in ("hf", "jsonl")}
    assert [(r["loss"], r.get("eval_loss")) for r in metrics["hf"]] == \
        [(r["loss"], r.get("eval_loss")) for r in metrics["jsonl"]] and "eval_loss" in metrics["hf"][-1]
