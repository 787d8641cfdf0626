"""qswap: retrieval over a frozen document index with query encoders swapped per request.

Package map (dependency arrows point one way):

- ``qswap.space``, ``qswap.errors``, ``qswap.atomic``, ``qswap.paths``, ``qswap.locks``,
  ``qswap.beir``, ``qswap.plotting``, ``qswap.matryoshka``: shared types and helpers every package may import (the
  embedding-space fingerprint, named errors, atomic file writes, file locks, the BEIR dataset
  reader, matplotlib set-up, Matryoshka truncation); they import no package.
- ``qswap.guard``: the regression guard (statistics, retrieval metrics, checks and the typed
  record, both sentinel formats, the evaluator); below tuning and the server, imports neither.
- ``qswap.encoders``: base models and query-encoder adapters.
- ``qswap.index``: the FAISS document index on disk.
- ``qswap.tuning``: adiabatic query-tower tuning -> ``qswap.encoders``, ``qswap.index``, ``qswap.guard``.
- ``qswap.server``: the HTTP search service -> ``qswap.index``, ``qswap.encoders``, ``qswap.guard``.
  Nothing imports it but the CLI.
- ``qswap.bench``: benchmarks -> every package but the server's code (servers run as processes).
- ``qswap.cli`` (folder ``cli/``): the ``qswap`` command, above all packages; nothing imports it.
"""

__version__ = "0.1.0"

#: The base model (a frozen text tower) used when none is named: one spelling for every command.
DEFAULT_MODEL = "multilingual-e5-small"
