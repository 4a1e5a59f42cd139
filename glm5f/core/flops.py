"""Model FLOPs of a GLM-5 config: what tokens/s becomes MFU with (the benches and bench/device_check.py), counted
from the config as the model defines it, independent of how a kernel computes it."""

from __future__ import annotations

from glm5f.core.config import GLM5Config
from glm5f.core.layers import kinds, layer_spec


def flops_per_token(cfg: GLM5Config, seq: int, train: bool = True) -> float:
    """Model FLOPs per token of a causal sequence of `seq` tokens (2 per multiply-add): the forward, and with
    `train` the backward at twice the forward, except the indexer's (forward only: the LM loss gives it no
    gradient).

    Per layer: each of its kinds' multiply-adds (`layers.Kind.macs`: attention with its indexer, the MLP), then
    the LM head. Norms, rope, softmax and the MTP layers are not counted.
    """
    macs, forward_only = 0.0, 0.0
    for layer in range(cfg.num_hidden_layers):
        spec = layer_spec(cfg, layer)
        for kind in kinds(spec):
            trained, once = kind.macs(cfg, spec, seq)
            macs, forward_only = macs + trained, forward_only + once
    macs += cfg.hidden_size * cfg.vocab_size
    return 2 * ((3 if train else 1) * macs + forward_only)
