"""The server's wiring of the query backends, which live in :mod:`qswap.encoders.backend`."""

from qswap.encoders.backend import BACKENDS, Backend, TorchBackend, make_backend, runtime_of

__all__ = ["BACKENDS", "Backend", "TorchBackend", "make_backend", "runtime_of"]
