"""ckpt: the run's checkpoints (checkpoint) and Transformers / PEFT files both ways (hf/).

Imports core/, kernels/, parallel/, model/ and data/ only."""
