"""Compare the loss curves of runs: per-step differences against the first run (training loss, and the held-out
eval_loss where both runs have it), and one PNG of all curves, held-out ones dashed; --metric another logged metric
(GRPO's reward).

    python scripts/compare_runs.py runs/base runs/cp2 runs/ep2 --png runs/compare.png
    python scripts/compare_runs.py runs/grpo-tiny --metric reward --png runs/grpo-tiny/reward.png
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from glm5f.run.metrics import number, plot_losses, read_metrics  # noqa: E402


def compare(base: list[dict], other: list[dict], key: str = "loss") -> dict:
    """{steps, avg, max} of |difference| of `key` over the steps both runs logged it."""
    a = {r["step"]: r[key] for r in base if key in r}
    diffs = [abs(a[r["step"]] - r[key]) for r in other if r["step"] in a and key in r]
    if not diffs:
        return {"steps": 0, "avg": float("nan"), "max": float("nan")}
    return {"steps": len(diffs), "avg": sum(diffs) / len(diffs), "max": max(diffs)}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("runs", nargs="+", help="run directories (or metrics.jsonl files); the first is the baseline")
    ap.add_argument("--png", help="write the curves to this PNG file (a directory: its compare.png)")
    ap.add_argument("--metric", default="loss", help="the metrics.jsonl field to compare and plot (default loss)")
    args = ap.parse_args(argv)
    runs = {os.path.basename(os.path.normpath(r)): read_metrics(r) for r in args.runs}
    empty = [name for name, recs in runs.items() if not any(args.metric in r for r in recs)]
    if empty:
        print(f"error: no metrics.jsonl records with {args.metric!r} in {empty}", file=sys.stderr)
        return 1
    names = list(runs)
    if len(names) == 1:  # nothing to compare with: the run's own curve
        recs = [r for r in runs[names[0]] if args.metric in r]
        values = [r[args.metric] for r in recs]
        print(f"{names[0]}: {args.metric} {number(values[0])} (step {recs[0]['step']}) -> {number(values[-1])} (step "
              f"{recs[-1]['step']}), min {number(min(values))}, max {number(max(values))} over {len(recs)} steps; "
              f"pass more runs to compare them with it")
    else:
        width = max(6, len(args.metric) + 2)
        print(f"{'run':<24}{'curve':<{width}}{'steps':>7}{'avg |diff|':>14}{'max |diff|':>14}   (against {names[0]})")
    for name in names[1:]:
        for key, label in ((args.metric, "train"), ("eval_loss", "eval")) if args.metric == "loss" else \
                ((args.metric, args.metric),):
            c = compare(runs[names[0]], runs[name], key)
            if c["steps"] or key == args.metric:
                print(f"{name:<24}{label:<{width}}{c['steps']:>7}{c['avg']:>14.3e}{c['max']:>14.3e}")
    if args.png:
        png = os.path.join(args.png, "compare.png") if os.path.isdir(args.png) or args.png.endswith(os.sep) else \
            args.png  # a directory: the picture goes into it
        print(f"plot: {png}" if plot_losses(runs, png, args.metric, args.metric) else
              "plot skipped (matplotlib not installed)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
