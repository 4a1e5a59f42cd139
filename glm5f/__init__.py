"""glm5f: GLM-5 (MLA + DeepSeek sparse attention + sigmoid-routed MoE) as pure PyTorch functions over pytrees."""

from glm5f.core.config import PRESETS, GLM5Config, preset
from glm5f.model.decode import generate
from glm5f.ckpt.hf import hf_state_dict, load_hf, save_hf
from glm5f.data import IGNORE_INDEX
from glm5f.model.env import make_env
from glm5f.model.logprobs import token_logprobs
from glm5f.model.head import causal_lm_loss, cross_entropy_sum, shift_labels
from glm5f.model.decoder import apply, decoder_layer, forward
from glm5f.core.params import abstract_params, check_params, flatten, init_params, param_count, unflatten

__all__ = [
    "GLM5Config", "PRESETS", "preset", "init_params", "abstract_params", "param_count", "check_params", "flatten",
    "unflatten", "forward", "apply", "make_env", "decoder_layer", "causal_lm_loss", "cross_entropy_sum", "shift_labels",
    "IGNORE_INDEX", "load_hf", "save_hf", "hf_state_dict", "generate", "token_logprobs",
]
