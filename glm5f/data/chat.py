"""Chat data: conversations (messages or ShareGPT records) rendered by a jinja chat template into token ids, with
the loss on the assistant's tokens only; rendered and tokenized the way Transformers' apply_chat_template does.
"""

from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass
from datetime import datetime
from importlib import resources

from glm5f.data.tokens import (IGNORE_INDEX, ChatByteTokenizer, Example, chat_tokenizer, template_tokens,  # noqa: F401
                               is_byte_tokenizer, tokenizer_config, tokenizer_dir)

ROLES = ("system", "user", "assistant", "tool")
SHAREGPT_ROLES = {"system": "system", "human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant",
                  "model": "assistant", "function_call": "assistant", "observation": "tool", "tool": "tool",
                  "function": "tool", "function_response": "tool", "tool_response": "tool"}
TRAIN_ON = ("assistant", "last", "all")
# Tokens that end an assistant turn: generation stops at them, and the one right after a trained turn is trained too.
STOP_TOKENS = ("<|user|>", "<|observation|>", "<|im_end|>", "<|eot_id|>", "<|end|>")
_REASONING = ("reasoning_content", "thinking", "reasoning")  # the names a message's reasoning goes by


# ---- templates --------------------------------------------------------------------------------------------------

def default_template() -> str:
    """The GLM-5-style template shipped with glm5f (glm5f/assets/glm5_chat_template.jinja)."""
    return resources.files("glm5f").joinpath("assets/glm5_chat_template.jinja").read_text(encoding="utf-8")


def template_source(tokenizer_path: str | None, chat_template: str | None) -> tuple[str, str]:
    """(template text, where it came from): --data.chat_template FILE; else the tokenizer directory's
    chat_template.jinja, else its tokenizer_config.json's chat_template; else (byte tokenizer) the shipped one."""
    if chat_template is not None:
        if not os.path.isfile(chat_template):
            raise FileNotFoundError(f"--data.chat_template {chat_template!r}: no such file (expected a jinja chat "
                                    f"template, e.g. a chat_template.jinja)")
        with open(chat_template, encoding="utf-8") as f:
            return f.read(), chat_template
    if tokenizer_path is None:
        return default_template(), "glm5f's GLM-5 chat template"
    d = tokenizer_dir(tokenizer_path)
    jinja = os.path.join(d, "chat_template.jinja")
    if os.path.isfile(jinja):
        with open(jinja, encoding="utf-8") as f:
            return f.read(), jinja
    found = tokenizer_config(tokenizer_path).get("chat_template")
    if isinstance(found, list):  # named templates: [{"name", "template"}]
        found = next((t.get("template") for t in found if isinstance(t, dict) and t.get("name") == "default"), None)
    if isinstance(found, str):
        return found, os.path.join(d, "tokenizer_config.json")
    raise ValueError(f"--model.tokenizer_path {tokenizer_path}: no chat template (expected {jinja}, or a "
                     f"'chat_template' in {os.path.join(d, 'tokenizer_config.json')}); pass --data.chat_template FILE")


class ChatTemplate:
    """A chat template compiled as apply_chat_template compiles it: an immutable sandboxed jinja2 environment with
    trim_blocks and lstrip_blocks, loop controls, the {% generation %} tag, raise_exception, strftime_now and a
    tojson that leaves non-ASCII text as it is."""

    def __init__(self, source: str, name: str = "chat template"):
        import jinja2
        from jinja2.ext import Extension, loopcontrols
        from jinja2.sandbox import ImmutableSandboxedEnvironment

        spans_of = self._spans = []  # [(start, end)] of the {% generation %} blocks of the render in progress
        done = self._done = []  # the text rendered so far, in pieces

        class Generation(Extension):
            tags = {"generation"}

            def parse(self, parser):
                lineno = next(parser.stream).lineno
                body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
                return jinja2.nodes.CallBlock(self.call_method("_mark"), [], [], body).set_lineno(lineno)

            def _mark(self, caller):
                text = caller()
                start = sum(map(len, done))
                spans_of.append((start, start + len(text)))
                return text

        def raise_exception(message):
            raise jinja2.exceptions.TemplateError(message)

        def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
            return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                            extensions=[Generation, loopcontrols])
        env.filters["tojson"] = tojson
        env.globals.update(raise_exception=raise_exception, strftime_now=lambda fmt: datetime.now().strftime(fmt))
        self.name, self.source = name, source
        self.has_generation = re.search(r"\{%-?\s*generation\s*-?%\}", source) is not None
        try:
            self._template = env.from_string(source)
        except jinja2.TemplateSyntaxError as e:
            raise ValueError(f"{name}: not a valid jinja template (line {e.lineno}: {e.message})") from None

    def render(self, messages: list[dict], tools: list | None = None, add_generation_prompt: bool = False,
               **tokens) -> tuple[str, list[tuple[int, int]]]:
        """(text, [start, end) of each {% generation %} block's text)."""
        import jinja2

        self._spans.clear()
        self._done.clear()
        try:
            for piece in self._template.generate(messages=messages, tools=tools, documents=None,
                                                 add_generation_prompt=add_generation_prompt, **tokens):
                self._done.append(piece)
        except jinja2.TemplateError as e:
            raise ValueError(f"{self.name} failed: {e}") from None
        except Exception as e:  # a template is code: it can fail like any (a key lookup, a type error)
            raise ValueError(f"{self.name} failed: {type(e).__name__}: {e}") from None
        return "".join(self._done), list(self._spans)


# ---- records ----------------------------------------------------------------------------------------------------

def json_type(value) -> str:
    """A JSON value's type as JSON names it."""
    return {type(None): "null", bool: "a boolean", int: "a number", float: "a number", list: "a list",
            dict: "an object", str: "a string"}.get(type(value), type(value).__name__)


def _json_value(value, what: str):
    if isinstance(value, str):
        try:
            return json.loads(value)
        except json.JSONDecodeError as e:
            raise ValueError(f"{what} is a string but not JSON ({e.msg} at column {e.colno})") from None
    return value


def _tool_calls(calls, what: str) -> list[dict]:
    calls = _json_value(calls, what)
    if isinstance(calls, dict):
        calls = [calls]
    if not isinstance(calls, list) or not all(isinstance(c, dict) for c in calls):
        raise ValueError(f"{what} must be a list of {{'function': {{'name', 'arguments'}}}} objects")
    out = []
    for c in calls:
        f = c.get("function", c)
        if not isinstance(f, dict) or not isinstance(f.get("name"), str):
            raise ValueError(f"{what}: a tool call needs a function name, found {json.dumps(c)[:80]}")
        arguments = _json_value(f.get("arguments", {}), f"{what}: the arguments of {f['name']}")
        if not isinstance(arguments, dict):
            raise ValueError(f"{what}: the arguments of {f['name']} must be a JSON object of named arguments, found "
                             f"{json_type(arguments)} ({json.dumps(arguments)[:40]})")
        f = {**f, "arguments": arguments}
        out.append({**{k: v for k, v in c.items() if k != "function"}, "type": c.get("type", "function"),
                    "function": f})
    return out


def chat_messages(rec: dict) -> tuple[list[dict], list | None]:
    """(messages, tools) of a chat record, either form: {"messages": [{"role", "content", ...}], "tools"} or
    ShareGPT {"conversations": [{"from", "value"}], "system", "tools"} (a function_call turn's value is the JSON
    of {"name", "arguments"}, or a list of them). Keys whose value is null are dropped and reasoning is also
    passed as reasoning_content and thinking (as apply_chat_template does); tool calls take the form
    {"type": "function", "function": {"name", "arguments"}}, with arguments given as a JSON string parsed.
    ValueError: what is wrong."""
    tools = _json_value(rec.get("tools"), "'tools'")
    if tools is not None and not isinstance(tools, list):
        raise ValueError(f"'tools' must be a list of tool schemas, found {type(tools).__name__}")
    if "messages" in rec:
        raw = rec["messages"]
        if not isinstance(raw, list):
            raise ValueError(f"'messages' must be a list of {{'role', 'content'}} objects, found {type(raw).__name__}")
        messages = []
        for i, m in enumerate(raw):
            if not isinstance(m, dict):
                raise ValueError(f"message {i} must be an object with 'role' and 'content', found {m!r:.60}")
            m = {k: v for k, v in m.items() if v is not None}
            if m.get("role") not in ROLES:
                raise ValueError(f"message {i} has role {m.get('role')!r}; expected one of {', '.join(ROLES)}")
            if "tool_calls" in m:
                m["tool_calls"] = _tool_calls(m["tool_calls"], f"message {i}: 'tool_calls'")
            if not isinstance(m.get("content", "" if m.get("tool_calls") else None), str):
                found = "none" if "content" not in m else type(m["content"]).__name__
                raise ValueError(f"message {i} ({m['role']}) needs a string 'content', found {found}")
            messages.append(m)
    else:
        raw = rec["conversations"]
        if not isinstance(raw, list):
            raise ValueError(f"'conversations' must be a list of {{'from', 'value'}} objects, found "
                             f"{type(raw).__name__}")
        messages = []
        if isinstance(rec.get("system"), str) and rec["system"]:
            messages.append({"role": "system", "content": rec["system"]})
        for i, m in enumerate(raw):
            if not isinstance(m, dict):
                raise ValueError(f"turn {i} must be an object with 'from' and 'value', found {m!r:.60}")
            role = SHAREGPT_ROLES.get(m.get("from"))
            if role is None:
                raise ValueError(f"turn {i} is from {m.get('from')!r}; expected one of {', '.join(SHAREGPT_ROLES)}")
            if not isinstance(m.get("value"), str):
                found = "none" if m.get("value") is None else type(m["value"]).__name__
                raise ValueError(f"turn {i} ({m['from']}) needs a string 'value', found {found}")
            if m["from"] == "function_call":
                messages.append({"role": "assistant", "content": "",
                                 "tool_calls": _tool_calls(m["value"], f"turn {i} (function_call)")})
            else:
                messages.append({"role": role, "content": m["value"]})
    for i, m in enumerate(messages):
        reasoning = next((m[k] for k in _REASONING if m.get(k) is not None), None)
        if reasoning is not None and not isinstance(reasoning, str):
            name = next(k for k in _REASONING if m.get(k) is not None)
            raise ValueError(f"message {i} ({m['role']}) needs a string {name!r}, found {json_type(reasoning)} "
                             f"({json.dumps(reasoning)[:40]}); join its parts into one string")
        if reasoning is not None:
            messages[i] = {"thinking": reasoning, **m, "reasoning_content": reasoning}
    return messages, tools


# ---- tokens and loss mask ---------------------------------------------------------------------------------------

def span_mask(offsets: list[tuple[int, int]], spans: list[tuple[int, int]]) -> list[int]:
    """1 for each token (its [start, end) characters) that overlaps one of the ordered spans, else 0."""
    mask, s = [0] * len(offsets), 0
    for i, (start, end) in enumerate(offsets):
        while s < len(spans) and start >= spans[s][1]:
            s += 1
        if s == len(spans):
            break
        mask[i] = int(end > spans[s][0])
    return mask


class ChatFormat:
    """A tokenizer with a chat template: a conversation's token ids and which of them are the assistant's."""

    def __init__(self, tok, template: ChatTemplate, tokens: dict[str, str]):
        self.tok, self.template, self.tokens = tok, template, tokens
        stops = [tok.token_id(s) for s in STOP_TOKENS] + [tok.eos_id]
        self.stop_ids = sorted({i for i in stops if i is not None})

    @classmethod
    def load(cls, tokenizer_path: str | None, chat_template: str | None = None) -> "ChatFormat":
        tok = chat_tokenizer(tokenizer_path)
        source, name = template_source(tokenizer_path, chat_template)
        return cls(tok, ChatTemplate(source, name), template_tokens(tok, tokenizer_path))

    def split_tokens(self) -> list[str]:
        """The special-looking tokens the template writes (`<|...|>`, and the stop tokens) that the tokenizer has
        no single id for: each is trained and generated as several pieces, and generation cannot stop at it."""
        found = set(re.findall(r"<\|[^|<>\s]+\|>", self.template.source))
        found |= {s for s in STOP_TOKENS if s in self.template.source}
        return sorted(s for s in found if self.tok.token_id(s) is None)

    def render(self, messages, tools=None, add_generation_prompt=False):
        return self.template.render(messages, tools, add_generation_prompt, **self.tokens)

    def ids(self, messages, tools=None, add_generation_prompt=False) -> list[int]:
        return self.tok.encode_offsets(self.render(messages, tools, add_generation_prompt)[0])[0]

    def tokenize(self, messages: list[dict], tools=None) -> tuple[list[int], list[int]]:
        """(ids, assistant mask) of a whole conversation, as apply_chat_template(..., tokenize=True,
        return_dict=True, return_assistant_tokens_mask=True) gives them; without {% generation %} blocks the
        mask comes from rendering each assistant turn's prefix: the tokens a turn adds are the turn's."""
        text, spans = self.render(messages, tools)
        ids, offsets = self.tok.encode_offsets(text)
        if self.template.has_generation:
            return ids, span_mask(offsets, spans)
        mask = [0] * len(ids)
        for i, m in enumerate(messages):
            if m["role"] != "assistant":
                continue
            before = self.ids(messages[:i], tools, add_generation_prompt=True)
            turn = self.ids(messages[:i + 1], tools)
            if turn[:len(before)] != before or ids[:len(turn)] != turn:
                raise ValueError(f"{self.template.name}: the tokens of the conversation up to assistant message {i} "
                                 f"are not a prefix of the whole one's (the template renders earlier turns "
                                 f"differently once later ones follow); mark the assistant text with "
                                 f"{{% generation %}} blocks in the template, or use --data.train_on all")
            mask[len(before):len(turn)] = [1] * (len(turn) - len(before))
        return ids, mask

    def example(self, messages: list[dict], tools=None, train_on: str = "assistant") -> Example:
        """The conversation as an Example: labels on the assistant tokens (train_on "assistant"), on those of the
        last assistant message ("last") or on every token ("all"). After each trained assistant turn the stop
        token that ends it (the next turn's role token) is trained too, and eos is appended (and trained) when the
        conversation ends with a turn that ends in no stop token, so the model learns where to stop."""
        ids, mask = self.tokenize(messages, tools)
        if train_on == "last":
            last = max(i for i, m in enumerate(messages) if m["role"] == "assistant")
            before = self.ids(messages[:last], tools, add_generation_prompt=True)
            common = next((j for j, (a, b) in enumerate(zip(before, ids)) if a != b), min(len(before), len(ids)))
            mask = [0] * common + mask[common:]
        for j in range(1, len(ids)):
            if mask[j - 1] and not mask[j] and ids[j] in self.stop_ids:
                mask[j] = 1
        if mask and mask[-1] and ids[-1] not in self.stop_ids and self.tok.eos_id is not None:
            ids, mask = ids + [self.tok.eos_id], mask + [1]
        return Example(ids, [t if m or train_on == "all" else IGNORE_INDEX for t, m in zip(ids, mask)])


class ChatData:
    """Chat records to Examples for a run: the format, --data.train_on and --data.seq_len (a longer record is
    truncated to its first seq_len tokens; dropped when that leaves no trained token)."""

    def __init__(self, fmt: ChatFormat, train_on: str = "assistant", seq_len: int | None = None):
        if train_on not in TRAIN_ON:
            raise ValueError(f"--data.train_on must be one of {', '.join(TRAIN_ON)}, got {train_on!r}")
        self.fmt, self.train_on, self.seq_len = fmt, train_on, seq_len

    def example(self, rec: dict, where: str) -> Example:
        """The Example of one chat record; an empty one, with a note saying why, when it has nothing to learn."""
        try:
            messages, tools = chat_messages(rec)
            if not any(m["role"] == "assistant" for m in messages):
                return Example([], [], note="have no assistant turn (nothing to learn): skipped")
            ex = self.fmt.example(messages, tools, self.train_on)
        except ValueError as e:
            raise ValueError(f"{where}: {e}") from None
        if all(t == IGNORE_INDEX for t in ex.labels[1:]):
            return Example([], [], note="have no token the template marks as the assistant's: skipped")
        if self.seq_len is not None and len(ex.ids) > self.seq_len:
            ids, labels = ex.ids[:self.seq_len], ex.labels[:self.seq_len]
            if all(t == IGNORE_INDEX for t in labels[1:]):
                return Example([], [], note=f"are longer than --data.seq_len {self.seq_len} with no assistant token "
                                            f"in their first {self.seq_len}: dropped")
            return Example(ids, labels, note=f"are longer than --data.seq_len {self.seq_len}: truncated to their "
                                             f"first {self.seq_len} tokens")
        return ex


def sample_records(part: str | None = None) -> list[tuple[str, dict]]:
    """(where, record) of the chat sample shipped with glm5f (glm5f/assets/chat_sample.jsonl): all of it, or its
    "train" or "eval" part (every 10th conversation, counting from the 10th, is "eval")."""
    name = "assets/chat_sample.jsonl"
    lines = resources.files("glm5f").joinpath(name).read_text(encoding="utf-8").splitlines()
    out = [(f"glm5f/{name}:{n}", json.loads(line)) for n, line in enumerate(lines, 1) if line.strip()]
    if part is None:
        return out
    return [r for i, r in enumerate(out) if (i % 10 == 9) == (part == "eval")]


def run_chat_data(tokenizer_path: str | None, chat_template: str | None, train_on: str, seq_len: int,
                  vocab_size: int, warn=lambda message: None):
    """A function giving the run's ChatData, made (template read, tokenizer checked) when first called, so
    data without chat records never needs a chat template."""
    if train_on not in TRAIN_ON:
        raise ValueError(f"--data.train_on must be one of {', '.join(TRAIN_ON)}, got {train_on!r}")
    made = []

    def chat() -> ChatData:
        if not made:
            fmt = ChatFormat.load(tokenizer_path, chat_template)
            if fmt.tok.vocab_size > vocab_size:
                raise ValueError(f"the chat tokenizer has {fmt.tok.vocab_size} ids (with its special tokens) but the "
                                 f"model's vocab_size is {vocab_size}: raise --model.vocab_size to at least "
                                 f"{fmt.tok.vocab_size}")
            split = fmt.split_tokens()
            if split:
                warn(f"the chat template {fmt.template.name} writes {', '.join(split)}, which the tokenizer has no "
                     f"single token for: each is split into pieces (trained as text, and generation cannot stop at "
                     f"it); add them to the tokenizer as special tokens, or use a template written for it")
            made.append(ChatData(fmt, train_on, seq_len))
        return made[0]
    return chat


# ---- the run's tokenizer and template ---------------------------------------------------------------------------

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")
TEMPLATE_FILE = "chat_template.jinja"
RUN_TOKENIZER_DIR = "tokenizer"  # a run keeps copies of its tokenizer files and chat template here


def _read_bytes(file: str) -> bytes:
    with open(file, "rb") as f:
        return f.read()


def _sha256(data: bytes) -> str:
    import hashlib

    return hashlib.sha256(data).hexdigest()[:16]


@dataclass(frozen=True)
class RunTokenizer:
    """A run's tokenizer and chat template, resolved once at its start: `path` a tokenizer.json (or a directory
    with one; None: the byte tokenizer), `template` the template's text and `template_name` where it came from
    (None: no template), `how` the words the start line uses."""

    path: str | None
    template: str | None
    template_name: str | None
    how: str

    def files(self) -> dict[str, str]:
        """{name: the file it is copied from} of the tokenizer files an export or a run directory carries (the
        template is written from its text, as chat_template.jinja)."""
        if self.path is None:
            return {}
        d = tokenizer_dir(self.path)
        out = {"tokenizer.json": self.path if os.path.isfile(self.path) else os.path.join(self.path, "tokenizer.json")}
        out.update((n, os.path.join(d, n)) for n in TOKENIZER_FILES[1:] if os.path.isfile(os.path.join(d, n)))
        return out

    def fingerprint(self) -> dict:
        """What a checkpoint records of it: a SHA-256 (first 16 hex digits) of the tokenizer's files and of the
        template, and `how`, so a resume can tell another tokenizer or template and name both."""
        tok = "byte tokenizer"
        if self.path is not None:
            tok = _sha256(b"".join(_read_bytes(f) for _, f in sorted(self.files().items())))
        return {"tokenizer": tok, "chat_template": None if self.template is None else _sha256(self.template.encode()),
                "how": self.how}

    def generated(self) -> dict[str, str]:
        """{name: text} of the files written for the byte tokenizer (`ChatByteTokenizer.hf_files`: what Transformers'
        AutoTokenizer loads as it); {} for a tokenizer.json's run (its files are copied) or without `tokenizers`."""
        return (ChatByteTokenizer().hf_files() or {}) if self.path is None else {}

    def names(self) -> list[str]:
        """The names of the files `write` writes."""
        return sorted([*self.files(), *self.generated()]) + ([TEMPLATE_FILE] if self.template is not None else [])

    def write(self, directory: str) -> list[str]:
        """Copy the tokenizer files into `directory` (created), write the byte tokenizer's (`generated`) and the
        template as chat_template.jinja there; the names written."""
        import shutil

        os.makedirs(directory, exist_ok=True)
        for name, file in self.files().items():
            if os.path.abspath(file) != os.path.abspath(os.path.join(directory, name)):
                shutil.copyfile(file, os.path.join(directory, name))
        texts = {**self.generated(), **({TEMPLATE_FILE: self.template} if self.template is not None else {})}
        for name, text in texts.items():
            with open(os.path.join(directory, name), "w", encoding="utf-8") as f:
                f.write(text)
        return self.names()


def resolve_tokenizer(tokenizer_path: str | None, init_from: str | None, chat_template: str | None) -> RunTokenizer:
    """The run's tokenizer: --model.tokenizer_path, else the --model.init_from directory's tokenizer.json (unless it
    is the byte tokenizer's, `is_byte_tokenizer`), else the byte tokenizer; its template: --data.chat_template, else the tokenizer directory's chat_template.jinja or
    tokenizer_config.json's chat_template, else (byte tokenizer) glm5f's GLM-5-style one; a tokenizer without a
    template has none (chat data then says so)."""
    if tokenizer_path is not None:
        path, how = tokenizer_path, f"tokenizer {tokenizer_path} (--model.tokenizer_path)"
    elif init_from is not None and os.path.isfile(os.path.join(init_from, "tokenizer.json")) and \
            not is_byte_tokenizer(init_from):
        path, how = init_from, f"tokenizer {os.path.join(init_from, 'tokenizer.json')} (from --model.init_from)"
    else:
        path = None
        held = "the byte tokenizer's tokenizer.json" if init_from and is_byte_tokenizer(init_from) else \
            "no tokenizer.json"
        how = "the byte tokenizer" + (f" (--model.init_from {init_from} holds {held})" if init_from else "")
    if path is not None:
        chat_tokenizer(path)  # a missing or unreadable tokenizer.json: its error, before any training
    try:
        template, name = template_source(path, chat_template)
    except ValueError:  # a tokenizer without a template: fine unless the data is chat (which then says so)
        template, name = None, None
    how += f", chat template {name}" if name else ", no chat template"
    return RunTokenizer(path, template, name, how)


def tokenizer_of(directory: str) -> RunTokenizer:
    """The tokenizer and template a run directory's tokenizer/ copy or an export holds: its tokenizer.json (else, or
    when it is the byte tokenizer's, the byte tokenizer) and its chat_template.jinja or tokenizer_config.json's template (else, for the byte tokenizer,
    glm5f's)."""
    path = directory if os.path.isfile(os.path.join(directory, "tokenizer.json")) and \
        not is_byte_tokenizer(directory) else None
    template, name = None, None
    if os.path.isfile(os.path.join(directory, TEMPLATE_FILE)):
        name = os.path.join(directory, TEMPLATE_FILE)
        with open(name, encoding="utf-8") as f:
            template = f.read()
    else:
        try:
            template, name = template_source(path, None)
        except ValueError:
            pass
    where = f"tokenizer {os.path.join(directory, 'tokenizer.json')}" if path else "the byte tokenizer"
    return RunTokenizer(path, template, name, where + (f", chat template {name}" if name else ", no chat template"))


def checkpoint_tokenizer(ckpt: str, run: dict) -> tuple[RunTokenizer, str | None]:
    """(the tokenizer and template of the run that wrote checkpoint `ckpt`, the directory of its copy): its run
    directory's tokenizer/ copy; for a run from before that copy (directory None), its --model.tokenizer_path and
    --data.chat_template (`run`: the checkpoint's meta.json "run")."""
    copy = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(ckpt))), RUN_TOKENIZER_DIR)
    if os.path.isdir(copy):
        return tokenizer_of(copy), copy
    return resolve_tokenizer((run.get("model") or {}).get("tokenizer_path"), None,
                             (run.get("data") or {}).get("chat_template")), None


def check_same_tokenizer(saved: dict | None, now: RunTokenizer, ckpt: str, allow_changed: bool, warn) -> None:
    """A checkpoint's tokenizer and template (`saved`: its fingerprint; None: from before fingerprints) against
    this run's: a ValueError naming both unless allow_changed (then a warning)."""
    if saved is None:
        return
    mine = now.fingerprint()
    changed = [k for k in ("tokenizer", "chat_template") if saved.get(k) != mine[k]]
    if not changed:
        return
    what = (f"{ckpt} was trained with {saved.get('how')}; this run has {now.how} (the {' and the '.join(changed)} "
            f"differ{'s' if len(changed) == 1 else ''}: {', '.join(f'{saved.get(k)} -> {mine[k]}' for k in changed)})")
    if allow_changed:
        warn(f"{what}; resuming with this run's (--data.allow_changed)")
        return
    raise ValueError(f"{what}: its weights learned other token ids or another rendering. Resume with the tokenizer "
                     f"and template it was saved with (see its run directory's {RUN_TOKENIZER_DIR}/), pass "
                     f"--data.allow_changed to go on with this run's, or start a new run")
