"""posttrain: post-training objectives -- DPO (dpo), GRPO (grpo), the no-grad reference passes (reference),
the on-policy sampler (sampler) and the shipped reward functions (rewards).

Imports the floors below it (core/ to train/), never run/."""
