"""qswap: retrieval over a frozen document index with query encoders swapped per request.

Package map (dependency arrows point one way):

- ``qswap.space``, ``qswap.errors``, ``qswap.atomic``, ``qswap.paths``, ``qswap.locks``,
  ``qswap.beir``: shared types and helpers every package may import (the embedding-space
  fingerprint, named errors, atomic file writes, the BEIR dataset reader).
- ``qswap.encoders``: base models and query-encoder adapters.
- ``qswap.index``: the FAISS document index on disk.
- ``qswap.tuning``: adiabatic query-tower tuning -> ``qswap.encoders``, ``qswap.index``.
- ``qswap.server``: the HTTP search service -> ``qswap.index``, ``qswap.encoders``.
  Nothing imports it but the CLI.
"""

__version__ = "0.1.0"
