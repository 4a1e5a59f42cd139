"""Peak memory per rank of a training run in one process against FSDP over two (`--parallel.dp_shard 2`), with and
without activation checkpointing, beside what `--plan` predicts for each.

    python bench/fsdp_memory.py            # the 160M setting: glm5-scaled-moe, hidden 512, 64 experts of 512
    python bench/fsdp_memory.py --model "--model.preset glm5-scaled-moe --model.hidden_size 1024 \
        --model.n_routed_experts 32 --model.moe_intermediate_size 256 --model.num_hidden_layers 8 \
        --model.index_topk_pattern FSFSFSFS" --run "--data.type synthetic --data.batch_size 4 --data.seq_len 256"

Each side is a `tests/memory_probe.py` run (its own processes): the peak resident set (VmHWM) of every rank when
the last step has updated, after a one-step warm-up whose resident size is the plan's runtime line. With
activation checkpointing each decoder layer's weights are gathered as it runs and freed after it; without it
autograd keeps every layer's gathered weights for the backward.
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
    "1 process": [],
    "1 process, checkpointing": ["--train.activation_checkpointing"],
    "dp_shard 2": ["--parallel.dp_shard", "2"],
    "dp_shard 2, checkpointing": ["--parallel.dp_shard", "2", "--train.activation_checkpointing"],
}
SETTING_160M = ("--model.preset glm5-scaled-moe --model.hidden_size 512 --model.moe_intermediate_size 512 "
                "--model.n_routed_experts 64")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=SETTING_160M, help="the model flags of train.py")
    ap.add_argument("--run", default="--data.type synthetic --data.batch_size 2 --data.seq_len 128",
                    help="the data flags of train.py")
    ap.add_argument("--steps", type=int, default=2)
    args = ap.parse_args()

    import tyro

    import glm5f
    from configs import Config
    from glm5f.run.plan import plan, run_shape

    model = args.model.split()
    run = args.run.split() + ["--train.steps", str(args.steps), "--eval.every", "0", "--optim.warmup_steps", "0",
                              "--train.log_every", "1"]
    model_cfg = tyro.cli(Config, args=model, use_underscores=True).model.build()
    print(f"{args.model}: {glm5f.param_count(model_cfg) / 1e6:.0f}M parameters, fp32, {args.run}")
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
    for remat in ("", ", checkpointing"):
        print(f"peak per rank, dp_shard 2 / 1 process{remat}: "
              f"{peaks['dp_shard 2' + remat] / peaks['1 process' + remat]:.2f}x")


if __name__ == "__main__":
    main()
