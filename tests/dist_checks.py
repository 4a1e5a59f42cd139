"""Worker functions for the multi-process tests (run by glm5f.run.launch.spawn in fresh processes).

Property checks run hypothesis inside every rank with the same derandomized examples, so the ranks stay in
lockstep through the collectives; a check's verdict is agreed over all ranks before it is asserted.
"""

from __future__ import annotations

import os
import signal
import time

import torch
import torch.distributed as dist
import tyro
from hypothesis import given, settings
from hypothesis import strategies as st

import glm5f
from configs import Config
from conftest import env_of
from glm5f.model.attention import attention
from glm5f.parallel.distributed import DistLayout
from glm5f.run.launch import init_process
from glm5f.train.loss import Step, step_grads
from glm5f.model.moe import routed_experts
from glm5f.train.optim import global_norm
from glm5f.parallel.layout import Layout, cp_positions, full_tensor

PROPERTY = settings(max_examples=16, deadline=None, derandomize=True, database=None)


def agree(ok: bool) -> bool:
    flag = torch.tensor(0.0 if ok else 1.0)
    dist.all_reduce(flag)
    return flag.item() == 0


def first_step_grads(argv: list[str], out_path: str | None) -> dict:
    """Loss and full gradients of the first step of the run `argv` (saved by rank 0 when out_path is given)."""
    cfg = tyro.cli(Config, args=argv, use_underscores=True)
    p = cfg.parallel
    if p.world > 1:
        device = torch.device("cpu") if dist.is_initialized() else init_process(torch.device("cpu"))
        layout = DistLayout(p.dp_shard, p.cp, p.ep, device)
    else:
        layout = Layout(torch.device("cpu"))
    model_cfg = cfg.model.build()
    params = layout.local_params(lambda region: glm5f.init_params(model_cfg, cfg.train.seed, region=region))
    data = glm5f.data.make_source(cfg.data.type, vocab_size=model_cfg.vocab_size, batch_size=cfg.data.batch_size,
                                  seq_len=cfg.data.seq_len, seed=cfg.data.seed, path=cfg.data.path)
    metrics, grads, counts = step_grads(params, data.next_batch(), model_cfg, layout, Step.of(cfg.train, model_cfg))
    result = {"loss": metrics["loss"], "metrics": metrics, "grad_norm": float(global_norm(grads)),
              "grads": {k: full_tensor(g) for k, g in grads.items()},
              "counts": {k: c for k, c in counts.items()}}
    if out_path and layout.is_main:
        torch.save(result, out_path)
    return result


def first_step_grads_of(argvs: list[list[str]], out_path: str) -> None:
    """`first_step_grads` of each run in `argvs` (one layout, several runs) in this one group of ranks; rank 0 saves
    the list of results."""
    results = [first_step_grads(argv, None) for argv in argvs]
    if dist.get_rank() == 0:
        torch.save(results, out_path)


def rank_local_init_check(dp_shard: int, ep: int, ckpt_dir: str) -> None:
    """Each rank's rank-local init (`DistLayout.init_params`) is its shard of the one-process init, bit for bit,
    with leaves drawn in many small blocks of rows that shard boundaries cut through; each rank holds only its
    shard; the same for loading a Transformers checkpoint rank-locally."""
    glm5f.core.params.INIT_BLOCK_ELEMS = 1000
    layout = DistLayout(dp_shard, 1, ep, init_process(torch.device("cpu")))
    cfg = glm5f.preset("glm5-tiny", num_hidden_layers=2, index_topk_pattern="FS", pad_token_id=5)
    ours = glm5f.flatten(layout.local_params(lambda region: glm5f.init_params(cfg, 3, region=region)))
    ref = glm5f.flatten(layout.shard_params(glm5f.init_params(cfg, 3)))
    bad = [k for k in ref if not (torch.equal(ours[k].to_local(), ref[k].to_local())
                                  and ours[k].placements == ref[k].placements and ours[k].shape == ref[k].shape)]
    local = sum(t.to_local().numel() for t in ours.values())
    ok = not bad and local < glm5f.param_count(cfg, include_buffers=True) // dp_shard + 4096
    assert agree(ok), f"rank {layout.rank}: {bad[:5]}, {local} local elements"
    # and rank-local loading of a Transformers checkpoint: each rank reads only its slices
    ckpt = os.path.join(ckpt_dir, "ckpt")
    if layout.is_main:
        glm5f.save_hf(ckpt, cfg, glm5f.init_params(cfg, 4))
    dist.barrier()
    loaded = glm5f.flatten(layout.local_params(lambda region: glm5f.load_hf(ckpt, region=region)[1]))
    ref = glm5f.flatten(layout.shard_params(glm5f.load_hf(ckpt)[1]))
    bad = [k for k in ref if not (torch.equal(loaded[k].to_local(), ref[k].to_local())
                                  and loaded[k].placements == ref[k].placements and loaded[k].shape == ref[k].shape)]
    assert agree(not bad), f"rank {layout.rank}: {bad[:5]}"
    # and export from the shards: every rank gathers one leaf at a time, rank 0 writes what one process writes
    import weakref
    real, live = glm5f.ckpt.hf.io.materialize, {"n": 0, "bytes": 0, "peak": 0}

    def counted(t):
        out = real(t)
        live["n"], live["bytes"] = live["n"] + 1, live["bytes"] + out.numel() * out.element_size()
        live["peak"] = max(live["peak"], live["bytes"])
        weakref.finalize(out, lambda n=out.numel() * out.element_size(): live.update(bytes=live["bytes"] - n))
        return out
    glm5f.ckpt.hf.io.materialize = counted
    out = os.path.join(ckpt_dir, "export")
    glm5f.save_hf(out, cfg, layout.local_params(lambda region: glm5f.load_hf(ckpt, region=region)[1]),
                  max_shard_bytes=60_000, write=layout.is_main)
    glm5f.ckpt.hf.io.materialize = real
    dist.barrier()
    largest = max(t.numel() * t.element_size() for t in ref.values())
    _, again = glm5f.load_hf(out)
    _, whole = glm5f.load_hf(ckpt)
    same = all(torch.equal(a, b) for a, b in zip(glm5f.flatten(again).values(), glm5f.flatten(whole).values()))
    bound = largest if not layout.is_main else largest + 60_000
    assert agree(same and live["n"] == len(ref) and live["peak"] <= bound), \
        f"rank {layout.rank}: same {same}, {live['n']} gathers of {len(ref)} leaves, peak {live['peak']} > {bound}"
    assert agree(len([f for f in os.listdir(out) if f.endswith(".safetensors")]) > 1)


def cp_attention_property() -> None:
    """Context-parallel attention (a full-indexer layer, then a shared one) equals the unsharded computation,
    values and gradients, for random lengths, top-k, padding and packed documents."""
    init_process(torch.device("cpu"))
    layout = DistLayout(1, dist.get_world_size(), 1, torch.device("cpu"))
    rank, cp = dist.get_rank(), dist.get_world_size()

    @PROPERTY
    @given(st.integers(1, 2), st.integers(1, 6), st.integers(1, 30), st.sampled_from(["none", "padded", "packed", "4d"]),
           st.integers(0, 2**31 - 1))
    def check(B, chunk, topk, masking, seed):
        S = 2 * cp * chunk
        cfg = glm5f.preset("glm5-tiny", index_topk=topk)
        params = glm5f.init_params(cfg, seed=seed % 1009)
        layers = params["model"]["layers"]
        g = torch.Generator().manual_seed(seed)
        x = torch.randn(B, S, cfg.hidden_size, generator=g)
        cot = torch.randn(B, S, cfg.hidden_size, generator=g)
        pos = torch.arange(S).expand(B, S).clone()
        mask = None
        if masking == "padded":
            mask = (torch.rand(B, S, generator=g) > 0.3).long()
            mask[:, -1] = 1
        elif masking == "packed":
            cut = int(torch.randint(1, S, (1,), generator=g))
            pos[:, cut:] -= cut
        elif masking == "4d":  # causal, some keys hidden at random, each token sees itself
            mask = (torch.rand(B, 1, S, S, generator=g) > 0.3) & torch.ones(S, S, dtype=torch.bool).tril()
            mask |= torch.eye(S, dtype=torch.bool)

        def run(x, ctx):
            out0, carry, _ = attention(layers[0]["self_attn"], x, cfg, 0, ctx, None)
            out2, _, _ = attention(layers[2]["self_attn"], out0, cfg, 2, ctx, carry)
            return out2

        leaves = [layers[0]["self_attn"]["q_b_proj"]["weight"], layers[2]["self_attn"]["kv_b_proj"]["weight"]]
        for t in leaves:
            t.requires_grad_()
        full_x = x.clone().requires_grad_()
        full = run(full_x, env_of(cfg, (B, S), mask, pos))
        full_grads = torch.autograd.grad((full * cot).sum(), [full_x, *leaves])

        q = cp_positions(S, cp, rank)
        batch = {"input_ids": torch.zeros(B, S, dtype=torch.long), "position_ids": pos}
        if mask is not None:
            batch["attention_mask"] = mask
        _, env = glm5f.make_env(cfg, batch, torch.float32, layout)
        local_x = x[:, q].clone().requires_grad_()
        local = run(local_x, env)
        local_grads = torch.autograd.grad((local * cot[:, q]).sum(), [local_x, *leaves])
        summed = [gr.clone() for gr in local_grads[1:]]
        for gr in summed:
            dist.all_reduce(gr)
        real = torch.ones(B, S, dtype=torch.bool) if mask is None or mask.ndim == 4 else mask.bool()
        rows = real[:, q]  # rows of padding queries are undefined in any implementation
        ok = (torch.allclose(local[rows], full[:, q][rows], atol=1e-5, rtol=1e-4)
              and torch.allclose(local_grads[0], full_grads[0][:, q], atol=1e-5, rtol=1e-4)
              and all(torch.allclose(a, b, atol=1e-5, rtol=1e-4) for a, b in zip(summed, full_grads[1:])))
        assert agree(ok), f"rank {rank}: CP attention differs from the unsharded computation"

    check()
    layout = None  # noqa: F841  hypothesis keeps `check`; drop its hold on the process groups before teardown


def ep_dispatch_property() -> None:
    """Routed experts dispatched over the EP group equal the local computation with all experts, values and
    gradients (each rank routes its own tokens)."""
    init_process(torch.device("cpu"))
    ep, rank = dist.get_world_size(), dist.get_rank()
    layout = DistLayout(ep, 1, ep, torch.device("cpu"))

    @PROPERTY
    @given(st.integers(0, 30), st.sampled_from([4, 8]), st.sampled_from([4, 8, 12]), st.sampled_from([3, 8]),
           st.integers(1, 4), st.integers(0, 2**31 - 1))
    def check(N, D, F_, per_rank, K, seed):
        E = per_rank * ep
        K = min(K, E)
        g = torch.Generator().manual_seed(seed)
        weights = {k: torch.randn(E, *shape, generator=g)
                   for k, shape in (("gate_proj", (F_, D)), ("up_proj", (F_, D)), ("down_proj", (D, F_)))}
        g_rank = torch.Generator().manual_seed(seed + 7919 * (rank + 1))  # each rank routes its own tokens
        x = torch.randn(N, D, generator=g_rank, requires_grad=True)
        idx = torch.rand(N, E, generator=g_rank).argsort(-1)[:, :K]
        w = torch.rand(N, K, generator=g_rank)
        full_p = {k: {"weight": v.clone().requires_grad_()} for k, v in weights.items()}
        mine = slice(rank * per_rank, (rank + 1) * per_rank)
        local_p = {k: {"weight": v[mine].clone().requires_grad_()} for k, v in weights.items()}
        ref = routed_experts(full_p, x, idx, w, E)
        ours = routed_experts(local_p, x, idx, w, E, layout.experts)
        cot = torch.randn(N, D, generator=g_rank)
        ref_g = torch.autograd.grad((ref * cot).sum(), [x, *(p["weight"] for p in full_p.values())])
        our_g = torch.autograd.grad((ours * cot).sum(), [x, *(p["weight"] for p in local_p.values())],
                                    allow_unused=True)
        ok = torch.allclose(ours, ref, atol=1e-4, rtol=1e-5) and torch.allclose(our_g[0], ref_g[0], atol=1e-4,
                                                                                 rtol=1e-4)
        for full_grad, local_grad in zip(ref_g[1:], our_g[1:]):
            total = full_grad.clone()
            dist.all_reduce(total)  # expert e's gradient gathers every rank's tokens routed to e
            local_grad = torch.zeros_like(total[mine]) if local_grad is None else local_grad
            ok = ok and torch.allclose(local_grad, total[mine], atol=1e-4, rtol=1e-4)
        assert agree(ok), f"rank {rank}: EP dispatch differs from local experts"

    check()
    layout = None  # noqa: F841  hypothesis keeps `check`; drop its hold on the process groups before teardown


def die_on_rank_one() -> None:
    """Rank 1 is killed while rank 0 waits for it in a collective."""
    init_process(torch.device("cpu"))
    if dist.get_rank() == 1:
        time.sleep(0.5)
        os.kill(os.getpid(), signal.SIGKILL)
    t = torch.ones(1)
    dist.all_reduce(t)
    time.sleep(60)


def bad_input_on_rank_one() -> None:
    """Rank 1 meets bad input (a ValueError for the user) while rank 0 waits for it in a collective."""
    init_process(torch.device("cpu"))
    if dist.get_rank() == 1:
        raise ValueError("data.jsonl:3: field 'response' must be a string, found null")
    dist.all_reduce(torch.ones(1))
    time.sleep(60)


def ignore_sigint_and_wait(pid_dir: str) -> None:
    """A rank that cannot act on SIGINT (as one stuck in native code): records its pid, then waits."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    open(os.path.join(pid_dir, str(os.getpid())), "w").close()
    time.sleep(300)


def load_export_growth(ckpt: str, export_dir: str, out: str, dp_shard: int) -> None:
    """Each rank's peak RSS growth (VmHWM over the resident size before) while loading the Transformers checkpoint
    `ckpt` rank-locally, and then while exporting it back, written to out.<rank> as JSON."""
    import json

    from glm5f.run.plan import process_rss_bytes

    layout = (DistLayout(dp_shard, 1, 1, init_process(torch.device("cpu"))) if dp_shard > 1
              else Layout(torch.device("cpu")))
    loaded = {}

    def load(region):
        loaded["cfg"], p = glm5f.load_hf(ckpt, region=region)
        return p
    layout.shard_params({"lm_head": {"weight": torch.zeros(8, 8)}})  # DTensor's one-time set-up (~30 MB) is runtime
    before = process_rss_bytes()
    params = layout.local_params(load)
    growth = {"load": process_rss_bytes("VmHWM") - before}
    if dp_shard > 1:
        dist.barrier()
    with open("/proc/self/clear_refs", "w") as f:  # restart the peak (VmHWM) from the resident size now
        f.write("5")
    before = process_rss_bytes()
    glm5f.save_hf(export_dir, loaded["cfg"], params, write=layout.is_main)
    growth["export"] = process_rss_bytes("VmHWM") - before
    with open(f"{out}.{layout.rank}", "w") as f:
        json.dump(growth, f)


def lora_fingerprint_check(dp_shard: int, ep: int, out_path: str) -> None:
    """The fingerprint of the rank-local (sharded) glm5-tiny init with its LoRA adapters attached, written by rank
    0 (to compare with the one-process one)."""
    from glm5f.model import lora
    from glm5f.ckpt.checkpoint import fingerprint

    layout = DistLayout(dp_shard, 1, ep, init_process(torch.device("cpu")))
    cfg = glm5f.preset("glm5-tiny")
    params = layout.local_params(lambda region: glm5f.init_params(cfg, 0, region=region))
    adapters = layout.shard_params(lora.init_adapters(params, lora.LoraSpec(4, targets=r"self_attn|mlp\."), 0))
    found = fingerprint(lora.attach(params, adapters), layout.sum)
    if layout.is_main:
        with open(out_path, "w") as f:
            f.write(found)


def muon_once_check(dp_shard: int, ep: int, split: str, out_path: str) -> None:
    """Two Muon steps on glm5-tiny's Muon leaves (fp64, random gradients) stored dp_shard x ep, and the same two
    steps in one process (every rank runs it): rank 0 writes each rank's largest |difference| of params and momentum
    from the one-process ones, how many blocks its Newton-Schulz calls took (and one process's), and how many
    elements it passed to all_to_all_single."""
    import json

    from configs import OptimConfig
    from glm5f.train import optim
    from glm5f.core.params import flatten, map_with_path, unflatten

    layout = DistLayout(dp_shard, 1, ep, init_process(torch.device("cpu")))
    cfg = glm5f.preset("glm5-tiny")
    opt = optim.make_optimizer(OptimConfig(name="muon", muon_split=split), cfg)
    full = glm5f.init_params(cfg, 0, dtype=torch.float64)
    paths = [p for p, t in flatten(full).items() if opt.rule(p, t.ndim) == "muon"]
    gen = torch.Generator().manual_seed(1)
    grads = [map_with_path(lambda p, t: torch.randn(t.shape, generator=gen, dtype=t.dtype), full) for _ in range(2)]
    blocks, sent = [0], [0]
    real_ns, real_a2a = optim.newton_schulz, dist.all_to_all_single

    def counting_ns(x, *args, **kwargs):
        blocks[0] += x.shape[0]
        return real_ns(x, *args, **kwargs)

    def counting_a2a(output, input, *args, **kwargs):
        sent[0] += input.numel()
        return real_a2a(output, input, *args, **kwargs)
    optim.newton_schulz, dist.all_to_all_single = counting_ns, counting_a2a
    ref = map_with_path(lambda p, t: t.clone(), full)
    ref_state = opt.init(ref, paths)
    for g in grads:
        ref, ref_state = opt.update(ref, {p: t for p, t in flatten(g).items() if p in paths}, ref_state, 0.01)
    one_process = blocks[0]
    blocks[0] = sent[0] = 0
    params = layout.shard_params(full)
    state = opt.init(params, paths)
    for g in grads:
        sharded = flatten(layout.shard_params(unflatten(flatten(g), full)))
        params, state = opt.update(params, {p: sharded[p] for p in paths}, state, 0.01)
    got, want = flatten({"p": params, "m": state["momentum"]}), flatten({"p": ref, "m": ref_state["momentum"]})
    diff = max(float((full_tensor(got[k]) - want[k]).abs().max()) for k in want)
    moved = min(float((flatten(ref)[p] - flatten(full)[p]).abs().max()) for p in paths)
    counted = {"blocks": blocks[0], "sent": sent[0], "one_process_blocks": one_process}
    # uneven pieces: world + 1 matrices of 2 rows cut over every rank (1, 1, then empty pieces past 2 ranks)
    mats = [torch.randn(2, 16, generator=gen, dtype=torch.float64) for _ in range(layout.world + 1)]
    cut = optim.muon_cut((2, 16), 2, 0, layout.world)
    at = sum(cut.sizes[:layout.rank])
    pieces = [m[at:at + cut.sizes[layout.rank]] for m in mats]
    steps = optim.exchange_orthogonalised(pieces, [(2,)] * len(mats), cut, layout.meshes["fsdp"].get_group(0),
                                          layout.rank, 1, {})
    uneven = sum(float((s - optim.orthogonalise_blocks(m, [2])[at:at + len(s)]).abs().sum())  # empty: 0
                 for s, m in zip(steps, mats))
    found = [None] * layout.world
    dist.all_gather_object(found, {"diff": diff, "moved": moved, "uneven": uneven, "cut": cut.sizes, **counted})
    if layout.is_main:
        with open(out_path, "w") as f:
            json.dump(found, f)
