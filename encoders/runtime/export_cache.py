"""One cached ONNX export directory, for both runtimes (a merged export per encoder and the
shared base graph): reused when its record's digest matches and its model file is there, else
exported into a staging directory and swapped in atomically, the record written last.

Layout of one entry::

    <target>/<model file>    # the graph
    <target>/export.json     # written last: digest and facts; marks the export complete
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Callable

from qswap.atomic import atomic_write_json, recover_dir, staged_dir

META_FILE = "export.json"


def read_meta(directory: Path) -> dict[str, Any]:
    """The export record in ``directory``; ``{}`` when it is missing or torn (no cache)."""
    try:
        return json.loads((directory / META_FILE).read_text())
    except (OSError, ValueError):   # missing or torn record: treat as no cache
        return {}


def cached_dir(target: Path, digest: str, model_file: str,
                  export: Callable[[Path], dict[str, Any]]) -> tuple[dict[str, Any], bool]:
    """The export record of ``target``, exporting first unless a complete one with ``digest`` is there.

    Args:
        target: the cache directory of this export.
        digest: content key the cached record must carry to be reused.
        model_file: the graph's file name inside ``target``.
        export: writes the graph into the staging directory it is given and returns the
            record to keep (with ``digest``).

    Returns:
        ``(record, exported)``: ``exported`` is False when the cached export was reused.
    """
    recover_dir(target)
    meta = read_meta(target)
    if meta.get("digest") == digest and (target / model_file).exists():
        return meta, False
    with staged_dir(target) as staging:
        meta = export(staging)
        atomic_write_json(staging / META_FILE, meta)   # last: marks the export complete
    return meta, True
