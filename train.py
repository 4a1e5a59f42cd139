"""Train GLM-5 with glm5f: config -> params -> data -> [batch -> train_step -> log -> evaluate -> save].

    python train.py                      # glm5-tiny on the embedded text, CPU, about a minute
    python train.py --help               # every flag, with defaults
    python train.py --model.preset glm5-scaled-moe --data.type synthetic --train.steps 50
    python train.py --config recipes/tiny.yaml --train.steps 100   # a recipe (or a run's config.yaml), flags over it
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import time

import torch
import torch.distributed as dist

import glm5f
from configs import Config, mesh_errors, parse, validate, with_data_type
from glm5f.ckpt import checkpoint
from glm5f.data import print_warning, warnings_as_lines
from glm5f.parallel.distributed import DistLayout
from glm5f.parallel.layout import Layout
from glm5f.run import finish, preempt, rundir
from glm5f.run.errors import TrainingError, out_of_memory, user_errors
from glm5f.run.launch import (TIMEOUT_EXIT, StallWatch, WorkerFailure, collective_timeout, init_process, silent_ranks,
                              spawn, under_torchrun)
from glm5f.run.loop import (Checkpoints, Evaluation, RunFiles, check_batch, first_step_check, say_start, skip_rule,
                            step_record)
from glm5f.run.metrics import read_metrics
from glm5f.run.preflight import check_inputs, check_run
from glm5f.run.resume import resume
from glm5f.run.setup import plan_device, resolve_device, start
from glm5f.train.step import train_step

__all__ = ["TrainingError", "main", "train"]


def train(cfg: Config, layout: Layout | None = None) -> list[dict]:
    """Run the training `cfg` describes (already validated) on `layout` (default: one process); returns the
    metrics records of the steps it ran."""
    cfg = with_data_type(cfg)
    layout = layout or Layout(resolve_device(cfg.train.device))
    run, state = start(cfg, layout)  # tokenizer, run dir, params, adapters, objective, reference, data, feed
    state, last_ckpt = resume(run, state)
    first = state.step
    if first >= cfg.train.steps:
        run.say(f"nothing to do: step {first} >= --train.steps {cfg.train.steps}")
        finish.export(run, state)
        return read_metrics(cfg.checkpoint.dir)
    say_start(run, state, first)
    files, evaluate, checkpoints, records = RunFiles(run, first), Evaluation(run), Checkpoints(run, last_ckpt), []
    for i in range(first, cfg.train.steps):
        t0 = time.perf_counter()
        with user_errors():  # a streamed record is read, and checked, when a batch needs it
            batch = run.feed.next(state, i)  # the objective's schedule: a new batch, or the one it updates again
        check_batch(run, batch, i, first=i == first)
        check = first_step_check(run) if all(r.get("skipped") for r in records) else None  # the first update
        with out_of_memory(i + 1, layout, cfg):
            state, metrics = train_step(state, batch, run.trainer, skip=skip_rule(run, batch, i + 1, checkpoints.last),
                                        inspect=check)
        rec = step_record(i + 1, metrics, batch, time.perf_counter() - t0, run.feed.metrics)
        rec.update(evaluate(i + 1, state))
        records.append(rec)
        files.write(rec, batch)
        layout.step_done(i + 1)
        checkpoints.after(i + 1, state)  # saves when due (or on SIGTERM, then stops)
    files.close()
    finish.report(run)
    finish.export(run, state)
    return records


# ---- the command line ---------------------------------------------------------------------------------------------

def run_rank(argv: list[str], torchrun: bool = False) -> None:
    """One process of a multi-process run: spawned by main (which holds the run directory's lock and names the
    ranks that stop answering), or started by torchrun (then rank 0 holds the lock for all, and on a collective
    timeout the ranks that timed out name, in one line, those that did not)."""
    cfg = parse(argv)
    device = init_process(resolve_device(cfg.train.device), cfg.parallel.timeout_s)
    if device.type == "cpu" and "OMP_NUM_THREADS" not in os.environ:
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // int(os.environ.get("LOCAL_WORLD_SIZE", 1))))
    p = cfg.parallel
    with preempt.handling(cfg.checkpoint.preempt_grace_s, launched=not torchrun):
        try:
            with rundir.shared_run_lock(cfg.checkpoint.dir) if torchrun else contextlib.nullcontext():
                watch = StallWatch(cfg.parallel.timeout_s)  # its thread runs from `with` on
                layout = DistLayout(p.dp_shard, p.cp, p.ep, device, on_step=watch.step_done)
                with watch:
                    train(cfg, layout)
        except (preempt.Preempted, preempt.StopNow) as e:  # every rank stops here; rank 0 says where
            stopped(e, cfg, argv)
        except Exception as e:
            if preempt.stopped_now():  # the collective of a peer that stopped on the same second SIGTERM
                stopped(preempt.stopped_now(), cfg, argv)
            if torchrun and preempt.interrupted():  # a peer that stopped on the same Ctrl-C: main says it once
                raise KeyboardInterrupt from None
            if not torchrun or not collective_timeout(e):
                raise
            report_timeout(cfg, e)
            raise SystemExit(TIMEOUT_EXIT) from None


def stopped(e: BaseException, cfg: Config, argv: list[str]) -> None:
    """A rank of a multi-process run stops on SIGTERM (Preempted after the save, StopNow without one): rank 0 says
    where, and every rank exits 143."""
    if os.environ.get("RANK") == "0":
        print(e.message(argv) if isinstance(e, preempt.Preempted) else
              interrupted_line(f"{e} (without saving)", cfg.checkpoint.dir, argv), file=sys.stderr, flush=True)
    raise SystemExit(preempt.SIGNAL_EXIT[signal.SIGTERM]) from None


def interrupted_line(why: str, run_dir: str, argv: list[str]) -> str:
    """The one line a run stopped at once (Ctrl-C, StopNow) prints: why, its last checkpoint, how to resume."""
    last = checkpoint.latest(run_dir)
    if last is None:
        return f"stopped {why}: no checkpoint was written in {run_dir}; start again with the same command"
    return f"stopped {why}: the last checkpoint is {last}; resume with: {preempt.resume_command(argv)}"


def report_timeout(cfg: Config, e: Exception) -> None:
    """Under torchrun, after this rank's collective timed out: the lowest rank that timed out prints one line
    naming the ranks that did not (they stopped answering) and the last checkpoint; the others print nothing."""
    last = checkpoint.last_line(cfg.checkpoint.dir)
    found = silent_ranks()
    if found is None:  # the store is gone too (it lived in a rank that stopped): what this rank's error says
        print(f"error: [rank {dist.get_rank()}] {collective_timeout(e)}; {last}", file=sys.stderr, flush=True)
        return
    answered, silent = found
    if dist.get_rank() == min(answered):
        who = (f"rank(s) {', '.join(map(str, silent))} stopped answering (hung, stopped or dead)" if silent else
               "every rank timed out waiting for the others (each in another collective)")
        print(f"error: a collective timed out after --parallel.timeout_s {cfg.parallel.timeout_s}: {who}; {last}",
              file=sys.stderr, flush=True)


def plan_run(cfg: Config) -> None:
    """--plan: print the memory plan of the run the other flags describe (nothing allocated, nothing written)."""
    from glm5f.run.plan import print_plan

    model_cfg = glm5f.GLM5Config.from_hf(cfg.model.init_from) if cfg.model.init_from else cfg.model.build()
    blocking = mesh_errors(cfg, model_cfg)
    if blocking:
        raise TrainingError(f"--plan needs a mesh: {'; '.join(blocking)}")
    print_plan(cfg, cfg.plan, model_cfg, plan_device(cfg.train.device), cfg.model.init_from or cfg.model.preset)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    warnings_as_lines()
    try:
        cfg = parse(argv, description=__doc__)
    except ValueError as e:  # a recipe file (--config) that does not fit Config
        print(f"error: {e}", file=sys.stderr)
        return 1
    world = int(os.environ["WORLD_SIZE"]) if under_torchrun() else cfg.parallel.world
    try:
        errors = validate(cfg, world_size=world)
        if cfg.plan:  # the plan of what the flags describe, with what a run of them would refuse
            for e in errors:
                print_warning(f"a run of these flags would stop: {e}")
            with user_errors():
                plan_run(cfg)
            return 0
        if errors:  # before any process starts
            raise TrainingError("invalid configuration:\n  - " + "\n  - ".join(errors))
        cfg = with_data_type(cfg)
        rundir.check_run_paths(cfg)
        device = resolve_device(cfg.train.device)  # a device that is not there: one line, before any process starts
        local = int(os.environ.get("LOCAL_WORLD_SIZE", 1)) if under_torchrun() else world  # ranks on this machine
        with user_errors():  # what the ranks would read first, and the memory they would hold, checked here
            check_inputs(cfg)
            if not cfg.train.skip_memory_check:
                check_run(cfg, device, local, spawned=not under_torchrun() and world > 1,
                          rank=int(os.environ.get("LOCAL_RANK", 0)))
        if under_torchrun():  # rank 0 holds the lock, once the process group is up (see run_rank)
            run_rank(argv, torchrun=True)
            return 0
        with rundir.run_lock(cfg.checkpoint.dir):
            if world > 1:
                spawn(run_rank, world, argv)
            else:
                with preempt.handling(cfg.checkpoint.preempt_grace_s):
                    train(cfg)
    except preempt.Preempted as e:
        print(e.message(argv), file=sys.stderr)
        return preempt.SIGNAL_EXIT[e.signum]
    except (preempt.StopNow, KeyboardInterrupt) as e:
        why = f"{e} (without saving)" if isinstance(e, preempt.StopNow) else "on Ctrl-C (SIGINT)"
        if os.environ.get("RANK", "0") == "0":  # under torchrun every rank gets Ctrl-C; rank 0 says it
            print(interrupted_line(why, cfg.checkpoint.dir, argv), file=sys.stderr)
        return 130 if isinstance(e, KeyboardInterrupt) else 143
    except WorkerFailure as e:
        print(f"error: {e}; {checkpoint.last_line(cfg.checkpoint.dir)}", file=sys.stderr)
        return 1
    except (TrainingError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
