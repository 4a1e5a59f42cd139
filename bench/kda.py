"""One KDA attention layer, forward + backward, glm5f against Transformers' Glm5NextTextLinearAttention (its torch
fallback: fla's kernels need CUDA).

    python bench/kda.py --sweep 1024,4096,16384,65536 --ref-max-seq 16384

Each side runs in its own subprocess (so each peak is that side's alone) on the same weights and inputs, at a
scaled GLM-5.3 KDA layer: hidden 256, 4 heads of dim 128 (GLM-5.3's head dim; its q/k/v width is twice the hidden
size, as here), short convolution 4, lower bound -5. Prints seconds (median of --steps after one warm-up step; and
the CPU time of a step: the machine may be shared); the peak tensor memory of a step (the inputs and weights plus
the most the allocator held at once during one more step: `common.allocated_peak_gb`, the figure an accelerator's
allocator reports); and the process's peak RSS (the interpreter and libraries, ~0.3 GB, and what malloc keeps
included; the RSS before the first step is printed beside it). The ratio line compares both sides. The Transformers
side runs under --ref-mem-gb of address space and --ref-timeout seconds; a side past either is reported as such.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys

import torch

from common import add_run_flags, allocated_peak_gb, median_times, peak_memory_gb, run_flags, serve_child, threads_of

LAYER = dict(hidden_size=256, linear_num_heads=4, linear_head_dim=128, linear_conv_kernel_dim=4,
             linear_lower_bound=-5.0, rms_norm_eps=1e-5)


def kda_params(cfg, seed: int) -> dict:
    """Random weights of one KDA layer under the checkpoint's names (as a trained layer's magnitudes go: gates
    near their initial values, projections ~ 1/sqrt(fan-in))."""
    gen = torch.Generator().manual_seed(seed)
    D, H, K, W = cfg.hidden_size, cfg.linear_num_heads, cfg.linear_head_dim, cfg.linear_conv_kernel_dim

    def mat(out, inp):
        return {"weight": torch.randn(out, inp, generator=gen) / inp ** 0.5}

    p = {f"{n}_proj": mat(H * K, D) for n in "qkv"}
    p |= {f"{n}_conv1d": {"weight": torch.randn(H * K, 1, W, generator=gen) / W ** 0.5} for n in "qkv"}
    p |= {"f_a_proj": mat(K, D), "f_b_proj": mat(H * K, K), "b_proj": mat(H, D), "g_a_proj": mat(K, D),
          "g_b_proj": mat(H * K, K), "o_proj": mat(D, H * K), "o_norm": {"weight": torch.ones(K)},
          "dt_bias": torch.randn(H * K, generator=gen) * 0.5, "A_log": torch.zeros(H)}
    return p


def transformers_layer(cfg, p):
    """Transformers' KDA layer holding the weights p (the checkpoint's renames undone by hand)."""
    from transformers.models.glm5_next.configuration_glm5_next import Glm5NextTextConfig
    from transformers.models.glm5_next.modeling_glm5_next import Glm5NextTextLinearAttention
    hcfg = Glm5NextTextConfig(num_hidden_layers=1, layer_types=["linear_attention"], mlp_layer_types=["dense"],
                              **LAYER)
    layer = Glm5NextTextLinearAttention(hcfg, 0)
    state = {f"{n}.weight": p[n]["weight"] for n in ("q_proj", "k_proj", "v_proj", "b_proj", "g_a_proj",
                                                     "g_b_proj", "o_norm", "o_proj")}
    state |= {f"forget_gate.{n}.weight": p[n]["weight"] for n in ("f_a_proj", "f_b_proj")}
    state |= {f"forget_gate.{n}": p[n] for n in ("dt_bias", "A_log")}
    state["conv1d.weight"] = torch.cat([p[f"{n}_conv1d"]["weight"] for n in "qkv"])
    layer.load_state_dict(state, strict=True)
    return layer


def run_side(side: str, seq: int, steps: int) -> dict:
    from glm5f.model.kda_layer import KDAConfig, kda_attention
    cfg = KDAConfig(**LAYER)
    p = kda_params(cfg, seed=0)
    x = torch.randn(1, seq, cfg.hidden_size, generator=torch.Generator().manual_seed(1))
    if side == "glm5f":
        leaves = [t.requires_grad_() for t in (*(d["weight"] for d in p.values() if isinstance(d, dict)),
                                               p["dt_bias"], p["A_log"])]
        weights = leaves

        def step():
            xg = x.detach().requires_grad_()
            out = kda_attention(p, xg, cfg)
            torch.autograd.grad(out.square().mean(), [xg, *leaves])
    else:
        layer = transformers_layer(cfg, p)
        weights = list(layer.parameters())

        def step():
            layer.zero_grad(set_to_none=True)
            xg = x.detach().requires_grad_()
            layer(xg).square().mean().backward()
    before = peak_memory_gb("cpu")
    times = median_times(step, steps, "cpu")
    rss = peak_memory_gb("cpu")  # before the profiled step, whose records take memory too
    held = (x.nbytes + sum(w.nbytes for w in weights)) / 2**30
    return {"side": side, "seq": seq, **times, "tensor_gb": held + allocated_peak_gb(step, "cpu"),
            "peak_rss_gb": rss, "rss_before_gb": before}


def child(args, side: str, seq: int) -> dict:
    """One side in a fresh interpreter; the Transformers side under the address-space and time caps."""
    def cap():
        if side == "transformers":
            limit = int(args.ref_mem_gb * 2**30)
            resource.setrlimit(resource.RLIMIT_AS, (limit, limit))

    cmd = [sys.executable, os.path.abspath(__file__), "--child", side, "--seq", str(seq), "--steps", str(args.steps),
           *run_flags(args)]
    try:
        res = subprocess.run(cmd, capture_output=True, text=True, preexec_fn=cap,
                             timeout=args.ref_timeout if side == "transformers" else None)
    except subprocess.TimeoutExpired:
        return {"side": side, "seq": seq, "failed": f"over {args.ref_timeout} s"}
    if res.returncode != 0:
        if side == "transformers" and ("MemoryError" in res.stderr or "alloc" in res.stderr.lower()
                                       or res.returncode < 0):
            return {"side": side, "seq": seq, "failed": f"over {args.ref_mem_gb} GB of address space"}
        sys.exit(f"{res.stderr[-3000:]}\nerror: the {side} side at T={seq} failed (its output is above)")
    return json.loads(res.stdout.strip().splitlines()[-1])


def show(r: dict) -> str:
    if "failed" in r:
        return f"  {r['side']:12s} T={r['seq']:6d}  not measured: {r['failed']}"
    return (f"  {r['side']:12s} T={r['seq']:6d}  {r['seconds']:8.2f} s ({r['cpu_seconds']:8.2f} s CPU)  tensors "
            f"{r['tensor_gb']:6.3f} GB  peak RSS {r['peak_rss_gb']:6.2f} GB "
            f"({r['rss_before_gb']:.2f} before the first step)")


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seq", type=int, default=4096)
    ap.add_argument("--sweep", default="", help="comma-separated sequence lengths (overrides --seq)")
    ap.add_argument("--steps", type=int, default=1)
    ap.add_argument("--ref-max-seq", type=int, default=16384, help="longest T the Transformers side runs at")
    ap.add_argument("--ref-mem-gb", type=float, default=20.0, help="address-space cap of the Transformers side")
    ap.add_argument("--ref-timeout", type=float, default=1200.0, help="seconds cap of the Transformers side")
    add_run_flags(ap)
    args = ap.parse_args()
    if serve_child(args, lambda a: run_side(a.child, a.seq, a.steps)):
        return
    seqs = [int(s) for s in args.sweep.split(",")] if args.sweep else [args.seq]
    print(f"one KDA layer fwd+bwd (hidden {LAYER['hidden_size']}, {LAYER['linear_num_heads']} heads x "
          f"{LAYER['linear_head_dim']}), float32 on cpu ({threads_of(args)} threads), median of {args.steps}")
    for seq in seqs:
        ours = child(args, "glm5f", seq)
        ref = child(args, "transformers", seq) if seq <= args.ref_max_seq else None
        for r in (ours, ref):
            if r:
                print(show(r), flush=True)
        if ref and "failed" not in ref:
            print(f"  ratio        T={seq:6d}  {ref['seconds'] / ours['seconds']:8.2f}x faster "
                  f"({ref['cpu_seconds'] / ours['cpu_seconds']:.2f}x in CPU time), "
                  f"{ours['tensor_gb'] / ref['tensor_gb']:.3f} of the tensor memory, "
                  f"{ours['peak_rss_gb'] / ref['peak_rss_gb']:.3f} of the peak RSS", flush=True)


if __name__ == "__main__":
    main()
