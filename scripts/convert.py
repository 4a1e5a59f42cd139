"""Convert a training checkpoint (DCP, saved from any parallel layout) to a Transformers checkpoint directory.

    python scripts/convert.py runs/default runs/default-hf            # the run's latest checkpoint
    python scripts/convert.py runs/default/checkpoints/step_00000100 out/hf

Reads only the parameters (not the optimizer state) into this one process, then writes config.json and
safetensors shards one at a time (glm5f.save_hf). OUT_DIR must be new, empty, or a previous export.
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import glm5f  # noqa: E402
from glm5f import checkpoint  # noqa: E402
from glm5f.hf import check_export_dir  # noqa: E402


def convert(source: str, out_dir: str) -> str:
    """Write the params of `source` (a checkpoint, or a run directory's latest) to `out_dir`; returns the
    checkpoint it read."""
    path = checkpoint.resolve(source)
    check_export_dir(out_dir)  # before reading: refuses a non-empty directory that is not a previous export
    cfg, params = checkpoint.load_params(path)
    glm5f.save_hf(out_dir, cfg, params)
    return path


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("checkpoint", help="a run directory (its latest checkpoint) or a checkpoint directory")
    ap.add_argument("out_dir", help="the Transformers checkpoint directory to write")
    args = ap.parse_args(argv)
    try:
        path = convert(args.checkpoint, args.out_dir)
    except (ValueError, FileNotFoundError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    print(f"wrote {args.out_dir} from {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
