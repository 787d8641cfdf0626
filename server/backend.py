"""The server's wiring of the query backends, which live in :mod:`qswap.encoders.runtime.backend`."""

from qswap.encoders.runtime.backend import BACKENDS, Backend, TorchBackend, make_backend, runtime_of

__all__ = ["BACKENDS", "Backend", "TorchBackend", "make_backend", "runtime_of"]
