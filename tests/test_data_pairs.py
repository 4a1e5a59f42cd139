"""glm5f/data/pairs.py: preference records of each kind become two sequences with labels on their answers only, one pair
per row; bad records are named by file:line; the position survives a state_dict round trip."""

import json

import pytest
import torch

from glm5f.data.chat import ChatFormat
from glm5f.data.pairs import CHOSEN, REJECTED, PairSource, pair_of, read_pairs
from glm5f.data.tokens import IGNORE_INDEX, make_tokenizer


def write(path, records):
    path.write_text("\n".join(json.dumps(r) for r in records) + "\n")
    return str(path)


def test_text_records_score_the_answers_and_eos():
    tok = make_tokenizer(None)
    p = pair_of({"prompt": "2+2=", "chosen": "4", "rejected": "5"}, "f:1", tok)
    head = [tok.bos_id] + tok.encode("2+2=")
    assert p.chosen.ids == head + tok.encode("4") + [tok.eos_id]
    assert p.rejected.ids == head + tok.encode("5") + [tok.eos_id]
    assert p.chosen.labels == [IGNORE_INDEX] * len(head) + tok.encode("4") + [tok.eos_id]


def test_token_records_score_the_answer_ids_as_given():
    p = pair_of({"prompt_ids": [5, 6], "chosen_ids": [7], "rejected_ids": [8, 9]}, "f:1", None)
    assert (p.chosen.ids, p.chosen.labels) == ([5, 6, 7], [IGNORE_INDEX, IGNORE_INDEX, 7])
    assert (p.rejected.ids, p.rejected.labels) == ([5, 6, 8, 9], [IGNORE_INDEX, IGNORE_INDEX, 8, 9])


def test_chat_records_score_only_the_last_answer_and_its_stop_token():
    fmt = ChatFormat.load(None)
    messages = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"},
                {"role": "user", "content": "2+2?"}]
    p = pair_of({"messages": messages, "chosen": "4", "rejected": [{"role": "assistant", "content": "5"}]},
                "f:1", fmt.tok, fmt)
    for ex, answer in ((p.chosen, "4"), (p.rejected, "5")):
        full = fmt.example(messages + [{"role": "assistant", "content": answer}], train_on="last")
        assert ex == full
        prompt = fmt.ids(messages, add_generation_prompt=True)
        assert ex.ids[:len(prompt)] == prompt and all(t == IGNORE_INDEX for t in ex.labels[:len(prompt)])
        scored = [t for t in ex.labels if t != IGNORE_INDEX]
        text = fmt.tok.decode(scored[:-1])  # the template's rendering of the answer (it may add an empty think block)
        assert text.strip().endswith(answer) and "hello" not in text and scored[-1] in fmt.stop_ids


@pytest.mark.parametrize("rec,message", [
    ({"prompt": "a", "chosen": "b"}, "needs 'prompt'"),
    ({"prompt": "a", "chosen": 3, "rejected": "c"}, "field 'chosen' must be a string"),
    ({"prompt_ids": [1], "chosen_ids": [2.5], "rejected_ids": [3]}, "chosen_ids must be a list of integer"),
    ([1, 2], "expected a JSON object"),
])
def test_bad_records_are_named_by_file_and_line(tmp_path, rec, message):
    path = write(tmp_path / "p.jsonl", [{"prompt": "x", "chosen": "y", "rejected": "z"}, rec])
    with pytest.raises(ValueError, match=message) as e:
        read_pairs(path, make_tokenizer(None))
    assert str(e.value).startswith(f"{path}:2: ") and str(e.value).count(f"{path}:2") == 1


@pytest.mark.parametrize("rec,message", [
    ({"messages": [{"role": "user", "content": "a"}], "chosen": 5, "rejected": "c"},
     "'chosen' must be a string or a list of assistant messages, found 5"),
    ({"messages": [{"role": "user", "content": "a"}], "chosen": "b", "rejected": [{"role": "user", "content": "c"}]},
     "'rejected' must be a string or a list of assistant messages"),
])
def test_a_bad_chat_pair_names_its_file_and_line_once(tmp_path, rec, message):
    fmt = ChatFormat.load(None)
    path = write(tmp_path / "p.jsonl", [rec])
    with pytest.raises(ValueError, match=message) as e:
        read_pairs(path, fmt.tok, fmt)
    assert str(e.value).startswith(f"{path}:1: ") and str(e.value).count(f"{path}:1") == 1, str(e.value)


def test_rows_pack_both_answers_with_restarting_positions(tmp_path):
    recs = [{"prompt_ids": [1, 2], "chosen_ids": [3, 4], "rejected_ids": [5]},
            {"prompt_ids": [6], "chosen_ids": [7], "rejected_ids": [8, 9, 10]}]
    pairs = read_pairs(write(tmp_path / "p.jsonl", recs), None)
    src = PairSource(pairs, batch_size=2, seq_len=12, vocab_size=32, seed=0, pad_id=0)
    b = src.next_batch()
    assert set(b) == {"input_ids", "labels", "position_ids", "answer", "valid", "tokens_computed", "tokens_unshared"}
    assert b["input_ids"].shape == (2, 12)
    for row in range(2):
        ids = b["input_ids"][row].tolist()
        which = 0 if ids[:2] == [1, 2] else 1
        chosen = [1, 2, 3, 4] if which == 0 else [6, 7]
        rejected = [1, 2, 5] if which == 0 else [6, 8, 9, 10]
        n = len(chosen) + len(rejected)
        assert ids[:n] == chosen + rejected
        assert b["tokens_computed"][row] == b["tokens_unshared"][row] == n
        assert b["valid"][row].tolist() == [1] * n + [0] * (12 - n)  # padding is not a token of the pair
        assert b["position_ids"][row].tolist() == list(range(len(chosen))) + list(range(len(rejected))) + \
            list(range(12 - n))
        labels, answer = b["labels"][row].tolist(), b["answer"][row].tolist()
        scored = {i for i, t in enumerate(labels) if t != IGNORE_INDEX}
        assert {i for i, a in enumerate(answer) if a == CHOSEN} == {i for i in scored if i < len(chosen)}
        assert {i for i, a in enumerate(answer) if a == REJECTED} == {i for i in scored if i >= len(chosen)}
        assert [labels[i] for i in sorted(scored)] == chosen[len(chosen) - (2 if which == 0 else 1):] + \
            rejected[len(rejected) - (1 if which == 0 else 3):]


def test_a_pair_too_long_is_cut_to_half_each_or_dropped(tmp_path):
    recs = [{"prompt_ids": [1] * 3, "chosen_ids": [2] * 6, "rejected_ids": [3] * 6},  # 9 + 9 > 12: cut to 6 + 6
            {"prompt_ids": [1] * 7, "chosen_ids": [2], "rejected_ids": [3]}]  # the prompt alone fills half: dropped
    notes = []
    src = PairSource(read_pairs(write(tmp_path / "p.jsonl", recs), None), batch_size=1, seq_len=12,
                     vocab_size=8, seed=0, pad_id=0, warn=notes.append)
    assert len(src.pairs) == 1 and len(notes) == 2
    b = src.next_batch()
    assert b["input_ids"][0].tolist() == [1, 1, 1, 2, 2, 2, 1, 1, 1, 3, 3, 3]


def test_state_dict_resumes_the_same_rows(tmp_path):
    recs = [{"prompt_ids": [i], "chosen_ids": [i + 1], "rejected_ids": [i + 2]} for i in range(7)]
    pairs = read_pairs(write(tmp_path / "p.jsonl", recs), None)
    a = PairSource(pairs, 3, 8, 16, seed=4, pad_id=0)
    for _ in range(3):
        a.next_batch()
    state = a.state_dict()
    b = PairSource(pairs, 3, 8, 16, seed=4, pad_id=0)
    b.load_state_dict(state)
    for _ in range(4):
        assert torch.equal(a.next_batch()["input_ids"], b.next_batch()["input_ids"])
