"""The fine-tuner's round trip: one tokenizer and template per run, carried from a Transformers checkpoint through
training, checkpoints, exports and generation; exports that never replace what glm5f did not write."""

from __future__ import annotations

import json
import os

import pytest
import torch

import glm5f
from conftest import RUN_64
from glm5f.ckpt import checkpoint
from glm5f.data.chat import resolve_tokenizer
from glm5f.data.tokens import is_byte_tokenizer
from glm5f.ckpt.hf import EXPORT_MARKER
from scripts import convert, generate
from train import main


TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m.role }}\n"
            "{% if m.role == 'assistant' %}{% generation %}{{ m.content }}<|im_end|>{% endgeneration %}"
            "{% else %}{{ m.content }}<|im_end|>{% endif %}\n{% endfor %}"
            "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")




@pytest.fixture(scope="module")
def base(tmp_path_factory):
    """A Transformers checkpoint as save_pretrained writes one: a tiny GLM-5 with a byte-level BPE tokenizer
    (tokenizer.json, tokenizer_config.json) and a chat template (chat_template.jinja)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import GlmMoeDsaConfig, GlmMoeDsaForCausalLM, PreTrainedTokenizerFast

    d = tmp_path_factory.mktemp("base")
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer, tok.decoder = pre_tokenizers.ByteLevel(add_prefix_space=False), decoders.ByteLevel()
    tok.train_from_iterator(glm5f.data.embedded_documents("train")[:50], trainers.BpeTrainer(
        vocab_size=320, special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|endoftext|>", pad_token="<|endoftext|>")
    fast.chat_template = TEMPLATE
    torch.manual_seed(0)
    GlmMoeDsaForCausalLM(GlmMoeDsaConfig(**glm5f.preset("glm5-tiny").to_hf())).save_pretrained(d)
    fast.save_pretrained(d)
    return d


def losses(run) -> list[float]:
    return [json.loads(line)["loss"] for line in (run / "metrics.jsonl").read_text().splitlines()]


def test_init_from_brings_its_tokenizer_and_template_to_the_run_its_checkpoints_and_exports(base, tmp_path, capsys):
    """--model.init_from DIR without --model.tokenizer_path trains with DIR's tokenizer and template (the same loss
    as naming them), says so, keeps a copy in the run directory, and every export carries them."""
    named, implied = tmp_path / "named", tmp_path / "implied"
    assert main(["--model.init_from", str(base), "--model.tokenizer_path", str(base), "--data.type", "chat", *RUN_64,
                 "--checkpoint.dir", str(named)]) == 0
    assert main(["--model.init_from", str(base), "--data.type", "chat", *RUN_64, "--checkpoint.dir", str(implied),
                 "--checkpoint.export_hf", str(tmp_path / "hf")]) == 0
    out = capsys.readouterr().out
    assert f"tokenizer: tokenizer {base / 'tokenizer.json'} (from --model.init_from), chat template " \
           f"{base / 'chat_template.jinja'}" in out
    assert losses(implied) == losses(named)
    for where in (implied / "tokenizer", tmp_path / "hf"):
        for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
            assert (where / name).read_bytes() == (base / name).read_bytes(), (where, name)
    meta = checkpoint.read_meta(checkpoint.latest(str(implied)))
    assert {k: v for k, v in meta["tokenizer"].items() if k != "how"} == \
        {k: v for k, v in resolve_tokenizer(str(base), None, None).fingerprint().items() if k != "how"}
    assert convert.main([str(implied), str(tmp_path / "converted")]) == 0
    assert (tmp_path / "converted" / "chat_template.jinja").read_text() == TEMPLATE
    for model in (implied, tmp_path / "hf", tmp_path / "converted"):  # generate.py renders with the run's template
        cfg, _, _, tokens = generate.load(str(model))
        fmt = generate.chat_format(tokens, None, cfg.vocab_size)
        assert fmt.template.source == TEMPLATE and fmt.ids([{"role": "user", "content": "hi"}],
                                                           add_generation_prompt=True) == \
            fmt.tok.encode("<|im_start|>user\nhi<|im_end|><|im_start|>assistant\n")


def test_resume_with_another_tokenizer_or_template_is_an_error_naming_both(base, tmp_path, capsys):
    run = tmp_path / "run"
    assert main(["--model.init_from", str(base), "--data.type", "chat", *RUN_64, "--checkpoint.dir", str(run)]) == 0
    other = tmp_path / "other.jinja"
    other.write_text(TEMPLATE.replace("<|im_start|>", "<|im_start|> "))
    again = ["--model.init_from", str(base), "--data.type", "chat", *RUN_64[:4], "--train.steps", "2",
             "--checkpoint.dir", str(run), "--checkpoint.resume", "latest", "--data.chat_template", str(other)]
    capsys.readouterr()
    assert main(again) == 1
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert err.startswith("error: ") and f"chat template {base / 'chat_template.jinja'}" in err \
        and f"chat template {other}" in err and "--data.allow_changed" in err
    assert len(losses(run)) == 1
    assert main(again + ["--data.allow_changed"]) == 0
    assert "warning: " in capsys.readouterr().err and len(losses(run)) == 2
    assert (run / "tokenizer" / "chat_template.jinja").read_text() == other.read_text()


def test_an_export_never_replaces_a_base_in_use_tokenizer_files_or_files_it_did_not_write(base, tmp_path, capsys):
    """The reported loss: an export (with tokenizer files) that a LoRA run starts from, replaced by another run's
    --checkpoint.export_hf, lost its weights and tokenizer files. Now: refused (one error line, nothing touched)
    unless --checkpoint.replace_export; files glm5f did not write are never replaced; a run directory is never an
    export."""
    export = tmp_path / "export"
    assert main(["--model.init_from", str(base), "--data.type", "chat", *RUN_64, "--checkpoint.dir", str(tmp_path / "a"),
                 "--checkpoint.export_hf", str(export)]) == 0
    lora_run = tmp_path / "lora"
    assert main(["--model.init_from", str(export), "--data.type", "chat", "--lora.rank", "2", *RUN_64,
                 "--checkpoint.dir", str(lora_run)]) == 0
    before = {n: (export / n).read_bytes() for n in os.listdir(export)}
    capsys.readouterr()
    other = ["--model.preset", "glm5-tiny", "--data.type", "synthetic", *RUN_64, "--checkpoint.dir"]
    assert main(other + [str(tmp_path / "b"), "--checkpoint.export_hf", str(export)]) == 1
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert err.startswith("error: ") and f"is the --model.init_from base of the run(s) {lora_run}" in err, err
    assert main(["--model.init_from", str(export), "--data.type", "chat", "--lora.rank", "2", *RUN_64,
                 "--checkpoint.dir", str(tmp_path / "c"), "--checkpoint.export_hf", str(export)]) == 1
    assert "is this run's --model.init_from" in capsys.readouterr().err
    assert convert.main([str(tmp_path / "a"), str(export)]) == 1
    assert "--replace-export" in capsys.readouterr().err
    assert main(["--model.init_from", str(base), *RUN_64, "--checkpoint.dir", str(export)]) == 1
    assert "is a glm5f export" in capsys.readouterr().err
    assert {n: (export / n).read_bytes() for n in os.listdir(export)} == before
    # an export of ours with the tokenizer files of a run that is gone: a byte-tokenizer export writes its own
    # tokenizer.json and tokenizer_config.json over them (none left stale, none dropped)
    lone = tmp_path / "lone"
    assert main(["--model.init_from", str(base), "--data.type", "chat", *RUN_64, "--checkpoint.dir", str(tmp_path / "d"),
                 "--checkpoint.export_hf", str(lone)]) == 0
    assert not is_byte_tokenizer(str(lone))
    assert main(other + [str(tmp_path / "e"), "--checkpoint.export_hf", str(lone)]) == 0
    assert is_byte_tokenizer(str(lone)) and (lone / "chat_template.jinja").exists()
    # files glm5f did not write: refused even with consent; an export from before markers listed files too
    (export / "notes.txt").write_text("mine")
    replace = ["--checkpoint.export_hf", str(export), "--checkpoint.replace_export"]
    assert main(other + [str(tmp_path / "g"), *replace]) == 1
    assert "files glm5f did not write there (notes.txt)" in capsys.readouterr().err
    os.remove(export / "notes.txt")
    (export / EXPORT_MARKER).write_text("")  # as convert.py wrote it before, beside the tokenizer files it copied
    assert main(other + [str(tmp_path / "h"), *replace]) == 1
    assert "(chat_template.jinja, tokenizer.json, tokenizer_config.json)" in capsys.readouterr().err
    assert (export / "tokenizer.json").read_bytes() == before["tokenizer.json"]


def test_template_tokens_the_tokenizer_splits_are_named_in_a_warning(base, tmp_path):
    from glm5f.data import make_source

    glm_template = tmp_path / "glm.jinja"
    glm_template.write_text("{% for m in messages %}{% if m.role == 'assistant' %}<|assistant|>{% generation %}"
                            "{{ m.content }}{% endgeneration %}{% else %}<|user|>{{ m.content }}{% endif %}"
                            "{% endfor %}{% if add_generation_prompt %}<|assistant|>{% endif %}")
    warnings = []
    common = dict(vocab_size=512, batch_size=1, seq_len=64, tokenizer_path=str(base), warn=warnings.append)
    make_source("chat", chat_template=str(glm_template), **common)
    assert any("writes <|assistant|>, <|user|>, which the tokenizer has no single token for" in w for w in warnings)
    warnings.clear()
    make_source("chat", **common)  # its own template: <|im_start|> and <|im_end|> are single tokens
    assert not any("no single token" in w for w in warnings), warnings
