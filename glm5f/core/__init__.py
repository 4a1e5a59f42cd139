"""core: what every floor stands on -- the model's config and presets, the params tree and its leaf table, the
layer-kind tables, the plain ops (norms, rope, dtype rules), FLOP counts, replay records and IGNORE_INDEX.

Imports no other glm5f folder."""

IGNORE_INDEX = -100  # the label of a position that is not trained (as Transformers and torch's cross_entropy)
