"""bench/kernels_fla.py: fla-core's KDA kernels, as glm5f.kernels.kda.fla_kda launches them, compile ahead of time for sm_90a
(the first autotune config of each, at the tiny shape), and a config that does not compile fails the report.

In their own processes, as tests/test_kernel_report.py's: Triton reads TRITON_INTERPRET when first imported."""

import importlib.util
import json
import os
import subprocess
import sys

import pytest

TRITON = importlib.util.find_spec("triton")
if TRITON is None:
    pytest.skip("Triton is not installed", allow_module_level=True)
if importlib.util.find_spec("fla") is None:
    pytest.skip("fla-core is not installed (pip install fla-core)", allow_module_level=True)
PTXAS = os.path.join(os.path.dirname(TRITON.origin), "backends", "nvidia", "bin", "ptxas-blackwell")
if not os.path.exists(PTXAS):
    pytest.skip(f"no {PTXAS} (Triton's wheel ships it on Linux x86_64)", allow_module_level=True)
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# what chunk_kda launches: the forward's six kernels (the gate's cumsum, the intra-chunk WY matrices, the chunks'
# states, the output) and the backward's four more (it recomputes the forward's cumsum, w/u and states)
FORWARD = {"chunk_local_cumsum_vector_kernel", "chunk_kda_fwd_kernel_intra_token_parallel",
           "chunk_kda_fwd_kernel_inter_solve_fused", "recompute_w_u_fwd_kda_kernel",
           "chunk_gated_delta_rule_fwd_kernel_h_blockdim64", "chunk_gla_fwd_kernel_o"}
BACKWARD = {"chunk_kda_bwd_kernel_dAv", "chunk_gated_delta_rule_bwd_kernel_dhu_blockdim64",
            "chunk_kda_bwd_kernel_wy_dqkg_fused", "chunk_kda_bwd_kernel_intra"}


def run(*args):
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    res = subprocess.run([sys.executable, *args], cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    return res.returncode, res.stdout + res.stderr


def test_fla_kda_kernels_compile_for_sm90a(tmp_path):
    """Every kernel of the forward and backward, with and without an initial state, in the dtypes glm5f's bf16 KDA
    layer passes (q, k, g fp32; v, beta bf16): each compiles, within a block's registers and shared memory."""
    path = tmp_path / "rows.json"
    code, out = run("bench/kernels_fla.py", "--shapes", "tiny", "--archs", "sm_90a", "--dtypes", "bf16",
                    "--configs", "first", "--json", str(path))
    assert code == 0 and "all compile" in out, out
    rows = json.loads(path.read_text())
    assert {r["kernel"] for r in rows} == FORWARD | BACKWARD, out
    for r in rows:
        assert r["error"] is None and 0 < r["regs"] <= 255 and r["shared"] <= 227 * 1024, r
    # the state kernels are specialised on the initial state / the final state's gradient: both variants compiled
    assert sum(r["kernel"] == "chunk_gated_delta_rule_bwd_kernel_dhu_blockdim64" for r in rows) == 2, out


def test_a_config_that_does_not_compile_fails_the_report():
    """The forward's output kernel with its chunk size BT 48 (tl.arange needs a power of two): a compile error
    row, and the kernel's summary is not ok."""
    code, out = run("-c", "import json; from bench import kernels_fla as k; k.emulate('sm_90a'); "
                          "l = next(x for x in k.discover(k.SHAPES['tiny'], 'bf16', 'first') "
                          "if x['kernel'] == 'chunk_gla_fwd_kernel_o'); "
                          "s = json.loads(l['spec']); i = list(s['signature']).index('BT'); "
                          "s['constant_vals'][s['constant_keys'].index([i])] = 48; "
                          "r = k.compile_row(dict(arch='sm_90a', dtype='bf16', shape='tiny'), "
                          "dict(l, spec=json.dumps(s))); "
                          "print('ok', k.summarise([r])[0]['ok'], r['error'])")
    assert code == 0 and "ok False" in out and "power of 2" in out.lower().replace("two", "2"), out
