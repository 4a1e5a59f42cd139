"""Nothing an objective's flags say is silently ignored: every flag of one objective's section given under another
objective is refused, naming the flag, both objectives and what to do; --dpo.reference under GRPO points to GRPO's own
--rl.reference, which is the KL term's reference (read as --dpo.reference is)."""

import dataclasses
import typing

import pytest
import torch

import glm5f
from configs import parse, validate
from glm5f.core.params import flatten
from glm5f.objectives import OBJECTIVES
from glm5f.parallel.layout import Layout
from glm5f.run.setup import init_reference

TINY = ["--model.preset", "glm5-tiny", "--data.batch_size", "2", "--data.seq_len", "32"]
DATA = {"lm": ["--data.type", "synthetic"], "dpo": ["--data.type", "preference", "--data.path", "p.jsonl"],
        "grpo": ["--data.type", "rollouts", "--data.path", "r.jsonl"]}


def other_value(kind, value):
    """A value of type `kind` other than `value`."""
    if typing.get_origin(kind) is typing.Literal:
        return next(c for c in typing.get_args(kind) if c != value)
    if isinstance(value, bool):
        return not value
    if isinstance(value, (int, float)):
        return value + 1
    return "routing" if value == "" else "somewhere"


def section_flags():
    """(owner objective, section, field) of every field of every objective's settings section."""
    return [(name, row.settings, f) for name, row in OBJECTIVES.items() if row.settings
            for f in dataclasses.fields(row.config)]


@pytest.mark.parametrize("under", ["lm", "dpo", "grpo"])
def test_every_flag_of_another_objectives_section_is_refused(under):
    flags = section_flags()
    assert {s for _, s, _ in flags} == {"dpo", "rl"} and len(flags) > 15
    for owner, section, f in flags:
        if owner == under:
            continue
        cfg = parse([*TINY, "--train.objective", under, *DATA[under]])
        section_cfg = getattr(cfg, section)
        kind = typing.get_type_hints(type(section_cfg))[f.name]
        given = dataclasses.replace(section_cfg, **{f.name: other_value(kind, getattr(section_cfg, f.name))})
        errs = validate(dataclasses.replace(cfg, **{section: given}))
        said = [e for e in errs if e.startswith(f"--{section}.{f.name} ")]
        assert said and f"is for --train.objective {owner}, not {under}" in said[0] \
            and f"drop it, or pass --train.objective {owner}" in said[0], (section, f.name, errs)


def test_dpo_reference_under_grpo_is_refused_and_names_rl_reference():
    errs = validate(parse([*TINY, "--train.objective", "grpo", *DATA["grpo"], "--rl.kl_beta", "0.1",
                           "--dpo.reference", "ref"]))
    assert errs == ["--dpo.reference is for --train.objective dpo, not grpo (which would ignore it); drop it, or pass "
                    "--train.objective dpo (grpo's own is --rl.reference)"]
    assert validate(parse([*TINY, "--train.objective", "grpo", *DATA["grpo"], "--rl.kl_beta", "0.1",
                           "--rl.reference", "ref"])) == []
    assert validate(parse([*TINY, "--train.objective", "grpo", *DATA["grpo"], "--rl.reference", "ref"])) == [
        "--rl.reference ref is the KL term's reference, and --rl.kl_beta is 0 (no KL term): pass --rl.kl_beta > 0, "
        "or drop --rl.reference"]
    assert validate(parse([*TINY, "--train.objective", "grpo", *DATA["grpo"], "--rl.kl_beta", "0.1", "--rl.reference",
                           "ref", "--lora.rank", "2"]))[0].startswith("--rl.reference with --lora.rank: a LoRA run's "
                                                                     "reference is its base")


def test_rl_reference_is_the_kl_reference(tmp_path):
    """GRPO with --rl.reference keeps that checkpoint's weights as its reference (in the compute dtype), not the
    run's starting weights; without it, a copy of the starting weights."""
    model_cfg = glm5f.preset("glm5-tiny")
    saved = glm5f.init_params(model_cfg, seed=7)
    glm5f.save_hf(str(tmp_path / "ref"), model_cfg, saved)
    start = glm5f.init_params(model_cfg, seed=0)
    flags = [*TINY, "--train.objective", "grpo", *DATA["grpo"], "--rl.kl_beta", "0.1"]
    layout = Layout(torch.device("cpu"))
    given = flatten(init_reference(parse([*flags, "--rl.reference", str(tmp_path / "ref")]), model_cfg, start, layout))
    default = flatten(init_reference(parse(flags), model_cfg, start, layout))
    for p, t in flatten(saved).items():
        assert torch.equal(given[p], t.to(given[p].dtype)), p
        assert torch.equal(default[p], flatten(start)[p].to(default[p].dtype)), p
    assert any(not torch.equal(given[p], default[p]) for p in given)
