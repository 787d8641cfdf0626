"""Run a function on a module once it is imported, without importing it.

A server configures how some libraries log (transformers keeps a stderr handler of its own) but
must not import them to do so: importing ``transformers`` costs about a second of every start,
and a server serving from cached exports never needs it.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import sys
import threading
from types import ModuleType
from typing import Callable, Sequence

_lock = threading.Lock()


class _AfterImport(importlib.abc.MetaPathFinder):
    """Finds nothing itself: it asks the finders after it for ``name`` and wraps the loader's
    ``exec_module`` so that ``then`` runs on the module just after it executed."""

    def __init__(self, name: str, then: Callable[[ModuleType], None]) -> None:
        self.name, self.then = name, then

    def find_spec(self, fullname: str, path: Sequence[str] | None,
                  target: ModuleType | None = None) -> importlib.machinery.ModuleSpec | None:
        if fullname != self.name:
            return None
        with _lock:
            if self in sys.meta_path:
                sys.meta_path.remove(self)   # once; and the finders asked below must not find us again
        for finder in sys.meta_path:
            spec = finder.find_spec(fullname, path, target) if hasattr(finder, "find_spec") else None
            if spec is not None:
                break
        else:
            return None
        loader = spec.loader
        if loader is None or not hasattr(loader, "exec_module"):
            return spec
        run, then = loader.exec_module, self.then

        def exec_module(module: ModuleType) -> None:
            run(module)
            then(module)
        loader.exec_module = exec_module  # type: ignore[method-assign]
        return spec


def after_import(name: str, then: Callable[[ModuleType], None]) -> None:
    """Call ``then(module)`` now if module ``name`` is imported, else right after it is (once, in
    the importing thread), without importing it here."""
    module = sys.modules.get(name)
    if module is not None:
        then(module)
        return
    with _lock:
        # Set up twice (logging configured again) before the import: one hook runs it.
        if not any(isinstance(f, _AfterImport) and f.name == name and f.then == then for f in sys.meta_path):
            sys.meta_path.insert(0, _AfterImport(name, then))
