"""The fine-tuner's round trip: one tokenizer and template per run, carried from a Transformers checkpoint through
training, checkpoints, exports and generation; exports that never replace what glm5f did not write."""

from __future__ import annotations

import json
import os

import pytest
import torch

import glm5f
from glm5f import checkpoint
from glm5f.chat import resolve_tokenizer
from glm5f.hf import EXPORT_MARKER
from scripts import convert, generate
from train import main

TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m.role }}\n"
            "{% if m.role == 'assistant' %}{% generation %}{{ m.content }}<|im_end|>{% endgeneration %}"
            "{% else %}{{ m.content }}<|im_end|>{% endif %}\n{% endfor %}"
            "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
RUN = ["--data.batch_size", "2", "--data.seq_len", "64", "--train.steps", "1"]


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
    assert main(["--model.init_from", str(base), "--model.tokenizer_path", str(base), "--data.type", "chat", *RUN,
                 "--checkpoint.dir", str(named)]) == 0
    assert main(["--model.init_from", str(base), "--data.type", "chat", *RUN, "--checkpoint.dir", str(implied),
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
    assert main(["--model.init_from", str(base), "--data.type", "chat", *RUN, "--checkpoint.dir", str(run)]) == 0
    other = tmp_path / "other.jinja"
    other.write_text(TEMPLATE.replace("<|im_start|>", "<|im_start|> "))
    again = ["--model.init_from", str(base), "--data.type", "chat", *RUN[:4], "--train.steps", "2",
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
    assert main(["--model.init_from", str(base), "--data.type", "chat", *RUN, "--checkpoint.dir", str(tmp_path / "a"),
                 "--checkpoint.export_hf", str(export)]) == 0
    lora_run = tmp_path / "lora"
    assert main(["--model.init_from", str(export), "--data.type", "chat", "--lora.rank", "2", *RUN,
                 "--checkpoint.dir", str(lora_run)]) == 0
    before = {n: (export / n).read_bytes() for n in os.listdir(export)}
    capsys.readouterr()
    other = ["--model.preset", "glm5-tiny", "--data.type", "synthetic", *RUN, "--checkpoint.dir"]
    assert main(other + [str(tmp_path / "b"), "--checkpoint.export_hf", str(export)]) == 1
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert err.startswith("error: ") and f"is the --model.init_from base of the run(s) {lora_run}" in err, err
    assert main(["--model.init_from", str(export), "--data.type", "chat", "--lora.rank", "2", *RUN,
                 "--checkpoint.dir", str(tmp_path / "c"), "--checkpoint.export_hf", str(export)]) == 1
    assert "is this run's --model.init_from" in capsys.readouterr().err
    assert convert.main([str(tmp_path / "a"), str(export)]) == 1
    assert "--replace-export" in capsys.readouterr().err
    assert main(["--model.init_from", str(base), *RUN, "--checkpoint.dir", str(export)]) == 1
    assert "is a glm5f export" in capsys.readouterr().err
    assert {n: (export / n).read_bytes() for n in os.listdir(export)} == before
    # an export of ours with the tokenizer files of a run that is gone: a byte-tokenizer export would drop them
    lone = tmp_path / "lone"
    assert main(["--model.init_from", str(base), "--data.type", "chat", *RUN, "--checkpoint.dir", str(tmp_path / "d"),
                 "--checkpoint.export_hf", str(lone)]) == 0
    assert main(other + [str(tmp_path / "e"), "--checkpoint.export_hf", str(lone)]) == 1
    assert "holds tokenizer files (tokenizer.json, tokenizer_config.json)" in \
        capsys.readouterr().err
    assert main(other + [str(tmp_path / "f"), "--checkpoint.export_hf", str(lone), "--checkpoint.replace_export"]) == 0
    assert not (lone / "tokenizer.json").exists() and (lone / "chat_template.jinja").exists()
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


ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ENV = {**os.environ, "PYTHONPATH": ROOT, "OMP_NUM_THREADS": "1"}


def run(*argv, stdin=None):
    import subprocess
    import sys

    return subprocess.run([sys.executable, *argv], cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=300,
                          input=stdin)


@pytest.mark.parametrize("flags, line", [
    (["--parallel.dp_shard", "3", "--parallel.ep", "64"], "error: --plan needs a mesh: --parallel.ep 64 must divide "
                                                          "the ranks dp_shard x cp = 3"),
    (["--parallel.dp_shard", "16", "--parallel.ep", "16"], "error: --plan needs a mesh: --parallel.ep 16 must divide "
                                                          "n_routed_experts (8)"),
    (["--parallel.dp_shard", "0"], "error: --plan needs a mesh: --parallel.dp_shard must be >= 1, got 0")])
def test_plan_of_flags_that_leave_no_mesh_is_an_error_line(flags, line):
    out = run("train.py", "--plan", "table", *flags)
    assert out.returncode == 1 and "Traceback" not in out.stderr and out.stderr.strip().splitlines()[-1] == line


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks a machine without a GPU")
def test_plan_for_a_gpu_runs_on_a_machine_without_one(capsys):
    """The README's `--plan search ... --train.device cuda`: the plan allocates nothing, so it needs no GPU here;
    planned for cuda, the table has no measured CPU runtime row."""
    flags = ["--model.preset", "glm5-tiny", "--train.device", "cuda", "--parallel.device_memory_gb", "1",
             "--data.batch_size", "2", "--data.seq_len", "64"]
    assert main(["--plan", "search", *flags]) == 0
    out, err = capsys.readouterr()
    assert "smallest meshes for glm5-tiny" in out and "within 1 GB per rank" in out and "error" not in err, err
    assert main(["--plan", "table", *flags]) == 0
    out, err = capsys.readouterr()
    assert "device memory (--parallel.device_memory_gb)" in out and "runtime" not in out, out


def test_out_of_memory_names_the_allocation_the_step_and_what_to_change(monkeypatch, tmp_path, capsys):
    import glm5f.step as step_mod

    real = step_mod.step_grads

    def step_grads(*args, **kwargs):
        if len(calls := step_grads.calls) == 1:
            raise step_grads.error
        calls.append(1)
        return real(*args, **kwargs)
    step_grads.calls = []
    step_grads.error = torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.50 GiB. GPU 0 has a total "
                                              "capacity of 79.11 GiB of which 1.02 GiB is free.")
    monkeypatch.setattr(step_mod, "step_grads", step_grads)
    assert main(["--model.preset", "glm5-tiny", "--data.type", "synthetic", *RUN[:4], "--train.steps", "3",
                 "--checkpoint.dir", str(tmp_path)]) == 1
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert err.startswith("error: step 2: out of memory on cpu trying to allocate 2.50 GiB") and \
        "--train.grad_accum" in err and "--train.activation_checkpointing" in err and "--plan" in err, err
    step_grads.calls = [1]  # the CPU allocator's error
    step_grads.error = RuntimeError("DefaultCPUAllocator: not enough memory: you tried to allocate 3221225472 bytes.")
    assert main(["--model.preset", "glm5-tiny", "--data.type", "synthetic", *RUN[:4], "--train.steps", "3",
                 "--checkpoint.dir", str(tmp_path / "cpu")]) == 1
    assert "error: step 1: out of memory on cpu trying to allocate 3.00 GiB" in capsys.readouterr().err


def test_generate_device_auto_and_a_chat_with_system_messages_and_turns_from_stdin(tmp_path):
    run_dir = tmp_path / "run"
    assert main(["--model.preset", "glm5-tiny", "--data.type", "chat", *RUN, "--checkpoint.dir", str(run_dir)]) == 0
    out = run("scripts/generate.py", str(run_dir), "--device", "auto", "--prompt", "The", "--max-tokens", "4")
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
    out = run("scripts/generate.py", str(run_dir), "--chat", "--system", "Be brief.", "--messages", str(talk),
              "--prompt", "and 3+3?", "--max-tokens", "6")
    assert out.returncode == 0 and out.stderr == "", out.stderr
    out2 = run("scripts/generate.py", str(run_dir), "--chat", "--system", "Be brief.", "--messages", str(talk),
               "--interactive", "--max-tokens", "6", stdin="and 3+3?\n\nagain?\n")
    assert out2.returncode == 0 and out2.stdout.startswith(out.stdout) and len(out2.stdout) > len(out.stdout), \
        (out.stdout, out2.stdout)  # the first answer as the one-shot one's, then a second


def test_typed_chat_fields_are_checked_as_content_is():
    from glm5f.chat import chat_messages

    with pytest.raises(ValueError, match=r"message 1 \(assistant\) needs a string 'reasoning_content', found a list"):
        chat_messages({"messages": [{"role": "user", "content": "q"},
                                    {"role": "assistant", "content": "a", "reasoning_content": ["x", "y"]}]})
    with pytest.raises(ValueError, match="the arguments of f must be a JSON object of named arguments, found a number"):
        chat_messages({"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "",
                                     "tool_calls": [{"function": {"name": "f", "arguments": 42}}]}]})


def test_a_plain_record_in_a_chat_file_is_an_error_at_its_line(tmp_path):
    from glm5f.data import make_source

    path = tmp_path / "chat.jsonl"
    path.write_text(json.dumps({"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}]})
                    + "\n" + json.dumps({"text": "a plain document"}) + "\n")
    with pytest.raises(ValueError, match=f"{path}:2: --data.type chat reads chat records"):
        make_source("chat", path=str(path), vocab_size=512, batch_size=1, seq_len=64)
    make_source("json_file", path=str(path), vocab_size=512, batch_size=1, seq_len=64)  # mixed on purpose: read


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


def test_a_recipe_key_given_twice_is_an_error_naming_both_lines(tmp_path, capsys):
    recipe = tmp_path / "r.yaml"
    recipe.write_text("train:\n  steps: 5\n  seed: 1\n  steps: 7\n")
    assert main(["--config", str(recipe)]) == 1
    assert "the key 'steps' is given twice, on line 2 and line 4" in capsys.readouterr().err


def test_trained_leaves_without_a_gradient_and_positions_past_the_model_are_warned(tmp_path, capsys):
    tiny = ["--model.preset", "glm5-tiny", "--data.type", "synthetic", *RUN]
    assert main(tiny + ["--lora.rank", "2", "--lora.targets", "indexer", "--checkpoint.dir", str(tmp_path / "a")]) == 0
    err = capsys.readouterr().err
    assert "warning: 6 of the 6 trained leaves got no gradient in the first step " \
           "(model.layers.0.self_attn.indexer.wq_b, " in err, err
    assert main(tiny + ["--lora.rank", "2", "--checkpoint.dir", str(tmp_path / "b"),
                        "--model.max_position_embeddings", "32"]) == 0
    err = capsys.readouterr().err
    assert "no gradient" not in err and "--data.seq_len 64 reaches past the model's max_position_embeddings 32" in err


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
    assert main(["--model.preset", "glm5-tiny", "--data.type", "chat", "--data.path", str(chat), *RUN,
                 "--eval.split_fraction", "0.1", "--checkpoint.dir", str(tmp_path / "run")]) == 0
    assert "eval_loss" in json.loads((tmp_path / "run" / "metrics.jsonl").read_text().splitlines()[-1])


def test_compare_runs_png_into_a_directory(tmp_path):
    pytest.importorskip("matplotlib")
    for name in ("a", "b"):
        (tmp_path / name).mkdir()
        (tmp_path / name / "metrics.jsonl").write_text(json.dumps({"step": 1, "loss": 2.0}) + "\n")
    (tmp_path / "plots").mkdir()
    out = run("scripts/compare_runs.py", str(tmp_path / "a"), str(tmp_path / "b"), "--png", str(tmp_path / "plots"))
    assert out.returncode == 0 and f"plot: {tmp_path / 'plots' / 'compare.png'}" in out.stdout, out.stderr
    assert os.listdir(tmp_path / "plots") == ["compare.png"] and not (tmp_path / "plots.png").exists()


def test_warnings_print_as_one_line_in_the_scripts():
    out = run("-c", "import warnings; from glm5f.data import warnings_as_lines; warnings_as_lines(); "
                    "warnings.warn('an FP8 checkpoint: dequantized as read')")
    assert out.returncode == 0 and out.stderr == "warning: an FP8 checkpoint: dequantized as read\n", out.stderr


def test_mtp_loss_weight_given_for_a_model_without_mtp_layers_is_one_warning(tmp_path, capsys):
    """--train.mtp_loss_weight on a model without MTP layers: one warning line (no MTP loss exists to weight).
    Not given: no warning, and a model with MTP layers trains with 0.1 (the same losses as --train.mtp_loss_weight
    0.1, and Step.of's weight)."""
    from configs import Config
    from glm5f.loss import Step

    tiny = ["--model.preset", "glm5-tiny", "--data.type", "synthetic", *RUN[:4], "--train.steps", "2",
            "--eval.every", "0"]
    assert main(tiny + ["--train.mtp_loss_weight", "0.5", "--checkpoint.dir", str(tmp_path / "set")]) == 0
    err = capsys.readouterr().err
    assert [line for line in err.splitlines() if "mtp_loss_weight" in line] == [
        "warning: --train.mtp_loss_weight 0.5 is not used: the model has no MTP layers "
        "(--model.num_nextn_predict_layers), so there is no mtp_loss to weight; drop the flag or train a model "
        "with them"], err
    mtp = tiny + ["--model.num_nextn_predict_layers", "1"]
    assert main(tiny + ["--checkpoint.dir", str(tmp_path / "plain")]) == 0
    assert main(mtp + ["--checkpoint.dir", str(tmp_path / "default")]) == 0
    assert main(mtp + ["--train.mtp_loss_weight", "0.1", "--checkpoint.dir", str(tmp_path / "given")]) == 0
    assert "mtp_loss_weight" not in capsys.readouterr().err
    records = {name: [json.loads(line) for line in (tmp_path / name / "metrics.jsonl").read_text().splitlines()]
               for name in ("default", "given")}
    assert [(r["loss"], r["mtp_loss"]) for r in records["default"]] == \
        [(r["loss"], r["mtp_loss"]) for r in records["given"]]
    run = checkpoint.read_meta(checkpoint.latest(str(tmp_path / "default")))["run"]
    assert run["train"]["mtp_loss_weight"] is None
    assert Step.of(Config().train, glm5f.preset("glm5-tiny", num_nextn_predict_layers=1)).coeffs["mtp_loss"] == 0.1


def test_a_preset_pt_runs_start_line_shows_the_sizes_of_its_batches(tmp_path, capsys):
    """--data.type preset_pt trains on the batches of its file, whatever --data.batch_size and --data.seq_len say:
    the start line shows their sizes (the tokens each step's metrics record counts), not the flags'."""
    path = tmp_path / "batches.pt"
    g = torch.Generator().manual_seed(0)
    torch.save([{"input_ids": torch.randint(0, 200, (4, 48), generator=g)},
                {"input_ids": torch.randint(0, 200, (2, 64), generator=g)}], path)
    assert main(["--model.preset", "glm5-tiny", "--data.path", str(path), "--data.batch_size", "16",
                 "--data.seq_len", "128", "--train.steps", "2", "--checkpoint.dir", str(tmp_path / "run")]) == 0
    start = next(line for line in capsys.readouterr().out.splitlines() if line.startswith("glm5f:"))
    assert f"preset_pt data, 4x48 or 2x64 tokens/step (the batches of {path})," in start and "16x128" not in start
    assert [json.loads(line)["tokens"] for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()] \
        == [4 * 48, 2 * 64]


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
    flags = ["--model.preset", "glm5-tiny", *RUN[:4], "--train.steps", "2", "--eval.split_fraction", "0.1"]
    assert main(flags + ["--data.path", str(tmp_path / "text"), "--data.split", "train",
                         "--checkpoint.dir", str(tmp_path / "hf")]) == 0
    assert main(flags + ["--data.path", str(tmp_path / "text.jsonl"), "--checkpoint.dir", str(tmp_path / "jsonl")]) == 0
    metrics = {name: [json.loads(line) for line in (tmp_path / name / "metrics.jsonl").read_text().splitlines()]
               for name in ("hf", "jsonl")}
    assert [(r["loss"], r.get("eval_loss")) for r in metrics["hf"]] == \
        [(r["loss"], r.get("eval_loss")) for r in metrics["jsonl"]] and "eval_loss" in metrics["hf"][-1]


def test_the_first_compiled_step_and_evaluation_are_announced_before_they_compile(monkeypatch, tmp_path, capsys):
    """--train.compile: a line says the step is compiling before the first step runs (in a resumed run too: a new
    process compiles again) and another before the first evaluation (no gradients: other graphs), each once;
    without --train.compile neither. What was printed is read when the step and the evaluation are called."""
    import train as train_mod

    calls = []

    def spy(name, real):
        def call(*args, **kwargs):
            step = args[-1]
            calls.append((name, step.compile, capsys.readouterr().out))
            return real(*args, **kwargs)
        return call
    monkeypatch.setattr(glm5f.step, "step_grads", spy("step", glm5f.step.step_grads))
    monkeypatch.setattr(train_mod, "eval_loss", spy("eval", train_mod.eval_loss))
    monkeypatch.setattr(glm5f.model, "compiled_decoder_layer", lambda: glm5f.model.decoder_layer)  # eager: fast
    flags = ["--model.preset", "glm5-tiny", "--data.type", "synthetic", *RUN[:4], "--train.log_every", "1",
             "--eval.every", "1", "--eval.batches", "1", "--checkpoint.dir", str(tmp_path / "run")]
    step_line = "compiling the step (the first step takes a while; the next ones reuse it)...\n"
    eval_line = "compiling the evaluation (the first one takes a while; the next ones reuse it)...\n"
    assert main(flags + ["--train.steps", "2", "--train.compile"]) == 0
    assert [(name, compiled) for name, compiled, _ in calls] == [("step", True), ("eval", True)] * 2
    (_, _, before_step), (_, _, before_eval), (_, _, later_step), (_, _, later_eval) = calls
    assert before_step.endswith(step_line) and before_eval == eval_line, (before_step, before_eval)
    assert "compiling" not in later_step + later_eval + capsys.readouterr().out
    calls.clear()
    assert main(flags + ["--train.steps", "3", "--train.compile", "--checkpoint.resume", "latest"]) == 0
    assert calls[0][2].endswith(step_line) and calls[1][2] == eval_line
    calls.clear()
    assert main(flags + ["--train.steps", "4", "--checkpoint.resume", "latest"]) == 0
    assert [compiled for _, compiled, _ in calls] == [False, False]
    assert "compiling" not in "".join(out for _, _, out in calls) + capsys.readouterr().out


@pytest.mark.slow
def test_the_compiling_line_reaches_a_pipe_before_the_first_step_ends(tmp_path):
    """A real `train.py --train.compile` (one layer; minutes on a loaded CPU) writing to a pipe, as under a job
    scheduler or `| tee`: the compiling line arrives while the first step still compiles (no metrics yet)."""
    import subprocess
    import sys

    run_dir = tmp_path / "run"
    proc = subprocess.Popen([sys.executable, "train.py", "--model.preset", "glm5-tiny", "--model.num_hidden_layers",
                             "1", "--data.type", "synthetic", "--data.batch_size", "2", "--data.seq_len", "16",
                             "--train.steps", "1", "--eval.every", "0", "--train.compile", "--checkpoint.dir",
                             str(run_dir)], cwd=ROOT, env={k: v for k, v in ENV.items() if k != "PYTHONUNBUFFERED"},
                            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)  # buffered, as a user's
    try:
        for line in proc.stdout:
            if line.startswith("compiling the step"):
                assert not (run_dir / "metrics.jsonl").exists(), "the line came after the first step"
                break
        else:
            raise AssertionError("no compiling line")
        proc.stdout.read()
        assert proc.wait(timeout=900) == 0 and (run_dir / "metrics.jsonl").exists()
    finally:
        proc.kill()
