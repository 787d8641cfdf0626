"""qswap.after_import: a callback on a module's import, without importing it."""

from __future__ import annotations

import sys

from qswap.after_import import after_import


def test_runs_once_after_the_import_even_when_set_up_twice(tmp_path, monkeypatch):
    (tmp_path / "qswap_probe_mod.py").write_text("VALUE = 41\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "qswap_probe_mod", raising=False)
    seen: list[int] = []

    def then(module):
        seen.append(module.VALUE)
    after_import("qswap_probe_mod", then)
    after_import("qswap_probe_mod", then)   # e.g. logging configured twice before the import
    assert seen == [] and "qswap_probe_mod" not in sys.modules   # nothing imported by setting it up
    import qswap_probe_mod   # noqa: F401
    assert seen == [41]
    after_import("qswap_probe_mod", then)   # already imported: at once
    assert seen == [41, 41]
    assert not any(getattr(f, "name", None) == "qswap_probe_mod" for f in sys.meta_path)
