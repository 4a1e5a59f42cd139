"""Chat data: token ids and assistant masks equal Transformers' apply_chat_template, bad records are lines naming
file:line, and a chat run learns (its assistant-token loss falls)."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import pytest
import torch
from hypothesis import given, settings, strategies as st

from glm5f.data.chat import (ChatByteTokenizer, ChatData, ChatFormat, ChatTemplate, chat_messages, default_template,
                             resolve_tokenizer)
from glm5f.data import IGNORE_INDEX, make_source

CHATML = """{% for message in messages %}{{ '<|im_start|>' + message.role + '\\n' }}
{%- if message.reasoning_content %}<think>{{ message.reasoning_content }}</think>{% endif %}
{{- message.content }}{% for call in message.tool_calls | default([]) %}\
<tool_call>{{ call.function | tojson }}</tool_call>
{%- endfor %}{{ '<|im_end|>\\n' }}{% endfor %}\
{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"""

CHATML_GENERATION = """{{ bos_token }}{% if tools %}<|im_start|>system
{% for tool in tools %}{{ tool | tojson }}
{% endfor %}<|im_end|>
{% endif %}{% for message in messages %}
{% if message.role == 'assistant' %}
<|im_start|>assistant
{% generation %}{{ message.content }}{% for call in message.tool_calls | default([]) %}\
<tool_call>{{ call.function.name }} {{ call.function.arguments | tojson }}</tool_call>\
{% endfor %}<|im_end|>{% endgeneration %}

{% else %}
<|im_start|>{{ message.role }}
{{ message.content }}<|im_end|>
{% endif %}
{% endfor %}
{% if add_generation_prompt %}<|im_start|>assistant
{% endif %}"""

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ENV = {**os.environ, "PYTHONPATH": ROOT, "OMP_NUM_THREADS": "1"}

WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string", "description": "Ville, e.g. Zürich"}}}}}


def call(name, **arguments):
    return {"type": "function", "function": {"name": name, "arguments": arguments}}


CONVERSATIONS = {
    "single": ([{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello!"}], None),
    "multi-turn + system": ([{"role": "system", "content": "Be brief."}, {"role": "user", "content": "2+2?"},
                             {"role": "assistant", "content": "4"}, {"role": "user", "content": "and 3+3?"},
                             {"role": "assistant", "content": "6"}], None),
    "reasoning": ([{"role": "user", "content": "Is 9 prime?"},
                   {"role": "assistant", "content": "No.", "reasoning_content": "9 = 3 x 3"}], None),
    "tools": ([{"role": "user", "content": "Weather in Zürich and Oslo?"},
               {"role": "assistant", "content": "", "tool_calls": [call("get_weather", city="Zürich"),
                                                                   call("get_weather", city="Oslo")]},
               {"role": "tool", "content": '{"t": 21}'}, {"role": "tool", "content": '{"t": 4}'},
               {"role": "assistant", "content": "Zürich 21 °C, Oslo 4 °C."}], [WEATHER]),
    "empty": ([{"role": "user", "content": ""}, {"role": "assistant", "content": ""}], None),
    "unicode": ([{"role": "user", "content": "日本の首都は？ 🚀 <think> is literal here"},
                 {"role": "assistant", "content": "東京です 🗼\n\ttabs\u00a0and é"}], None),
    "ends with user": ([{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"},
                        {"role": "user", "content": "c"}], None),
}


def byte_level_tokenizer():
    """A tokenizers Tokenizer with the ids of glm5f's chat byte tokenizer: bytes 0..255, then its special tokens."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    chars = bytes_to_unicode()
    tok = Tokenizer(models.BPE(vocab={chars[b]: b for b in range(256)}, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    ours = ChatByteTokenizer()
    tok.add_special_tokens(sorted(ours.special, key=ours.special.get))
    return tok


@pytest.fixture(scope="module")
def hf_tokenizer():
    from transformers import PreTrainedTokenizerFast

    ours = ChatByteTokenizer()
    return PreTrainedTokenizerFast(tokenizer_object=byte_level_tokenizer(), bos_token=ours.BOS, eos_token=ours.EOS,
                                   pad_token=ours.PAD)


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory, hf_tokenizer):
    """A tokenizer directory as Transformers saves one (tokenizer.json, tokenizer_config.json with bos/eos, the
    chat template)."""
    d = tmp_path_factory.mktemp("tok")
    hf_tokenizer.chat_template = CHATML_GENERATION
    hf_tokenizer.save_pretrained(d)
    return str(d)


def test_template_comes_from_the_tokenizer_directory_or_the_flag(tokenizer_dir, tmp_path):
    assert ChatFormat.load(tokenizer_dir).template.source == CHATML_GENERATION
    (tmp_path / "t.jinja").write_text(CHATML)
    assert ChatFormat.load(tokenizer_dir, str(tmp_path / "t.jinja")).template.source == CHATML
    assert ChatFormat.load(None).template.source == default_template()


def hf_ids_and_mask(hf_tok, template, messages, tools):
    kwargs = dict(tools=tools, chat_template=template, tokenize=True, return_dict=True)
    if ChatTemplate(template).has_generation:
        out = hf_tok.apply_chat_template(messages, return_assistant_tokens_mask=True, **kwargs)
        return list(out["input_ids"]), list(out["assistant_masks"])
    return list(hf_tok.apply_chat_template(messages, **kwargs)["input_ids"]), None


def ours(fmt, messages, tools):
    got_messages, got_tools = chat_messages({"messages": messages, "tools": tools})
    return fmt.tokenize(got_messages, got_tools)


@pytest.mark.parametrize("template_name", ["glm5", "chatml", "chatml_generation"])
@pytest.mark.parametrize("case", sorted(CONVERSATIONS))
def test_ids_and_mask_equal_apply_chat_template(template_name, case, hf_tokenizer, tokenizer_dir):
    template = {"glm5": default_template(), "chatml": CHATML, "chatml_generation": CHATML_GENERATION}[template_name]
    messages, tools = CONVERSATIONS[case]
    want_ids, want_mask = hf_ids_and_mask(hf_tokenizer, template, messages, tools)
    byte_fmt = ChatFormat(ChatByteTokenizer(), ChatTemplate(template), ChatByteTokenizer().template_tokens())
    file_fmt = ChatFormat.load(tokenizer_dir)
    file_fmt.template = ChatTemplate(template)
    for fmt in (byte_fmt, file_fmt):
        ids, mask = ours(fmt, messages, tools)
        assert ids == want_ids
        if want_mask is not None:
            assert mask == want_mask
            assert sum(mask) > 0  # every case has an assistant turn, and both templates mark some of its text


def test_prefix_mask_without_generation_blocks_is_each_assistant_turn():
    fmt = ChatFormat(ChatByteTokenizer(), ChatTemplate(CHATML), ChatByteTokenizer().template_tokens())
    messages, tools = CONVERSATIONS["multi-turn + system"]
    ids, mask = fmt.tokenize(messages, tools)
    runs = re.findall(r"1+", "".join(map(str, mask)))
    assert len(runs) == 2
    text = fmt.tok.decode([t for t, m in zip(ids, mask) if m])
    assert text == "4<|im_end|>\n6<|im_end|>\n"


def test_stop_tokens_and_train_on():
    fmt = ChatFormat.load(None)
    messages, tools = chat_messages({"messages": CONVERSATIONS["tools"][0], "tools": [WEATHER]})
    tok = fmt.tok
    ex = fmt.example(messages, tools)
    trained = tok.decode([t for t in ex.labels if t != IGNORE_INDEX])
    # the tool-call turn is trained up to the <|observation|> that ends it; the last turn up to an appended eos
    assert trained.startswith("<think></think><tool_call>get_weather<arg_key>city</arg_key>")
    assert "</tool_call><|observation|><think></think>Zürich 21 °C, Oslo 4 °C." == trained[trained.index(
        "</tool_call><|observation|>"):]
    assert ex.ids[-1] == tok.eos_id and ex.labels[-1] == tok.eos_id
    assert "<tool_response>" not in trained and "Weather in" not in trained
    last = fmt.example(messages, tools, "last")
    assert tok.decode([t for t in last.labels if t != IGNORE_INDEX]) == "<think></think>Zürich 21 °C, Oslo 4 °C."
    assert fmt.example(messages, tools, "all").labels == ex.ids
    chatml = ChatFormat(tok, ChatTemplate(CHATML_GENERATION), tok.template_tokens())
    ex = chatml.example(*chat_messages({"messages": CONVERSATIONS["single"][0]}))
    assert tok.decode([t for t in ex.labels if t != IGNORE_INDEX]) == "Hello!<|im_end|>"  # no eos: <|im_end|> ends it
    assert ex.ids[-1] != tok.eos_id


def test_sharegpt_equals_messages():
    fmt = ChatFormat.load(None)
    sharegpt = {"system": "Be brief.", "tools": json.dumps([WEATHER]), "conversations": [
        {"from": "human", "value": "Weather in Oslo?"},
        {"from": "function_call", "value": json.dumps({"name": "get_weather", "arguments": {"city": "Oslo"}})},
        {"from": "observation", "value": '{"t": 4}'}, {"from": "gpt", "value": "4 °C."}]}
    messages = {"tools": [WEATHER], "messages": [
        {"role": "system", "content": "Be brief."}, {"role": "user", "content": "Weather in Oslo?"},
        {"role": "assistant", "content": "", "tool_calls": [
            {"type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}}]},
        {"role": "tool", "content": '{"t": 4}'}, {"role": "assistant", "content": "4 °C."}]}
    assert fmt.example(*chat_messages(sharegpt)) == fmt.example(*chat_messages(messages))


ROLE_AFTER = {"user": ["assistant"], "assistant": ["user", "tool"], "tool": ["tool", "assistant"]}


@st.composite
def conversations(draw):
    pieces = st.sampled_from(list("ab é日🚀\n<>|{}") + ["<|user|>", "<think>", "<|im_end|>"])
    text = st.lists(pieces, max_size=8).map("".join)
    messages = [{"role": "system", "content": draw(text)}] if draw(st.booleans()) else []
    role = "user"
    for _ in range(draw(st.integers(1, 6))):
        m = {"role": role, "content": draw(text)}
        if role == "assistant" and draw(st.booleans()):
            m["reasoning_content"] = draw(text)
        if role == "assistant" and draw(st.booleans()):
            m["tool_calls"] = [call("f", x=draw(text), n=draw(st.integers(-5, 5)))]
            role = "tool"
        else:
            role = "user" if role == "assistant" else draw(st.sampled_from(ROLE_AFTER[role]))
        messages.append(m)
    return messages, ([WEATHER] if draw(st.booleans()) else None)


@settings(max_examples=40, deadline=None)
@given(conv=conversations(), template_name=st.sampled_from(["glm5", "chatml_generation"]))
def test_generated_conversations_equal_apply_chat_template(conv, template_name, hf_tokenizer):
    template = default_template() if template_name == "glm5" else CHATML_GENERATION
    messages, tools = conv
    want = hf_ids_and_mask(hf_tokenizer, template, messages, tools)
    tok = ChatByteTokenizer()
    assert ours(ChatFormat(tok, ChatTemplate(template), tok.template_tokens()), messages, tools) == want


# ---- bad records ----------------------------------------------------------------------------------------------

def write_jsonl(path, records):
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in records))
    return str(path)


GOOD = {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]}


@pytest.mark.parametrize("bad, expected", [
    ({"messages": [{"role": "wizard", "content": "x"}]}, "role 'wizard'; expected one of system, user"),
    ({"messages": [{"role": "user"}, {"role": "assistant", "content": "x"}]}, "needs a string 'content', found none"),
    ({"conversations": [{"from": "alien", "value": "x"}]}, "is from 'alien'; expected one of"),
    ({"conversations": [{"from": "function_call", "value": "{not json"}]}, "is a string but not JSON"),
    ({"messages": [{"role": "user", "content": "x"}, {"role": "assistant", "content": "y"}], "tools": [1]},
     "template.jinja failed: no tools here"),
])
def test_bad_record_names_file_and_line(tmp_path, bad, expected):
    path = write_jsonl(tmp_path / "chat.jsonl", [GOOD, GOOD, bad])
    template = tmp_path / "template.jinja"
    template.write_text("{% if tools %}{{ raise_exception('no tools here') }}{% endif %}" + CHATML)
    with pytest.raises(ValueError) as e:
        make_source("chat", vocab_size=512, batch_size=2, seq_len=64, path=path, chat_template=str(template))
    assert f"{path}:3: " in str(e.value) and expected in str(e.value)


def test_skipped_and_truncated_records_warn_once(tmp_path):
    long = {"messages": [{"role": "user", "content": "q" * 10}, {"role": "assistant", "content": "a" * 100}]}
    prompt_only = {"messages": [{"role": "user", "content": "q" * 100}, {"role": "assistant", "content": "a"}]}
    no_assistant = {"messages": [{"role": "user", "content": "anyone?"}]}
    path = write_jsonl(tmp_path / "chat.jsonl", [GOOD, no_assistant, long, no_assistant, prompt_only, long])
    warnings = []
    src = make_source("json_file", vocab_size=512, batch_size=2, seq_len=64, path=path, warn=warnings.append)
    assert sorted(warnings) == sorted([
        f"2 of 6 records have no assistant turn (nothing to learn): skipped (the first at {path}:2)",
        f"2 of 6 records are longer than --data.seq_len 64: truncated to their first 64 tokens (the first at "
        f"{path}:3)",
        f"1 of 6 records are longer than --data.seq_len 64 with no assistant token in their first 64: dropped "
        f"(the first at {path}:5)"])
    batch = src.next_batch()
    assert (batch["labels"] != IGNORE_INDEX).any()


def test_mixed_chat_and_text_records(tmp_path):
    sharegpt = {"conversations": [{"from": "human", "value": "hi"}, {"from": "gpt", "value": "yo"}]}
    path = write_jsonl(tmp_path / "mixed.jsonl", [{"text": "plain text"}, GOOD, sharegpt,
                                                 {"prompt": "p", "response": "r"}])
    src = make_source("json_file", vocab_size=512, batch_size=1, seq_len=256, path=path, shuffle_buffer=1, pack=True)
    row = src.next_batch()["input_ids"][0].tolist()
    text = ChatByteTokenizer().decode(row)
    assert "plain text" in text and "<|assistant|><think></think>hello" in text and "<|user|>hi" in text


def test_train_cli_errors_are_lines(tmp_path, capsys):
    from train import main

    bad = write_jsonl(tmp_path / "bad.jsonl", [GOOD, {"messages": [{"role": "robot", "content": "x"}]}])
    assert main(["--data.type", "chat", "--data.path", bad, "--train.steps", "2", "--checkpoint.dir",
                 str(tmp_path / "run")]) == 1
    err = capsys.readouterr().err
    assert "Traceback" not in err
    assert err.strip().splitlines()[-1].startswith(f"error: {bad}:2: message 0 has role 'robot'")


def test_chat_run_learns_assistant_tokens(tmp_path):
    """The shipped sample on the byte tokenizer: the loss (assistant tokens only) falls, and the held-out
    conversations' loss too."""
    run = tmp_path / "run"
    out = subprocess.run([sys.executable, "train.py", "--data.type", "chat", "--train.steps", "40",
                          "--data.batch_size", "8", "--optim.warmup_steps", "5", "--eval.every", "40",
                          "--checkpoint.dir", str(run)], capture_output=True, text=True, timeout=300, cwd=ROOT,
                         env=ENV)
    assert out.returncode == 0, out.stderr
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    first, last = records[0]["loss"], records[-1]["loss"]
    assert last < first - 1.5, (first, last)
    assert records[-1]["eval_loss"] < first - 1.0
    from scripts import generate
    assert generate.main([str(run), "--chat", "--prompt", "What is the capital of Peru?", "--max-tokens", "8"]) == 0


def test_generate_chat_prompt_and_stops(tmp_path, capsys):
    import io

    from scripts import generate

    byte = resolve_tokenizer(None, None, None)
    fmt = generate.chat_format(byte, None, vocab_size=512)
    ids = fmt.ids(generate.conversation(None, None, "Hi?"), add_generation_prompt=True)
    assert fmt.tok.decode(ids) == "[gMASK]<sop><|user|>Hi?<|assistant|>"
    out = io.StringIO()
    answer = fmt.tok.encode("<think></think>Hello.<|user|>more")
    got = generate.print_stream(fmt.tok, iter(answer), out=out, stops=fmt.stop_ids)
    assert out.getvalue() == "<think></think>Hello.\n" and len(got) == answer.index(fmt.tok.special["<|user|>"])
    with pytest.raises(ValueError, match="raise|only 260"):
        generate.chat_format(byte, None, vocab_size=260)


def test_hf_datasets_rows_are_chat_records(tmp_path):
    """Rows of a saved dataset, whose missing fields read as None, give the same examples as the JSONL records."""
    datasets = pytest.importorskip("datasets")
    records = [{"messages": [{"role": "user", "content": "Is 9 prime?"},
                             {"role": "assistant", "content": "No.", "reasoning_content": "3 x 3"}]},
               {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]}]
    datasets.Dataset.from_list(records).save_to_disk(str(tmp_path / "ds"))
    path = write_jsonl(tmp_path / "chat.jsonl", records)
    common = dict(vocab_size=512, batch_size=1, seq_len=128, shuffle_buffer=1)
    rows = make_source("hf_datasets", path=str(tmp_path / "ds"), **common)
    lines = make_source("json_file", path=path, **common)
    for _ in range(2):
        a, b = rows.next_batch(), lines.next_batch()
        assert all(torch.equal(a[k], b[k]) for k in a)


def test_default_template_lays_out_the_glm_format():
    fmt = ChatFormat.load(None)
    messages, tools = chat_messages({"messages": [
        {"role": "system", "content": "Be brief."}, {"role": "user", "content": "Oslo?"},
        {"role": "assistant", "content": "", "reasoning_content": "look it up",
         "tool_calls": [call("get_weather", city="Oslo", days=2)]},
        {"role": "tool", "content": "4 C"}, {"role": "tool", "content": "rain"},
        {"role": "assistant", "content": "4 °C, rain."}, {"role": "user", "content": "Thanks"}]})
    text, _ = fmt.render(messages, add_generation_prompt=True)
    assert text == ("[gMASK]<sop><|system|>Be brief.<|user|>Oslo?<|assistant|><think>look it up</think>"
                    "<tool_call>get_weather<arg_key>city</arg_key><arg_value>Oslo</arg_value><arg_key>days</arg_key>"
                    "<arg_value>2</arg_value></tool_call><|observation|><tool_response>4 C</tool_response>"
                    "<tool_response>rain</tool_response><|assistant|><think></think>4 °C, rain.<|user|>Thanks"
                    "<|assistant|>")
    with_tools, _ = fmt.render(messages[:2], tools=[WEATHER])
    assert with_tools.startswith("[gMASK]<sop><|system|>\n# Tools\n") and '"name": "get_weather"' in with_tools
    ids = fmt.ids(messages)
    assert all(fmt.tok.special[s] in ids for s in ("[gMASK]", "<|observation|>", "<arg_key>", "</think>"))


def test_typed_chat_fields_are_checked_as_content_is():
    from glm5f.data.chat import chat_messages

    with pytest.raises(ValueError, match=r"message 1 \(assistant\) needs a string 'reasoning_content', found a list"):
        chat_messages({"messages": [{"role": "user", "content": "q"},
                                    {"role": "assistant", "content": "a", "reasoning_content": ["x", "y"]}]})
    with pytest.raises(ValueError, match="the arguments of f must be a JSON object of named arguments, found a number"):
        chat_messages({"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "",
                                     "tool_calls": [{"function": {"name": "f", "arguments": 42}}]}]})
