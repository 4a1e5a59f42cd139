"""The GLM-5 network as pure functions of (params, inputs, cfg, env): decoder layer, the main model, MTP layers and
`forward`, the logits Transformers' `GlmMoeDsaForCausalLM` computes."""

from __future__ import annotations

import dataclasses
import functools

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from glm5f.core import replay
from glm5f.model.attention import INDEXER_KINDS, MLA_DSA, Selection
from glm5f.core.config import GLM5Config
from glm5f.model.env import Env, make_env
from glm5f.model.hyper import HYPER
from glm5f.model.kda_layer import KDA
from glm5f.core.layers import ATTENTION, INDEXERS, MLP, RESIDUAL, Kind, LeafKind, kinds, layer_spec, norm_leaves, \
    swiglu_leaves
from glm5f.model.lora import LoraSpec
from glm5f.model.moe import MOE
from glm5f.core.ops import linear, rms_norm, swiglu_mlp


def decoder_layer(p: dict, x_BxSxD: torch.Tensor, cfg: GLM5Config, layer: int, env: Env,
                  carry: Selection | None) -> tuple[torch.Tensor, Selection, dict]:
    """Layer `layer` as its kinds make it (`layers.layer_spec`, `layers.kinds`): its residual's function around its
    attention's and its MLP's.

    Returns (x [B, S, D], the Selection the next layer may reuse, aux): aux is a dict of this layer's extra
    outputs: "expert_idx" [N, K] for MoE layers (the experts each token chose); the objectives env.objectives
    asks for, as fp64 sums of this rank's share ("indexer_loss" and "indexer_recall", see `attention`;
    "seq_aux_loss", see `moe`).
    """
    attention, mlp, residual = kinds(layer_spec(cfg, layer))
    return residual.fn(p, x_BxSxD, cfg, layer, env, carry, attention.fn, mlp.fn)


def plain_residual(p: dict, x_BxSxD: torch.Tensor, cfg: GLM5Config, layer: int, env: Env, carry: Selection | None,
                   attend, mlp) -> tuple[torch.Tensor, Selection, dict]:
    """Pre-norm attention and MLP, each added to the residual stream."""
    x_norm_BxSxD = rms_norm(p["input_layernorm"]["weight"], x_BxSxD, cfg.rms_norm_eps)
    a_BxSxD, carry, aux = attend(p["self_attn"], x_norm_BxSxD, cfg, layer, env, carry)
    x_BxSxD = x_BxSxD + a_BxSxD
    h_BxSxD = rms_norm(p["post_attention_layernorm"]["weight"], x_BxSxD, cfg.rms_norm_eps)
    m_BxSxD, mlp_aux = mlp(p["mlp"], h_BxSxD, cfg, layer, env)
    return x_BxSxD + m_BxSxD, carry, {**aux, **mlp_aux}


def dense_mlp(p: dict, x_BxSxD: torch.Tensor, cfg: GLM5Config, layer: int, env: Env) -> tuple[torch.Tensor, dict]:
    return swiglu_mlp(p, x_BxSxD, cfg.swiglu_limit), {}


PLAIN = Kind(plain_residual, lambda c, spec: {"input_layernorm": norm_leaves(c.hidden_size),
                                              "post_attention_layernorm": norm_leaves(c.hidden_size)})
DENSE = Kind(dense_mlp, lambda c, spec: swiglu_leaves(c.hidden_size, c.intermediate_size),
             rows=((r"\.(gate|up)_proj\.weight$", LeafKind(("mlp", "embed"), optim="hidden")),
                   (r"\.down_proj\.weight$", LeafKind(("embed", "mlp"), optim="hidden"))),
             macs=lambda c, spec, seq: (3 * c.hidden_size * c.intermediate_size, 0.0))

# The kinds a decoder layer is made of, entered in glm5f.core.layers' tables by the names `layers.layer_spec` gives them:
# each record (function, parameters, rows, cache, FLOPs, memory) comes from its kind's module. A new kind is its
# module, its line here, and the config field or layer_types entry (`config.ATTENTION_KINDS`) that selects it.
ATTENTION.update(mla_dsa=MLA_DSA, kda=KDA)
INDEXERS.update(INDEXER_KINDS)
MLP.update(moe=MOE, dense=DENSE)
RESIDUAL.update(plain=PLAIN, hyper=HYPER)


@functools.cache
def compiled_decoder_layer():
    """`decoder_layer` under torch.compile: a graph per distinct layer (its index and kind are constants), the
    glm5f custom ops opaque inside it. The recompile limit is raised so every layer of a deep model gets one."""
    torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, 1024)
    return torch.compile(decoder_layer)


def layer_fn(env: Env):
    """The decoder layer function `env` runs: compiled with env.compile (--train.compile), else eager."""
    return compiled_decoder_layer() if env.compile else decoder_layer


def run_layer(p_layer: dict, x_BxSxD: torch.Tensor, cfg: GLM5Config, layer: int, env: Env,
              carry: Selection | None):
    """`decoder_layer` on the stored weights of layer `layer`: its compute weights are made (env.weights: cast,
    FSDP gather) as it starts; with env.remat (and gradients on) the layer is recomputed in the backward pass,
    its gathered weights freed after the forward and gathered again, so one layer's are alive at a time."""
    def run(p_layer, x_BxSxD, carry):
        return layer_fn(env)(env.weights(p_layer, f"model.layers.{layer}"), x_BxSxD, cfg, layer, env, carry)

    if env.remat and torch.is_grad_enabled():
        return checkpoint(run, p_layer, x_BxSxD, carry, use_reentrant=False)
    return run(p_layer, x_BxSxD, carry)


def apply(params: dict, cfg: GLM5Config, input_ids_BxS: torch.Tensor, env: Env) -> tuple[torch.Tensor, dict]:
    """(logits [B, S, V], aux) of this rank's tokens. `params` holds compute weights except its decoder layers,
    which each make theirs as they run (`run_layer`). aux: "layers", each layer's aux dict (see `decoder_layer`);
    "hidden", the last layer's output [B, S, D] before the final norm."""
    hidden_BxSxD, aux = hidden_states(params, cfg, input_ids_BxS, env)
    return lm_head(params, cfg, hidden_BxSxD), aux


def hidden_states(params: dict, cfg: GLM5Config, input_ids_BxS: torch.Tensor, env: Env) -> tuple[torch.Tensor, dict]:
    """`apply` without the final norm and head: (the last layer's output [B, S, D], aux)."""
    x_BxSxD = F.embedding(input_ids_BxS, params["model"]["embed_tokens"]["weight"]).to(env.dtype)
    return run_layers(params, cfg, x_BxSxD, env)


def apply_embeds(params: dict, cfg: GLM5Config, x_BxSxD: torch.Tensor, env: Env) -> tuple[torch.Tensor, dict]:
    """`apply` from input embeddings [B, S, D] instead of token ids."""
    hidden_BxSxD, aux = run_layers(params, cfg, x_BxSxD, env)
    return lm_head(params, cfg, hidden_BxSxD), aux


def run_layers(params: dict, cfg: GLM5Config, x_BxSxD: torch.Tensor, env: Env) -> tuple[torch.Tensor, dict]:
    """The main decoder layers on input embeddings [B, S, D]: (their output [B, S, D], aux as `apply`'s)."""
    carry, layers = None, []
    residual = RESIDUAL[layer_spec(cfg, 0).residual]  # its streams between the layers (GLM-5.3's hc_mult)
    if residual.enter is not None:
        x_BxSxD = residual.enter(x_BxSxD, cfg)
    for i, p_layer in enumerate(params["model"]["layers"][:cfg.num_hidden_layers]):
        x_BxSxD, carry, aux = run_layer(p_layer, x_BxSxD, cfg, i, env, carry)
        layers.append(aux)
    if residual.leave is not None:
        x_BxSxD = residual.leave(x_BxSxD)
    return x_BxSxD, {"layers": layers, "hidden": x_BxSxD}


def main_head(params: dict, cfg: GLM5Config) -> dict:
    """The main model's head: {"norm": the final norm's weight [D], "weight": the LM head's [V, D] (the
    embedding when tied)}, as `head_logits` and `head.head_loss_sum` take it."""
    head = params["model"]["embed_tokens"] if cfg.tie_word_embeddings else params["lm_head"]
    return {"norm": params["model"]["norm"]["weight"], "weight": head["weight"]}


def head_logits(head: dict, x_BxSxD: torch.Tensor, eps: float) -> torch.Tensor:
    """Logits [B, S, V] of hidden states through a head (`main_head`, `mtp_layer`'s): its norm, then its weight."""
    return linear({"weight": head["weight"]}, rms_norm(head["norm"], x_BxSxD, eps))


def lm_head(params: dict, cfg: GLM5Config, x_BxSxD: torch.Tensor) -> torch.Tensor:
    """Logits [B, S, V] of hidden states: the final norm, then the LM head (the embedding when tied)."""
    return head_logits(main_head(params, cfg), x_BxSxD, cfg.rms_norm_eps)


def mtp_apply(params: dict, cfg: GLM5Config, hidden_BxSxD: torch.Tensor, mtp_input_ids: list[torch.Tensor],
              env: Env) -> tuple[list[torch.Tensor], dict]:
    """(logits [B, S, V] of each MTP depth, aux) from the main model's last hidden state (aux["hidden"] of
    `apply`, before the final norm) and each depth's input ids (`loss.mtp_inputs`: depth d holds t_{i+d} at i);
    `mtp_states` through each depth's head."""
    states, aux = mtp_states(params, cfg, hidden_BxSxD, mtp_input_ids, env)
    return [head_logits(head, h_BxSxD, cfg.rms_norm_eps) for h_BxSxD, head in states], aux


def mtp_states(params: dict, cfg: GLM5Config, hidden_BxSxD: torch.Tensor, mtp_input_ids: list[torch.Tensor],
               env: Env) -> tuple[list[tuple[torch.Tensor, dict]], dict]:
    """([(output h^d [B, S, D], head) of each MTP depth d], aux), the arguments as `mtp_apply`'s.

    Depth d at position i: h = eh_proj(cat[enorm(embed(t_{i+d})), hnorm(h_i^{d-1})]) through its decoder layer
    (h^0 the main model's); its head (shared_head.norm and the LM head) predicts t_{i+d+1}. aux: "layers", each
    MTP decoder layer's aux; "hidden", the last depth's output.
    """
    h_BxSxD, states, layers = hidden_BxSxD, [], []
    for d, ids_BxS in enumerate(mtp_input_ids[:cfg.mtp_depths]):
        h_BxSxD, head, aux = mtp_layer(params, cfg, d + 1, h_BxSxD, ids_BxS, env)
        states.append((h_BxSxD, head))
        layers.append(aux)
    return states, {"layers": layers, "hidden": h_BxSxD}


def mtp_layer(params: dict, cfg: GLM5Config, depth: int, h_BxSxD: torch.Tensor, input_ids_BxS: torch.Tensor,
              env: Env) -> tuple[torch.Tensor, dict, dict]:
    """MTP depth `depth` (1-based): (its output h^depth [B, S, D], its head as `main_head`'s, the decoder layer's
    aux). The embedding and head are the main model's unless the layer holds its own copies (params.MTP_COPIES).
    The whole MTP layer's weights are made once (env.weights), outside activation checkpointing."""
    layer, eps = cfg.mtp_layer(depth), cfg.rms_norm_eps
    p = env.weights(params["model"]["layers"][layer], f"model.layers.{layer}")
    embed = p.get("embed_tokens", params["model"]["embed_tokens"])["weight"]
    e_BxSxD = F.embedding(input_ids_BxS, embed).to(env.dtype)
    x_BxSxD = linear(p["eh_proj"], torch.cat([rms_norm(p["enorm"]["weight"], e_BxSxD, eps),
                                              rms_norm(p["hnorm"]["weight"], h_BxSxD, eps)], dim=-1))
    if env.remat and torch.is_grad_enabled():
        h_BxSxD, _, aux = checkpoint(layer_fn(env), p, x_BxSxD, cfg, layer, env, None, use_reentrant=False)
    else:
        h_BxSxD, _, aux = layer_fn(env)(p, x_BxSxD, cfg, layer, env, None)
    own = p["shared_head"].get("head")
    head = main_head(params, cfg) if own is None else {"weight": own["weight"]}
    return h_BxSxD, {**head, "norm": p["shared_head"]["norm"]["weight"]}, aux


def forward(params: dict, cfg: GLM5Config, input_ids: torch.Tensor, *, attention_mask: torch.Tensor | None = None,
            position_ids: torch.Tensor | None = None, lora: LoraSpec | None = None,
            routing: torch.Tensor | None = None, indexer: torch.Tensor | None = None) -> torch.Tensor:
    """Logits [B, S, V] of the causal LM, as `GlmMoeDsaForCausalLM` computes them.

    attention_mask: None (causal), 2D [B, S] padding mask (1 keep, 0 pad), or a 4D [B, 1, S, S] mask, boolean
    (True attends) or additive float (0 attends, dtype-min masks), used as given. position_ids [B, S] or [1, S]
    (default 0..S-1); with no attention_mask, positions that restart mark packed documents, and attention stays
    within each document. `lora`: the spec of the LoRA adapters `params` holds (`lora.attach`), applied unmerged
    (without dropout). `routing` [B, S, M, K] and `indexer` [B, S, L, T]: recorded experts and keys to use
    (`glm5f.core.replay`, checked by `replay.check_replay`).
    """
    batch = input_batch(cfg, input_ids, attention_mask, position_ids, routing, indexer)
    spec = None if lora is None else dataclasses.replace(lora, dropout=0.0)
    local, env = make_env(cfg, batch, params["model"]["embed_tokens"]["weight"].dtype, lora=spec)
    return apply(params, cfg, local["input_ids"], env)[0]


def input_batch(cfg: GLM5Config, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None,
                position_ids: torch.Tensor | None = None, routing: torch.Tensor | None = None,
                indexer: torch.Tensor | None = None) -> dict:
    """The batch `make_env` takes for `forward`'s arguments (see there), the ids and any replay records checked."""
    check_input_ids(input_ids, cfg)
    batch = {"input_ids": input_ids, "position_ids": position_ids}
    if attention_mask is not None:
        batch["attention_mask"] = attention_mask
    if routing is not None or indexer is not None:
        batch.update(routing=routing, indexer=indexer)
        replay.check_replay(batch, cfg)
    return batch


def check_input_ids(input_ids: torch.Tensor, cfg: GLM5Config) -> None:
    if not isinstance(input_ids, torch.Tensor) or input_ids.ndim != 2:
        raise ValueError(f"input_ids must be a [batch, seq] tensor, got "
                         f"{tuple(input_ids.shape) if isinstance(input_ids, torch.Tensor) else type(input_ids)}")
    if input_ids.dtype.is_floating_point or input_ids.dtype == torch.bool or input_ids.dtype.is_complex:
        raise ValueError(f"input_ids must hold integer token ids, got dtype {input_ids.dtype}")
    if input_ids.numel():
        lo, hi = int(input_ids.min()), int(input_ids.max())
        if lo < 0 or hi >= cfg.vocab_size:
            raise ValueError(f"token ids must lie in [0, vocab_size={cfg.vocab_size}), found ids in [{lo}, {hi}]: "
                             f"the tokenizer and the model config disagree on the vocabulary")
