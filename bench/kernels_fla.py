"""Ahead-of-time fitness of fla-core's KDA kernels (the `chunk_kda` that glm5f.kernels.kda.kda calls on CUDA, via `fla_kda`)
without a GPU: every launch of its forward and backward, each autotune config compiled for sm_90a and sm_100a.

    python bench/kernels_fla.py                                    # every arch, shape, dtype and autotune config
    python bench/kernels_fla.py --shapes tiny --archs sm_90a --configs first   # a subset (the CI test's)

The launches are discovered without a GPU: one process per arch answers fla's and Triton's device queries as an H100
(sm_90a) or a B200 (sm_100a) would (fla picks its config lists from them when imported), runs glm5f.kernels.kda.fla_kda
forward and backward on CPU tensors of the dtypes glm5f's KDA layer passes it, and Triton's `jit_cache_hook` records
each kernel's specialization (argument types, divisibility, constexprs, options) instead of compiling and launching
it; the autotuner, which would time each config on the device, hands every config (`--configs all`) or its first
(`--configs first`) to the kernel instead. Two calls cover the paths glm5f takes: no initial state with only the
output's gradient (training), and an fp32 initial state with the final state's gradient too. Which config fla's
autotuner keeps is decided by timings on the device, so all are compiled (registers and spills from the log of
Triton's own ptxas run); a row per kernel gives their count, how many compile without spilling, how many fit a
block's shared memory (the autotuner skips the others on the device), and the range of registers, spill stores
(bytes) and shared memory over them. Spills in fla's kernels are reported, not failed on
(they are not glm5f's; the autotuner may still pick a spilling config when it is the fastest); the exit code is 1
when a config does not compile or a kernel has no config within a block's shared memory (it could not run).
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import re
import subprocess
import sys
import tempfile
import time
import types

os.environ.setdefault("TRITON_DEFAULT_FP_FUSION", "1")  # Triton 3.9's default, set to keep it quiet

import torch  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import glm5f  # noqa: E402

# per arch: what the emulated device answers (compute capability, the name fla reads, SMs, shared memory per block)
GPUS = {"sm_90a": dict(capability=(9, 0), name="NVIDIA H100 80GB HBM3", sms=132),
        "sm_100a": dict(capability=(10, 0), name="NVIDIA B200", sms=148)}
SHARED_LIMIT = 227 * 1024  # bytes a block may use on sm_90 and sm_100 (228 KB per SM)
# the layer's dtype (--train.dtype); glm5f.kernels.kda.kda_attention passes q, k and g in fp32 (the short convolution
# L2-normalises q and k in fp32, the forget gate is fp32), v and beta in the layer's dtype
DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}


def _shape(cfg: glm5f.GLM5Config, B: int, T: int) -> dict:
    """chunk_kda's sizes for a KDA layer of cfg: B sequences of T tokens, its heads and head dim (d_k = d_v)."""
    return dict(B=B, T=T, H=cfg.linear_num_heads, K=cfg.linear_head_dim)


SHAPES = {"glm5.3": _shape(glm5f.preset("glm53"), 1, 4096),  # 64 heads of 128
          "tiny": _shape(glm5f.preset("glm53-tiny"), 2, 64)}  # 2 heads of 16


def shape_label(shape: dict) -> str:
    return "B{B} T{T} H{H} K{K}".format(**shape)


# ---- the emulated device (in a worker process, before fla is imported) -------------------------------------------

class _Driver:
    """What Triton's JIT, its autotuner and fla ask of the active driver: the target, a device and stream index,
    the device's properties."""

    def __init__(self, arch: str):
        from triton.backends.compiler import GPUTarget
        major, minor = GPUS[arch]["capability"]
        self.target = GPUTarget("cuda", major * 10 + minor, 32)
        props = dict(max_shared_mem=SHARED_LIMIT, multiprocessor_count=GPUS[arch]["sms"], warpSize=32)
        self.utils = types.SimpleNamespace(get_device_properties=lambda device: props)

    def get_current_target(self):
        return self.target

    def get_current_device(self):
        return 0

    def get_current_stream(self, device=None):
        return 0

    def get_active_torch_device(self):
        return torch.device("cpu")

    def get_device_interface(self):
        return torch.cuda

    def get_benchmarker(self):
        raise RuntimeError("an emulated device has no benchmarker: the autotuner must not time configs here")


def emulate(arch: str) -> None:
    """Answer Triton's and torch.cuda's device queries as the arch's GPU; call before fla is imported."""
    import triton
    triton.runtime.driver.set_active(_Driver(arch))
    gpu = GPUS[arch]
    torch.cuda.get_device_name = lambda device=None: gpu["name"]
    torch.cuda.get_device_capability = lambda device=None: gpu["capability"]
    torch.cuda.device_count = lambda: 1


class _Recorder:
    """Installs the hooks: Triton's jit_cache_hook keeps each specialization a launch would compile (and stops it);
    the autotuner hands its configs to the kernel in turn instead of timing them."""

    def __init__(self, configs: str):
        self.configs, self.launches, self.site = configs, [], None

    def __enter__(self):
        from triton import knobs
        from triton.runtime.autotuner import Autotuner
        self._run, self._hook = Autotuner.run, knobs.runtime.jit_cache_hook
        recorder = self

        def run(tuner, *args, **kwargs):
            tuner.nargs = dict(zip(tuner.arg_names, args))
            configs = tuner.prune_configs(kwargs) if len(tuner.configs) > 1 else tuner.configs
            configs = configs if recorder.configs == "all" else configs[:1]
            for i, config in enumerate(configs):
                recorder.site = (i, len(configs), len(tuner.configs))
                tuner.fn.run(*args, **kwargs, **config.all_kwargs())
            recorder.site = None

        def hook(key, repr, fn, compile, is_manual_warmup, already_compiled):
            config, n, listed = recorder.site or (0, 1, 1)
            self.launches.append(dict(fn=fn.jit_function, kernel=fn.name.rsplit(".", 1)[-1], config=config,
                                      configs=n, listed=listed, spec=compile["specialization_data"]))
            return True  # neither compiled nor launched

        Autotuner.run, knobs.runtime.jit_cache_hook = run, hook
        return self

    def __exit__(self, *exc):
        from triton import knobs
        from triton.runtime.autotuner import Autotuner
        Autotuner.run, knobs.runtime.jit_cache_hook = self._run, self._hook


def _inputs(B, T, H, K, dtype, initial_state: bool):
    """CPU tensors of the delta rule's arguments as glm5f's KDA layer passes them (their values do not matter:
    nothing runs)."""
    shapes = [(B, T, H, K)] * 4 + [(B, T, H)]
    dtypes = (torch.float32, torch.float32, dtype, torch.float32, dtype)
    q, k, v, g, beta = (torch.zeros(s, dtype=d).requires_grad_() for s, d in zip(shapes, dtypes))
    h0 = torch.zeros(B, H, K, K, dtype=torch.float32).requires_grad_() if initial_state else None
    return q, k, v, g, beta, h0


def discover(shape: dict, dtype: str, configs: str = "all") -> list[dict]:
    """The distinct kernel specializations glm5f.kernels.kda.fla_kda's forward and backward launch at shape and dtype,
    each with its autotune config index and count, in launch order."""
    from glm5f.kernels.kda import fla_kda
    with _Recorder(configs) as rec:
        for initial_state, state_grad in ((False, False), (True, True)):
            q, k, v, g, beta, h0 = _inputs(**shape, dtype=DTYPES[dtype], initial_state=initial_state)
            o, state = fla_kda(q, k, v, g, beta, shape["K"] ** -0.5, h0)
            outs, grads = ((o, state), (torch.zeros_like(o), torch.zeros_like(state))) if state_grad else \
                ((o,), (torch.zeros_like(o),))
            inputs = [x for x in (q, k, v, g, beta, h0) if x is not None]
            torch.autograd.grad(outs, inputs, grads)
    seen, out = set(), []
    for launch in rec.launches:
        if launch["spec"] not in seen:
            seen.add(launch["spec"])
            out.append(launch)
    return out


# ---- compiling a recorded specialization ---------------------------------------------------------------------------

def ptxas_counts(log: str) -> tuple[int, int]:
    """(registers, spill store bytes) from a ptxas -v log of one kernel."""
    regs, spills = re.search(r"Used (\d+) registers", log), re.search(r"(\d+) bytes spill stores", log)
    if not (regs and spills):
        raise RuntimeError(f"no register or spill count in ptxas' log:\n{log[-2000:]}")
    return int(regs.group(1)), int(spills.group(1))


def _config_label(spec: dict) -> str:
    """The config's block sizes, warps and stages, e.g. "BK32 BV64 w4 s2"."""
    params = list(spec["signature"])
    consts = {params[k[0]]: v for k, v in zip(spec["constant_keys"], spec["constant_vals"]) if len(k) == 1}
    sizes = [f"{n}{v}" for n, v in consts.items() if re.fullmatch(r"B[A-Z]+|BLOCK_\w+", n) and isinstance(v, int)
             and not isinstance(v, bool)]
    return " ".join(sizes + [f"w{spec['options']['num_warps']}", f"s{spec['options']['num_stages']}"])


def compile_launch(launch: dict) -> dict:
    """Compile the recorded specialization for the emulated arch (Triton's preload: the compile a launch makes,
    ptxas' flags included; never from Triton's cache, so that its ptxas prints its log); {regs, spills, shared}."""
    from triton import knobs
    knobs.compilation.always_compile, knobs.nvidia.dump_ptxas_log = True, True
    log = io.StringIO()
    with contextlib.redirect_stdout(log):
        kernel = launch["fn"].preload(launch["spec"])
    regs, spills = ptxas_counts(log.getvalue())
    return dict(regs=regs, spills=spills, shared=kernel.metadata.shared)


def _error(e: Exception) -> str:
    """The exception's type and last line (a CompilationError's first lines quote the kernel's source)."""
    lines = str(e).strip().splitlines()
    return f"{type(e).__name__}: {lines[-1] if lines else ''}"[:300]


def worker(arch: str, shapes, dtypes, configs: str) -> list[dict]:
    """In this process: emulate arch, discover every launch, then compile them (a compiled kernel would be launched
    by a later discovery: Triton caches it). One row per (kernel specialization, config); a failure to discover a
    shape and dtype's launches is a row with kernel "discovery"."""
    emulate(arch)
    rows, found = [], []
    for shape_name in shapes:
        for dtype in dtypes:
            base = dict(arch=arch, dtype=dtype, shape=shape_name)
            try:
                found += [(base, launch) for launch in discover(SHAPES[shape_name], dtype, configs)]
            except Exception as e:  # chunk_kda refused these inputs before any kernel: reported as such
                rows.append(dict(base, kernel="discovery", config="", configs=0, listed=0, regs=0, spills=0,
                                 shared=0, error=_error(e), compile_s=0.0))
    return rows + [compile_row(base, launch) for base, launch in found]


def compile_row(base: dict, launch: dict) -> dict:
    """The report's row of one launch: base (arch, dtype, shape), the kernel, its config and `compile_launch`'s
    counts, or the compile error."""
    row = dict(base, kernel=launch["kernel"], config=_config_label(json.loads(launch["spec"])),
               configs=launch["configs"], listed=launch["listed"])
    t0 = time.perf_counter()
    try:
        row.update(compile_launch(launch), error=None)
    except Exception as e:  # a compile error is a failed row, reported with the others
        row.update(regs=0, spills=0, shared=0, error=_error(e))
    row["compile_s"] = time.perf_counter() - t0
    return row


# ---- the report: one worker process per arch, one row per kernel --------------------------------------------------

def missing() -> str | None:
    """Why the report cannot run here, or None."""
    import importlib.util
    for module, what in (("triton", "Triton"), ("fla", "fla-core (pip install fla-core)")):
        if importlib.util.find_spec(module) is None:
            return f"{what} is not installed"
    import triton
    ptxas = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "ptxas-blackwell")
    if not os.path.exists(ptxas):
        return f"no {ptxas} (Triton's wheel ships it on Linux x86_64)"
    return None


def report(shapes=tuple(SHAPES), archs=tuple(GPUS), dtypes=tuple(DTYPES), configs: str = "all") -> list[dict]:
    """Every arch's rows (`worker`), each arch in its own process (fla reads the device once, when imported)."""
    rows = []
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    for arch in archs:
        with tempfile.TemporaryDirectory() as tmp:
            path = os.path.join(tmp, "rows.json")
            res = subprocess.run([sys.executable, os.path.abspath(__file__), "--worker", arch, "--shapes", *shapes,
                                  "--dtypes", *dtypes, "--configs", configs, "--json", path], env=env,
                                 capture_output=True, text=True)
            if res.returncode or not os.path.exists(path):
                raise RuntimeError(f"the {arch} worker failed (exit {res.returncode}):\n"
                                   f"{(res.stdout + res.stderr)[-3000:]}")
            with open(path) as f:
                rows += json.load(f)
    return rows


def summarise(rows: list[dict]) -> list[dict]:
    """One row per kernel, arch, dtype and shape over its configs (and specializations): counts, ranges, and ok
    (every config compiled and one fits a block's shared memory)."""
    groups = {}
    for r in rows:
        groups.setdefault((r["kernel"], r["arch"], r["dtype"], r["shape"]), []).append(r)
    out = []
    for (kernel, arch, dtype, shape), rs in groups.items():
        good = [r for r in rs if r["error"] is None]
        fits = [r for r in good if r["shared"] <= SHARED_LIMIT]
        errors = [r["error"] for r in rs if r["error"]]
        out.append(dict(kernel=kernel, arch=arch, dtype=dtype, shape=shape, compiled=len(rs),
                        failed=len(errors), no_spill=sum(r["spills"] == 0 for r in good), fits=len(fits),
                        regs=[min((r["regs"] for r in good), default=0), max((r["regs"] for r in good), default=0)],
                        spills=[min((r["spills"] for r in good), default=0),
                                max((r["spills"] for r in good), default=0)],
                        shared=[min((r["shared"] for r in good), default=0),
                                max((r["shared"] for r in good), default=0)],
                        error=errors[0] if errors else None, ok=not errors and bool(fits)))
    return out


HEADER = (f"{'kernel':<50}{'arch':<8}{'dtype':<6}{'shape':<7}{'configs':>8}{'no spill':>9}{'fit smem':>9}"
          f"{'regs':>10}{'spill':>13}{'smem KB':>10}")


def _range(pair, scale=1.0) -> str:
    lo, hi = (round(x / scale) for x in pair)
    return f"{lo}" if lo == hi else f"{lo}-{hi}"


def format_row(s: dict) -> str:
    head = f"{s['kernel']:<50}{s['arch']:<8}{s['dtype']:<6}{s['shape']:<7}"
    if s["failed"] == s["compiled"]:
        return head + f"COMPILE ERROR {s['error']}"
    line = (head + f"{s['compiled']:>8}{s['no_spill']:>9}{s['fits']:>9}{_range(s['regs']):>10}"
            f"{_range(s['spills']):>13}{_range(s['shared'], 1024):>10}")
    if s["failed"]:
        line += f"  <- {s['failed']} configs do not compile: {s['error']}"
    elif not s["ok"]:
        line += "  <- no config within 227 KB of shared memory"
    return line


def format_config(r: dict) -> str:
    head = f"  {r['kernel'] + ' ' + r['config']:<48}{r['arch']:<8}{r['dtype']:<6}{r['shape']:<7}"
    if r["error"]:
        return head + f"COMPILE ERROR {r['error']}"
    return head + f"{'':>8}{'':>9}{'':>9}{r['regs']:>10}{r['spills']:>13}{r['shared'] / 1024:>10.0f}"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shapes", nargs="+", default=list(SHAPES), choices=list(SHAPES))
    ap.add_argument("--archs", nargs="+", default=list(GPUS), choices=list(GPUS))
    ap.add_argument("--dtypes", nargs="+", default=list(DTYPES), choices=list(DTYPES))
    ap.add_argument("--configs", default="all", choices=["all", "first"],
                    help="every autotune config, or each kernel's first (fast)")
    ap.add_argument("--each", action="store_true", help="also print a row per config")
    ap.add_argument("--json", default=None, help="also write the per-config rows to this file")
    ap.add_argument("--worker", default=None, choices=list(GPUS), help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    why = missing()
    if why:
        print(f"error: fla's kernels cannot be compiled here: {why}", file=sys.stderr)
        return 2
    if args.worker:  # one arch, in this process (report's child)
        rows = worker(args.worker, args.shapes, args.dtypes, args.configs)
        with open(args.json, "w") as f:
            json.dump(rows, f)
        return 0
    t0 = time.perf_counter()
    try:
        rows = report(args.shapes, args.archs, args.dtypes, args.configs)
    except RuntimeError as e:
        print(f"{e}\nerror: fla's kernels could not be discovered (see above)", file=sys.stderr)
        return 1
    summary = summarise(rows)
    print(f"fla-core's chunk_kda kernels ({args.configs} autotune configs)")
    for name in args.shapes:
        print(f"{name}: {shape_label(SHAPES[name])}")
    print(HEADER)
    for s in summary:
        print(format_row(s))
        if args.each:
            for r in rows:
                if (r["kernel"], r["arch"], r["dtype"], r["shape"]) == (s["kernel"], s["arch"], s["dtype"],
                                                                        s["shape"]):
                    print(format_config(r))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f)
    failed = [s for s in summary if not s["ok"]]
    print(f"{len(rows)} fla kernel configs compiled in {time.perf_counter() - t0:.0f} s; "
          + ("all compile" if not failed else f"{len(failed)} kernels FAIL (a config does not compile, or none "
                                               "fits shared memory)"))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
