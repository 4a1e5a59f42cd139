"""Alignment suite: train the same model on the same global batches under each parallel layout and compare the
per-step losses with the one-process baseline.

    python scripts/align.py --steps 100 --noise-floor --out runs/align   # the suite, about 20 minutes on 2 cores
    python scripts/align.py --steps 10 --objectives                      # the fp32 rule of the CI test
    python scripts/align.py --steps 10 --layouts dp2 cp2 --tolerance 1e-4   # a quick check, absolute bound
    python scripts/align.py --steps 100 --out runs/align-r64 --extra --train.reduce_dtype float64   # fp32, fp64 sums
    python scripts/align.py --steps 100 --out runs/align64 --extra --train.dtype float64   # exactness, fp64
    python scripts/align.py --steps 10 --objectives     # with the indexer (sparse KL), MTP and balance losses on
    python scripts/align.py --steps 10 --layouts dp2 ep2 cp2 cp2-ep2 --extra --model.preset glm53-tiny --data.type text

In plain fp32 the layouts compute one process's forward bit for bit but sum gradients in another order: data
parallelism each weight gradient over two halves of the tokens, context parallelism also each latent row's gradient
over two parts of the queries, which changes every activation gradient upstream of attention. Adam turns these
rounding differences into weight differences, and the runs drift apart once one flips a near-tied top-k choice
(an indexer's or a router's); they meet only the noise floor (--noise-floor). With
--train.reduce_dtype float64 (fp32 weights, activations and optimizer; every gradient sum in fp64, rounded once)
they compute the same fp32 numbers as one process.

Prints a table of avg / max |loss difference| per layout (the largest over every objective the runs log), writes
OUT/align.png, and exits non-zero when a layout's max difference exceeds --tolerance: an absolute bound (1e-6), or
by default `2x`, the fp32 layout rule: a layout may differ from one process by up to twice as much as one process
differs from itself with its sums split as the layouts split them (the noise floors, NOISE_FLOORS, then always
run): the step's batch in micro-batches, and the queries in parts held as CP ranks hold them (--train.query_parts),
each in two and in four parts, whichever drifts furthest (`floor`). How far a run drifts within a few steps is
decided by whether its rounding flips a near-tied top-k choice, and each split is one draw of that: an EP run,
whose weights after step 1 differ from one process's in a subset of what 2 micro-batches change, may still flip a
choice first (glm53-tiny, fp32, 20 steps: 2 micro-batches first flip one at step 17, 2 query parts at 13, 4 of
either and EP2 at 5; all reach ~1e-4). So every layout is held to the furthest of all the draws.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from glm5f.run.metrics import plot_losses, read_metrics  # noqa: E402
from scripts.compare_runs import compare  # noqa: E402

LAYOUTS = {
    "dp2": ["--parallel.dp_shard", "2"],
    "cp2": ["--parallel.cp", "2"],
    "ep2": ["--parallel.dp_shard", "2", "--parallel.ep", "2"],
    "cp2-ep2": ["--parallel.cp", "2", "--parallel.ep", "2"],
    "dp2-cp2": ["--parallel.dp_shard", "2", "--parallel.cp", "2"],
}
# One process again, the same mathematics with sums in another order: the step's batch in micro-batches (each
# weight gradient summed over parts of the tokens, as every layout's ranks sum it), and the queries in parts as CP
# ranks hold them (each latent row's gradient summed over each part's queries, as CP ranks sum it), each in two and
# in four parts. How far they drift from the baseline is the floor a layout can be held to in this precision.
NOISE_FLOORS = {f"1proc-{name}{n}": [flag, str(n)] for name, flag in (("accum", "--train.grad_accum"),
                                                                         ("qparts", "--train.query_parts"))
                for n in (2, 4)}
# fp32, the MoE + MLA + DSA preset, index_topk 64 < 128 tokens per CP rank < 256 per sequence: DSA is sparse on
# every rank and over the whole sequence.
COMMON = ["--model.preset", "glm5-scaled-moe", "--data.type", "synthetic", "--data.batch_size", "4",
          "--data.seq_len", "256", "--train.dtype", "float32", "--checkpoint.every", "0", "--train.log_every", "25"]
# GLM-5's training objectives beside the LM loss: the indexer's sparse KL (its leaves then train), one MTP layer,
# the sequence-wise balance loss; each is compared per step like the loss.
OBJECTIVES = ["--train.indexer_loss", "sparse", "--model.num_nextn_predict_layers", "1",
              "--train.seq_aux_loss_coeff", "0.001"]
METRICS = ("loss", "indexer_loss", "mtp_loss", "seq_aux_loss")


def run(name: str, args: list[str], out: str, steps: int, extra: list[str], in_process: bool = False) -> float:
    run_dir = os.path.join(out, name)
    cmd = [sys.executable, os.path.join(ROOT, "train.py"), *COMMON, "--train.steps", str(steps),
           "--checkpoint.dir", run_dir, "--checkpoint.overwrite", *extra, *args]
    t = time.perf_counter()
    if in_process:
        from train import main as train

        if train(cmd[2:]) != 0:
            raise SystemExit(f"{name} failed (its error is above)")
        return time.perf_counter() - t
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
    if proc.returncode != 0:
        raise SystemExit(f"{name} failed:\n{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}")
    return time.perf_counter() - t


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=100)
    ap.add_argument("--out", default="runs/align")
    ap.add_argument("--layouts", nargs="+", default=list(LAYOUTS), choices=list(LAYOUTS))
    ap.add_argument("--tolerance", type=tolerance, default="2x",
                    help="max |metric difference| a layout may have: a number, or Nx: N times its noise floor's")
    ap.add_argument("--noise-floor", action="store_true",
                    help="also run the noise floors (NOISE_FLOORS), as reference rows")
    ap.add_argument("--objectives", action="store_true",
                    help="turn on the indexer (sparse), MTP and sequence-wise balance losses (OBJECTIVES)")
    ap.add_argument("--in-process", action="store_true",
                    help="run each train.py in this process, not a fresh one (the tests: one interpreter to start)")
    ap.add_argument("--extra", nargs=argparse.REMAINDER, default=[],
                    help="train.py flags for every run, e.g. --extra --optim.lr 1e-3 (must come last)")
    args = ap.parse_args(argv)
    if args.objectives:
        args.extra = OBJECTIVES + args.extra
    os.makedirs(args.out, exist_ok=True)
    seconds = {"baseline": run("baseline", [], args.out, args.steps, args.extra, args.in_process)}
    for name in args.layouts:
        seconds[name] = run(name, LAYOUTS[name], args.out, args.steps, args.extra, args.in_process)
    factor = args.tolerance[1] if isinstance(args.tolerance, tuple) else None
    if args.noise_floor or factor is not None:
        for name, flags in NOISE_FLOORS.items():
            seconds[name] = run(name, flags, args.out, args.steps, args.extra, args.in_process)
    runs = {name: read_metrics(os.path.join(args.out, name)) for name in seconds}
    results = {name: largest_difference(runs["baseline"], runs[name]) for name in seconds if name != "baseline"}
    bounds = {name: args.tolerance if factor is None else factor * results[floor(results)]["max"]
              for name in args.layouts}
    ok = True
    flags = dict(zip(COMMON + args.extra, (COMMON + args.extra)[1:]))  # flag -> the value after it (last one wins)
    dtype = flags["--train.dtype"]
    if "--train.reduce_dtype" in flags:
        dtype += f" (sums in {flags['--train.reduce_dtype']})"
    logged = [key for key in METRICS if key in runs["baseline"][0]]
    print(f"{args.steps} steps, {dtype}, {flags['--model.preset']}, {flags['--data.type']} data; |metric - baseline| "
          f"per step, the largest of {', '.join(logged)}:")
    print(f"{'layout':<14}{'avg':>12}{'max':>12}{'bound':>12}{'seconds':>10}")
    for name, c in results.items():
        bound = f"{bounds[name]:>12.2e}" if name in LAYOUTS else " " * 12
        if name in LAYOUTS:
            ok &= c["steps"] == args.steps and c["max"] <= bounds[name]
            results[name] = {**c, "bound": bounds[name]}
        results[name] = {**results[name], "seconds": seconds[name]}
        note = f"   (noise floor: one process, {' '.join(NOISE_FLOORS[name])})" if name in NOISE_FLOORS else ""
        if factor is not None and name in LAYOUTS:
            note = f"   ({factor:g} x {floor(results)})"
        print(f"{name:<14}{c['avg']:>12.2e}{c['max']:>12.2e}{bound}{seconds[name]:>10.1f}{note}")
    print(f"baseline {seconds['baseline']:.1f} s; loss {runs['baseline'][0]['loss']:.4f} -> "
          f"{runs['baseline'][-1]['loss']:.4f}")
    with open(os.path.join(args.out, "align.json"), "w") as f:
        json.dump(results, f, indent=2)
    if plot_losses(runs, os.path.join(args.out, "align.png"), title="loss per layout"):
        print(f"plot: {os.path.join(args.out, 'align.png')}")
    print("ALIGNED: every layout within its bound" if ok else "NOT ALIGNED: a layout differs by more than its bound")
    return 0 if ok else 1


def tolerance(text: str) -> float | tuple[str, float]:
    """--tolerance: an absolute bound ("1e-6"), or ("x", N) for "Nx", N times the noise floor's difference."""
    try:
        return ("x", float(text[:-1])) if text.endswith("x") else float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number (1e-6) or a multiple of the noise floor (2x), "
                                         f"got {text!r}") from None


def floor(results: dict) -> str:
    """The noise floor every layout is held to: of the NOISE_FLOORS runs in `results`, the one whose max difference
    is largest."""
    return max(NOISE_FLOORS, key=lambda name: results[name]["max"])


def largest_difference(baseline: list[dict], other: list[dict]) -> dict:
    """compare()'s avg / max |difference| per step of the metric (of METRICS the baseline logs) that differs most."""
    per_metric = [compare(baseline, other, key) for key in METRICS if key in baseline[0]]
    return max(per_metric, key=lambda m: m["max"])


if __name__ == "__main__":
    sys.exit(main())
