"""The recipe file: reading one (`--config FILE.yaml`, under the command line's flags) into a run config (the
dataclass `configs.Config`, passed in), and writing a run's resolved config.yaml, which `--config` reads back.
"""

from __future__ import annotations

import contextlib
import dataclasses
import difflib
import os
import re
import typing
from typing import Literal

import tyro
import yaml

from glm5f.run.rundir import CONFIG_FILE

HISTORY = "changes"  # config.yaml's list of the settings changed on resume


class _Loader(yaml.SafeLoader):
    """YAML as written by people: `1e-4` is a float (YAML 1.1 would read it as a string), and a key given twice in
    one mapping is an error naming both lines (YAML would keep the last silently)."""

    def construct_mapping(self, node, deep=False):
        seen = {}
        for key_node, _ in node.value:
            key = self.construct_object(key_node, deep=True)
            if key in seen:
                raise yaml.constructor.ConstructorError(
                    None, None, f"the key {key!r} is given twice, on line {seen[key] + 1} and line "
                    f"{key_node.start_mark.line + 1}; keep one", key_node.start_mark)
            seen[key] = key_node.start_mark.line
        return super().construct_mapping(node, deep)


_Loader.add_implicit_resolver("tag:yaml.org,2002:float",
                              re.compile(r"^[-+]?(?:[0-9][0-9_]*)(?:\.[0-9_]*)?[eE][-+]?[0-9]+$"), list("-+0123456789"))


def parse(argv: list[str], cls, description: str | None = None):
    """The run config of a command line: `--config FILE` (a recipe, or a run's config.yaml) if given, with the
    other flags over it. A bad file is a ValueError naming the file, the key and what would be valid."""
    rest, path = [], None
    it = iter(argv)
    for a in it:
        if a == "--config" or a.startswith("--config="):
            if path is not None:
                raise ValueError("--config is given twice; pass one recipe file (and flags to change it)")
            path = a.partition("=")[2] if "=" in a else next(it, None)
            if not path:
                raise ValueError("--config needs a file: --config recipes/tiny.yaml")
        else:
            rest.append(a)
    default = load_config(path, cls) if path else cls()
    return tyro.cli(cls, args=rest, default=default, use_underscores=True, description=description)


def load_config(path: str, cls):
    """The run config (an instance of dataclass `cls`) of recipe file `path`: a YAML mapping of sections (model, data, ...) to mappings of fields, every
    field optional (its default), each value of the field's type. A run's config.yaml's history of changed settings
    (the top-level `changes`, `history_yaml`) is a record, not a setting: it is skipped."""
    try:
        with open(path) as f:
            tree = yaml.load(f, Loader=_Loader)
    except OSError as e:
        raise ValueError(f"--config {path}: cannot read it ({e.strerror or e}); pass a recipe file such as "
                         f"recipes/tiny.yaml") from None
    except yaml.YAMLError as e:
        raise ValueError(f"--config {path}: not valid YAML ({' '.join(str(e).split())})") from None
    if isinstance(tree, dict):
        tree = {k: v for k, v in tree.items() if k != HISTORY}
    return _build(cls, tree if tree is not None else {}, path, "")


def _build(cls, tree, path: str, where: str):
    """An instance of dataclass `cls` from mapping `tree` (read from file `path`, at dotted key `where`)."""
    name = where or "the file"
    if not isinstance(tree, dict):
        raise ValueError(f"--config {path}: {name} must be a mapping of {_keys(cls)}, found {_found(tree)}")
    hints, fields = typing.get_type_hints(cls), {f.name: f for f in dataclasses.fields(cls)}
    values = {}
    for key, value in tree.items():
        dotted = f"{where}.{key}" if where else str(key)
        if key not in fields:
            near = [f"{where}.{k}" if where else k for k in difflib.get_close_matches(str(key), list(fields), n=1)]
            if not near and not where:  # a field put at the top: its section
                near = difflib.get_close_matches(str(key), [f"{s}.{k}" for s in fields if dataclasses.is_dataclass(
                    hints[s]) for k in _fields(hints[s])], n=1)
            hint = f"did you mean {near[0]!r}? " if near else ""
            raise ValueError(f"--config {path}: unknown key {dotted!r}; {hint}the valid keys of {name} are "
                             f"{_keys(cls)}")
        hint = hints[key]
        values[key] = _build(hint, value, path, dotted) if dataclasses.is_dataclass(hint) else \
            _value(value, hint, path, dotted)
    return cls(**values)


def _fields(cls) -> list[str]:
    return [f.name for f in dataclasses.fields(cls)]


def _keys(cls) -> str:
    return ", ".join(_fields(cls))


def _found(value) -> str:
    return f"{value!r} ({type(value).__name__})" if value is not None else "null"


def _value(value, hint, path: str, key: str):
    """`value` as a field of type `hint` (Optional, Literal, bool, int, float, str, a tuple of floats), or a
    ValueError naming it."""
    args, optional = typing.get_args(hint), ""
    if typing.get_origin(hint) is typing.Union:
        if value is None:
            return None
        (hint,) = [a for a in args if a is not type(None)]
        args, optional = typing.get_args(hint), " or null"
    if typing.get_origin(hint) is Literal:
        if value in args and all(isinstance(value, type(a)) for a in args):
            return value
        want = "one of " + ", ".join(map(str, args))
    elif hint is bool:
        if isinstance(value, bool):
            return value
        want = "true or false"
    elif hint is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        want = "an integer"
    elif hint is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
        want = "a number"
    elif typing.get_origin(hint) is tuple:
        if isinstance(value, list) and len(value) == len(args) and all(
                isinstance(v, (int, float)) and not isinstance(v, bool) for v in value):
            return tuple(float(v) for v in value)
        want = f"a list of {len(args)} numbers"
    else:
        if isinstance(value, str):
            return value
        want = "a string"
    raise ValueError(f"--config {path}: {key} must be {want}{optional}, found {_found(value)}")


def config_yaml(cfg) -> str:
    """The text of a run's config.yaml: every field of `cfg`, as `--config` reads it back. The checkpoint flags
    that act on an existing run directory (resume, overwrite, allow_changed) are left at their defaults, so the
    file repeats the run; `--config RUN/config.yaml --checkpoint.resume latest` continues it."""
    tree = dataclasses.asdict(dataclasses.replace(
        cfg, checkpoint=dataclasses.replace(cfg.checkpoint, resume=None, overwrite=False, allow_changed="")))
    return (f"# glm5f run config: python train.py --config {os.path.join(cfg.checkpoint.dir, CONFIG_FILE)} "
            f"--checkpoint.dir NEW_DIR repeats this run\n{yaml.safe_dump(tree, sort_keys=False)}")


def history_yaml(changes: list[dict]) -> str:
    """The end of a run's config.yaml: the settings changed on resume (`resume.Change.record`: from_step, flag,
    old, new) as the list `changes` (which `--config` skips), "" when none. The fields above it hold the values of
    the last step range; each change, the value the steps before its from_step ran with."""
    if not changes:
        return ""
    return (f"# {HISTORY}: settings changed on resume (--checkpoint.allow_changed); the steps before from_step ran "
            f"with old, the fields above hold the newest values\n"
            f"{yaml.safe_dump({HISTORY: list(changes)}, sort_keys=False)}")


def write_config(cfg, changes: list[dict] = ()) -> str:
    """Write config.yaml (`config_yaml`, then `history_yaml` of `changes`) into the run directory (atomically: a
    temporary file renamed); returns its path."""
    path = os.path.join(cfg.checkpoint.dir, CONFIG_FILE)
    try:
        with open(path + ".tmp", "w") as f:
            f.write(config_yaml(cfg) + history_yaml(changes))
        os.replace(path + ".tmp", path)
    except OSError:  # a full disk: no half-written copy left beside the file
        with contextlib.suppress(OSError):
            os.remove(path + ".tmp")
        raise
    return path
