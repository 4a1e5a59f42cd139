"""glm5f/posttrain/grpo.py: GRPO's step-1 loss from a rollouts file equals the formula over Transformers' fp64
log-probabilities (the engine's log-probabilities weighting each token); with two updates per batch the second pass
clips as the formula says (resumed between the two); advantages as torch.std gives them; a batch whose groups all
have equal rewards trains nothing; the flags that cannot work are refused; three other rows of the loss tables
(glm5f/posttrain/rl_losses.py) from train.py equal their formula over the same log-probabilities."""

import json
import math
import os
import statistics
from fractions import Fraction

import pytest
import torch

import glm5f
from configs import validate
from conftest import cli, hf_model_fp64, stable_topk, transformers_in_fp64
from glm5f.ckpt import checkpoint
from glm5f.posttrain.rl_losses import STD_EPS, advantages
from train import train

EPS_LOW, EPS_HIGH, CAP = 0.2, 0.28, 2.0


def rollout_records(vocab: int, groups: int = 2, size: int = 3, seed: int = 0) -> list[dict]:
    """Groups of token-id completions with distinct rewards; the engine's log-probabilities filled in later."""
    g = torch.Generator().manual_seed(seed)
    ids = lambda k: torch.randint(0, vocab, (k,), generator=g).tolist()  # noqa: E731
    return [{"prompt_ids": ids(3 + i), "completions": [{"ids": ids(2 + j + i), "reward": float(j * (i + 1) % 3 + j / 7)}
                                                       for j in range(size)]} for i in range(groups)]


def completion_logp(model, rec: dict, c: dict) -> torch.Tensor:
    """log p of each completion token [n] given what precedes it, from the Transformers model in fp64."""
    ids = rec["prompt_ids"] + c["ids"]
    with torch.no_grad(), transformers_in_fp64(), stable_topk():
        logits = model(torch.tensor([ids])).logits[0]
    lp = torch.log_softmax(logits[:-1].double(), -1).gather(-1, torch.tensor(ids[1:])[:, None])[:, 0]
    return lp[len(rec["prompt_ids"]) - 1:]


def formula(recs, logp, old, scale="group", loss="dapo") -> dict:
    """The issue's GRPO loss over the records, logp/old: (record, completion) -> [n] log-probabilities; the
    engine's come from each completion's "logprobs"."""
    terms, rewards, clipped, capped = [], [], [], []
    for rec in recs:
        r = torch.tensor([c["reward"] for c in rec["completions"]], dtype=torch.float64)
        rewards.append(r)
    every = torch.cat(rewards)
    for rec, r in zip(recs, rewards):
        std = every.std() if scale == "batch" else r.std()
        for c, ri in zip(rec["completions"], r):
            A = (ri - r.mean()) / (std + STD_EPS)
            lp, o = logp(rec, c), old(rec, c)
            rho = torch.exp(lp - o)
            w = torch.clamp(torch.exp(o - torch.tensor(c["logprobs"], dtype=torch.float64)), max=CAP)
            un, cl = rho * A, rho.clamp(1 - EPS_LOW, 1 + EPS_HIGH) * A
            terms.append(-torch.minimum(un, cl) * w)
            clipped.append(cl < un)
            capped.append(w >= CAP)
    n = sum(len(t) for t in terms)
    value = torch.cat(terms).sum() / n if loss == "dapo" else torch.stack([t.mean() for t in terms]).mean()
    return {"loss": float(value), "clip_fraction": float(torch.cat(clipped).double().mean()),
            "tis_capped_fraction": float(torch.cat(capped).double().mean())}


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    """A Transformers GLM-5 policy saved to disk and a rollouts file whose engine log-probabilities are the
    policy's own, moved by up to +-1 (so some importance weights reach the cap)."""
    tmp = tmp_path_factory.mktemp("grpo")
    cfg = glm5f.preset("glm5-tiny")
    with transformers_in_fp64():
        policy = hf_model_fp64(cfg, seed=0)
    policy.float().save_pretrained(tmp / "policy")
    policy.double()
    recs = rollout_records(cfg.vocab_size)
    g = torch.Generator().manual_seed(1)
    for rec in recs:
        for c in rec["completions"]:
            lp = completion_logp(policy, rec, c)
            c["logprobs"] = (lp + torch.empty_like(lp).uniform_(-1, 1, generator=g)).clamp(max=0).tolist()
    path = tmp / "rollouts.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in recs))
    return tmp, policy, recs, str(path)


def grpo_flags(tmp, data: str, run: str, *extra: str) -> list[str]:
    return ["--model.init_from", str(tmp / "policy"), "--train.objective", "grpo", "--data.type", "rollouts",
            "--data.path", data, "--data.batch_size", "2", "--data.seq_len", "16", "--train.dtype", "float64",
            "--eval.every", "0", "--optim.warmup_steps", "0", "--checkpoint.dir", str(tmp / run), *extra]


@pytest.mark.parametrize("loss", ["dapo", "grpo"])
def test_step_one_loss_equals_the_formula_with_transformers_fp64(setup, loss):
    tmp, policy, recs, data = setup
    records = train(cli(*grpo_flags(tmp, data, f"run_{loss}", "--train.steps", "1", "--rl.loss", loss)))
    own = lambda rec, c: completion_logp(policy, rec, c)  # noqa: E731
    expected = formula(recs, own, own, loss=loss)
    r = records[0]
    assert abs(r["loss"] - expected["loss"]) <= 1e-8, (r["loss"], expected)
    assert abs(expected["loss"]) > 1e-3  # the weights make it differ from 0 (each group's advantages sum to 0)
    assert r["clip_fraction"] == 0 and abs(r["tis_capped_fraction"] - expected["tis_capped_fraction"]) <= 1e-12
    assert 0 < r["tis_capped_fraction"] < 1
    gaps = torch.cat([(completion_logp(policy, rec, c) - torch.tensor(c["logprobs"], dtype=torch.float64)).abs()
                      for rec in recs for c in rec["completions"]])
    assert abs(r["rollout_logprob_gap"] - float(gaps.mean())) <= 1e-8
    assert abs(r["rollout_logprob_gap_max"] - float(gaps.max())) <= 1e-8
    rewards = torch.tensor([c["reward"] for rec in recs for c in rec["completions"]], dtype=torch.float64)
    assert abs(r["reward"] - float(rewards.mean())) <= 1e-12 and abs(r["reward_std"] - float(rewards.std())) <= 1e-12


@pytest.mark.parametrize("adv,policy,agg", [("rloo", "rollout_is", "token_sum_norm"),
                                            ("dr_grpo", "cispo", "sequence_mean"), ("grpo", "gspo", "token_mean")])
def test_step_one_loss_of_other_rows_equals_their_formula_with_transformers_fp64(setup, adv, policy, agg):
    """--rl.advantage / --rl.policy_loss / --rl.aggregation rows (tests/test_rl_losses.py's formula, old = logp at
    step 1): the loss and the row's own metrics from train.py."""
    from test_rl_losses import MAX_NEW, formula as rows_formula

    tmp, policy_model, recs, data = setup
    records = train(cli(*grpo_flags(tmp, data, f"run_{policy}", "--train.steps", "1", "--rl.advantage", adv,
                                    "--rl.policy_loss", policy, "--rl.aggregation", agg,
                                    "--rl.max_new_tokens", str(MAX_NEW))))
    groups = [[{"reward": c["reward"], "lp": lp, "old": lp, "rollout": torch.tensor(c["logprobs"], dtype=torch.float64)}
               for c in rec["completions"] for lp in [completion_logp(policy_model, rec, c)]] for rec in recs]
    value, metrics = rows_formula(groups, adv, policy, agg)
    assert abs(records[0]["loss"] - value.item()) <= 1e-8 and abs(value.item()) > 1e-3, (records[0]["loss"], value)
    for k, v in metrics.items():
        assert abs(records[0][k] - v) <= 1e-12, (k, records[0][k], v)


def test_the_second_update_on_a_batch_clips_as_the_formula_says(setup):
    """--rl.updates_per_batch 2: step 2 takes the batch of step 1 again, its ratio against the policy before step
    1 (old), resumed from a checkpoint taken between the two updates."""
    tmp, policy, recs, data = setup
    flags = grpo_flags(tmp, data, "run_two", "--rl.updates_per_batch", "2", "--optim.lr", "3e-2",
                       "--checkpoint.every", "1")
    train(cli(*flags, "--train.steps", "1"))
    records = train(cli(*flags, "--train.steps", "2", "--checkpoint.resume", "latest"))
    _, params = checkpoint.load_params(os.path.join(tmp, "run_two", "checkpoints", "step_00000001"))

    def new(rec, c):
        ids = rec["prompt_ids"] + c["ids"]
        with torch.no_grad():
            lp = torch.log_softmax(glm5f.forward(params, glm5f.preset("glm5-tiny"), torch.tensor([ids]))[0, :-1], -1)
        return lp.gather(-1, torch.tensor(ids[1:])[:, None])[:, 0][len(rec["prompt_ids"]) - 1:]

    old = lambda rec, c: completion_logp(policy, rec, c)  # noqa: E731
    expected = formula(recs, new, old)
    r = records[-1]
    assert r["step"] == 2
    assert abs(r["loss"] - expected["loss"]) <= 1e-8, (r["loss"], expected)
    assert abs(r["clip_fraction"] - expected["clip_fraction"]) <= 1e-12 and expected["clip_fraction"] > 0


def test_advantages_as_torch_std_gives_them():
    reward = torch.tensor([1.0, 0.0, 2.0, 5.0, 5.0, 3.0], dtype=torch.float64)
    group = torch.tensor([0, 0, 0, 1, 1, 1])
    a = advantages(reward, group, "group")
    for g in (0, 1):
        r = reward[group == g]
        assert torch.allclose(a[group == g], (r - r.mean()) / (r.std() + STD_EPS), rtol=0, atol=1e-15)
    b = advantages(reward, group, "batch")
    assert torch.allclose(b[:3], (reward[:3] - 1.0) / (reward.std() + STD_EPS), rtol=0, atol=1e-15)
    assert torch.equal(advantages(reward, group, "none"), reward - torch.tensor([1.0] * 3 + [13 / 3] * 3,
                                                                               dtype=torch.float64))


def test_groups_with_equal_rewards_train_nothing_and_say_so(setup, capsys):
    tmp, _, recs, _ = setup
    flat = [{**rec, "completions": [{**c, "reward": 1.0} for c in rec["completions"]]} for rec in recs]
    path = tmp / "flat.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in flat))
    records = train(cli(*grpo_flags(tmp, str(path), "run_flat", "--train.steps", "1")))
    assert records[0]["skipped"] and records[0]["loss"] == 0 and records[0]["frac_reward_zero_std"] == 1
    out, err = capsys.readouterr()
    assert "nothing to learn" in out and "no evaluation" not in out  # --eval.every 0: off, without a line
    assert "got no gradient" not in err  # a skipped step's zero gradients are no advice about --lora.targets
    _, after = checkpoint.load_params(os.path.join(tmp, "run_flat", "checkpoints", "step_00000001"))
    _, before = glm5f.load_hf(str(tmp / "policy"), dtype=torch.float64)
    assert all(torch.equal(a, b) for a, b in zip(glm5f.core.params.flatten(after).values(),
                                                 glm5f.core.params.flatten(before).values()))


def exact_advantages(rewards: list[float], scale: str, batch: list[float]) -> list[float]:
    """(r - mean) / (std + STD_EPS) of each reward of one group, in exact rational arithmetic (statistics' exact
    sums; the std correctly rounded), std the group's, the batch's or none."""
    mean = sum(map(Fraction, rewards)) / len(rewards)
    if scale == "none":
        return [float(Fraction(r) - mean) for r in rewards]
    std = Fraction(statistics.stdev(batch if scale == "batch" else rewards)) + Fraction(STD_EPS)
    return [float((Fraction(r) - mean) / std) for r in rewards]


@pytest.mark.parametrize("scale", ["group", "batch", "none"])
def test_advantages_of_rewards_too_large_for_fp64_sums_are_exact_not_zero(scale):
    groups = [[1e308, 0.0, -5e307], [1.0, 2.0, 4.0], [1.7e308, 1.7e308, 1.6e308]]
    reward = torch.tensor([r for g in groups for r in g], dtype=torch.float64)
    group = torch.tensor([i for i, g in enumerate(groups) for _ in g])
    got = advantages(reward, group, scale)
    expected = [a for g in groups for a in exact_advantages(g, scale, reward.tolist())]
    assert torch.isfinite(got).all()
    for a, e in zip(got.tolist(), expected):
        assert abs(a - e) <= 1e-14 * max(abs(e), 1) and (a == 0) == (e == 0), (got, expected)


def test_an_advantage_past_fp64_is_refused():
    reward = torch.tensor([1.7e308, -1.7e308, -1.7e308], dtype=torch.float64)
    with pytest.raises(ValueError, match="passes fp64's largest number"):
        advantages(reward, torch.tensor([0, 0, 0]), "none")


@pytest.mark.parametrize("flags,message", [
    (["--train.objective", "grpo", "--data.type", "text"], "trains on --data.type rollouts"),
    (["--train.objective", "lm", "--data.type", "rollouts", "--data.path", "x.jsonl"], "for --train.objective grpo"),
    (["--train.objective", "grpo", "--data.type", "rollouts", "--data.path", "x.jsonl", "--rl.epsilon_low", "1.5"],
     "--rl.epsilon_low must lie in [0, 1)"),
    (["--train.objective", "grpo", "--data.type", "rollouts", "--data.path", "x.jsonl", "--rl.updates_per_batch",
      "0"], "--rl.updates_per_batch >= 1"),
])
def test_flags_that_cannot_work_are_refused(flags, message):
    assert any(message in e for e in validate(cli(*flags)))


def test_a_reward_that_is_not_finite_stops_the_run_in_one_line(setup, tmp_path):
    tmp, _, recs, _ = setup
    bad = [recs[0], {**recs[1], "completions": [{**recs[1]["completions"][0], "reward": math.inf}]
                     + recs[1]["completions"][1:]}]
    path = tmp_path / "bad.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in bad).replace("Infinity", "1e999"))
    with pytest.raises(ValueError, match=rf"{path}:2: completion 0: 'reward' must be a finite number"):
        train(cli(*grpo_flags(tmp, str(path), "run_bad", "--train.steps", "1")))
    assert not os.path.exists(os.path.join(tmp, "run_bad", "checkpoints"))


def test_the_plan_counts_each_group_s_rows_and_the_kl_reference(tmp_path):
    from glm5f.run.plan import plan, run_shape

    recs = rollout_records(64, groups=2, size=4)
    path = tmp_path / "r.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in recs))
    base = ["--model.preset", "glm5-tiny", "--data.batch_size", "4", "--data.seq_len", "32"]
    grpo = [*base, "--train.objective", "grpo", "--data.type", "rollouts", "--data.path", str(path)]
    lm, off, on = (run_shape(cli(*flags)) for flags in (base, grpo, [*grpo, "--rl.kl_beta", "0.1"]))
    assert (lm.micro_batch, off.micro_batch) == (4, 16)  # 4 groups of 4 completions, one per row
    cfg = glm5f.preset("glm5-tiny")
    assert plan(cfg, off)["objective_bytes"] == 0
    dpo = run_shape(cli(*base, "--train.objective", "dpo", "--data.type", "preference", "--data.path", "x.jsonl"))
    assert plan(cfg, on)["objective_bytes"] == plan(cfg, dpo)["objective_bytes"] > 0  # the same reference copy


def test_routing_replay_step_one_equals_transformers_with_its_router_picking_the_recorded_experts(setup,
                                                                                                 hf_router_replay):
    """Completions carrying "routing" (random experts, not the router's choice) and --rl.replay routing: step 1's
    loss is the formula over Transformers' fp64 log-probabilities with its router made to pick those experts; the
    engine's log-probabilities are those same replayed ones, so the importance weights are 1 and the gap 0."""
    from glm5f.core.replay import replay_shapes, replay_slots

    tmp, policy, recs, _ = setup
    cfg = glm5f.preset("glm5-tiny")
    M, K = replay_shapes(cfg)["routing"]
    g = torch.Generator().manual_seed(5)
    slots = replay_slots(cfg)["routing"]

    def replayed_logp(rec, c):
        routing = torch.tensor(c["routing"] + [[[-1] * K] * M])  # the last position has no record
        for layer, m in slots.items():
            policy.model.layers[layer].mlp.gate.replay = routing[:, m]
        try:
            return completion_logp(policy, rec, c)
        finally:
            for layer in slots:
                policy.model.layers[layer].mlp.gate.replay = None

    replay_recs = json.loads(json.dumps(recs))
    for rec in replay_recs:
        for c in rec["completions"]:
            n = len(rec["prompt_ids"]) + len(c["ids"])
            c["routing"] = [[torch.randperm(cfg.n_routed_experts, generator=g)[:K].tolist() for _ in range(M)]
                            for _ in range(n - 1)]
            c["logprobs"] = replayed_logp(rec, c).tolist()
    path = tmp / "routed.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in replay_recs))
    replayed_run = train(cli(*grpo_flags(tmp, str(path), "run_replay", "--train.steps", "1", "--rl.replay", "routing")))
    own_run = train(cli(*grpo_flags(tmp, str(path), "run_noreplay", "--train.steps", "1")))
    expected = formula(replay_recs, replayed_logp, replayed_logp)
    r = replayed_run[0]
    assert abs(r["loss"] - expected["loss"]) <= 1e-8, (r["loss"], expected)
    assert r["rollout_logprob_gap_max"] <= 1e-9 and r["tis_capped_fraction"] == 0
    assert own_run[0]["rollout_logprob_gap"] > 1e-3  # without replay the router's own experts give other numbers


def test_the_plan_counts_the_sampler_s_cache_and_its_rows():
    from glm5f.model.decode import init_cache
    from glm5f.run.plan import plan, run_shape

    cfg = glm5f.preset("glm5-tiny")
    shape = run_shape(cli("--model.preset", "glm5-tiny", "--train.objective", "grpo", "--data.type", "prompts",
                          "--data.path", "p.jsonl", "--rl.reward", "m:f", "--data.batch_size", "2",
                          "--rl.group_size", "4", "--data.seq_len", "32"))
    assert shape.micro_batch == 8  # 2 prompts x 4 completions
    cache = init_cache(cfg, 8, 32, torch.float32)
    assert plan(cfg, shape)["objective_bytes"] == sum(t.numel() * 4 for layer in cache.layers for t in layer.values())
