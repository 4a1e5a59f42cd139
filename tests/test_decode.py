"""Greedy decoding on the cache equals re-running the full forward for every new token."""

import torch

import glm5f
from glm5f.decode import generate


def naive_greedy(params, cfg, ids, n):
    for _ in range(n):
        ids = torch.cat([ids, glm5f.forward(params, cfg, ids)[:, -1].argmax(-1, keepdim=True)], dim=1)
    return ids


def test_greedy_generate_matches_full_forward_loop():
    cfg = glm5f.preset("glm5-tiny")  # prompt + new tokens cross index_topk: decoding turns sparse midway
    params = glm5f.init_params(cfg, seed=4)
    prompt = torch.randint(0, cfg.vocab_size, (2, 9), generator=torch.Generator().manual_seed(0))
    assert torch.equal(generate(params, cfg, prompt, 20), naive_greedy(params, cfg, prompt, 20))


def test_left_padded_batch_generates_like_each_prompt_alone():
    cfg = glm5f.preset("glm5-tiny")
    params = glm5f.init_params(cfg, seed=5)
    g = torch.Generator().manual_seed(1)
    a, b = torch.randint(0, cfg.vocab_size, (1, 12), generator=g), torch.randint(0, cfg.vocab_size, (1, 5), generator=g)
    batch = torch.zeros(2, 12, dtype=torch.long)
    mask = torch.zeros(2, 12, dtype=torch.long)
    batch[0], mask[0] = a[0], 1
    batch[1, 7:], mask[1, 7:] = b[0], 1
    out = generate(params, cfg, batch, 10, attention_mask=mask)
    assert torch.equal(out[0, 12:], generate(params, cfg, a, 10)[0, 12:])
    assert torch.equal(out[1, 12:], generate(params, cfg, b, 10)[0, 5:])


def test_eos_stops_rows():
    cfg = glm5f.preset("glm5-tiny")
    params = glm5f.init_params(cfg, seed=6)
    prompt = torch.randint(0, cfg.vocab_size, (1, 4), generator=torch.Generator().manual_seed(2))
    free = generate(params, cfg, prompt, 6)
    eos = int(free[0, 6])  # the third generated token
    stopped = generate(params, cfg, prompt, 6, eos_token_id=eos)
    assert eos not in free[0, 4:6].tolist()  # so decoding stops right after the third token
    assert torch.equal(stopped, free[:, :7])
