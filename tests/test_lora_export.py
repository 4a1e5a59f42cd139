"""LoRA export: glm5f.ckpt.hf.save_peft's adapter directory, loaded by PEFT onto Transformers' GlmMoeDsaForCausalLM,
gives the logits of glm5f's forward of the merged weights (fp32); the merged export (lora.merge + save_hf) gives
PEFT's logits through Transformers alone. Adapters are random in A and B, so a swapped, transposed, misnamed or
mis-scaled factor shows."""

import json
import os
import warnings

import pytest
import torch
from safetensors.torch import load_file

import glm5f
from conftest import stable_topk
from glm5f.ckpt import hf
from glm5f.model import lora

pytest.importorskip("peft")

CFG = glm5f.preset("glm5-tiny")  # layer 0 dense, layers 1-2 MoE (8 experts, a shared expert)
S = 40  # longer than index_topk (16): the indexer selects, so its adapters count


def random_adapters(params: dict, spec: lora.LoraSpec, seed: int = 0) -> dict:
    """Adapters with random, non-zero A and B, large enough to move the logits well past the tolerance."""
    g = torch.Generator().manual_seed(seed)
    return {k: torch.randn(v.shape, generator=g) * 0.1 for k, v in lora.init_adapters(params, spec).items()}


def peft_model(base_path, adapter_dir, model_class=None):
    """Transformers' model of `base_path` (AutoModelForCausalLM, or `model_class`) with the PEFT adapter of
    `adapter_dir` (un-merged), checking that every tensor of the file lands in an adapter (no missing, no
    unexpected key) with its value."""
    from peft import PeftModel, get_peft_model_state_dict
    from transformers import AutoModelForCausalLM

    model_class = model_class or AutoModelForCausalLM
    base = model_class.from_pretrained(base_path, attn_implementation="eager").eval()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model = PeftModel.from_pretrained(base, adapter_dir).eval()
    # PEFT warns of missing adapter keys and of targets that match nothing. It also warns that rank_pattern and
    # alpha_pattern keys match no module when they match parameters (it checks modules only): those patterns are
    # checked below, by the ranks and scales of the adapters PEFT built.
    assert not [str(w.message) for w in caught if not issubclass(w.category, (FutureWarning, DeprecationWarning))
                and "_pattern keys did not match any targeted module" not in str(w.message)]
    saved = load_file(os.path.join(adapter_dir, "adapter_model.safetensors"))
    loaded = get_peft_model_state_dict(model)
    assert saved.keys() == loaded.keys()
    for k, v in saved.items():
        assert torch.equal(v, loaded[k]), k
    return model


def export_and_compare(tmp_path, hf_checkpoint, spec, seed=0):
    """(PEFT's logits, ours, the base model's, the PEFT model) for random adapters of `spec` on a tiny checkpoint."""
    _, path = hf_checkpoint(CFG)
    cfg, params = glm5f.load_hf(path)
    adapters = random_adapters(params, spec, seed)
    merged = lora.merge(params, adapters, spec)
    hf.save_peft(tmp_path / "peft", cfg, adapters, spec, base_model_name_or_path=str(path))
    ids = torch.randint(0, cfg.vocab_size, (2, S), generator=torch.Generator().manual_seed(1))
    model = peft_model(path, tmp_path / "peft")
    from peft.tuners.lora import LoraLayer
    scales = {m.scaling["default"] for m in model.modules() if isinstance(m, LoraLayer)}
    assert scales == {spec.scale}, "every adapter PEFT built (ranks from rank_pattern included) has our scale"
    with torch.no_grad(), stable_topk():  # the indexer's scores tie (at 0, after its ReLU): break ties as we do
        theirs = model(ids).logits
        ours = glm5f.forward(merged, cfg, ids)
        base = glm5f.forward(params, cfg, ids)
    return theirs, ours, base, model, merged


def check_merged_weights(model, merged):
    """PEFT's merge_and_unload gives, tensor for tensor, our merged weights (as Transformers holds them)."""
    theirs = model.merge_and_unload().state_dict()
    for key, w in hf.hf_state_dict(merged, fused_experts=True).items():
        if key in theirs:
            assert (theirs[key] - w).abs().max() <= 1e-6, key


def test_attention_targets_round_trip(tmp_path, hf_checkpoint):
    spec = lora.LoraSpec(rank=4, alpha=8.0)  # the default targets: the attention projections
    theirs, ours, base, model, merged = export_and_compare(tmp_path, hf_checkpoint, spec)
    assert (ours - base).abs().max() > 0.05, "the adapters must move the logits for the test to mean anything"
    print(f"attention targets: max |PEFT - ours| = {(theirs - ours).abs().max():.2e}")
    assert (theirs - ours).abs().max() <= 1e-5
    config = json.loads((tmp_path / "peft" / "adapter_config.json").read_text())
    assert config["target_modules"] == ["self_attn.kv_a_proj_with_mqa", "self_attn.kv_b_proj", "self_attn.o_proj",
                                        "self_attn.q_a_proj", "self_attn.q_b_proj"]
    assert (config["r"], config["lora_alpha"], config["task_type"], config["target_parameters"]) == \
        (4, 8, "CAUSAL_LM", None)
    check_merged_weights(model, merged)


def test_every_adaptable_weight_round_trip(tmp_path, hf_checkpoint):
    """Attention, indexer, the dense and shared MLPs (PEFT parameter adapters) and the routed experts (gate and up
    fused into one rank-2r adapter on gate_up_proj, down_proj per expert)."""
    spec = lora.LoraSpec(rank=3, alpha=5.0, targets=".")
    theirs, ours, base, model, merged = export_and_compare(tmp_path, hf_checkpoint, spec, seed=2)
    assert (ours - base).abs().max() > 0.05
    print(f"every weight: max |PEFT - ours| = {(theirs - ours).abs().max():.2e}")
    assert (theirs - ours).abs().max() <= 1e-5
    config = json.loads((tmp_path / "peft" / "adapter_config.json").read_text())
    assert config["target_parameters"] == ["mlp.down_proj.weight", "mlp.experts.down_proj",
                                           "mlp.experts.gate_up_proj", "mlp.gate_proj.weight",
                                           "mlp.shared_experts.down_proj.weight", "mlp.shared_experts.gate_proj.weight",
                                           "mlp.shared_experts.up_proj.weight", "mlp.up_proj.weight"]
    assert config["target_modules"] == ["self_attn.indexer.weights_proj", "self_attn.indexer.wk",
                                        "self_attn.indexer.wq_b", "self_attn.kv_a_proj_with_mqa", "self_attn.kv_b_proj",
                                        "self_attn.o_proj", "self_attn.q_a_proj", "self_attn.q_b_proj"]
    assert config["rank_pattern"] == {r"mlp\.experts\.gate_up_proj": 6}
    assert config["alpha_pattern"] == {r"mlp\.experts\.gate_up_proj": 10}
    check_merged_weights(model, merged)


def test_some_experts_round_trip(tmp_path, hf_checkpoint):
    """Layer 1: gate only (a rank-r gate_up_proj adapter, its up half zero), no down; layer 2: gate, up and down
    (a rank-2r gate_up_proj adapter, nested inside down_proj's)."""
    spec = lora.LoraSpec(rank=2, alpha=4.0, targets=r"layers\.1\.mlp\.experts\.gate_proj|layers\.2\.mlp\.experts\.")
    theirs, ours, base, model, merged = export_and_compare(tmp_path, hf_checkpoint, spec, seed=3)
    assert (ours - base).abs().max() > 0.05
    print(f"some experts: max |PEFT - ours| = {(theirs - ours).abs().max():.2e}")
    assert (theirs - ours).abs().max() <= 1e-5
    config = json.loads((tmp_path / "peft" / "adapter_config.json").read_text())
    assert config["target_modules"] == []
    assert config["target_parameters"] == ["model.layers.2.mlp.experts.down_proj", "mlp.experts.gate_up_proj"]
    assert config["rank_pattern"] == {r"model\.layers\.2\.mlp\.experts\.gate_up_proj": 4}
    check_merged_weights(model, merged)


def test_merged_export_matches_peft(tmp_path, hf_checkpoint):
    """scripts/convert.py --merge-lora's form: lora.merge (fp32) + save_hf, loaded by Transformers alone."""
    from transformers import AutoModelForCausalLM

    spec = lora.LoraSpec(rank=4, alpha=16.0, targets=r"self_attn\.(q_b_proj|o_proj)$|experts\.(up|down)_proj")
    theirs, ours, _, _, merged = export_and_compare(tmp_path, hf_checkpoint, spec, seed=4)
    hf.save_hf(tmp_path / "merged", CFG, merged)
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "merged", attn_implementation="eager").eval()
    ids = torch.randint(0, CFG.vocab_size, (2, S), generator=torch.Generator().manual_seed(1))
    with torch.no_grad(), stable_topk():
        exported = model(ids).logits
    print(f"merged export: max |Transformers(merged) - PEFT| = {(exported - theirs).abs().max():.2e}")
    assert (exported - theirs).abs().max() <= 1e-5
    assert (exported - ours).abs().max() <= 1e-5


def test_layout_of_expert_factors():
    """PEFT's parameter adapter holds lora_A [E * r, in] with row e * r + k = A_e[k] and lora_B [out, r * E] with
    column k * E + e = B_e[:, k]: checked here on single entries, independently of PEFT."""
    spec = lora.LoraSpec(rank=2, targets=r"experts\.down_proj")
    E, D, F = CFG.n_routed_experts, CFG.hidden_size, CFG.moe_intermediate_size
    a = torch.arange(E * 2 * F, dtype=torch.float32).reshape(E, 2, F)
    b = torch.arange(E * D * 2, dtype=torch.float32).reshape(E, D, 2) + 0.5
    module = "model.layers.1.mlp.experts"
    tensors, _ = hf.peft_adapter(CFG, {f"{module}.down_proj.lora_A": a, f"{module}.down_proj.lora_B": b}, spec)
    pa = tensors[f"base_model.model.{module}.lora_A.weight"]
    pb = tensors[f"base_model.model.{module}.lora_B.weight"]
    assert pa.shape == (E * 2, F) and pb.shape == (D, 2 * E)
    for e, k, i, o in [(0, 0, 0, 0), (3, 1, 5, 7), (E - 1, 1, F - 1, D - 1)]:
        assert pa[e * 2 + k, i] == a[e, k, i]
        assert pb[o, k * E + e] == b[e, o, k]


def test_adapters_that_do_not_fit_are_refused(tmp_path):
    params = glm5f.init_params(CFG)
    spec = lora.LoraSpec(rank=4)
    adapters = random_adapters(params, spec)
    with pytest.raises(ValueError, match=r"\(15 in all\):\n  model\.layers\.0\.self_attn\.q_a_proj: "
                       r"expected lora_A \[2, 64\] and lora_B \[32, 2\] \(weight \[32, 64\], rank 2\), "
                       r"found \[4, 64\] and \[32, 4\]"):
        hf.save_peft(tmp_path / "a", CFG, adapters, lora.LoraSpec(rank=2))
    with pytest.raises(ValueError, match="model.layers.0.nope: expected"):
        hf.save_peft(tmp_path / "a", CFG, {**adapters, "model.layers.0.nope.lora_A": torch.zeros(4, 64)}, spec)
    assert not os.path.exists(tmp_path / "a")


def test_mtp_layer_adapters_are_left_out(tmp_path):
    """Transformers' model has no MTP layers: their adapters are left out with a warning that points to the merged
    export; when they are all there is, the export is refused."""
    cfg = glm5f.preset("glm5-tiny", num_nextn_predict_layers=1)
    params = glm5f.init_params(cfg)
    spec = lora.LoraSpec(rank=2, targets=r"layers\.(0|3)\.self_attn\.o_proj$")
    adapters = random_adapters(params, spec)
    with pytest.warns(UserWarning, match=r"leaving out .*model\.layers\.3\.self_attn\.o_proj.*--merge-lora"):
        hf.save_peft(tmp_path / "a", cfg, adapters, spec)
    assert sorted(load_file(tmp_path / "a" / "adapter_model.safetensors")) == [
        "base_model.model.model.layers.0.self_attn.o_proj.lora_A.weight",
        "base_model.model.model.layers.0.self_attn.o_proj.lora_B.weight"]
    only_mtp = {k: v for k, v in adapters.items() if ".layers.3." in k}
    with pytest.warns(UserWarning), pytest.raises(ValueError, match="--merge-lora"):
        hf.save_peft(tmp_path / "b", cfg, only_mtp, spec)
    assert not os.path.exists(tmp_path / "b")


def test_dropout_is_written_where_peft_takes_it(tmp_path):
    params = glm5f.init_params(CFG)
    attention = lora.LoraSpec(rank=2, dropout=0.1)
    hf.save_peft(tmp_path / "a", CFG, random_adapters(params, attention), attention)
    assert json.loads((tmp_path / "a" / "adapter_config.json").read_text())["lora_dropout"] == 0.1
    experts = lora.LoraSpec(rank=2, dropout=0.1, targets="experts")
    with pytest.warns(UserWarning, match="lora_dropout 0.1 written as 0"):
        hf.save_peft(tmp_path / "b", CFG, random_adapters(params, experts), experts)
    assert json.loads((tmp_path / "b" / "adapter_config.json").read_text())["lora_dropout"] == 0.0


def test_dtype_as_saved(tmp_path):
    params = glm5f.init_params(CFG)
    spec = lora.LoraSpec(rank=2, targets=r"self_attn\.o_proj|mlp\.experts")
    adapters = {k: v.to(torch.bfloat16) for k, v in random_adapters(params, spec).items()}
    hf.save_peft(tmp_path / "a", CFG, adapters, spec)
    saved = load_file(tmp_path / "a" / "adapter_model.safetensors")
    assert len(saved) == 2 * (3 + 2 * 2) and {t.dtype for t in saved.values()} == {torch.bfloat16}


def test_export_directory_rules(tmp_path, monkeypatch):
    """A foreign non-empty directory is refused and left alone; a previous export is replaced; a failed write leaves
    neither half a directory nor a temporary one."""
    params = glm5f.init_params(CFG)
    spec = lora.LoraSpec(rank=2)
    adapters = random_adapters(params, spec)
    foreign = tmp_path / "foreign"
    foreign.mkdir()
    (foreign / "notes.txt").write_text("mine")
    with pytest.raises(ValueError, match="not a previous glm5f export"):
        hf.save_peft(foreign, CFG, adapters, spec)
    assert os.listdir(foreign) == ["notes.txt"]
    out = tmp_path / "out"
    hf.save_peft(out, CFG, adapters, spec)
    first = load_file(out / "adapter_model.safetensors")
    os.remove(out / hf.EXPORT_MARKER)  # PEFT's two files alone are recognised too
    hf.save_peft(out, CFG, random_adapters(params, spec, seed=1), spec)
    again = load_file(out / "adapter_model.safetensors")
    assert first.keys() == again.keys() and not all(torch.equal(first[k], again[k]) for k in first)

    def broken(*args, **kwargs):
        raise OSError("disk full")
    monkeypatch.setattr(hf.io, "write_safetensors", broken)
    with pytest.raises(OSError):
        hf.save_peft(out, CFG, adapters, spec)
    assert sorted(os.listdir(tmp_path)) == ["foreign", "out"]
    assert torch.equal(load_file(out / "adapter_model.safetensors")[next(iter(again))], next(iter(again.values())))
    with pytest.raises(ValueError, match="--checkpoint.export_peft"):
        hf.check_export_dir(tmp_path, run_dir=out, flag="--checkpoint.export_peft")


@pytest.mark.parametrize("targets", ["default", "every"])
def test_glm53_adapters_load_onto_transformers_glm5next(tmp_path, targets):
    """GLM-5.3 (KDA and DSA layers, dense and MoE MLPs): the PEFT export loads onto Transformers'
    Glm5NextForConditionalGeneration (modules under model.language_model, KDA's forget gate under forget_gate; the
    vision tower's mlp projections untouched) and gives glm5f's logits with the adapters, merged and unmerged.
    Default targets: MLA's and KDA's q, k, v, o projections; every: KDA's gates, the indexer and the MLPs too."""
    from peft.tuners.lora import LoraLayer
    from test_glm53 import hf_glm53, random_config
    from transformers import Glm5NextForConditionalGeneration

    hf_glm53(random_config(1, 2, 2), 1).save_pretrained(tmp_path / "base")
    cfg, params = glm5f.load_hf(tmp_path / "base")
    spec = lora.LoraSpec(rank=3, alpha=5.0, targets=lora.DEFAULT_TARGETS if targets == "default" else ".")
    adapters = random_adapters(params, spec, seed=2)
    kda_names = {m.rpartition(".")[2] for m in lora.target_modules(params, spec.targets)
                 if glm5f.core.layers.layer_spec(cfg, int(m.split(".")[2])).attention == "kda"}
    assert kda_names >= {"q_proj", "k_proj", "v_proj", "o_proj"} and not any("conv" in n for n in kda_names)
    hf.save_peft(tmp_path / "peft", cfg, adapters, spec, base_model_name_or_path=str(tmp_path / "base"))
    model = peft_model(tmp_path / "base", tmp_path / "peft", Glm5NextForConditionalGeneration)
    assert not [n for n, m in model.named_modules() if "visual" in n and isinstance(m, LoraLayer)]
    assert {m.scaling["default"] for m in model.modules() if isinstance(m, LoraLayer)} == {spec.scale}
    ids = torch.randint(0, cfg.vocab_size, (2, 20), generator=torch.Generator().manual_seed(1))
    with torch.no_grad(), stable_topk():
        theirs = model(ids).logits
        ours = glm5f.forward(lora.attach(params, adapters), cfg, ids, lora=spec)
        merged = glm5f.forward(lora.merge(params, adapters, spec), cfg, ids)
        base = glm5f.forward(params, cfg, ids)
    assert (ours - base).abs().max() > 0.05
    assert (theirs - ours).abs().max() <= 1e-5 and (merged - ours).abs().max() <= 1e-5
    config = json.loads((tmp_path / "peft" / "adapter_config.json").read_text())
    kda = {"self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj"}
    assert kda <= set(config["target_modules"])
    if targets == "every":
        assert {"self_attn.forget_gate.f_a_proj", "self_attn.forget_gate.f_b_proj", "self_attn.b_proj",
                "self_attn.g_a_proj", "self_attn.g_b_proj"} <= set(config["target_modules"])
        assert "mlp.gate_proj.weight" not in config["target_parameters"]  # it would adapt the vision tower too


def test_adapter_config_names_a_local_base_by_its_absolute_path(tmp_path, monkeypatch):
    """PEFT loads the base that adapter_config.json names from wherever the adapter is loaded: a local base given as
    a relative path is written absolute; a name that is no local path (a Hub id) is written as given."""
    params = glm5f.init_params(CFG)
    spec = lora.LoraSpec(rank=2)
    adapters = random_adapters(params, spec)
    (tmp_path / "runs" / "base").mkdir(parents=True)
    monkeypatch.chdir(tmp_path / "runs")
    base = os.path.join(os.path.realpath(tmp_path), "runs", "base")
    for given, written in (("base", base), ("./base/", base), (base, base), ("zai-org/GLM-5", "zai-org/GLM-5"),
                           (None, None)):
        hf.save_peft(tmp_path / "out", CFG, adapters, spec, base_model_name_or_path=given)
        config = json.loads((tmp_path / "out" / "adapter_config.json").read_text())
        assert config["base_model_name_or_path"] == written, given
