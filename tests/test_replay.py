"""glm5f/core/replay.py: a forward with recorded experts ("routing") equals Transformers with its router made to pick them,
gradients included; a forward with recorded keys ("indexer") equals attention over exactly those keys; replaying
the model's own choices changes nothing; bad records fail in one line."""

import dataclasses

import pytest
import torch
from torch.func import functional_call

import glm5f
from conftest import hf_model_fp64, stable_topk, transformers_in_fp64, with_grad
from glm5f.core.params import map_with_path
from glm5f.core.replay import check_replay, replay_shapes, replay_slots


def fp64_params(cfg, seed):
    params = map_with_path(lambda path, t: t.double(), glm5f.init_params(cfg, seed=seed))
    with torch.no_grad():  # a router bias that changes the choice (it only chooses, it never weights)
        for layer in replay_slots(cfg)["routing"]:
            params["model"]["layers"][layer]["mlp"]["gate"]["e_score_correction_bias"].normal_(0, 0.1)
    return params


def other_experts(cfg, B, S, seed, unrecorded=()):
    """routing [B, S, M, K]: distinct random experts per position and layer, -1 at the (b, s, slot) `unrecorded`."""
    M, K = replay_shapes(cfg)["routing"]
    g = torch.Generator().manual_seed(seed)
    routing = torch.stack([torch.randperm(cfg.n_routed_experts, generator=g)[:K] for _ in range(B * S * M)])
    routing = routing.view(B, S, M, K)
    for b, s, m in unrecorded:
        routing[b, s, m] = -1
    return routing


def test_routing_replay_equals_transformers_with_its_router_picking_the_recorded_experts(hf_router_replay):
    cfg = glm5f.preset("glm5-tiny")
    params = fp64_params(cfg, seed=1)
    B, S = 2, 24  # S > index_topk: sparse attention too
    ids = torch.randint(0, cfg.vocab_size, (B, S), generator=torch.Generator().manual_seed(2))
    routing = other_experts(cfg, B, S, seed=3, unrecorded=[(0, 5, 0), (1, 0, 1), (1, 7, 0)])
    slots = replay_slots(cfg)["routing"]
    upstream = torch.randn(B, S, cfg.vocab_size, dtype=torch.float64, generator=torch.Generator().manual_seed(4))
    p = with_grad(params)
    routers = [p["model"]["layers"][layer]["mlp"]["gate"]["weight"] for layer in slots]

    ours = glm5f.forward(p, cfg, ids, routing=routing)
    ours_grads = torch.autograd.grad((ours * upstream).sum(), routers)
    with stable_topk(), transformers_in_fp64():
        model = hf_model_fp64(cfg)
        for layer, m in slots.items():
            model.model.layers[layer].mlp.gate.replay = routing[:, :, m].reshape(B * S, -1)
        ref = functional_call(model, glm5f.hf_state_dict(p, fused_experts=True), (ids,)).logits
        ref_grads = torch.autograd.grad((ref * upstream).sum(), routers)
    assert (ours - ref).abs().max() <= 1e-10
    for g, rg in zip(ours_grads, ref_grads):
        assert rg.abs().max() > 1e-3  # the router learns through the replayed experts' weights
        assert (g - rg).abs().max() <= 1e-10 * max(1.0, rg.abs().max().item())
    with torch.no_grad():
        own = glm5f.forward(params, cfg, ids)
    assert (own - ours).abs().max() > 1e-3  # the recorded experts are not the router's own


def test_routing_replay_uses_the_recorded_experts_with_the_routers_weights():
    """One MoE layer: the output is sum_k w_k expert_{e_k}(x) + shared(x) with e the record and w the router's
    normalised, scaled sigmoid scores of e, written out per token; "expert_idx" reports e."""
    from glm5f.model.moe import moe
    from glm5f.core.ops import swiglu_mlp

    cfg = glm5f.preset("glm5-tiny")
    params = fp64_params(cfg, seed=5)
    p = params["model"]["layers"][1]["mlp"]
    B, S, D = 2, 6, cfg.hidden_size
    x = torch.randn(B, S, D, dtype=torch.float64, generator=torch.Generator().manual_seed(6))
    routing = other_experts(cfg, B, S, seed=7, unrecorded=[(1, 2, 0)])[:, :, 0]
    env = glm5f.make_env(cfg, {"input_ids": torch.zeros(B, S, dtype=torch.long)}, torch.float64)[1]
    out, idx, _ = moe(p, x, cfg, env, routing)
    own_out, own_idx, _ = moe(p, x, cfg, env)
    ref = torch.zeros_like(x)
    for b in range(B):
        for s in range(S):
            xs = x[b, s]
            scores = torch.sigmoid(p["gate"]["weight"] @ xs)
            chosen = routing[b, s] if routing[b, s, 0] >= 0 else own_idx.view(B, S, -1)[b, s]
            w = scores[chosen] / scores[chosen].sum() * cfg.routed_scaling_factor
            experts = p["experts"]
            for k, e in enumerate(chosen.tolist()):
                gate, up = experts["gate_proj"]["weight"][e] @ xs, experts["up_proj"]["weight"][e] @ xs
                h = torch.nn.functional.silu(gate) * up
                ref[b, s] += w[k] * (experts["down_proj"]["weight"][e] @ h)
            ref[b, s] += swiglu_mlp(p["shared_experts"], xs)
            assert idx.view(B, S, -1)[b, s].tolist() == chosen.tolist()
    assert (out - ref).abs().max() <= 1e-12
    assert (own_out - out).abs().max() > 1e-3


@pytest.mark.parametrize("preset", ["glm5-tiny", "glm53-tiny"])
def test_replaying_the_models_own_routing_changes_nothing(preset):
    cfg = glm5f.preset(preset)
    params = fp64_params(cfg, seed=8)
    B, S = 2, 32
    ids = torch.randint(0, cfg.vocab_size, (B, S), generator=torch.Generator().manual_seed(9))
    batch = {"input_ids": ids}
    local, env = glm5f.make_env(cfg, batch, torch.float64)
    with torch.no_grad():
        logits, aux = glm5f.apply(params, cfg, local["input_ids"], env)
        routing = torch.stack([aux["layers"][layer]["expert_idx"].view(B, S, -1) for layer in
                               replay_slots(cfg)["routing"]], 2)
        again = glm5f.forward(params, cfg, ids, routing=routing)
        other = glm5f.forward(params, cfg, ids, routing=other_experts(cfg, B, S, seed=10))
    assert torch.equal(again, logits)
    assert (other - logits).abs().max() > 1e-3


def test_bad_routing_fails_in_one_line():
    cfg = glm5f.preset("glm5-tiny")
    B, S = 2, 8
    ids = torch.zeros(B, S, dtype=torch.long)
    M, K = replay_shapes(cfg)["routing"]
    good = other_experts(cfg, B, S, seed=11)
    check_replay({"input_ids": ids, "routing": good}, cfg)
    check_replay({"input_ids": ids[0].tolist(), "routing": good[0].tolist()}, cfg)  # one sequence, as lists
    cases = {
        "must be (2, 8, 2, 2)": good[:, :, :1],
        "expert id 8: ids must lie in [0, n_routed_experts=8)": good.masked_fill(good == good[1, 3, 1, 0], 8),
        "expert id -2": good.masked_fill(good == good[0, 0, 0, 0], -2),
        "some of its experts -1": torch.cat([good[..., :1], torch.full_like(good[..., 1:], -1)], -1),
        "integer tensor": good.double(),
    }
    params = glm5f.init_params(cfg, seed=0)
    for message, routing in cases.items():
        for run in (lambda: check_replay({"input_ids": ids, "routing": routing}, cfg),
                    lambda: glm5f.forward(params, cfg, ids, routing=routing)):
            with pytest.raises(ValueError) as err:
                run()
            assert message in str(err.value) and "\n" not in str(err.value), str(err.value)


# ---- indexer replay -------------------------------------------------------------------------------------------------

def own_selection(params, cfg, ids):
    """(logits, the record of a forward over ids: its own routing and selections) in the batch keys' format."""
    from glm5f.core.replay import record

    local, env = glm5f.make_env(cfg, {"input_ids": ids}, torch.float64)
    env = dataclasses.replace(env, record=True)
    with torch.no_grad():
        logits, aux = glm5f.apply(params, cfg, local["input_ids"], env)
    return logits, record(aux, cfg, env.mask, torch.arange(ids.shape[1]).expand_as(ids))


def key_sets(recorded_BxSxLxT, cfg, S):
    """The keys each query of each indexer layer attends [B, S, L, S] (bool) under `recorded` (every query has a
    record here), written out: GLM-5 the recorded keys; GLM-5.3 the recorded pools' tokens, and the tail, the
    query's own pool up to itself where the query does not end it."""
    from glm5f.core.replay import pool_size

    P = pool_size(cfg)
    B, _, L, T = recorded_BxSxLxT.shape
    sets = torch.zeros(B, S, L, S, dtype=torch.bool)
    for b in range(B):
        for s in range(S):
            for j in range(L):
                for g in recorded_BxSxLxT[b, s, j].tolist():
                    if g >= 0:
                        sets[b, s, j, g * P:(g + 1) * P] = True
                if P > 1 and s % P < P - 1:
                    sets[b, s, j, s - s % P:s + 1] = True
    return sets


def naive_core(sets_per_call):
    """An mla_core attending, in its n-th call, exactly the keys sets_per_call[n] [B, S, T] marks: per head, keys
    and values expanded from the latent rows through kv_b, a softmax over the marked keys, in fp64."""
    calls = iter(sets_per_call)

    def core(p, q_nope, q_rot, latent, topk, mask, cfg, parts=1, allowed=None, topk_dense=True):
        keep_BxSxT = next(calls)
        B, T = latent.shape[:2]
        H, N, R = cfg.num_attention_heads, cfg.qk_nope_head_dim, cfg.kv_lora_rank
        kv = (latent[..., :R] @ p["kv_b_proj"]["weight"].T).view(B, T, H, -1)
        k_nope, v = kv[..., :N], kv[..., N:]
        scores = (torch.einsum("bshn,bthn->bsht", q_nope, k_nope)
                  + torch.einsum("bshp,btp->bsht", q_rot, latent[..., R:])) * cfg.softmax_scale
        scores = scores.masked_fill(~keep_BxSxT[:, :, None, :T], float("-inf"))
        return torch.einsum("bsht,bthv->bshv", scores.softmax(-1), v)
    return core


def random_keys(cfg, own_BxSxLxT, seed):
    """A record of other keys than the indexer's: per query that sees more keys (pools) than it selects, a random
    set of them, some rows with fewer (-1 filled), one row per layer not recorded (all -1: its own choice stays);
    the other queries keep the own record (all they see)."""
    from glm5f.core.replay import pool_size

    P = pool_size(cfg)
    g = torch.Generator().manual_seed(seed)
    rec = own_BxSxLxT.clone()
    B, S, L, T = rec.shape
    for b in range(B):
        for s in range(S):
            seen = (s + 1) // P  # complete pools (keys) visible
            for j in range(L):
                if seen <= T or (b, s) == (1, S - 3):
                    continue
                n = T if s % 3 else T - 3
                rec[b, s, j] = -1
                rec[b, s, j, :n] = torch.randperm(seen, generator=g)[:n]
    return rec


@pytest.mark.parametrize("preset", ["glm5-tiny", "glm53-tiny"])
def test_indexer_replay_attends_exactly_the_recorded_keys(preset, monkeypatch):
    import glm5f.model.attention as attention

    cfg = glm5f.preset(preset)
    params = fp64_params(cfg, seed=12)
    B, S = 2, 24
    ids = torch.randint(0, cfg.vocab_size, (B, S), generator=torch.Generator().manual_seed(13))
    own_logits, own = own_selection(params, cfg, ids)
    recorded = random_keys(cfg, own["indexer"], seed=14)
    assert (recorded != own["indexer"]).any(-1).float().mean() > 0.2
    with torch.no_grad():
        ours = glm5f.forward(params, cfg, ids, indexer=recorded)
    # the reference: every MLA layer attends the written-out sets (a shared layer its group's), through a naive core
    sets = key_sets(recorded, cfg, S)
    slots = replay_slots(cfg)["indexer"]
    per_call, current = [], None
    for layer in range(cfg.num_hidden_layers):
        if layer in slots:
            current = sets[:, :, slots[layer]]
        if glm5f.core.layers.layer_spec(cfg, layer).attention == "mla_dsa":
            per_call.append(current)
    monkeypatch.setattr(attention, "mla_core", naive_core(per_call))
    with torch.no_grad():
        ref = glm5f.forward(params, cfg, ids)
    assert (ours - ref).abs().max() <= 1e-10
    assert (ours - own_logits).abs().max() > 1e-3


@pytest.mark.parametrize("preset", ["glm5-tiny", "glm53-tiny"])
def test_replaying_the_models_own_selections_changes_nothing(preset):
    cfg = glm5f.preset(preset)
    params = fp64_params(cfg, seed=15)
    B, S = 2, 32
    ids = torch.randint(0, cfg.vocab_size, (B, S), generator=torch.Generator().manual_seed(16))
    logits, own = own_selection(params, cfg, ids)
    assert (own["indexer"] >= 0).any() and (own["routing"] >= 0).all()
    with torch.no_grad():
        again = glm5f.forward(params, cfg, ids, routing=own["routing"], indexer=own["indexer"])
        other = glm5f.forward(params, cfg, ids, indexer=random_keys(cfg, own["indexer"], seed=17))
    assert torch.equal(again, logits)
    assert (other - logits).abs().max() > 1e-3


@pytest.mark.parametrize("preset", ["glm5-tiny", "glm53-tiny"])
def test_the_decoders_record_replayed_gives_its_logits(preset):
    """stream(record=True): the prompt's record, then each new position's; replayed in a forward over prompt and
    completion, the logits equal the decoder's (fp64), and the record equals the forward's own choices."""
    from glm5f.model.decode import stream

    cfg = glm5f.preset(preset)
    params = fp64_params(cfg, seed=18)
    B, S, n = 2, 20, 8  # the prompt within index_topk's reach for GLM-5 (records -1), the completion beyond
    prompt = torch.randint(0, cfg.vocab_size, (B, S), generator=torch.Generator().manual_seed(19))
    steps = list(stream(params, cfg, prompt, n, eos_token_id=None, with_logits=True, record=True))
    tokens = torch.cat([prompt] + [t[:, None] for t, _, _ in steps[:-1]], 1)
    routing = torch.cat([r["routing"] for _, _, r in steps], 1)
    indexer = torch.cat([r["indexer"] for _, _, r in steps], 1)
    assert routing.shape == (B, S + n - 1, *replay_shapes(cfg)["routing"])
    assert indexer.shape == (B, S + n - 1, *replay_shapes(cfg)["indexer"])
    check_replay({"input_ids": tokens, "routing": routing, "indexer": indexer}, cfg)
    with torch.no_grad():
        replayed = glm5f.forward(params, cfg, tokens, routing=routing, indexer=indexer)
    decoded = torch.stack([lg for _, lg, _ in steps], 1)
    assert (replayed[:, S - 1:] - decoded).abs().max() <= 1e-10
    _, own = own_selection(params, cfg, tokens)
    assert torch.equal(own["routing"], routing)
    # the same keys, maybe in another order
    assert torch.equal(own["indexer"].sort(-1).values, indexer.sort(-1).values)


def test_bad_indexer_records_fail_in_one_line():
    cfg = glm5f.preset("glm5-tiny")
    B, S = 2, 24
    ids = torch.zeros(B, S, dtype=torch.long)
    L, T = replay_shapes(cfg)["indexer"]
    good = torch.full((B, S, L, T), -1)
    good[:, 20:, :, 0] = 20
    check_replay({"input_ids": ids, "indexer": good}, cfg)
    late = good.clone()
    late[1, 20, 0, 3] = 21
    wide = torch.full((B, S, L, T + 1), -1)
    params = glm5f.init_params(cfg, seed=0)
    for message, indexer in {"key position 21 at (1, 20, 0, 3) beyond its query's position 20": late,
                             "must be (2, 24, 2, 16)": wide}.items():
        for run in (lambda: check_replay({"input_ids": ids, "indexer": indexer}, cfg),
                    lambda: glm5f.forward(params, cfg, ids, indexer=indexer)):
            with pytest.raises(ValueError) as err:
                run()
            assert message in str(err.value) and "\n" not in str(err.value), str(err.value)
    pooled = glm5f.preset("glm53-tiny")
    rec = torch.full((1, 8, *replay_shapes(pooled)["indexer"]), -1)
    rec[0, 5, 0, 0] = 2  # pool 2 holds tokens 4 and 5: complete at position 5, not at 4
    check_replay({"input_ids": torch.zeros(1, 8, dtype=torch.long), "indexer": rec}, pooled)
    rec[0, 4, 0, 0] = 2
    with pytest.raises(ValueError, match=r"pool id \(pools of 2 keys\) 2 at \(0, 4, 0, 0\) beyond"):
        check_replay({"input_ids": torch.zeros(1, 8, dtype=torch.long), "indexer": rec}, pooled)


def test_the_indexer_loss_scores_the_indexers_own_selection_under_replay():
    """With the indexer loss on, replayed keys change what the layer attends, not what its indexer's loss scores:
    the first indexed layer's loss (its inputs the same either way) is the one without replay."""
    from glm5f.model.env import Objectives

    for preset in ("glm5-tiny", "glm53-tiny"):
        cfg = glm5f.preset(preset)
        params = fp64_params(cfg, seed=20)
        B, S = 2, 24
        ids = torch.randint(0, cfg.vocab_size, (B, S), generator=torch.Generator().manual_seed(21))
        _, own = own_selection(params, cfg, ids)
        first = min(replay_slots(cfg)["indexer"])
        losses = []
        for indexer in (None, random_keys(cfg, own["indexer"], seed=22)):
            batch = {"input_ids": ids, "indexer": indexer}
            local, env = glm5f.make_env(cfg, batch, torch.float64,
                                        objectives=Objectives(indexer_loss="sparse", indexer_target="own"))
            with torch.no_grad():
                logits, aux = glm5f.apply(params, cfg, local["input_ids"], env)
            losses.append((logits, aux["layers"][first]["indexer_loss"]))
        (plain, plain_loss), (replayed, replayed_loss) = losses
        assert (plain - replayed).abs().max() > 1e-3
        assert plain_loss > 0 and replayed_loss == plain_loss, preset


def replay_layouts_check() -> None:
    """(Run on 2 ranks.) Context parallelism: two indexed layers (a full one, a shared one) with recorded keys, each
    rank holding its CP share of the queries, equal one process's; expert parallelism: an MoE layer with recorded
    experts, each rank holding its rows and half the experts, equals one process's (fp64)."""
    import torch.distributed as dist

    from glm5f.model.attention import attention
    from glm5f.parallel.distributed import DistLayout
    from glm5f.run.launch import init_process
    from glm5f.model.moe import moe_mlp
    from glm5f.parallel.layout import cp_positions

    init_process(torch.device("cpu"))
    rank, world = dist.get_rank(), dist.get_world_size()
    cfg = glm5f.preset("glm5-tiny")
    params = fp64_params(cfg, seed=23)
    layers = params["model"]["layers"]
    B, S = 2, 32
    g = torch.Generator().manual_seed(24)
    ids = torch.randint(0, cfg.vocab_size, (B, S), generator=g)
    pos = torch.arange(S).expand(B, S).clone()
    pos[1, 12:] -= 12  # row 1 packs two sequences: its records count from each one's start
    _, own = own_selection(params, cfg, ids)
    recorded = random_keys(cfg, own["indexer"], seed=25)
    recorded[1, 12:] = torch.where(recorded[1, 12:] >= 12, recorded[1, 12:] - 12, -1)
    routing = other_experts(cfg, B, S, seed=26, unrecorded=[(0, 3, 0)])
    batch = {"input_ids": ids, "position_ids": pos, "indexer": recorded, "routing": routing}
    x = torch.randn(B, S, cfg.hidden_size, dtype=torch.float64, generator=g)

    def attend(x, env):
        out0, carry, _ = attention(layers[0]["self_attn"], x, cfg, 0, env, None)
        return attention(layers[2]["self_attn"], out0, cfg, 2, env, carry)[0]

    full_env = glm5f.make_env(cfg, batch, torch.float64)[1]
    full = attend(x, full_env)
    q = cp_positions(S, world, rank)
    cp_env = glm5f.make_env(cfg, batch, torch.float64, DistLayout(1, world, 1, torch.device("cpu")))[1]
    assert (attend(x[:, q], cp_env) - full[:, q]).abs().max() <= 1e-12, f"rank {rank}: CP replay differs"
    assert (attend(x, glm5f.make_env(cfg, {"input_ids": ids, "position_ids": pos}, torch.float64)[1])
            - full).abs().max() > 1e-3

    p = layers[1]["mlp"]
    full_moe = moe_mlp(p, x, cfg, 1, full_env)[0]
    E = cfg.n_routed_experts // world
    local_p = {**p, "experts": {k: {"weight": v["weight"][rank * E:(rank + 1) * E]} for k, v in p["experts"].items()}}
    ep_local, ep_env = glm5f.make_env(cfg, batch, torch.float64, DistLayout(world, 1, world, torch.device("cpu")))
    rows = slice(rank * B // world, (rank + 1) * B // world)
    assert torch.equal(ep_local["routing"], routing[rows])
    assert (moe_mlp(local_p, x[rows], cfg, 1, ep_env)[0] - full_moe[rows]).abs().max() <= 1e-12, \
        f"rank {rank}: EP replay differs"
    dist.destroy_process_group()


def test_replay_under_context_and_expert_parallelism():
    from glm5f.run.launch import spawn

    spawn(replay_layouts_check, 2)


@pytest.mark.parametrize("preset", ["glm5-tiny", "glm53-tiny"])
def test_records_count_keys_from_each_packed_sequences_start(preset):
    """Two sequences packed in one row (position_ids restarting), each with its own record, give each sequence's
    logits replayed alone."""
    cfg = glm5f.preset(preset)
    params = fp64_params(cfg, seed=27)
    g = torch.Generator().manual_seed(28)
    seqs = [torch.randint(0, cfg.vocab_size, (1, n), generator=g) for n in (20, 24)]
    records = [random_keys(cfg, own_selection(params, cfg, ids)[1]["indexer"], seed=29 + i)
               for i, ids in enumerate(seqs)]
    with torch.no_grad():
        alone = [glm5f.forward(params, cfg, ids, indexer=rec) for ids, rec in zip(seqs, records)]
        packed = glm5f.forward(params, cfg, torch.cat(seqs, 1), indexer=torch.cat(records, 1),
                               position_ids=torch.cat([torch.arange(20), torch.arange(24)])[None])
    assert (packed - torch.cat(alone, 1)).abs().max() <= 1e-10
