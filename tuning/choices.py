"""The names ``qswap tune`` offers for each of its choices, in a module without torch.

The CLI builds its options (and ``--help``) from these without importing the training stack, so
that commands which train nothing (``qswap sentinels make``, ``qswap feedback export``) start
without torch. The modules that implement each choice import their names from here.
"""

from __future__ import annotations

#: Training losses (:func:`qswap.tuning.losses.build_loss`).
LOSSES = ("triplet", "infonce", "samtone", "pair")
#: Similarity of a query and a document inside a loss.
METRICS = ("cos", "euclid")
#: Tuning methods (:data:`qswap.tuning.methods.METHODS`), in the order ``--help`` lists them.
METHOD_NAMES = ("partial", "bias", "lora", "full")
#: Optimisers, learning-rate schedules and the batch-size rule (:mod:`qswap.tuning.optim`).
OPTIMIZERS = ("adamw", "adamax", "sgd")
SCHEDULERS = ("none", "L", "Q", "E0.95", "E0.98")
#: --lr-rule: keep the learning rate, or scale it with the square root of the batch.
LR_RULES = ("none", "sqrt")
#: Where hard negatives are mined.
MINE_CHOICES = ("auto", "corpus", "index", "none")
#: What encodes queries for mining and evaluation.
QUERY_RUNTIMES = ("onnx", "torch")
