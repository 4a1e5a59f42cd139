"""Transformers checkpoints and PEFT adapters, both ways: one module per concern (io: safetensors files; keys: our
paths and Transformers' keys; fp8; load; export; export_dir: where an export may go; peft)."""

from glm5f.ckpt.hf.export import export_run, save_hf
from glm5f.ckpt.hf.export_dir import (EXPORT_MARKER, PEFT_FILES, TOKEN_FILES, check_export_dir, note_base,
                                      read_marker)
from glm5f.ckpt.hf.io import checkpoint_files
from glm5f.ckpt.hf.keys import hf_state_dict
from glm5f.ckpt.hf.load import check_loaded_finite, load_hf
from glm5f.ckpt.hf.peft import peft_adapter, save_peft

__all__ = ["EXPORT_MARKER", "PEFT_FILES", "TOKEN_FILES", "check_export_dir", "check_loaded_finite", "checkpoint_files",
           "export_run", "hf_state_dict", "load_hf", "note_base", "peft_adapter", "read_marker", "save_hf",
           "save_peft"]
