"""What every bench shares: one subprocess per side (so each peak is that side's alone), timing, peak memory, the
measured matmul peak, and the model FLOPs of a GLM-5 config (what utilisation and MFU are computed from)."""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import time

import torch

# The bench scripts run with bench/ first on sys.path, where kernels.py (the kernel report) would stand for the
# `kernels` package that Transformers imports: each script imports this module first, which moves bench/ last.
_BENCH_DIR = os.path.dirname(os.path.abspath(__file__))
if sys.path and os.path.abspath(sys.path[0] or os.curdir) == _BENCH_DIR:
    sys.path.append(sys.path.pop(0))
# and the checkout's own glm5f comes first (not an installed one from another checkout): what a bench measures is
# the code beside it; its side subprocesses inherit the path through PYTHONPATH
_ROOT = os.path.dirname(_BENCH_DIR)
if os.path.abspath(sys.path[0] or os.curdir) != _ROOT:
    sys.path.insert(0, _ROOT)
os.environ["PYTHONPATH"] = os.pathsep.join([_ROOT, *filter(None, os.environ.get("PYTHONPATH", "").split(os.pathsep))])

# Other shapes of the bench model (--shape), each a set of overrides of BENCH_MODEL: more heads and a wider latent,
# and more experts with a larger top-k (narrower experts).
SHAPES = {"base": {},
          "heads16-latent256": dict(num_attention_heads=16, kv_lora_rank=256),
          "experts64-top8": dict(n_routed_experts=64, num_experts_per_tok=8, moe_intermediate_size=128)}

# The bench model: hidden 512, 8 heads, q_lora 256, kv_lora 128, nope 64, rope 32, v 64, indexer 16 x 64,
# 16 experts top-2 + 1 shared, vocab 4096. bench/attention.py uses one layer of it, bench/forward_backward.py four.
BENCH_MODEL = dict(vocab_size=4096, hidden_size=512, num_attention_heads=8, q_lora_rank=256,
                   kv_lora_rank=128, qk_nope_head_dim=64, qk_rope_head_dim=32, v_head_dim=64, index_n_heads=16,
                   index_head_dim=64, num_hidden_layers=1, first_k_dense_replace=1, index_topk_pattern=None,
                   index_topk_freq=1, intermediate_size=1024, moe_intermediate_size=256, n_routed_experts=16,
                   num_experts_per_tok=2, n_shared_experts=1, n_group=1, topk_group=1)


def peak_memory_gb(device: str) -> float:
    """Peak memory of this process: allocated accelerator memory on CUDA, resident set size on the CPU."""
    if device.startswith("cuda"):
        return torch.cuda.max_memory_allocated() / 2**30
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20


def allocated_peak_gb(fn, device: str) -> float:
    """The most tensor memory fn holds at once beyond what was allocated before it: the caching allocator's peak on
    CUDA; on the CPU, the sum over torch's CPU allocations and frees while fn runs, in order, as the profiler records
    them (the resident set size also counts the interpreter, the libraries and memory malloc keeps after a free).
    A block allocated before fn and freed during it is not subtracted, so the figure errs high."""
    if device.startswith("cuda"):
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        fn()
        torch.cuda.synchronize()
        return (torch.cuda.max_memory_allocated() - base) / 2**30
    from torch.profiler import ProfilerActivity, profile
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    events = sorted((e for e in prof.profiler.kineto_results.events() if e.name() == "[memory]"),
                    key=lambda e: e.start_ns())
    held = peak = 0
    for e in events:
        held += e.nbytes()  # negative for a free
        peak = max(peak, held)
    return peak / 2**30


def median_seconds(fn, steps: int, device: str) -> float:
    """Median wall time of fn over `steps` calls, after one warm-up call."""
    return median_times(fn, steps, device)["seconds"]


def median_times(fn, steps: int, device: str) -> dict:
    """Median wall time ("seconds") and CPU time of this process ("cpu_seconds", all its threads) of fn over
    `steps` calls, after one warm-up call. On a shared CPU the CPU time is the figure that does not depend on the
    load (at one thread, --threads 1, it is the work done)."""
    sync = torch.cuda.synchronize if device.startswith("cuda") else (lambda: None)

    def once():
        sync()
        t, c = time.perf_counter(), time.process_time()
        fn()
        sync()
        return time.perf_counter() - t, time.process_time() - c

    once()
    wall, cpu = zip(*(once() for _ in range(steps)))
    return {"seconds": statistics.median(wall), "cpu_seconds": statistics.median(cpu)}


def matmul_peak_flops(device: str, dtype: torch.dtype, n: int = 2048, reps: int = 5) -> float:
    """FLOP/s of an n^3 matmul in `dtype` on `device`, best of `reps`: the peak utilisation is measured against."""
    a = torch.randn(n, n, device=device, dtype=dtype)
    b = torch.randn(n, n, device=device, dtype=dtype)
    best = min(median_seconds(lambda: a @ b, 1, device) for _ in range(reps))
    return 2 * n**3 / best


def train_flops(cfg, batch: int, seq: int) -> float:
    """Model FLOPs of one forward + backward over [batch, seq] causal tokens (`glm5f.core.flops.flops_per_token`)."""
    from glm5f.core.flops import flops_per_token
    return batch * seq * flops_per_token(cfg, seq)


def run_child(script: str, args: list[str], what: str) -> dict:
    """Run `script --child ...` in a fresh interpreter and return the JSON object its last line prints."""
    res = subprocess.run([sys.executable, script, *args], capture_output=True, text=True)
    if res.returncode != 0:
        sys.exit(f"{res.stderr[-3000:]}\nerror: {what} failed (its output is above)")
    return json.loads(res.stdout.strip().splitlines()[-1])


def add_model_flags(ap, steps_help: str) -> None:
    """--preset, --batch, --seq, --steps, --topk: the model and batch of a whole-model bench (`model_config`)."""
    ap.add_argument("--preset", default="bench", help="'bench' (the issue's 4-layer model) or a glm5f preset name")
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--seq", type=int, default=512)
    ap.add_argument("--steps", type=int, default=3, help=f"timed steps per side ({steps_help})")
    ap.add_argument("--topk", type=int, default=None, help="index_topk (default: 128 for 'bench', else the preset's)")
    ap.add_argument("--shape", default="base", choices=list(SHAPES), help="the 'bench' preset's shape (SHAPES)")


def model_flags(args) -> list[str]:
    """The flags of `add_model_flags` and `add_run_flags` as parsed, to hand to a side's subprocess."""
    return ["--preset", args.preset, "--batch", str(args.batch), "--seq", str(args.seq), "--steps", str(args.steps),
            "--shape", args.shape, *run_flags(args), *(["--topk", str(args.topk)] if args.topk else [])]


def model_config(args):
    """The GLM5Config of --preset ('bench': BENCH_MODEL with 4 layers) and --topk."""
    import glm5f
    if args.preset == "bench":
        return glm5f.preset("glm5-tiny", **{**BENCH_MODEL, **SHAPES[args.shape], "num_hidden_layers": 4,
                                            "index_topk": args.topk or 128, "max_position_embeddings": max(4096, args.seq)})
    if args.shape != "base":
        sys.exit(f"error: --shape {args.shape} reshapes the 'bench' preset; with --preset {args.preset} leave it out")
    return glm5f.preset(args.preset, **({"index_topk": args.topk} if args.topk else {}))


def add_run_flags(ap) -> None:
    """--device, --dtype, --threads, and the hidden --child a bench passes to the subprocess of one side."""
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--threads", type=int, default=0, help="CPU threads of each side (0: torch's default)")
    ap.add_argument("--child", default=None, help=argparse.SUPPRESS)


def run_flags(args) -> list[str]:
    """The flags of `add_run_flags` as parsed (but --child), to hand to a side's subprocess."""
    return ["--dtype", args.dtype, "--device", args.device, "--threads", str(args.threads)]


def threads_of(args) -> int:
    """The threads each side runs (--threads, else torch's default)."""
    return args.threads or torch.get_num_threads()


def serve_child(args, run_side) -> bool:
    """In a side's subprocess (--child SIDE): run it and print its JSON result; returns whether it did."""
    if not args.child:
        return False
    if args.threads:
        torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    print(json.dumps(run_side(args)))
    return True


# ---- where a step's time goes (--profile) ------------------------------------------------------------------------

GEMM_OPS = {"aten::mm", "aten::addmm", "aten::bmm", "aten::baddbmm", "aten::addbmm", "aten::_grouped_mm"}
# Families of the step's work, looked up on the Python frames and module calls above each op (innermost first): a
# frame is (file, function) for glm5f and Transformers code, or the class of an nn.Module call.
FAMILY_OF_FRAME = [  # (file or module class, functions or None for any, family)
    ("dsa.py", ("indexer_topk", "_indexer_topk_torch", "_indexer_scores_torch", "topk_first", "allowed_rows"),
     "indexer"),
    ("attention.py", ("select", "indexer_keys", "indexer_queries", "indexer_topk"), "indexer"),
    ("GlmMoeDsaIndexer", None, "indexer"),
    ("dsa.py", None, "attention core"),
    ("modeling_glm_moe_dsa.py", ("eager_attention_forward", "expand_kv"), "attention core"),
    ("ops.py", ("rms_norm", "layer_norm", "apply_rope", "swiglu"), "norms, rope, SwiGLU"),
    ("GlmMoeDsaRMSNorm", None, "norms, rope, SwiGLU"), ("LayerNorm", None, "norms, rope, SwiGLU"),
    ("modeling_glm_moe_dsa.py", ("apply_rotary_pos_emb_interleave",), "norms, rope, SwiGLU"),
    ("activations.py", None, "norms, rope, SwiGLU"), ("GlmMoeDsaMLP", None, "norms, rope, SwiGLU"),
    ("moe.py", None, "MoE routing, gathers, sums"), ("GlmMoeDsaExperts", None, "MoE routing, gathers, sums"),
    ("GlmMoeDsaTopkRouter", None, "MoE routing, gathers, sums"), ("GlmMoeDsaMoE", None, "MoE routing, gathers, sums"),
    ("head.py", None, "loss"), ("loss.py", None, "loss"), ("loss_utils.py", None, "loss"),
    ("attention.py", None, "attention core"), ("GlmMoeDsaAttention", None, "attention core"),
]
FAMILIES = ["linear layers", "MoE experts", "attention core", "indexer", "MoE routing, gathers, sums",
            "norms, rope, SwiGLU", "loss", "other"]


def _frame(name: str):
    """(file, function) of a profiled Python frame 'path/file.py(line): function' in glm5f's or Transformers'
    code, (class,) of an nn.Module call, None for anything else (torch's own frames)."""
    if name.startswith("nn.Module: "):
        return (name[len("nn.Module: "):].rsplit("_", 1)[0],)
    head, sep, func = name.partition("): ")
    if not sep or ".py(" not in head or not any(d in head for d in ("glm5f/", "transformers/")):
        return None
    return os.path.basename(head.split("(")[0]), func


def _family(frames: list, op: str) -> str:
    """The family of an op from its frames (innermost first): the expert GEMMs (glm5f's and Transformers'
    grouped_mm); a linear layer (ops.linear or an
    nn.Linear; Transformers' kv_b_proj expansion counts as attention); else the first frame FAMILY_OF_FRAME names."""
    for i, f in enumerate(frames):
        if f in (("moe.py", "grouped_mm"), ("moe.py", "grouped_mm_backward"), ("moe.py", "_grouped_mm")):
            return "MoE experts"
        if f in (("ops.py", "linear"), ("Linear",)):
            above = frames[i + 1:i + 3]
            return "attention core" if ("modeling_glm_moe_dsa.py", "expand_kv") in above else "linear layers"
        for where, funcs, fam in FAMILY_OF_FRAME:
            if f[0] == where and (funcs is None or (len(f) > 1 and f[1] in funcs)):
                return fam
    return "other"


def profile_split(step, reps: int = 3, ops: dict | None = None) -> dict:
    """Seconds of op self time per (family, "GEMM" or "other"), and ("autograd engine", "other"), each the least
    of `reps` profiled calls of step (torch.profiler with Python frames). The profiler's times are wall times: each
    call's are scaled by its process CPU time over its wall time (on one thread, the share of the wall the process
    ran; other work on a shared machine takes the rest). A backward op takes the frames of the forward op that
    made its autograd node (same sequence number). Python time is left out (the profiler's tracing inflates it):
    the caller sets the sum against the step's unprofiled CPU time. With `ops`, the first call also counts there
    which family each op landed in: {op name: {family: calls}}."""
    splits = [_profile_once(step, ops if i == 0 else None) for i in range(reps)]
    return {k: min(s.get(k, 0.0) for s in splits) for k in set().union(*splits)}


def _profile_once(step, ops: dict | None = None) -> dict:
    from torch.profiler import ProfilerActivity, profile
    with profile(activities=[ProfilerActivity.CPU], with_stack=True) as prof:
        wall, cpu = time.perf_counter(), time.process_time()
        step()
        ran = min(1.0, (time.process_time() - cpu) / (time.perf_counter() - wall))
    events = prof.events()

    def is_op(e):
        return e.name.startswith(("aten::", "glm5f::"))

    def frames_of(e, stop=None):
        out = []
        while e is not None and e is not stop:
            f = None if is_op(e) else _frame(e.name)
            if f is not None:
                out.append(f)
            e = e.cpu_parent
        return out

    def node_of(e):
        while e is not None and not e.name.startswith("autograd::engine::evaluate_function"):
            e = e.cpu_parent
        return e

    forward_op = {}  # the last forward op of each sequence number: the one that made the node (the number moves on)
    for e in events:
        if is_op(e) and e.sequence_nr >= 0 and node_of(e) is None:
            forward_op[e.sequence_nr] = e
    split = {}
    for e in events:
        if e.name.startswith("autograd::engine"):
            key = ("autograd engine", "other")
        elif is_op(e):
            frames = frames_of(e)
            node = node_of(e)
            if node is not None and not frames_of(e, stop=node):  # no Python backward of ours between them
                fwd = forward_op.get(node.sequence_nr)
                frames = frames_of(fwd) if fwd is not None else []
            key = (_family(frames, e.name), "GEMM" if e.name in GEMM_OPS else "other")
            if ops is not None:
                ops.setdefault(e.name, {}).setdefault(key[0], 0)
                ops[e.name][key[0]] += 1
        else:
            continue
        split[key] = split.get(key, 0.0) + e.self_cpu_time_total / 1e6 * ran
    return split


def print_profile_split(splits: dict, cpu_seconds: dict) -> None:
    """A table of `profile_split`s, one column per side: seconds per family and kind, the ops' sum, and the
    unprofiled CPU time of a step less that sum (Python and dispatch)."""
    sides = list(splits)
    print(f"  {'family':34s}" + "".join(f"{s:>14s}" for s in sides))
    rows = [(f, k) for f in FAMILIES for k in ("GEMM", "other")] + [("autograd engine", "other")]
    for f, k in rows:
        vals = [splits[s].get((f, k), 0.0) for s in sides]
        if any(v >= 0.0005 for v in vals):
            print(f"  {f + ' (' + k + ')':34s}" + "".join(f"{v:14.3f}" for v in vals))
    sums = [sum(splits[s].values()) for s in sides]
    print(f"  {'ops in all (profiled)':34s}" + "".join(f"{v:14.3f}" for v in sums))
    print(f"  {'step CPU time (unprofiled)':34s}" + "".join(f"{cpu_seconds[s]:14.3f}" for s in sides))
    print(f"  {'  less the ops: Python, dispatch':34s}" + "".join(f"{cpu_seconds[s] - v:14.3f}"
                                                                for s, v in zip(sides, sums)))
