"""Transformers checkpoints and PEFT adapters: reading, writing and the rules for export directories.

The public names of the package's modules, for callers that import them from `glm5f.hf`."""

from glm5f.hf.keys import (EXPORT_MARKER, PEFT_FILES, TOKEN_FILES, check_export_dir, check_loaded_finite,
                           checkpoint_files, hf_state_dict, load_hf, note_base, peft_adapter, read_marker, save_hf,
                           save_peft)
