"""Peak memory per rank of a training run in one process against FSDP over two (`--parallel.dp_shard 2`), with and
without activation checkpointing, beside what `--plan` predicts for each.

    python bench/fsdp_memory.py                     # glm5-scaled-moe at hidden 1024, 8 layers, 32 experts (196M)
    python bench/fsdp_memory.py --hidden 512 --layers 4 --experts 16 --steps 2

Each side is a `tests/memory_probe.py` run (its own processes): the peak resident set (VmHWM) of every rank when
the last step has updated, after a one-step warm-up whose resident size is the plan's runtime line. With
activation checkpointing each decoder layer's weights are gathered as it runs and freed after it, so FSDP's peak
drops by the gathered model less one layer; without checkpointing autograd keeps every layer's gathered weights
for the backward, and FSDP shards only the stored parameters, gradients and optimizer state.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

SIDES = {
    "1 process, checkpointing": ["--train.activation_checkpointing"],
    "dp_shard 2, checkpointing": ["--parallel.dp_shard", "2", "--train.activation_checkpointing"],
    "dp_shard 2, no checkpointing": ["--parallel.dp_shard", "2"],
}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--experts", type=int, default=32)
    ap.add_argument("--moe-intermediate", type=int, default=256)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--seq", type=int, default=256)
    ap.add_argument("--steps", type=int, default=2)
    args = ap.parse_args()

    import tyro

    import glm5f
    from configs import Config
    from glm5f.plan import plan, run_shape

    pattern = ("FS" * args.layers)[:args.layers]
    model = ["--model.preset", "glm5-scaled-moe", "--model.hidden_size", str(args.hidden), "--model.num_hidden_layers",
             str(args.layers), "--model.index_topk_pattern", pattern, "--model.n_routed_experts", str(args.experts),
             "--model.moe_intermediate_size", str(args.moe_intermediate)]
    run = ["--data.type", "synthetic", "--data.batch_size", str(args.batch), "--data.seq_len", str(args.seq),
           "--train.steps", str(args.steps), "--eval.every", "0", "--optim.warmup_steps", "0",
           "--train.log_every", "1"]
    model_cfg = tyro.cli(Config, args=model, use_underscores=True).model.build()
    print(f"glm5-scaled-moe, hidden {args.hidden}, {args.layers} layers, {args.experts} experts: "
          f"{glm5f.param_count(model_cfg) / 1e6:.0f}M parameters, fp32, batch {args.batch} x {args.seq}")
    peaks = {}
    with tempfile.TemporaryDirectory() as tmp:
        for name, extra in SIDES.items():
            argv = model + run + extra + ["--checkpoint.dir", os.path.join(tmp, f"run{len(peaks)}")]
            out = os.path.join(tmp, "probe.json")
            env = dict(os.environ, OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1"))
            res = subprocess.run([sys.executable, os.path.join(ROOT, "tests", "memory_probe.py"), out, "--", *argv],
                                 env=env, capture_output=True, text=True)
            if res.returncode:
                sys.exit(f"{res.stderr[-3000:]}\nerror: the side {name!r} failed (its output is above)")
            cfg = tyro.cli(Config, args=argv, use_underscores=True)
            with open(out) as f:
                records = json.load(f)
            peaks[name] = max(r["peak_bytes"] for r in records)
            for r in records:
                p = plan(cfg.model.build(), run_shape(cfg), r["runtime_bytes"])
                error = (p["total_bytes"] - r["peak_bytes"]) / r["peak_bytes"]
                print(f"  {name:<30} rank {r['rank']}: peak {r['peak_bytes'] / 1e9:6.3f} GB measured, "
                      f"{p['total_bytes'] / 1e9:6.3f} GB planned ({error:+.1%}, peak in {p['peak_phase']}; gathered "
                      f"{p['gathered_bytes'] / 1e9:.3f} GB, runtime {r['runtime_bytes'] / 1e9:.3f} GB)")
    one, fsdp, whole = peaks.values()
    print(f"peak per rank, dp_shard 2 / 1 process (checkpointing): {fsdp / one:.2f}x; "
          f"dp_shard 2 without / with checkpointing: {whole / fsdp:.2f}x")


if __name__ == "__main__":
    main()
