"""glm5f/posttrain/rl_losses.py: every advantage x policy loss x aggregation row's step loss, gradients and own metrics
equal the written formula computed per completion in fp64 over glm5f.token_logprobs (groups of unequal sizes and
lengths, masked tokens, two micro-batches cutting a group); rollout_is refuses data without rollout log-probs."""

import itertools
import json
import math
import os

import pytest
import torch
from torch.utils import _pytree as pytree

import glm5f
from conftest import cli
from glm5f.core.params import flatten
from glm5f.data.rollouts import Completion, Group, rollout_batch
from glm5f.data.tokens import IGNORE_INDEX, Example
from glm5f.parallel.layout import Layout
from glm5f.posttrain import grpo, rl_losses
from glm5f.train.loss import Step, step_grads

EPS_LOW, EPS_HIGH, CAP, MAX_NEW, STD_EPS = 0.2, 0.28, 2.0, 12, 1e-4
SEQ = 16


# ---- the written formulas, one completion at a time -------------------------------------------------------------

def advantage(name: str, rewards: list[float]) -> list[float]:
    """A_i of each completion of one group (Python floats)."""
    n = len(rewards)
    mean = sum(rewards) / n
    if name == "grpo":
        std = math.sqrt(sum((r - mean) ** 2 for r in rewards) / (n - 1))
        return [(r - mean) / (std + STD_EPS) for r in rewards]
    if name == "dr_grpo":
        return [r - mean for r in rewards]
    assert name == "rloo"
    return [r - sum(rewards[j] for j in range(n) if j != i) / (n - 1) for i, r in enumerate(rewards)]


def token_losses(policy: str, A: float, lp, old, rollout) -> tuple[torch.Tensor, dict]:
    """The per-token losses [n] of one completion (gspo: its sequence loss at each token) and its metric counts."""
    if policy == "clip":
        rho = torch.exp(lp - old)
        w = torch.clamp(torch.exp(old - rollout), max=CAP)
        un, cl = rho * A, rho.clamp(1 - EPS_LOW, 1 + EPS_HIGH) * A
        return -torch.minimum(un, cl) * w, {"clip_fraction": int((cl < un).sum()),
                                            "tis_capped_fraction": int((w >= CAP).sum())}
    if policy == "gspo":
        s = torch.exp((lp - old).mean())
        un, cl = s * A, s.clamp(1 - EPS_LOW, 1 + EPS_HIGH) * A
        return (-torch.minimum(un, cl)).expand(len(lp)), {"seq_clip_fraction": int(cl < un)}
    if policy == "cispo":
        rho = torch.exp(lp - old)
        return -torch.clamp(rho, max=1 + EPS_HIGH).detach() * A * lp, {"clip_fraction": int((rho > 1 + EPS_HIGH).sum())}
    assert policy == "rollout_is"
    r = torch.exp(lp - rollout)
    keep = (r > 1 - EPS_LOW) & (r < 1 + EPS_HIGH)
    return -(r.detach() * keep) * A * lp, {"rollout_rs_masked_fraction": int((~keep).sum())}


def formula(groups: list[list[dict]], adv: str, policy: str, agg: str) -> tuple[torch.Tensor, dict]:
    """The step's loss over groups of completions {"reward", "lp", "old", "rollout"} (each [n] over its trained
    tokens) and its metrics."""
    per, counts = [], {}
    for group in groups:
        for c, A in zip(group, advantage(adv, [c["reward"] for c in group])):
            losses, n = token_losses(policy, A, c["lp"], c["old"], c["rollout"])
            per.append(losses)
            for k, v in n.items():
                counts[k] = counts.get(k, 0) + v
    N, C = sum(len(p) for p in per), len(per)
    if agg == "token_mean":
        value = torch.cat(per).sum() / N
    elif agg == "sequence_mean":
        value = sum(p.mean() for p in per) / C
    else:
        assert agg == "token_sum_norm"
        value = torch.cat(per).sum() / (C * MAX_NEW)
    return value, {k: v / (C if k == "seq_clip_fraction" else N) for k, v in counts.items()}


# ---- a batch of two groups (4 and 3 completions, unequal lengths, masked tokens) --------------------------------

def settings(adv: str = "grpo", policy: str = "clip", agg: str = "token_mean", **kw) -> grpo.RLConfig:
    return grpo.RLConfig(advantage=adv, policy_loss=policy, aggregation=agg, max_new_tokens=MAX_NEW,
                           epsilon_low=EPS_LOW, epsilon_high=EPS_HIGH, tis_cap=CAP, **kw)


@pytest.fixture(scope="module")
def case():
    """glm5-tiny in fp64; groups of 4 and 3 completions of 3 to 9 tokens after prompts of 2 to 5, two of them with
    untrained tokens inside; the old policy's and the engine's log-probabilities are the policy's own moved per
    completion and per token (so ratios clip and tokens drop); the engine gives one for untrained tokens too."""
    cfg = glm5f.preset("glm5-tiny")
    params = pytree.tree_map(lambda t: t.double(), glm5f.init_params(cfg, 0))
    g = torch.Generator().manual_seed(0)
    ids = lambda k: torch.randint(2, cfg.vocab_size, (k,), generator=g).tolist()  # noqa: E731
    shifts = [0.5, -0.45, 0.0, 0.3, -0.3, 0.1, 0.6]  # of each completion's old log-probabilities
    rewards = [[1.0, 0.0, 2.5, 0.25], [0.5, 3.0, 1.0]]
    masked = {1: [1, 2], 4: [3]}  # completion -> its untrained tokens
    groups, recs, k = [], [], 0
    for gi, rs in enumerate(rewards):
        prompt, members, group = ids(2 + 3 * gi), [], []
        for r in rs:
            c = ids(3 + (k * 5) % 7)
            labels = [IGNORE_INDEX if j in masked.get(k, ()) else t for j, t in enumerate(c)]
            with torch.no_grad():
                full = glm5f.token_logprobs(params, cfg, torch.tensor([prompt + c]))[0]
            own = full[len(prompt) - 1:len(prompt) - 1 + len(c)]
            rollout = (own + torch.empty_like(own).uniform_(-0.4, 0.4, generator=g)).clamp(max=0)
            old = own + shifts[k] + torch.empty_like(own).uniform_(-0.3, 0.3, generator=g)
            members.append(Completion(Example(prompt + c, [IGNORE_INDEX] * len(prompt) + labels), r,
                                      rollout.tolist(), {}))
            group.append({"prompt": prompt, "ids": c, "trained": [t != IGNORE_INDEX for t in labels],
                          "reward": r, "old": old, "rollout": rollout})
            k += 1
        groups.append(Group(tuple(members), f"g{gi}", {}))
        recs.append(group)
    batch = rollout_batch(groups, SEQ, 0)
    batch["old_targets"] = torch.zeros(len(batch["reward"]), SEQ, dtype=torch.float64)
    for row, c in enumerate(c for group in recs for c in group):
        p = len(c["prompt"])
        batch["old_targets"][row, p - 1:p - 1 + len(c["ids"])] = torch.where(torch.tensor(c["trained"]), c["old"], 0.0)
    return cfg, params, batch, recs


def formula_inputs(case) -> tuple[list, list[torch.Tensor]]:
    """The groups `formula` reads, logp from per-completion glm5f.token_logprobs with gradients to `leaves`."""
    cfg, params, _, recs = case
    grad_params = pytree.tree_map(lambda t: t.detach().requires_grad_(), params)
    groups = []
    for group in recs:
        out = []
        for c in group:
            p, keep = len(c["prompt"]), torch.tensor(c["trained"])
            full = glm5f.token_logprobs(grad_params, cfg, torch.tensor([c["prompt"] + c["ids"]]))[0]
            out.append({"reward": c["reward"], "lp": full[p - 1:p - 1 + len(c["ids"])][keep],
                        "old": c["old"][keep], "rollout": c["rollout"][keep]})
        groups.append(out)
    return groups, flatten(grad_params)


@pytest.fixture(scope="module")
def reference(case):
    return formula_inputs(case)


def run_step(case, o, micro_batches: int = 2):
    cfg, params, batch, _ = case
    step = Step(dtype=torch.float64, objective=grpo.GRPO, settings=o, grad_accum=micro_batches)
    return step_grads(params, batch, cfg, Layout(torch.device("cpu")), step)


COVER = {("grpo", "clip", "token_mean"), ("dr_grpo", "gspo", "sequence_mean"), ("grpo", "gspo", "token_mean"),
         ("rloo", "cispo", "token_sum_norm"), ("rloo", "rollout_is", "token_mean")}  # every row of every table
ROWS = [pytest.param(*r, id="-".join(r), marks=[] if r in COVER else [pytest.mark.slow])
        for r in itertools.product(rl_losses.ADVANTAGES, rl_losses.POLICY_LOSSES, rl_losses.AGGREGATIONS)]


@pytest.mark.parametrize("adv,policy,agg", ROWS)
def test_each_row_s_loss_gradient_and_metrics_equal_the_formula(case, reference, adv, policy, agg):
    """Two micro-batches, the first cutting the 4-completion group after its third: the step's loss, every
    gradient and the row's own metrics equal the formula over the global batch."""
    groups, leaves = reference
    metrics, grads, _ = run_step(case, settings(adv, policy, agg))
    value, expected = formula(groups, adv, policy, agg)
    assert abs(metrics["loss"] - value.item()) <= 1e-10, (metrics["loss"], value.item())
    want = dict(zip(leaves, torch.autograd.grad(value, list(leaves.values()), retain_graph=True, allow_unused=True)))
    worst = max(float((grads[p] - (want[p] if want[p] is not None else 0)).abs().max()) for p in grads)
    scale = max(float(w.abs().max()) for w in want.values() if w is not None)
    assert worst <= 1e-10 * max(scale, 1.0) and scale > 1e-4, (worst, scale)
    print(f"{adv} {policy} {agg}: |loss - formula| {abs(metrics['loss'] - value.item()):.1e}, max |gradient - "
          f"formula's| {worst:.1e} (largest gradient {scale:.1e})")
    for k, v in expected.items():
        assert abs(metrics[k] - v) <= 1e-12, (k, metrics[k], v)
    _, _, _, recs = case
    trained = [t for group in recs for c in group for t in c["trained"]]  # the engine gave every token's
    assert abs(metrics["rollout_logprob_masked_fraction"] - trained.count(False) / len(trained)) <= 1e-12


@pytest.mark.parametrize("policy", rl_losses.POLICY_LOSSES)
def test_the_case_clips_caps_and_drops(reference, policy):
    """Each row's own metrics are strictly between 0 and 1 on the case, so the tests above compare numbers that
    count something."""
    metrics = formula(reference[0], "grpo", policy, "token_mean")[1]
    assert metrics and all(0 < v < 1 for v in metrics.values()), metrics


@pytest.mark.parametrize("loss,rows", [("dapo", ("grpo", "clip", "token_mean")),
                                       ("grpo", ("grpo", "clip", "sequence_mean"))])
def test_rl_loss_is_its_two_rows_and_the_flags_override_them(loss, rows):
    assert rl_losses.rows(grpo.RLConfig(loss=loss)) == rows
    assert rl_losses.rows(grpo.RLConfig(loss=loss, advantage="rloo", aggregation="token_sum_norm")) == \
        ("rloo", "clip", "token_sum_norm")


@pytest.mark.parametrize("o,message", [
    (grpo.RLConfig(policy_loss="ppo"), "--rl.policy_loss must be one of clip, gspo, cispo, rollout_is"),
    (grpo.RLConfig(aggregation="token_sum_norm", max_new_tokens=0), "must be >= 1; got 0"),
])
def test_rows_no_table_has_are_refused(o, message):
    with pytest.raises(ValueError, match=message):
        rl_losses.rows(o)


def test_rollout_is_refuses_a_batch_without_rollout_logprobs(case):
    from glm5f.train.loss import with_targets

    _, _, batch, recs = case
    b = dict(batch, rollout_logprobs=batch["rollout_logprobs"].clone())
    b["rollout_logprobs"][2] = float("nan")  # the third completion's, all trained
    n = sum(sum(c["trained"]) for group in recs for c in group)
    with pytest.raises(ValueError, match=rf"rollout_is .* {len(recs[0][2]['ids'])} of the batch's {n} trained tokens"):
        grpo.prepare(with_targets(b), settings(policy="rollout_is"))
    grpo.prepare(with_targets(b), settings(policy="cispo"))  # the others read none


def test_rollout_is_refuses_a_rollouts_file_without_logprobs_at_its_line(tmp_path):
    from train import train

    recs = [{"prompt_ids": [3, 4, 5], "completions": [{"ids": [6, 7], "reward": r, "logprobs": [-1.0, -2.0]}
                                                     for r in (0.0, 1.0)]} for _ in range(2)]
    del recs[1]["completions"][1]["logprobs"]
    path = tmp_path / "r.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in recs))
    flags = ["--model.preset", "glm5-tiny", "--train.objective", "grpo", "--data.type", "rollouts", "--data.path",
             str(path), "--data.batch_size", "2", "--data.seq_len", "8", "--train.steps", "1", "--eval.every", "0",
             "--checkpoint.dir", str(tmp_path / "run")]
    with pytest.raises(ValueError, match=rf"^{path}:2: completion 1 has no 'logprobs'; --rl.policy_loss rollout_is"):
        train(cli(*flags, "--rl.policy_loss", "rollout_is"))
    assert not os.path.exists(tmp_path / "run" / "checkpoints")
