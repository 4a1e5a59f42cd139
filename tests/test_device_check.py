"""bench/device_check.py at its CPU sizes (the CUDA run is the same code, bigger), and the model FLOPs per token it
computes MFU from, against a count by hand."""

import os
import sys

import pytest

import glm5f
from glm5f.core.flops import flops_per_token

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_flops_per_token_of_a_two_layer_model_by_hand():
    # glm5-tiny's widths: D 64, H 4, q_lora 32, kv_lora 32, nope 16, rope 8, v 16, indexer 4 x 16, top-k 16,
    # vocab 512; layer 0 dense SwiGLU (128) with a full indexer, layer 1 MoE (8 experts of 32, top-2, 1 shared)
    # reusing layer 0's top-k.
    cfg = glm5f.preset("glm5-tiny", num_hidden_layers=2, index_topk_pattern="FS")
    assert tuple(cfg.indexer_types) == ("full", "shared") and [cfg.is_moe(i) for i in range(2)] == [False, True]
    projections = 64 * 32 + 32 * 4 * 24 + 64 * 40 + 32 * 4 * 32 + 4 * 16 * 64  # q_a, q_b, kv_a, kv_b, o: 15872
    dense_mlp = 3 * 64 * 128  # 24576
    moe_mlp = 64 * 8 + 3 * 64 * 32 * 3  # router, then 2 routed + 1 shared expert: 18944
    head = 64 * 512
    # 32 tokens, top-k 16: query s attends min(16, s + 1) keys: (1 + ... + 16 + 16 * 16) / 32 = 12.25 per query;
    # per key and head: nope + rope scores and v values, 16 + 8 + 16 multiply-adds
    attention = 12.25 * 4 * 40
    # the indexer: wq_b, wk, weights_proj, then per visible key (33 / 2 on average) 4 heads x (16 + 1)
    indexer = 32 * 4 * 16 + 64 * 16 + 64 * 4 + 16.5 * 4 * 17
    macs = 2 * (projections + attention) + dense_mlp + moe_mlp + head
    assert flops_per_token(cfg, 32) == pytest.approx(2 * (3 * macs + indexer), rel=1e-12)
    assert flops_per_token(cfg, 32, train=False) == pytest.approx(2 * (macs + indexer), rel=1e-12)
    # 8 tokens (below top-k 16): every visible key, (8 + 1) / 2 per query
    short = 2 * (projections + 4.5 * 4 * 40) + dense_mlp + moe_mlp + head
    assert flops_per_token(cfg, 8) == pytest.approx(2 * (3 * short + 32 * 4 * 16 + 64 * 20 + 4.5 * 4 * 17),
                                                    rel=1e-12)


def test_device_check_runs_on_the_cpu(capsys):
    sys.path.insert(0, ROOT)
    from bench.device_check import main
    assert main(["--device", "cpu"]) == 0
    out = capsys.readouterr().out
    table = out[out.index("\ncheck"):]
    for check in ("indexer top-k vs fp64", "sparse MLA fwd+bwd vs fp64", "model logits vs CPU fp64",
                  "model gradients vs CPU fp64", "bf16 loss curve vs CPU fp32", "peak memory / --plan",
                  "tokens/s (fwd+bwd)", "MFU of measured peak", "attention layer fwd+bwd", "attention layer peak",
                  "kernel spill bytes", "KDA glm5f kda_op vs fp64", "KDA fwd+bwd time"):
        assert check in table, check
    assert "float32" in table and "bfloat16" in table and "DEVICE CHECK PASSED" in out
