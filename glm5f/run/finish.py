"""A run's end: its summary (the loss curve, loss.png, and the first and last metrics) and its exports (a
Transformers checkpoint, a PEFT adapter), each with the run's tokenizer files and chat template."""

from __future__ import annotations

import errno
import os

from glm5f.ckpt.hf.export import export_run
from glm5f.ckpt.hf.peft import save_peft
from glm5f.data import make_tokenizer, print_warning
from glm5f.data.chat import RUN_TOKENIZER_DIR
from glm5f.model import lora
from glm5f.run.errors import user_errors, writing
from glm5f.run.metrics import number, plot_losses, read_metrics
from glm5f.train.step import TrainState


def report(run) -> None:
    """The run's loss curve (loss.png) and a summary of its metrics.jsonl (the main objective's lines among it,
    `Objective.summary`)."""
    if not run.layout.is_main:
        return
    say, run_dir = run.say, run.cfg.checkpoint.dir
    history = read_metrics(run_dir)
    png = os.path.join(run_dir, "loss.png")
    try:
        if plot_losses({os.path.basename(os.path.abspath(run_dir)): history}, png):
            say(f"loss curve: {png}")
        else:
            say("no loss curve: matplotlib is not installed (pip install matplotlib)")
    except OSError as e:  # the run and its checkpoint are complete: the picture is not worth an error
        print_warning(f"no loss curve: could not write {png}: {e.strerror or e} "
                      f"({errno.errorcode.get(e.errno, e.errno)})")
    first, last = history[0], history[-1]
    say(f"done: loss {number(first['loss'])} (step {first['step']}) -> {number(last['loss'])} (step {last['step']})")
    for line in run.row.summary(first, last):
        say(line)
    if "indexer_loss" in first:
        say(f"indexer: indexer_loss {first['indexer_loss']:.4f} -> {last['indexer_loss']:.4f}, "
            f"indexer_recall {first['indexer_recall']:.4f} -> {last['indexer_recall']:.4f}")
    evals = [r for r in history if "eval_loss" in r]
    if evals:
        say(f"held-out: eval_loss {evals[-1]['eval_loss']:.4f} (ppl {evals[-1]['eval_ppl']:.2f}) at step "
            f"{evals[-1]['step']}")


def export(run, state: TrainState) -> None:
    """--checkpoint.export_hf: the weights (a LoRA run's merged into the base) as a Transformers checkpoint
    (`hf.export_run`, what scripts/convert.py writes from the run's last checkpoint; collective: the ranks gather
    one leaf at a time, rank 0 writes; a GLM-5.3 run copies the tensors of --model.init_from that are not its
    text model's). --checkpoint.export_peft: a LoRA run's adapters as a PEFT adapter directory (`hf.save_peft`:
    the ranks gather them, rank 0 writes). Both carry the run's tokenizer files and chat template."""
    cfg, model_cfg, layout, say, tokenizer, spec = run.cfg, run.model_cfg, run.layout, run.say, run.tokenizer, run.spec
    params, adapters = (state.frozen, state.trained) if spec else (state.trained, None)
    files = ()
    if layout.is_main and (cfg.checkpoint.export_hf or cfg.checkpoint.export_peft):
        here = os.path.join(cfg.checkpoint.dir, RUN_TOKENIZER_DIR)
        with writing(here, cfg.checkpoint.dir), user_errors():
            files = tuple(os.path.join(here, n) for n in tokenizer.write(here))
    if cfg.checkpoint.export_hf:
        tok = make_tokenizer(tokenizer.path)
        with user_errors(), writing(cfg.checkpoint.export_hf, cfg.checkpoint.dir):
            weights = lora.merge(params, adapters, spec) if spec else params
            export_run(cfg.checkpoint.export_hf, model_cfg, weights, init_from=cfg.model.init_from,
                       token_ids={"bos_token_id": tok.bos_id, "eos_token_id": tok.eos_id, "pad_token_id": tok.pad_id},
                       token_files=files, write=layout.is_main, overwrite=cfg.checkpoint.replace_export)
        say(f"exported Transformers checkpoint{' (adapters merged)' if spec else ''}: {cfg.checkpoint.export_hf}")
    if cfg.checkpoint.export_peft:
        with user_errors(), writing(cfg.checkpoint.export_peft, cfg.checkpoint.dir):
            save_peft(cfg.checkpoint.export_peft, model_cfg, adapters, spec,
                      base_model_name_or_path=cfg.model.init_from, write=layout.is_main, extra_files=files,
                      overwrite=cfg.checkpoint.replace_export)
        say(f"exported PEFT adapter: {cfg.checkpoint.export_peft}")
