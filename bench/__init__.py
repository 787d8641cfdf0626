"""Benchmarks (``qswap bench ...``): each writes ``bench/results/<name>/`` with its command, commit and
machine. Shared parts: :mod:`provenance`, :mod:`stats`, :mod:`results`, :mod:`plots`, :mod:`processes`,
:mod:`load_options`, :mod:`fixtures`, the load generator :mod:`loadgen`, and the data sets in :mod:`data`."""
