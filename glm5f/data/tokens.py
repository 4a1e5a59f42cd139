"""Tokens: the byte and tokenizer.json tokenizers, the Example (ids and labels) a record becomes, and the
vocabulary checks; what chat.py and data.py both build on.
"""

from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass

from glm5f.core import IGNORE_INDEX


# ---- tokenizers ---------------------------------------------------------------------------------------------------

class ByteTokenizer:
    """UTF-8 bytes are ids 0..255; then bos 256, eos 257, pad 258."""

    vocab_size = 259
    bos_id, eos_id, pad_id = 256, 257, 258

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, ids) -> str:
        return bytes(i for i in ids if i < 256).decode("utf-8", errors="replace")


class FileTokenizer:
    """A `tokenizers` tokenizer.json (a file, or a directory holding one)."""

    def __init__(self, path: str):
        try:
            from tokenizers import Tokenizer
        except ImportError as e:
            raise ImportError("--model.tokenizer_path needs the `tokenizers` package: "
                              "pip install 'glm5f[tokenizers]'") from e
        file = os.path.join(path, "tokenizer.json") if os.path.isdir(path) else path
        if not os.path.isfile(file):
            raise FileNotFoundError(f"no tokenizer.json at {file!r}: pass a tokenizer.json or a directory with one")
        try:
            self._tok = Tokenizer.from_file(file)
        except Exception as e:  # tokenizers raises a bare Exception on a malformed file
            raise ValueError(f"--model.tokenizer_path {file}: not a readable tokenizer.json ({e}); pass the "
                             f"tokenizer.json of a Transformers/tokenizers tokenizer") from None
        self.vocab_size = self._tok.get_vocab_size(with_added_tokens=True)
        find = lambda *names: next((i for n in names if (i := self.token_id(n)) is not None), None)  # noqa
        self.bos_id = find("<|begin_of_text|>", "<s>", "[gMASK]", "<bos>", "<|endoftext|>")
        self.eos_id = find("<|endoftext|>", "</s>", "<eos>", "<|end_of_text|>")
        self.pad_id = find("<pad>", "[PAD]", "<|pad|>")
        if self.pad_id is None:
            self.pad_id = self.eos_id if self.eos_id is not None else 0

    def encode(self, text: str) -> list[int]:
        return self._tok.encode(text, add_special_tokens=False).ids

    def encode_offsets(self, text: str) -> tuple[list[int], list[tuple[int, int]]]:
        """Token ids of `text` and each one's [start, end) in characters."""
        enc = self._tok.encode(text, add_special_tokens=False)
        return list(enc.ids), [tuple(o) for o in enc.offsets]

    def token_id(self, text: str) -> int | None:
        return self._tok.token_to_id(text)

    def decode(self, ids, keep_special: bool = False) -> str:
        """The text of `ids`; with keep_special, the special tokens written out too (as a chat's tool calls need)."""
        return self._tok.decode(list(ids), skip_special_tokens=not keep_special)


def make_tokenizer(path: str | None):
    return ByteTokenizer() if path is None else FileTokenizer(path)


# ---- the byte tokenizer's chat special tokens -------------------------------------------------------------------

class ChatByteTokenizer(ByteTokenizer):
    """The byte tokenizer with chat special tokens, each one id: bos 256, eos 257, pad 258 as ever, then
    CHAT_SPECIALS from 259 in their listed order (so the tiny presets, vocab 512, hold them all)."""

    CHAT_SPECIALS = ("[gMASK]", "<sop>", "<|system|>", "<|user|>", "<|assistant|>", "<|observation|>", "<think>",
                     "</think>", "<tool_call>", "</tool_call>", "<arg_key>", "</arg_key>", "<arg_value>",
                     "</arg_value>", "<tool_response>", "</tool_response>", "<|im_start|>", "<|im_end|>")
    BOS, EOS, PAD = "<|begin_of_text|>", "<|endoftext|>", "<|pad|>"

    def __init__(self):
        self.special = {self.BOS: 256, self.EOS: 257, self.PAD: 258}
        self.special.update((s, 259 + i) for i, s in enumerate(self.CHAT_SPECIALS))
        self.names = {i: s for s, i in self.special.items()}
        self.vocab_size = 259 + len(self.CHAT_SPECIALS)
        self._split = re.compile("(" + "|".join(re.escape(s) for s in sorted(self.special, key=len, reverse=True))
                                 + ")")

    def encode_offsets(self, text: str) -> tuple[list[int], list[tuple[int, int]]]:
        """Token ids of `text` (a special token's text is its one id) and each one's [start, end) in characters."""
        ids, offsets, at = [], [], 0
        for piece in self._split.split(text):
            if piece in self.special:
                ids.append(self.special[piece])
                offsets.append((at, at + len(piece)))
            else:
                for j, ch in enumerate(piece):
                    b = ch.encode("utf-8")
                    ids += b
                    offsets += [(at + j, at + j + 1)] * len(b)
            at += len(piece)
        return ids, offsets

    def encode(self, text: str) -> list[int]:
        return self.encode_offsets(text)[0]

    def decode(self, ids, keep_special: bool = True) -> str:
        """The text of `ids`: the chat special tokens written out (always: `keep_special` as FileTokenizer's),
        bos, eos and pad left out."""
        out, run = [], bytearray()
        for i in ids:
            if i < 256:
                run.append(i)
                continue
            out.append(run.decode("utf-8", errors="replace"))
            run = bytearray()
            if i in self.names and i not in (self.bos_id, self.eos_id, self.pad_id):
                out.append(self.names[i])
        return "".join(out) + run.decode("utf-8", errors="replace")

    def token_id(self, text: str) -> int | None:
        return self.special.get(text)

    def template_tokens(self) -> dict[str, str]:
        return {"bos_token": self.BOS, "eos_token": self.EOS, "pad_token": self.PAD}

    def hf_files(self) -> dict[str, str] | None:
        """{name: text} of a tokenizer.json and tokenizer_config.json that Transformers' AutoTokenizer loads as this
        tokenizer (a byte-level BPE without merges: byte b is id b; each special token its one id), what an export
        of a byte-tokenizer run carries; None without the `tokenizers` package."""
        try:
            from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers
        except ImportError:
            return None
        tok = Tokenizer(models.BPE(vocab={c: b for b, c in enumerate(_byte_chars())}, merges=[]))
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
        tok.decoder = decoders.ByteLevel()
        tok.add_special_tokens([AddedToken(s, special=True, normalized=False)
                                for s in sorted(self.special, key=self.special.get)])
        config = {"tokenizer_class": "PreTrainedTokenizerFast", **self.template_tokens(),
                  "clean_up_tokenization_spaces": False, BYTE_MARK: True}
        return {"tokenizer.json": tok.to_str(), "tokenizer_config.json": json.dumps(config, indent=2) + "\n"}


BYTE_MARK = "glm5f_byte_tokenizer"  # in the tokenizer_config.json of `ChatByteTokenizer.hf_files`


def is_byte_tokenizer(directory: str) -> bool:
    """Whether `directory`'s tokenizer.json is the byte tokenizer's (`ChatByteTokenizer.hf_files`, as its
    tokenizer_config.json says): glm5f reads it as the byte tokenizer itself."""
    try:
        with open(os.path.join(directory, "tokenizer_config.json"), encoding="utf-8") as f:
            return json.load(f).get(BYTE_MARK) is True
    except (OSError, ValueError, AttributeError):
        return False


def _byte_chars() -> list[str]:
    """The character a byte-level tokenizer.json writes for each byte 0..255: itself where printable, else the
    next character from 256 on, in byte order (the table `tokenizers`' ByteLevel uses)."""
    kept = {*range(ord("!"), ord("~") + 1), *range(ord("\xa1"), ord("\xac") + 1), *range(ord("\xae"), 256)}
    moved = iter(range(256, 512))
    return [chr(b) if b in kept else chr(next(moved)) for b in range(256)]


def chat_tokenizer(path: str | None):
    """The tokenizer of chat data: the byte tokenizer with its chat special tokens, or a tokenizer.json's."""
    return ChatByteTokenizer() if path is None else FileTokenizer(path)


def template_tokens(tok, tokenizer_path: str | None) -> dict[str, str]:
    """bos_token, eos_token, ... as a template sees them: tokenizer_config.json's, else the tokenizer's own."""
    if isinstance(tok, ChatByteTokenizer):
        return tok.template_tokens()
    out = {}
    config = tokenizer_config(tokenizer_path)
    for name in ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token"):
        value = config.get(name)
        value = value.get("content") if isinstance(value, dict) else value
        if isinstance(value, str):
            out[name] = value
    for name, i in (("bos_token", tok.bos_id), ("eos_token", tok.eos_id)):
        if name not in out and i is not None:
            out[name] = tok._tok.id_to_token(i)
    return out


def tokenizer_dir(tokenizer_path: str | None) -> str | None:
    if tokenizer_path is None:
        return None
    return tokenizer_path if os.path.isdir(tokenizer_path) else os.path.dirname(os.path.abspath(tokenizer_path))


def tokenizer_config(tokenizer_path: str | None) -> dict:
    d = tokenizer_dir(tokenizer_path)
    file = os.path.join(d, "tokenizer_config.json") if d else None
    if not file or not os.path.isfile(file):
        return {}
    try:
        with open(file, encoding="utf-8") as f:
            config = json.load(f)
    except (OSError, ValueError) as e:
        raise ValueError(f"{file}: not a readable JSON file ({e}); fix it or remove it") from None
    return config if isinstance(config, dict) else {}


# ---- examples ---------------------------------------------------------------------------------------------------

@dataclass
class Example:
    """One document: token ids and their labels (IGNORE_INDEX where no loss is taken, e.g. prompts)."""

    ids: list[int]
    labels: list[int]
    note: str | None = None  # what was done to the record to make it (skipped, truncated), for one warning


def has_target(ex: Example) -> bool:
    """Whether a document has a token to learn: a label other than IGNORE_INDEX past its first token (the first
    token of a document is never predicted). A record of 0-1 tokens, or with every label ignored, has none."""
    return any(t != IGNORE_INDEX for t in ex.labels[1:])


def check_vocab(examples: list[Example], vocab_size: int, source: str, first: int = 0) -> None:
    """Every token id in [0, vocab_size), every label too or IGNORE_INDEX (a ValueError naming the first bad one;
    examples are numbered from `first`)."""
    for i, ex in enumerate(examples, first):
        bad = [t for t in ex.ids if not 0 <= t < vocab_size]
        if bad:
            raise ValueError(f"{source}: example {i} has token id {bad[0]} outside [0, vocab_size={vocab_size}): "
                             f"the tokenizer or the data does not fit the model's vocabulary")
        bad = [t for t in ex.labels if t != IGNORE_INDEX and not (isinstance(t, int) and 0 <= t < vocab_size)]
        if bad:
            raise ValueError(f"{source}: example {i} has label {bad[0]} outside [0, vocab_size={vocab_size}) "
                             f"(use {IGNORE_INDEX} where no loss is taken): fix the labels or raise --model.vocab_size")
