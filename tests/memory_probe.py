"""Peak resident memory of each rank of a short training run, for the memory plan's tests.

    python tests/memory_probe.py OUT.json -- --model.preset glm5-scaled-moe --train.steps 2 ...

Each rank first trains a toy model for one step (loading the kernels, thread pools and communication buffers
every run has) and records its resident set size then (the runtime: python, torch, the process group); then it
trains the given run and records its peak (VmHWM) when the last step has updated, just before the checkpoint
would be written (it is not: its serialisation buffers are not part of a training step), and the bytes of its
parameter shards. OUT.json gets one record per rank.
"""

from __future__ import annotations

import json
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import torch  # noqa: E402
import tyro  # noqa: E402

import train  # noqa: E402
from configs import Config  # noqa: E402
from glm5f.ckpt import checkpoint  # noqa: E402
from glm5f.run.plan import process_rss_bytes  # noqa: E402


WARM_UP = ["--model.preset=glm5-tiny", "--model.num_hidden_layers=2", "--model.index_topk_pattern=FS",
           "--data.batch_size=2", "--data.seq_len=32", "--train.steps=1", "--checkpoint.overwrite"]


def probe(argv: list[str], out: str) -> None:
    """Train as train.py would, in this process (one rank), and write this rank's record to out.<rank>."""
    cfg = tyro.cli(Config, args=argv, use_underscores=True)
    layout = None
    if cfg.parallel.world > 1:
        from glm5f.parallel.distributed import DistLayout
        from glm5f.run.launch import init_process
        device = init_process(torch.device("cpu"))
        layout = DistLayout(cfg.parallel.dp_shard, cfg.parallel.cp, cfg.parallel.ep, device)
    record = {"rank": layout.rank if layout else 0, "cold_runtime_bytes": process_rss_bytes()}

    def save(run_dir, step, state, extra, meta, keep=3):
        if "runtime_bytes" not in record:  # the end of the warm-up run
            return os.path.join(run_dir, "not-written")
        # VmHWM, not ru_maxrss: Linux carries ru_maxrss across execve, so a process started from a large one
        # (pytest, late in a suite) would report its parent's size
        record["peak_bytes"] = process_rss_bytes("VmHWM")
        local = [t.to_local() if hasattr(t, "to_local") else t for t in _tensors(state["params"])]
        record["param_bytes"] = sum(t.numel() * t.element_size() for t in local)
        return os.path.join(run_dir, "not-written")

    checkpoint.save = save
    # warm-up: one step of a toy model in the same layout loads the kernels, thread pools and communication
    # buffers every run has; the resident size after it is the run's runtime
    train.train(tyro.cli(Config, args=argv + WARM_UP + [f"--checkpoint.dir={cfg.checkpoint.dir}-warm-up"],
                         use_underscores=True), layout)
    record["runtime_bytes"] = process_rss_bytes()
    train.train(cfg, layout)
    with open(f"{out}.{record['rank']}", "w") as f:
        json.dump(record, f)


def _tensors(tree):
    if isinstance(tree, dict):
        for v in tree.values():
            yield from _tensors(v)
    elif isinstance(tree, list):
        for v in tree:
            yield from _tensors(v)
    else:
        yield tree


def main(out: str, argv: list[str]) -> list[dict]:
    cfg = tyro.cli(Config, args=argv, use_underscores=True)
    if cfg.parallel.world > 1:
        from glm5f.run.launch import spawn
        spawn(probe, cfg.parallel.world, argv, out)
    else:
        probe(argv, out)
    records = []
    for r in range(cfg.parallel.world):
        with open(f"{out}.{r}") as f:
            records.append(json.load(f))
    with open(out, "w") as f:
        json.dump(records, f)
    return records


if __name__ == "__main__":
    args = sys.argv[1:]
    split = args.index("--")
    main(args[0], args[split + 1:])
