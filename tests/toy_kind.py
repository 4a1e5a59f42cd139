"""A toy attention kind defined by its record alone, for tests/test_kinds.py: each token's output is o(h_t), the
decaying sum h_t = DECAY h_{t-1} + v(x_t) of the values so far; its decode cache is h, a state carried per row."""

import torch

from glm5f.core.layers import Kind, LeafKind, linear_leaves
from glm5f.core.ops import linear, wide_dtype

DECAY = 0.5


def toy_attention(p: dict, x_BxSxD: torch.Tensor, cfg, layer: int, env, carry):
    """(o(h) [B, S, D], no Selection, no aux): the whole sequence at once (h = W v with W[t, s] = DECAY^(t - s),
    s <= t), or with a carried state (decoding) token by token from it, the state updated in place."""
    v_BxSxD = linear(p["toy_v"], x_BxSxD)
    state = env.state(layer)
    if state is None:
        S = x_BxSxD.shape[1]
        t = torch.arange(S, device=x_BxSxD.device)
        lag_SxS = (t[:, None] - t[None, :]).to(wide_dtype(v_BxSxD.dtype))
        w_SxS = torch.where(lag_SxS >= 0, DECAY ** lag_SxS.clamp(min=0), 0.0)
        h_BxSxD = torch.einsum("ts,bsd->btd", w_SxS, v_BxSxD.to(w_SxS.dtype))
    else:
        h_BxD, rows = state["toy_state"], []
        for i in range(x_BxSxD.shape[1]):
            h_BxD.copy_(DECAY * h_BxD + v_BxSxD[:, i].to(h_BxD.dtype))
            rows.append(h_BxD.clone())
        h_BxSxD = torch.stack(rows, 1)
    return linear(p["toy_o"], h_BxSxD.to(x_BxSxD.dtype)), None, {}


TOY = Kind(
    toy_attention,
    lambda c, spec: {"toy_v": linear_leaves(c.hidden_size, c.hidden_size),
                     "toy_o": linear_leaves(c.hidden_size, c.hidden_size)},
    rows=((r"\.self_attn\.toy_v\.weight$", LeafKind(("heads", "embed"), optim="hidden")),
          (r"\.self_attn\.toy_o\.weight$", LeafKind(("embed", "heads"), optim="hidden"))),
    macs=lambda c, spec, seq: (2 * c.hidden_size * c.hidden_size + (seq + 1) / 2 * c.hidden_size, 0.0),
    cache=lambda c, spec, B, capacity, dtype, device: {
        "toy_state": torch.zeros(B, c.hidden_size, dtype=wide_dtype(dtype), device=device)},
    recurrent=True, cp=False)

# GLM-5.3's tiny preset with its third layer (a KDA layer there) the toy kind, selected by its layer_types entry.
LAYER_TYPE = "toy_attention"
LAYER_TYPES = ("linear_attention", "indexed_attention", LAYER_TYPE, "indexed_attention")
