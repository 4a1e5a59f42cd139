"""train: one optimizer step -- the objective record and the step's losses and micro-batches (loss), the
optimizers (optim), the train state and train_step (step).

Imports the floors below it (core/ to ckpt/), never posttrain/ or run/: the objectives table sits above."""
