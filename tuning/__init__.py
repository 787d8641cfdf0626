"""Adiabatic query-tower tuning: a query encoder tuned over a frozen document tower.

Documents are embedded once by the frozen base (:mod:`~qswap.tuning.doc_cache`); a
trainable copy of the base encodes queries (:mod:`~qswap.tuning.methods`: partial, bias,
LoRA, full) and is trained with the papers' losses (:mod:`~qswap.tuning.losses`) in
fixed-size epochs with early stopping (:mod:`~qswap.tuning.trainer`). A run
(:mod:`~qswap.tuning.run`) evaluates base vs tuned (:mod:`~qswap.guard.evaluation`,
:mod:`~qswap.guard.stats`, :mod:`~qswap.tuning.multilingual`), checks sentinel sets
(:mod:`~qswap.tuning.sentinel_scores`, judged by the shared :mod:`qswap.guard`) and writes an encoder
directory with its report.
"""
