"""Training data: sources of global batches {input_ids, labels, position_ids[, attention_mask]} of [B, S].

Sources: `synthetic` (seeded random bigram language), `text` (the embedded corpus), `json_file` (JSONL of text,
prompt/response or pre-tokenized ids; streamed), `preset_pt` (fixed batches from torch.save), `hf_datasets` (a
dataset saved to disk; streamed), `chat` (conversations rendered by a chat template, see glm5f/data/chat.py; chat records
are read by json_file and hf_datasets too). Documents are packed into rows of seq_len: positions restart at each
document and attention stays inside it. Every source has state_dict() / load_state_dict(); a step's global batch
depends only on the source and its state, never on how it is later split over micro-batches or ranks.

readers.py: the file formats (records, JSONL, saved datasets, preset_pt, the embedded corpus); packing.py: rows of
seq_len; sources.py: the sources and make_source / make_eval_source; notes.py: warnings about the data;
rollouts.py: GRPO's groups of completions and trajectories; engines.py: other RL engines' rollout fields;
overlong.py: records past seq_len refused, or counted and skipped (--data.skip_overlong).
"""

from glm5f.data.notes import print_warning, warnings_as_lines
from glm5f.data.packing import check_first_batch
from glm5f.data.rollouts import ReadOptions
from glm5f.data.readers import check_path_fits, embedded_documents, infer_data_type, load_batches
from glm5f.data.sources import PresetSource, make_eval_source, make_source, model_tokenizer
from glm5f.data.tokens import IGNORE_INDEX, ByteTokenizer, make_tokenizer

__all__ = ["IGNORE_INDEX", "ByteTokenizer", "PresetSource", "ReadOptions", "check_first_batch", "check_path_fits",
           "embedded_documents", "infer_data_type", "load_batches", "make_eval_source", "make_source",
           "make_tokenizer", "model_tokenizer", "print_warning", "warnings_as_lines"]
