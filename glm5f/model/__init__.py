"""model: the GLM-5 family as pure functions -- the environment of a forward (env), the decoder (decoder),
attention and its indexers, KPool, MoE, KDA, mHC residual streams, LoRA adapters, the head (head), decoding and
token log-probabilities.

Imports core/, kernels/ and parallel/ only: the model knows no data, checkpoint, optimizer or process."""
