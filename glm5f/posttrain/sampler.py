"""The on-policy sampler (`--data.type prompts`): prompt records read into memory, groups of completions sampled from
them with the cached decoder under the current policy, scored by a reward function, served as GRPO's rollout batch.

Prompt record: {"prompt": str | "messages" (or "prompt"): [...] | "prompt_ids": [int], ...any other fields, passed to
the reward function (`rollouts.record_columns`: verl's reward_model.ground_truth also as ground_truth)}. Shape
suffixes: B rows (one completion each), P prompts (B = P x group), S prompt length, T decoded positions, V vocabulary.
"""

from __future__ import annotations

import importlib
import os
import sys
from dataclasses import dataclass, field

import torch

from glm5f.core.config import GLM5Config
from glm5f.data.files import file_records
from glm5f.data.overlong import fitting
from glm5f.data.readers import chat_prompt
from glm5f.data.rollouts import Completion, Group, prompt_ids, record_columns, rollout_batch
from glm5f.data.sources import shuffle_draw
from glm5f.model.decode import stream
from glm5f.posttrain.rewards import RewardFn, Rewards, form_of
from glm5f.data.tokens import IGNORE_INDEX, Example, check_vocab

RESERVED = ("completion", "completion_ids", "completions", "prompts")  # reward arguments a record's fields may not be


@dataclass(frozen=True)
class Prompt:
    ids: list[int]  # the prompt's token ids (a chat's rendered up to the assistant's turn)
    text: str  # the record's prompt, the rendered messages, or the decoded prompt_ids
    stops: tuple[int, ...]  # the ids a completion ends at (the template's stop tokens for a chat, else eos)
    fields: dict  # the record's other fields
    where: str  # file:line
    messages: list | None = None  # a chat record's messages (None for the others)


def prompt_of(rec, where: str, tok, fmt) -> Prompt:
    """The Prompt of one record (see the module docstring); a ValueError naming `where` for a bad one."""
    if not isinstance(rec, dict):
        raise ValueError(f"{where}: expected a JSON object, found {type(rec).__name__}")
    rec = chat_prompt(rec, where)
    ids = prompt_ids(rec, where, tok, fmt)
    if not ids:
        raise ValueError(f"{where}: the prompt has no tokens; give it at least one")
    taken = [k for k in RESERVED if k in rec]
    if taken:
        raise ValueError(f"{where}: field {taken[0]!r} is the name of a reward function's argument (the sampled "
                         f"completion, or TRL's lists); rename it")
    if "prompt_ids" in rec:
        text, stops = tok.decode(ids), (tok.eos_id,)
    elif "messages" in rec:
        text, stops = fmt.render(rec["messages"], add_generation_prompt=True)[0], tuple(fmt.stop_ids)
    else:
        text, stops = rec["prompt"], (tok.eos_id,)
    return Prompt(ids, text, tuple(i for i in stops if i is not None), record_columns(rec, where), where,
                  rec.get("messages"))


def read_prompts(path: str, tok, fmt) -> list[Prompt]:
    """Every prompt of a JSONL file (blank lines skipped); a ValueError naming file:line for a bad record."""
    return [prompt_of(rec, where, tok, fmt) for where, rec in file_records(path, "prompt records")]


def load_reward(spec: str, flag: str = "--rl.reward"):
    """The function `spec` ("module:function") names, imported with the working directory and PYTHONPATH on
    sys.path; a ValueError naming `flag` saying what is wrong."""
    module, _, name = spec.partition(":")
    if not module or not name:
        raise ValueError(f"{flag} {spec!r}: expected module:function, e.g. my_rewards:score")
    for d in [os.getcwd(), *filter(None, os.environ.get("PYTHONPATH", "").split(os.pathsep))]:
        if d not in sys.path:
            sys.path.append(d)
    try:
        fn = getattr(importlib.import_module(module), name)
    except Exception as e:  # the module is code: importing it can fail any way
        raise ValueError(f"{flag} {spec}: cannot import it ({type(e).__name__}: {e}); check the module is on "
                         f"the working directory or PYTHONPATH and defines {name}") from None
    if not callable(fn):
        raise ValueError(f"{flag} {spec}: {name} is a {type(fn).__name__}, not a function")
    return fn


def load_rewards(spec: str, weights: str = "", workers: int = 1) -> Rewards:
    """The --rl.reward functions (comma-separated module:function, each `load_reward`ed, its form `form_of`'s) with
    their --rl.reward_weights (comma-separated; default 1 each), called on `workers` threads; a ValueError naming
    the flag for a function that cannot be used. Each is logged under its function's name (its spec when two
    share one)."""
    specs = [x.strip() for x in spec.split(",") if x.strip()]
    ws = [float(w) for w in weights.split(",")] if weights.strip() else [1.0] * len(specs)
    if len(ws) != len(specs):
        raise ValueError(f"--rl.reward_weights {weights}: {len(ws)} weights for the {len(specs)} functions of "
                         f"--rl.reward {spec}; give one per function")
    names = [x.partition(":")[2] for x in specs]
    fns = []
    for x, w, name in zip(specs, ws, names):
        flag = f"--rl.reward {x}"
        fn = load_reward(x)
        fns.append(RewardFn(fn, form_of(fn, flag), w, name if names.count(name) == 1 else x, flag))
    return Rewards(fns, workers)


@torch.no_grad()
def decode_rows(params: dict, cfg: GLM5Config, rows: list[Prompt], s, pad_id: int,
                generator: torch.Generator | list[torch.Generator] | None,
                device, group: int = 1) -> tuple[list[list[int]], list[list[float]], dict]:
    """(each row's completion ids, their log-probabilities, the replay records): all rows decoded together on one
    cache (`decode.stream`, `generator` as `decode.sample` takes it; `s` the --rl settings, `grpo.RLConfig`, of
    which it reads temperature, top_p, max_new_tokens and replayed), the prompts left-padded, each row up to
    s.max_new_tokens and ending at the first of its stop ids (kept: it is part of the completion). With `group`,
    each prompt of `rows` is decoded `group` times (output row i * group + k: its k-th), its prefill run once and
    its cache shared by the group's rows (`decode.stream(..., group=)`): the output is the one of `rows` with each
    prompt repeated `group` times. A log-probability is the raw log_softmax of the model's logits at temperature 1,
    whatever the sampling temperature and top_p: the policy's log-probability the GRPO objective compares with.
    Records: for each field of s.replayed, per row a LongTensor [positions, slots, k] of what the decoder chose at
    each position of prompt + completion but the last (`decode.stream(..., record=True)`)."""
    P, S, M = len(rows), max(len(p.ids) for p in rows), s.max_new_tokens
    ids_PxS = torch.full((P, S), pad_id, dtype=torch.long, device=device)
    mask_PxS = torch.zeros(P, S, dtype=torch.long, device=device)
    for i, p in enumerate(rows):
        ids_PxS[i, S - len(p.ids):] = torch.tensor(p.ids, device=device)
        mask_PxS[i, S - len(p.ids):] = 1
    rows = [p for p in rows for _ in range(group)]
    B = len(rows)
    stop_BxV = torch.zeros(B, cfg.vocab_size, dtype=torch.bool, device=device)
    for b, p in enumerate(rows):
        stop_BxV[b, list(p.stops)] = True
    done_B = torch.zeros(B, dtype=torch.bool, device=device)
    tokens, logps, alive, recs = [], [], [], []
    for new_B, logits_BxV, *seen in stream(params, cfg, ids_PxS, M, attention_mask=mask_PxS, eos_token_id=None,
                                           temperature=s.temperature, top_p=s.top_p, generator=generator,
                                           with_logits=True, record=bool(s.replayed), group=group):
        recs += seen
        logps.append(torch.log_softmax(logits_BxV, dim=-1).gather(1, new_B[:, None])[:, 0])
        tokens.append(new_B)
        alive.append(~done_B)
        done_B = done_B | stop_BxV.gather(1, new_B[:, None])[:, 0]  # each row's own stop ids end it
        if bool(done_B.all()):
            break
    keep_BxN = torch.stack(alive, 1).cpu()
    tokens_BxN, logps_BxN = torch.stack(tokens, 1).cpu(), torch.stack(logps, 1).cpu()
    n_B = keep_BxN.sum(1).tolist()
    records = {}
    for f in s.replayed:  # positions S - len(prompt) .. S - 1 of the prompt, then the completion's but its last
        whole = torch.cat([r[f] for r in recs], 1).cpu()
        records[f] = [whole[b, S - len(p.ids):S + n_B[b] - 1] for b, p in enumerate(rows)]
    return ([tokens_BxN[b][keep_BxN[b]].tolist() for b in range(B)],
            [logps_BxN[b][keep_BxN[b]].tolist() for b in range(B)], records)


def sample_groups(params: dict, cfg: GLM5Config, prompts: list[Prompt], s, reward, tok, pad_id: int,
                  generator: torch.Generator | None = None, reward_name: str = "the reward function") -> list[Group]:
    """One Group per prompt: s.group_size completions sampled from `params` (see `decode_rows`: all of the call's
    completions decoded together, each prompt prefilled once for its group; `generator` one for all, or a list of
    one per prompt) at s.temperature / s.top_p, each with its log-probabilities, the reward `reward` gives it (a
    `rewards.Rewards`, or one function called as `rewards.form_of` says; the completion's text is that of its ids
    less a final stop id) and the decoder's choices of experts and keys s.replayed asks for (its `replay`); a
    ScoredGroup, with each function's rewards."""
    device = params["model"]["embed_tokens"]["weight"].device
    completions, logprobs, replay = decode_rows(params, cfg, prompts, s, pad_id, generator, device,
                                                group=s.group_size)
    texts = [[tok.decode(ids[:-1] if ids and ids[-1] in p.stops else ids) for ids in
              completions[g * s.group_size:(g + 1) * s.group_size]] for g, p in enumerate(prompts)]
    scorer = reward if isinstance(reward, Rewards) else Rewards.of(reward, reward_name)
    totals, parts = scorer.score([(p, texts[g], completions[g * s.group_size:(g + 1) * s.group_size])
                                  for g, p in enumerate(prompts)])
    groups = []
    for g, p in enumerate(prompts):
        members = []
        for k, r in enumerate(range(g * s.group_size, (g + 1) * s.group_size)):
            ids = completions[r]
            members.append(Completion(Example(p.ids + ids, [IGNORE_INDEX] * len(p.ids) + ids), totals[g][k],
                                      logprobs[r], {f: v[r] for f, v in replay.items()}))
        groups.append(ScoredGroup(tuple(members), p.where, {"prompt_ids": p.ids, **p.fields},
                                  rewards={name: tuple(v[g]) for name, v in parts.items()}))
    return groups


ENDINGS = ("answer", "done", "max_turns", "context", "length", "environment")  # agent.Episode.ended


def episode_metrics(groups: list[Group]) -> dict[str, float]:
    """An agent batch's episodes (the groups' `episodes`): the mean turns, the share of episodes ending each way
    (`agent.Episode.ended`; "ended_length": a turn ran out of tokens before its stop token) and the failed tool
    calls or environment steps per episode; {} for single-turn groups."""
    eps = [e for g in groups for e in g.episodes]
    if not eps:
        return {}
    n = len(eps)
    ended = {f"ended_{w}": sum(e == w for _, e, _ in eps) / n for w in ENDINGS}
    return {"turns": sum(t for t, _, _ in eps) / n, **ended, "tool_errors": sum(f for _, _, f in eps) / n}
@dataclass(frozen=True)
class ScoredGroup(Group):
    """A sampled Group with each reward function's rewards of its completions (name -> one per completion)."""

    rewards: dict = field(default_factory=dict)


class PromptSource:
    """--data.batch_size prompts per batch in a seeded per-epoch order of the file's prompts (as
    `rollouts.RolloutSource` orders groups), each batch sampled with the params it is given (`next_batch(params)`)
    into GRPO's rollout batch. Under a multi-process layout each rank samples its share of the prompts and the
    ranks exchange their groups, so every rank holds the whole batch. Each prompt's group is sampled with a
    generator of its own, seeded by (`sample_seed`, the prompt's draw number): the state is that count, so a
    resumed run samples what the uninterrupted run would, and every layout draws the same numbers. A prompt leaving
    no room for --rl.max_new_tokens within --data.seq_len refuses the source, or with `skip_overlong` is left out
    (`skipped`: `overlong.Skipped`, None when none was)."""

    def __init__(self, prompts: list[Prompt], batch_size: int, seq_len: int, cfg: GLM5Config, seed: int, pad_id: int,
                 settings, reward, reward_name: str, tok, sample_seed: int,
                 device: torch.device | str = "cpu", skip_overlong: bool = False):
        M = settings.max_new_tokens
        prompts, self.skipped = fitting(
            prompts, lambda p: None if len(p.ids) + M <= seq_len else (
                f"{p.where}: a prompt of {len(p.ids)} tokens leaves no room for --rl.max_new_tokens {M} within "
                f"--data.seq_len {seq_len}; raise --data.seq_len to {len(p.ids) + M} or shorten the prompt"),
            lambda p: p.where, skip_overlong, "prompts", prompts[0].where.rsplit(":", 1)[0] if prompts else "",
            seq_len)
        check_vocab([Example(p.ids, p.ids) for p in prompts], cfg.vocab_size, "prompts")
        self.prompts, self.B, self.S, self.cfg, self.seed, self.pad_id = prompts, batch_size, seq_len, cfg, seed, pad_id
        self.settings, self.reward, self.reward_name, self.tok = settings, reward, reward_name, tok
        self.sample_seed, self.device, self.drawn = sample_seed, torch.device(device), 0
        self.epoch, self.index = 0, 0
        self._order = self._permutation(0)

    def _permutation(self, epoch: int) -> list[int]:
        g = torch.Generator().manual_seed(self.seed * 100_003 + epoch)
        return torch.randperm(len(self.prompts), generator=g).tolist()

    def next_prompts(self) -> list[Prompt]:
        out = []
        for _ in range(self.B):
            out.append(self.prompts[self._order[self.index]])
            self.index += 1
            if self.index == len(self.prompts):
                self.epoch, self.index = self.epoch + 1, 0
                self._order = self._permutation(self.epoch)
        return out

    def next_batch(self, params: dict, layout=None) -> dict[str, torch.Tensor]:
        """The next batch, sampled with `params` (the whole weights, on every rank of `layout`)."""
        return rollout_batch(self.next_groups(params, layout), self.S, self.pad_id)

    def next_groups(self, params: dict, layout=None) -> list[Group]:
        """The groups of the next --data.batch_size prompts, sampled with `params`, every rank holding all."""
        prompts = self.next_prompts()
        rank, world = (layout.rank, layout.world) if layout is not None else (0, 1)
        lo, hi = rank * len(prompts) // world, (rank + 1) * len(prompts) // world
        generators = [torch.Generator(self.device).manual_seed(shuffle_draw(self.sample_seed, self.drawn + j) >> 1)
                      for j in range(lo, hi)]  # non-negative int64 seeds
        self.drawn += len(prompts)
        groups = self.sample(params, prompts[lo:hi], generators) if hi > lo else []
        if world > 1:
            groups = [g for part in layout.gather_objects(groups) for g in part]
        return groups

    def sample(self, params: dict, prompts: list[Prompt], generators: list[torch.Generator]) -> list[Group]:
        """The groups of `prompts` (this rank's share), one generator each."""
        return sample_groups(params, self.cfg, prompts, self.settings, self.reward, self.tok, self.pad_id, generators,
                             reward_name=self.reward_name)

    def state_dict(self) -> dict:
        return {"epoch": self.epoch, "index": self.index, "drawn": self.drawn}

    def load_state_dict(self, state: dict) -> None:
        self.epoch, self.index, self.drawn = state["epoch"], state["index"], state["drawn"]
        self._order = self._permutation(self.epoch)
