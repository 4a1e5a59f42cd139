"""Export directories: which directories an export may write (new, empty, or a previous export no other run
starts from), the marker that records what glm5f wrote there, and writing one whole or not at all."""

from __future__ import annotations

import json
import os
import shutil
import tempfile

EXPORT_MARKER = ".glm5f-export"  # JSON: {"files": the names glm5f wrote, "bases_of": runs that start from it}
TOKEN_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja")
PEFT_FILES = ("adapter_config.json", "adapter_model.safetensors")


def _is_export(path: str) -> bool:
    """Whether `path` holds a previous save_hf / save_peft export: our marker, or exactly config.json + safetensors
    (+ index), or exactly a PEFT adapter's two files."""
    names = set(os.listdir(path))
    if EXPORT_MARKER in names or names == set(PEFT_FILES):
        return True
    shards = {n for n in names if n.startswith("model") and n.endswith(".safetensors")}
    return "config.json" in names and bool(shards) and names - shards <= {"config.json", "model.safetensors.index.json"}


def read_marker(path: str) -> dict:
    """What the export marker in `path` says ({} without one, or for one written before markers listed files)."""
    try:
        with open(os.path.join(path, EXPORT_MARKER), encoding="utf-8") as f:
            marker = json.loads(f.read() or "{}")
    except (OSError, ValueError):
        return {}
    return marker if isinstance(marker, dict) else {}


def _written_by_us(path: str, names: set[str]) -> set[str]:
    """The files of export `path` glm5f wrote: those its marker lists; for an export without that list, the
    weights, config and PEFT files an export is recognised by."""
    listed = read_marker(path).get("files")
    if isinstance(listed, list):
        return set(listed) | {EXPORT_MARKER}
    return {n for n in names if n in ("config.json", "model.safetensors.index.json", EXPORT_MARKER, *PEFT_FILES)
            or (n.startswith("model") and n.endswith(".safetensors"))}


def note_base(path: str, run_dir: str) -> None:
    """Record in export `path`'s marker that the run in `run_dir` starts from it (--model.init_from), so a later
    export into `path` is refused without consent. Nothing for a directory glm5f did not export, or one it
    cannot write."""
    if not os.path.isfile(os.path.join(path, EXPORT_MARKER)):
        return
    marker = read_marker(path)
    bases_of = marker.get("bases_of") if isinstance(marker.get("bases_of"), list) else []
    run = os.path.realpath(run_dir)
    if run in bases_of:
        return
    try:
        with open(os.path.join(path, EXPORT_MARKER), "w", encoding="utf-8") as f:
            json.dump({**marker, "bases_of": bases_of + [run]}, f, indent=2)
    except OSError:
        pass


def check_export_dir(path: str | os.PathLike, run_dir: str | os.PathLike | None = None, *,
                     flag: str = "--checkpoint.export_hf", init_from: str | None = None, writes: tuple = (),
                     overwrite: bool = False, consent: str = "--checkpoint.replace_export") -> None:
    """Raise ValueError unless save_hf / save_peft may write `path`: new, empty, or a previous export of ours (which
    it replaces). Never the run directory `run_dir` or a directory that contains it, nor the run's base
    `init_from`; never one holding files glm5f did not write (they would be deleted with it). Without `overwrite`
    (the option `consent` names), not an export another run starts from, nor one whose tokenizer files the new
    export (its extra files `writes`) does not write. `flag` names the option."""
    path = os.path.realpath(os.fspath(path))
    if run_dir is not None:
        run = os.path.realpath(os.fspath(run_dir))
        if run == path or run.startswith(path.rstrip(os.sep) + os.sep):
            raise ValueError(f"{flag} {path} is or contains the run directory {run}; export to "
                             f"a directory of its own, e.g. {os.path.join(run, 'hf')}")
    if init_from is not None and os.path.realpath(init_from) == path:
        raise ValueError(f"{flag} {path} is this run's --model.init_from: exporting there would replace the base "
                         f"the run starts from (and its checkpoints rest on); export to another directory")
    if os.path.exists(path) and not os.path.isdir(path):
        raise ValueError(f"export directory {path} is a file; pass a new or empty directory")
    if not os.path.isdir(path) or not os.listdir(path):
        return
    names = set(os.listdir(path))
    if not _is_export(path):
        raise ValueError(f"export directory {path} holds files that are not a previous glm5f export "
                         f"({', '.join(sorted(names)[:5])}); pass a new or empty directory, or remove them")
    foreign = sorted(names - _written_by_us(path, names))
    if foreign:
        raise ValueError(f"export directory {path} is a previous glm5f export but also holds files glm5f did not "
                         f"write there ({', '.join(foreign[:5])}), which replacing it would delete; move them away "
                         f"or pass another directory")
    if overwrite:
        return
    users = [r for r in read_marker(path).get("bases_of") or [] if isinstance(r, str) and os.path.isdir(r)]
    if users:
        raise ValueError(f"export directory {path} is the --model.init_from base of the run(s) {', '.join(users)}: "
                         f"replacing it would change the base their checkpoints (and a LoRA run's --merge-lora) "
                         f"rest on; export to another directory, or pass {consent} to replace it")
    lost = sorted(names & set(TOKEN_FILES) - {os.path.basename(f) for f in writes})
    if lost:
        raise ValueError(f"export directory {path} holds tokenizer files ({', '.join(lost)}) that this export "
                         f"does not write (it has another tokenizer or none); export to another directory, or pass "
                         f"{consent} to replace them")


def write_marker(tmp: str) -> None:
    """The export marker of a directory just written: the names of the files in it (all glm5f's)."""
    files = sorted(os.listdir(tmp) + [EXPORT_MARKER])
    with open(os.path.join(tmp, EXPORT_MARKER), "w", encoding="utf-8") as f:
        json.dump({"files": files}, f, indent=2)


def write_dir(path: str, fill) -> None:
    """Let fill(tmp) write a temporary sibling of `path`, then put it in `path`'s place (replacing what is there),
    so `path` never holds half an export; on an error the sibling is removed and `path` is untouched. The
    directory gets the user's umask's permissions (not mkdtemp's 0700)."""
    parent = os.path.dirname(os.path.abspath(path))
    os.makedirs(parent, exist_ok=True)
    tmp = tempfile.mkdtemp(prefix=os.path.basename(path) + ".tmp-", dir=parent)
    try:
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(tmp, 0o777 & ~umask)
        fill(tmp)
        if os.path.exists(path):
            old = tempfile.mkdtemp(prefix=os.path.basename(path) + ".old-", dir=parent)
            os.replace(path, os.path.join(old, "x"))
            os.replace(tmp, path)
            shutil.rmtree(old)
        else:
            os.replace(tmp, path)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
