"""glm5f.ckpt.hf.export: one export path. train.py's --checkpoint.export_hf and scripts/convert.py (with --merge-lora
too) write a run's weights through `export_run`, so the same run gives the same directory, byte for byte."""

import json
import os

import pytest
import torch
from safetensors.torch import load_file

from scripts import convert
from train import main


def tensors(path) -> dict[str, tuple[torch.dtype, tuple[int, ...], bytes]]:
    """{key: (dtype, shape, raw bytes)} of every safetensors file in directory `path`."""
    out = {}
    for name in sorted(os.listdir(path)):
        if name.endswith(".safetensors"):
            for k, t in load_file(os.path.join(path, name)).items():
                assert k not in out, k
                out[k] = (t.dtype, tuple(t.shape), t.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes())
    return out


@pytest.fixture(scope="module")
def glm53_base(tmp_path_factory):
    """A tiny GLM-5.3 checkpoint as Transformers' Glm5NextForConditionalGeneration.save_pretrained writes it: the
    text model under model.language_model, a one-block vision tower beside it, config.json's vision_config."""
    from test_glm53 import hf_glm53, random_config

    base = tmp_path_factory.mktemp("glm53") / "base"
    hf_glm53(random_config(0, 2, 2)).save_pretrained(base)
    return base


@pytest.mark.parametrize("lora", [False, True])
def test_convert_writes_what_export_hf_writes_vision_tower_included(glm53_base, tmp_path, lora):
    """A run from a GLM-5.3 checkpoint, exported at its end (--checkpoint.export_hf) and converted from its last
    checkpoint (scripts/convert.py; a LoRA run's with --merge-lora): the same files, the same tensors (names,
    dtypes, shapes, bytes) and the same config.json, which keeps the base's vision_config and vision tensors."""
    run, exported, converted = tmp_path / "run", tmp_path / "exported", tmp_path / "converted"
    flags = ["--model.init_from", str(glm53_base), "--data.batch_size", "2", "--data.seq_len", "32",
             "--train.steps", "2", "--checkpoint.dir", str(run), "--checkpoint.export_hf", str(exported)]
    assert main(flags + (["--lora.rank", "2"] if lora else [])) == 0
    assert convert.main([str(run), str(converted)] + (["--merge-lora"] if lora else [])) == 0

    assert sorted(os.listdir(converted)) == sorted(os.listdir(exported))
    config = json.loads((exported / "config.json").read_text())
    assert json.loads((converted / "config.json").read_text()) == config
    base_config = json.loads((glm53_base / "config.json").read_text())
    assert config["architectures"] == ["Glm5NextForConditionalGeneration"]
    assert config["vision_config"] == base_config["vision_config"]

    ours, theirs, base = tensors(converted), tensors(exported), tensors(glm53_base)
    assert ours.keys() == theirs.keys()
    assert [k for k in ours if ours[k] != theirs[k]] == []
    vision = [k for k in base if k.startswith("model.visual.")]
    assert vision and all(ours[k] == base[k] for k in vision)
    text = [k for k in base if k.startswith("model.language_model.layers.")]
    assert any(ours[k][2] != base[k][2] for k in text)  # trained: the text model moved, the vision tower did not


def test_convert_of_a_glm53_run_whose_base_is_gone_is_an_error(glm53_base, tmp_path, capsys):
    """Converting a GLM-5.3 run needs the checkpoint it started from (its vision tower travels with the export):
    without it, one error line naming it, and nothing written."""
    import shutil

    base = tmp_path / "base"
    shutil.copytree(glm53_base, base)
    run = tmp_path / "run"
    assert main(["--model.init_from", str(base), "--data.batch_size", "2", "--data.seq_len", "32",
                 "--train.steps", "1", "--checkpoint.dir", str(run)]) == 0
    shutil.rmtree(base)
    capsys.readouterr()
    assert convert.main([str(run), str(tmp_path / "out")]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: ") and str(base) in err[0], err
    assert not (tmp_path / "out").exists()


def test_a_preset_run_s_export_loads_in_transformers_tokenizer_included(tmp_path):
    """A byte-tokenizer (preset) GLM-5.3 run's export: AutoTokenizer loads its tokenizer as the run's (the same
    ids for text, special tokens and the chat template; config.json's bos/eos/pad), AutoModelForImageTextToText its
    weights (AutoModelForCausalLM does not take glm5_next, as the README says), and its logits are glm5f's."""
    import transformers

    import glm5f
    from glm5f.data.chat import ChatFormat

    run, exported = tmp_path / "run", tmp_path / "hf"
    assert main(["--model.preset", "glm53-tiny", "--data.batch_size", "2", "--data.seq_len", "32", "--train.steps",
                 "1", "--eval.every", "0", "--checkpoint.dir", str(run), "--checkpoint.export_hf", str(exported)]) == 0
    tok, fmt = transformers.AutoTokenizer.from_pretrained(exported), ChatFormat.load(None)
    text = "héllo wörld 🙂 <|user|> x\n\t"
    assert tok(text).input_ids == fmt.tok.encode(text) and tok.decode(tok(text).input_ids) == text
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"},
                {"role": "assistant", "content": "yo"}]
    rendered = tok.apply_chat_template(messages, tokenize=True)
    assert list(getattr(rendered, "input_ids", rendered)) == fmt.ids(messages)
    config = json.loads((exported / "config.json").read_text())["text_config"]
    assert (tok.bos_token_id, tok.eos_token_id, tok.pad_token_id) == (config["bos_token_id"], config["eos_token_id"],
                                                                      config["pad_token_id"]) == (256, 257, 258)
    model = transformers.AutoModelForImageTextToText.from_pretrained(exported)
    assert type(model).__name__ == "Glm5NextForConditionalGeneration"
    with pytest.raises(ValueError, match="Unrecognized configuration class"):
        transformers.AutoModelForCausalLM.from_pretrained(exported)
    cfg, params = glm5f.load_hf(exported)
    ids = torch.tensor([tok(text).input_ids])
    with torch.no_grad():
        assert torch.allclose(model(ids).logits, glm5f.forward(params, cfg, ids), rtol=0, atol=1e-4)
