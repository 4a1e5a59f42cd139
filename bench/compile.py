"""--train.compile against eager: the training step (`step_grads`) of the bench model, one subprocess per side.

    python bench/compile.py --batch 4 --seq 512                  # the 4-layer bench model, index_topk 128
    python bench/compile.py --preset glm5-scaled-moe --batch 4 --seq 256 --objectives

Prints, per side, the first step (for the compiled side: compiling every layer), the median of --steps after it,
tokens/s and peak memory, then the speed ratio and after how many steps compiling has paid for itself.
"""

from __future__ import annotations

import argparse
import os
import time

import torch

from common import (add_model_flags, add_run_flags, median_seconds, model_config, model_flags, peak_memory_gb,
                    run_child, serve_child)

SIDES = ("eager", "compiled")


def run_side(args) -> dict:
    import glm5f
    from glm5f.model.env import Objectives
    from glm5f.train.loss import Step, step_grads
    from glm5f.parallel.layout import Layout
    cfg = model_config(args)
    params = glm5f.init_params(cfg, seed=0, device=args.device)
    ids = torch.randint(0, cfg.vocab_size, (args.batch, args.seq), generator=torch.Generator().manual_seed(0))
    ids = ids.to(args.device)
    batch = {"input_ids": ids, "labels": ids, "position_ids": torch.arange(args.seq, device=ids.device)[None]}
    objectives, coeffs = Objectives(), {"loss": 1.0}
    if args.objectives:  # the indexer's sparse KL and the balance loss (MTP needs MTP layers)
        objectives, coeffs = Objectives("sparse", seq_aux=True), {**coeffs, "indexer_loss": 1e-3, "seq_aux_loss": 1e-4}
    step = Step(objectives, coeffs, getattr(torch, args.dtype), compile=args.child == "compiled")
    t = time.perf_counter()
    step_grads(params, batch, cfg, Layout(args.device), step)
    first = time.perf_counter() - t
    seconds = median_seconds(lambda: step_grads(params, batch, cfg, Layout(args.device), step), args.steps,
                             args.device)
    return {"side": args.child, "first": first, "seconds": seconds, "peak_gb": peak_memory_gb(args.device)}


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_model_flags(ap, "after the first")
    ap.add_argument("--objectives", action="store_true", help="the indexer (sparse) and balance losses on")
    add_run_flags(ap)
    args = ap.parse_args()
    if serve_child(args, run_side):
        return
    tokens = args.batch * args.seq
    print(f"training step (step_grads) of {args.preset} B{args.batch}xS{args.seq}, {args.dtype} on {args.device} "
          f"({torch.get_num_threads()} threads), median of {args.steps} after the first"
          f"{', indexer and balance losses on' if args.objectives else ''}")
    flags = [*model_flags(args), *(["--objectives"] if args.objectives else [])]
    r = {side: run_child(os.path.abspath(__file__), ["--child", side, *flags], f"the {side} side") for side in SIDES}
    for side in SIDES:
        print(f"  {side:9s} first step {r[side]['first']:7.2f} s   then {r[side]['seconds']:6.3f} s/step  "
              f"{tokens / r[side]['seconds']:8.0f} tok/s   peak {r[side]['peak_gb']:.2f} GB")
    e, c = r["eager"]["seconds"], r["compiled"]["seconds"]
    compile_s = r["compiled"]["first"] - r["eager"]["first"]
    print(f"  compiled: {e / c:.2f}x the eager speed; compiling took about {compile_s:.0f} s"
          + (f", paid back after {compile_s / (e - c):.0f} steps" if c < e else ", never paid back"))


if __name__ == "__main__":
    main()
