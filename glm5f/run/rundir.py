"""The run directory: what a run writes there, its lock (one live run per directory, RUN/.lock held with flock), and
the checks, before any training, that the run directory and the export directories can be written and hold no
other run or export.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import shutil
import socket

import torch.distributed as dist

from glm5f.data.chat import RUN_TOKENIZER_DIR
from glm5f.ckpt.checkpoint import remove_partial_saves
from glm5f.ckpt.hf.export_dir import EXPORT_MARKER, check_export_dir

LOCK = ".lock"
CONFIG_FILE = "config.yaml"  # the resolved config a run writes into its directory
RUN_FILES = ("checkpoints", "metrics.jsonl", "loss.png", CONFIG_FILE, RUN_TOKENIZER_DIR)  # what a run writes there


class RunDirBusy(ValueError):
    """Another live run holds the run directory's lock."""


class RunLock:
    """An exclusive lock on a run directory for the life of a run: RUN/.lock, locked with flock and holding the
    holder's "host pid". A second run into the same directory stops in __enter__, before writing anything, with a
    RunDirBusy naming the holder. The kernel drops the lock of a process that dies, so the lock file of a killed
    run is taken over (saying so through `say`). On entering, partial checkpoint folders left by a killed save
    are removed (remove_partial_saves); on leaving, the lock file is removed, and the run directory too when this
    lock created it and it is still empty."""

    def __init__(self, run_dir: str, say=print):
        self.run_dir, self.say, self.fd, self.created = run_dir, say, None, False
        self.path = os.path.join(run_dir, LOCK)

    def __enter__(self) -> "RunLock":
        self.created = not os.path.isdir(self.run_dir)
        os.makedirs(self.run_dir, exist_ok=True)
        while True:
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                holder = _read_fd(fd) or "an unknown process"
                os.close(fd)
                self._remove_dir_if_created()
                raise RunDirBusy(f"the run directory {self.run_dir} is in use by another run ({_holder(holder)}, "
                                 f"lock {self.path}); wait for it to finish or stop it, or pass another "
                                 f"--checkpoint.dir") from None
            try:
                same = os.stat(self.path).st_ino == os.fstat(fd).st_ino
            except FileNotFoundError:
                same = False
            if same:  # else its holder removed it as we locked it: lock the new file
                break
            os.close(fd)
        previous = _read_fd(fd)
        if previous:
            self.say(f"took over the lock {self.path} of a run that is no longer running ({_holder(previous)}: it "
                     f"stopped without releasing it)")
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{socket.gethostname()} {os.getpid()}\n".encode(), 0)
        os.fsync(fd)
        self.fd = fd
        for line in remove_partial_saves(self.run_dir):
            self.say(line)
        return self

    def __exit__(self, *exc) -> None:
        if self.fd is not None:
            with contextlib.suppress(FileNotFoundError):
                os.remove(self.path)
            os.close(self.fd)  # releases the flock
            self.fd = None
            self._remove_dir_if_created()

    def _remove_dir_if_created(self) -> None:
        if self.created:
            with contextlib.suppress(OSError):
                os.rmdir(self.run_dir)  # only when empty: a run that wrote nothing leaves nothing


def _read_fd(fd: int) -> str:
    return os.pread(fd, 256, 0).decode(errors="replace").strip()


def _holder(text: str) -> str:
    host, _, pid = text.partition(" ")
    return f"pid {pid} on host {host}" if pid else text


def run_lock(run_dir: str, say=print):
    """The run directory's RunLock in the process that owns the run (rank 0, or the one process / launcher: RANK
    unset or 0); a no-op context elsewhere."""
    return RunLock(run_dir, say) if os.environ.get("RANK", "0") == "0" else contextlib.nullcontext()


@contextlib.contextmanager
def shared_run_lock(run_dir: str, say=print):
    """The run directory's RunLock for a run whose ranks were started by another launcher (torchrun): rank 0
    takes it, and every rank learns whether it did (a broadcast), so a refusal stops all of them at once rather
    than leaving the others to wait for a collective that rank 0 never joins. Rank 0 raises the RunDirBusy, the
    others SystemExit(1) without a word."""
    lock, refused = RunLock(run_dir, say) if dist.get_rank() == 0 else None, [None]
    if lock is not None:
        try:
            lock.__enter__()
        except RunDirBusy as e:
            refused[0] = str(e)
    dist.broadcast_object_list(refused, src=0)
    if refused[0] is not None:
        if lock is not None:
            raise RunDirBusy(refused[0])
        raise SystemExit(1)
    try:
        yield
    finally:
        if lock is not None:
            lock.__exit__(None, None, None)


def _nearest_existing(path: str) -> str:
    """`path` or its closest ancestor that exists."""
    path = os.path.abspath(path)
    while not os.path.exists(path) and os.path.dirname(path) != path:
        path = os.path.dirname(path)
    return path


def _path_problem(path: str, what: str) -> str | None:
    """What stops a run from creating and writing directory `path` (named as `what`), or None."""
    if os.path.exists(path) and not os.path.isdir(path):
        return f"{what} {path} is a file, not a directory; pass a directory (new or existing)"
    base = _nearest_existing(path)
    if not os.path.isdir(base):
        return f"{what} {path} is under {base}, which is a file, not a directory; pass another path"
    if not os.access(base, os.W_OK | os.X_OK):
        verb = "is" if base == os.path.abspath(path) else f"would be created in {base}, which is"
        return f"{what} {path} {verb} not writable (read-only or not yours); pass a writable directory"
    return None


def check_run_paths(cfg) -> None:
    """Before any training: a ValueError naming the path and what is wrong when the run directory
    (--checkpoint.dir) or its checkpoints/ cannot be written, or the --checkpoint.export_hf (export_peft)
    directory cannot be created beside its parent (a file in the way, read-only, under a file)."""
    run_dir, export = cfg.checkpoint.dir, cfg.checkpoint.export_hf
    problem = _path_problem(run_dir, "the run directory (--checkpoint.dir)")
    ckpts = os.path.join(run_dir, "checkpoints")
    if problem is None and os.path.exists(ckpts):
        if not os.path.isdir(ckpts):
            problem = (f"{ckpts} is a file, but a run keeps its checkpoints in a directory there; move the file "
                       f"away or pass another --checkpoint.dir")
        elif not os.access(ckpts, os.W_OK | os.X_OK):
            problem = f"{ckpts} is not writable (read-only or not yours); pass a writable --checkpoint.dir"
    for flag, export in (("export_hf", export), ("export_peft", getattr(cfg.checkpoint, "export_peft", None))):
        if problem is None and export:
            export = export.rstrip("/") or export
            problem = _path_problem(os.path.dirname(os.path.abspath(export)), f"the directory of --checkpoint.{flag}")
            if problem is None and os.path.isdir(export) and not os.access(export, os.W_OK | os.X_OK):
                problem = f"--checkpoint.{flag} {export} is not writable (read-only or not yours); pass another"
    if problem:
        raise ValueError(problem)


def prepare_run_dir(cfg, layout, say, token_files: list[str] = ()) -> None:
    """A run directory holding a previous run is only continued (--checkpoint.resume) or, with
    --checkpoint.overwrite, emptied of what we wrote; anything else would mix two runs' metrics and checkpoints.
    An export directory is checked before any training (it gets the run's `token_files`). `cfg` is the run's
    configs.Config; only `layout`'s main process deletes. A ValueError says what to pass instead."""
    for flag in ("export_hf", "export_peft"):
        if getattr(cfg.checkpoint, flag):
            check_export_dir(getattr(cfg.checkpoint, flag), run_dir=cfg.checkpoint.dir, flag=f"--checkpoint.{flag}",
                             init_from=cfg.model.init_from, writes=tuple(token_files),
                             overwrite=cfg.checkpoint.replace_export)
    run_dir = cfg.checkpoint.dir
    if os.path.isfile(os.path.join(run_dir, EXPORT_MARKER)):
        raise ValueError(f"--checkpoint.dir {run_dir} is a glm5f export (a Transformers or PEFT directory), not "
                         f"a run directory: a run there would mix its checkpoints into the export. Pass another "
                         f"--checkpoint.dir (and --model.init_from {run_dir} to start from the export)")
    if cfg.checkpoint.resume or not os.path.isdir(run_dir):
        return
    found = [n for n in RUN_FILES[:2] if os.path.exists(os.path.join(run_dir, n))]
    if found and not cfg.checkpoint.overwrite:
        raise ValueError(f"the run directory {run_dir} already holds a run ({', '.join(found)}); continue it "
                         f"with --checkpoint.resume latest, start over with --checkpoint.overwrite (deletes "
                         f"its {', '.join(RUN_FILES)}), or pass another --checkpoint.dir")
    if found and layout.is_main:
        for n in RUN_FILES:
            path = os.path.join(run_dir, n)
            if os.path.isdir(path):
                shutil.rmtree(path)
            elif os.path.exists(path):
                os.remove(path)
