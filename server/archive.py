"""Safe extraction of an uploaded encoder archive (``.tar.gz`` of one encoder directory).

The archive comes from the network, so nothing in it is trusted: members are written one by
one by this code (never ``extractall``), only regular files and directories are accepted, no
absolute paths, no ``..``, no links or devices, a bounded number of members and bytes.

Work is bounded before it is done: an extended header (PAX, GNU long name) is refused by its
declared size before tarfile reads and parses it (a 0.4 MB upload can declare a 400 MB PAX
header), sparse members are refused (their size on disk is not their size in the archive), and
extraction stops at a deadline or when the server shuts down.
"""

from __future__ import annotations

import tarfile
import zlib
from pathlib import Path, PurePosixPath
import time
from typing import BinaryIO, Callable

from qswap.atomic import disk_full
from qswap.encoders.artifact import ENCODER_MANIFEST
from qswap.errors import InsufficientStorageError, InvalidInputError

_CHUNK = 1 << 20
_MAX_DEPTH = 2   # an encoder directory is flat; allow one enclosing folder
# An encoder's member names are short; a PAX record of a few KB already means something odd.
MAX_HEADER_BYTES = 64 << 10
_EXTENDED = (tarfile.XHDTYPE, tarfile.XGLTYPE, tarfile.SOLARIS_XHDTYPE,
             tarfile.GNUTYPE_LONGNAME, tarfile.GNUTYPE_LONGLINK)


def _refuse(msg: str) -> InvalidInputError:
    return InvalidInputError(f"unsafe or malformed encoder archive: {msg}",
                             "upload `tar czf enc.tar.gz -C PARENT ENCODER_DIR` of a plain encoder directory")


class _BoundedTarInfo(tarfile.TarInfo):
    """A TarInfo that checks an extended header's declared size before tarfile reads it."""

    def _proc_member(self, tarfile_: tarfile.TarFile) -> tarfile.TarInfo:
        if self.type in _EXTENDED and self.size > MAX_HEADER_BYTES:
            raise _refuse(f"an extended header declares {self.size} bytes (at most {MAX_HEADER_BYTES})")
        return super()._proc_member(tarfile_)  # type: ignore[misc]


def _member_path(name: str) -> PurePosixPath | None:
    """The member's relative path, ``None`` for the archive root; raises for unsafe names."""
    if "\\" in name or "\x00" in name:
        raise _refuse(f"member name {name!r} has a backslash or NUL")
    if name.startswith("/"):
        raise _refuse(f"absolute member path {name!r}")
    parts = [p for p in PurePosixPath(name).parts if p not in ("", ".")]
    if any(p == ".." for p in parts):
        raise _refuse(f"member path {name!r} climbs out with '..'")
    if not parts:
        return None
    if len(parts) > _MAX_DEPTH:
        raise _refuse(f"member {name!r} is nested too deep (an encoder directory is flat)")
    return PurePosixPath(*parts)


def extract_encoder_archive(fileobj: BinaryIO, dest: Path, *, max_bytes: int, max_members: int,
                            deadline: float | None = None, cancelled: Callable[[], bool] | None = None) -> Path:
    """Extract a gzip tar into the empty directory ``dest``; return the encoder directory in it.

    The encoder directory is ``dest`` itself (files at the top) or its single subdirectory.
    Raises :class:`InvalidInputError` for anything unsafe or malformed, or when ``deadline``
    (a ``time.monotonic()`` value) passes; stops when ``cancelled()`` turns true.
    """
    dest = Path(dest)
    root = dest.resolve()
    total = 0
    count = 0

    def check_time() -> None:
        if cancelled is not None and cancelled():
            raise InvalidInputError("the upload was cancelled: the server is shutting down", "retry later")
        if deadline is not None and time.monotonic() > deadline:
            raise _refuse("extraction took longer than the server allows (upload_timeout_s)")

    if fileobj.read(2) != b"\x1f\x8b":
        raise InvalidInputError("the archive is not gzip-compressed",
                                "upload a gzip-compressed tar of one encoder directory (tar czf)")
    fileobj.seek(0)
    try:
        with tarfile.open(fileobj=fileobj, mode="r:gz", tarinfo=_BoundedTarInfo) as tar:
            for m in tar:   # streaming: members are checked before their data is read
                check_time()
                count += 1
                if count > max_members:
                    raise _refuse(f"more than {max_members} members")
                rel = _member_path(m.name)
                if m.issym() or m.islnk():
                    raise _refuse(f"member {m.name!r} is a link")
                if m.issparse():
                    raise _refuse(f"member {m.name!r} is a sparse file")
                if not (m.isfile() or m.isdir()):
                    raise _refuse(f"member {m.name!r} is not a regular file or directory")
                if rel is None:
                    continue
                target = dest / rel
                if not target.resolve().is_relative_to(root):
                    raise _refuse(f"member {m.name!r} resolves outside the extraction directory")
                if m.isdir():
                    target.mkdir(parents=True, exist_ok=True)
                    continue
                total += m.size
                if total > max_bytes:
                    raise _refuse(f"more than {max_bytes} bytes when extracted")
                target.parent.mkdir(parents=True, exist_ok=True)
                src = tar.extractfile(m)
                if src is None:
                    raise _refuse(f"member {m.name!r} has no data")
                written = 0
                try:
                    with open(target, "xb") as out:   # "x": a duplicate member is refused, not overwritten
                        while block := src.read(_CHUNK):
                            check_time()
                            written += len(block)
                            if written > m.size:
                                raise _refuse(f"member {m.name!r} is longer than its header says")
                            out.write(block)
                except FileExistsError:
                    raise _refuse(f"member {m.name!r} appears twice") from None
    except (tarfile.TarError, EOFError, zlib.error, OSError) as e:
        if disk_full(e):   # the server's disk, not the client's archive
            raise InsufficientStorageError("the server's disk is full: the archive could not be extracted",
                                           "free disk space on the server (state dir), then retry") from e
        raise InvalidInputError(f"not a readable .tar.gz archive: {e}",
                                "upload a gzip-compressed tar of one encoder directory") from None
    if (dest / ENCODER_MANIFEST).is_file():
        return dest
    subdirs = [p for p in dest.iterdir() if p.is_dir()]
    if len(subdirs) == 1 and (subdirs[0] / ENCODER_MANIFEST).is_file():
        return subdirs[0]
    raise InvalidInputError(f"the archive holds no encoder directory ({ENCODER_MANIFEST} not found)",
                            "archive the encoder directory itself: tar czf enc.tar.gz -C PARENT ENCODER_DIR")
