"""Intake: everything that brings encoder files from outside into the server's store.

Two ways in, nothing trusted on either:

- **by path** (``{"path": ...}``, only under ``--encoders-root``): the directory is opened by
  walking from the root one component at a time with ``O_NOFOLLOW | O_DIRECTORY`` (a link
  anywhere in the path is refused), and every file is then opened *relative to that open
  directory* (``dir_fd``), without following links, checked with ``fstat`` (a regular file
  with one link) and copied from the same descriptor. What is checked is what is copied:
  swapping the directory (or a file) for a link after the check changes nothing.
- **by upload** (``.tar.gz``): extracted member by member by tarfile under an extraction
  filter (its public filter API: ``data_filter`` plus qswap's rules): only regular files and directories, no
  absolute paths, no ``..``, no links or devices, each file once, a bounded number of members
  and bytes. Work is bounded before it is done: tarfile reads the decompressed stream through
  :class:`_BoundedStream`, which refuses an extended header (PAX, GNU long name) larger than
  :data:`MAX_HEADER_BYTES` before decompressing it (a 0.4 MB upload can declare a 400 MB PAX
  header), counts every byte read or skipped against the limit (a gzip bomb stops there), and
  stops at a deadline or when the server shuts down. Sparse members are refused (their size on
  disk is not their size in the archive).

Error messages name files relative to what the caller gave (never the server's absolute paths).
"""

from __future__ import annotations

import errno
import gzip
import os
import shutil
import stat
import tarfile
import time
import zlib
from pathlib import Path, PurePath, PurePosixPath
from contextlib import contextmanager
from typing import Any, BinaryIO, Callable, Iterator, Mapping

from qswap.encoders.artifact import ENCODER_MANIFEST, EncoderManifest, read_encoder_manifest
from qswap.atomic import disk_full
from qswap.errors import (InsufficientStorageError, IntegrityError, InvalidInputError, NotFoundError,
                          QswapError)

_CHUNK = 1 << 20
_MAX_DEPTH = 2   # an encoder directory is flat; allow one enclosing folder
# An encoder's member names are short; a PAX record of a few KB already means something odd.
MAX_HEADER_BYTES = 64 << 10


def _refuse(msg: str) -> InvalidInputError:
    return InvalidInputError(f"unsafe or malformed encoder archive: {msg}",
                             "upload `tar czf enc.tar.gz -C PARENT ENCODER_DIR` of a plain encoder directory")


class _BoundedStream:
    """The decompressed archive as tarfile reads it, with the work bounded before it is done.

    tarfile reads an extended header (PAX, GNU long name) in one read of its declared size, and
    member data in small pieces: a read larger than :data:`MAX_HEADER_BYTES` is refused before
    anything is decompressed for it. Nothing past ``limit`` bytes of decompressed stream is read
    or skipped (a gzip bomb stops there, not at the disk) and every read checks the deadline.
    """

    def __init__(self, raw: BinaryIO, limit: int, check_time: Callable[[], None]) -> None:
        self._raw = raw
        self._limit = limit
        self._check_time = check_time

    def read(self, n: int = -1) -> bytes:
        if n is None or n < 0 or n > MAX_HEADER_BYTES:
            raise _refuse(f"an extended header declares more than {MAX_HEADER_BYTES} bytes")
        self._check_time()
        if self.tell() + n > self._limit:
            raise _refuse("more than the server's limit of bytes when extracted")
        return self._raw.read(n)

    def seek(self, offset: int, whence: int = os.SEEK_SET) -> int:
        target = offset if whence == os.SEEK_SET else self.tell() + offset
        if whence not in (os.SEEK_SET, os.SEEK_CUR):
            raise _refuse("the archive cannot be read from its end")
        while self.tell() < target:   # skipping member data decompresses it: bounded like a read
            if not self.read(min(target - self.tell(), MAX_HEADER_BYTES)):
                break
        if target < self.tell():
            self._raw.seek(target)
        return self.tell()

    def tell(self) -> int:
        return self._raw.tell()

    def seekable(self) -> bool:
        return True

    def readable(self) -> bool:
        return True


def _member_filter(max_members: int, max_bytes: int,
                   check_time: Callable[[], None]) -> Callable[[tarfile.TarInfo, str], tarfile.TarInfo | None]:
    """The extraction filter (tarfile's public filter API): tarfile's own ``data_filter`` (no
    absolute paths, nothing outside the destination, safe modes) and qswap's stricter rules: only
    regular files and directories, no links at all, a flat encoder directory, a bounded number
    of members and bytes, each file once."""
    seen: set[PurePosixPath] = set()
    count = total = 0

    def member_filter(m: tarfile.TarInfo, dest: str) -> tarfile.TarInfo | None:
        nonlocal count, total
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
            return None   # the archive root itself
        if m.isfile():
            if rel in seen:
                raise _refuse(f"member {m.name!r} appears twice")
            seen.add(rel)
            total += m.size
            if total > max_bytes:
                raise _refuse(f"more than {max_bytes} bytes when extracted")
        try:
            return tarfile.data_filter(m, dest)
        except tarfile.FilterError as e:
            raise _refuse(f"member {m.name!r}: {e}") from None

    return member_filter


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

    Args:
        fileobj: the uploaded ``.tar.gz``.
        dest: an empty directory (the store's staging directory).
        max_bytes: most bytes the files may hold together.
        max_members: most members the archive may hold.
        deadline: a ``time.monotonic()`` value after which extraction stops.
        cancelled: extraction stops once it returns true (the server is shutting down).

    Returns:
        The encoder directory.

    Raises:
        InvalidInputError: anything unsafe or malformed, or the deadline passed.
        InsufficientStorageError: the server's disk filled up.
    """
    dest = Path(dest)

    def check_time() -> None:
        if cancelled is not None and cancelled():
            raise InvalidInputError("the upload was cancelled: the server is shutting down", "retry later")
        if deadline is not None and time.monotonic() > deadline:
            raise _refuse("extraction took longer than the server allows (upload_timeout_s)")

    if fileobj.read(2) != b"\x1f\x8b":
        raise InvalidInputError("the archive is not gzip-compressed",
                                "upload a gzip-compressed tar of one encoder directory (tar czf)")
    fileobj.seek(0)
    # Headers and their padding beside the files' bytes: a header block and up to one block of
    # padding per member, and one extended header.
    limit = max_bytes + (max_members + 2) * 2 * tarfile.BLOCKSIZE + MAX_HEADER_BYTES + tarfile.RECORDSIZE
    member_filter = _member_filter(max_members, max_bytes, check_time)
    try:
        with gzip.GzipFile(fileobj=fileobj, mode="rb") as gz, \
                tarfile.open(fileobj=_BoundedStream(gz, limit, check_time), mode="r:") as tar:
            # Member by member as the stream comes (extractall would list the whole archive
            # first, then rewind the gzip stream for every member).
            for m in tar:
                tar.extract(m, dest, filter=member_filter)
    except (tarfile.TarError, EOFError, zlib.error, gzip.BadGzipFile, OSError) as e:
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


# ----------------------------------------------------------------------------- by path

_NOFOLLOW_DIR = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
# O_NONBLOCK: opening a FIFO planted in the directory must not hang the registration.
_NOFOLLOW_FILE = os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK


class EncoderDir:
    """An encoder directory held open: its files are read relative to ``fd``, never by path.

    ``label`` names it in messages (the path the caller gave, not the server's).
    Use as a context manager, or call :meth:`close`.
    """

    def __init__(self, fd: int, label: str) -> None:
        self.fd = fd
        self.label = label

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1

    def __enter__(self) -> "EncoderDir":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


def open_dir(path: Path, label: str | None = None) -> EncoderDir:
    """Open a directory the server itself made (an extracted upload), not following a link.

    Args:
        path: the directory.
        label: how messages name it (default: its name).

    Returns:
        The open directory.
    """
    try:
        return EncoderDir(os.open(path, _NOFOLLOW_DIR), label or Path(path).name)
    except OSError as e:
        raise NotFoundError(f"{label or Path(path).name} is not a directory: {e.strerror}",
                            "give an encoder directory") from None


def open_under_root(root: Path, given: str) -> EncoderDir:
    """Open the encoder directory ``given`` names under ``root``, following no link on the way.

    A path that cannot name an encoder directory under the root (outside it, through a link,
    a component longer than a file name can be, no manifest) is "not found": 404.

    Args:
        root: the server's ``--encoders-root`` (configured by the operator: trusted).
        given: the path from the request, relative to the root (or absolute inside it).

    Returns:
        The open directory, labelled with the path relative to the root.
    """
    if "\x00" in given:
        raise InvalidInputError("the path contains a NUL byte", "give a plain directory path")
    p = PurePath(given)
    if ".." in p.parts:
        raise InvalidInputError(f"path {given!r} contains '..'",
                                "give the encoder directory relative to the encoders root")
    hint = "give the path of an encoder directory relative to the encoders root"
    too_long = next((part for part in p.parts if len(part.encode("utf-8", "surrogatepass")) > 255), None)
    if too_long is not None:
        raise NotFoundError(f"no encoder directory at {given!r}: a component is longer than 255 bytes", hint)
    root = Path(root)
    root_real = root.resolve()
    if p.is_absolute():
        for anchor in (root_real, root.absolute()):
            if p.is_relative_to(anchor):
                p = p.relative_to(anchor)
                break
        else:
            raise NotFoundError(f"path {given!r} is outside the encoders root",
                                "copy the encoder under the server's encoders root first")
    parts = [part for part in p.parts if part not in ("", ".")]
    label = "/".join(parts) or "."
    fd = os.open(root_real, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        for part in parts:
            try:
                nfd = os.open(part, _NOFOLLOW_DIR, dir_fd=fd)
            except OSError as e:
                if e.errno in (errno.ELOOP, errno.ENOTDIR):
                    raise NotFoundError(f"{label!r}: {part!r} is a link or not a directory (links are not "
                                        "followed under the encoders root)",
                                        "copy the encoder directory itself under the encoders root") from None
                raise NotFoundError(f"no encoder directory at {given!r} under the encoders root", hint) from None
            os.close(fd)
            fd = nfd
        try:
            st = os.stat(ENCODER_MANIFEST, dir_fd=fd, follow_symlinks=False)
        except (OSError, ValueError):
            st = None
        if st is None or not stat.S_ISREG(st.st_mode):
            raise NotFoundError(f"no encoder directory ({ENCODER_MANIFEST}) at {given!r} under the encoders root",
                                hint)
    except BaseException:
        os.close(fd)
        raise
    return EncoderDir(fd, label)


def _copy_file(src: EncoderDir, name: str, dst: Path) -> None:
    """Copy ``name`` of ``src`` (a regular file with one link, opened without following a link)."""
    where = f"{src.label}/{name}"
    try:
        fd = os.open(name, _NOFOLLOW_FILE, dir_fd=src.fd)
    except OSError as e:
        if e.errno == errno.ELOOP:
            raise InvalidInputError(f"{where} in the encoder directory is a link",
                                    "copy the real files into the encoder directory") from None
        raise IntegrityError(f"cannot read {where}: {e.strerror}", "copy the whole encoder directory again") from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise InvalidInputError(f"{where} is not a regular file", "re-export the encoder")
        if st.st_nlink > 1:
            # A hard link can make a file from outside the encoders root appear inside it
            # (the walk sees only names), so linked files are refused.
            raise InvalidInputError(f"{where} has {st.st_nlink} hard links",
                                    "copy the file into the encoder directory instead of linking it")
        os.set_blocking(fd, True)
        with os.fdopen(fd, "rb", closefd=False) as fin, open(dst / name, "xb") as fout:
            shutil.copyfileobj(fin, fout, 1 << 20)
    finally:
        os.close(fd)


def copy_encoder(src: EncoderDir, dst: Path) -> EncoderManifest:
    """Copy the manifest and the files it lists from the open directory ``src`` into ``dst``.

    The manifest is parsed from the copy, so what is checked is what was copied.

    Args:
        src: the open encoder directory.
        dst: an empty directory of the server's store (staging).

    Returns:
        The manifest (of the copy).
    """
    _copy_file(src, ENCODER_MANIFEST, dst)
    manifest = read_encoder_manifest(dst)
    for name in manifest.files:
        if "/" in name or "\\" in name or name in ("", ".", ".."):
            raise IntegrityError(f"{src.label}: manifest lists a bad file name {name!r}", "re-export the encoder")
        _copy_file(src, name, dst)
    return manifest


def keep_listed(directory: Path, manifest: EncoderManifest) -> None:
    """Delete what ``directory`` holds beyond the manifest and the files it lists (an archive
    may carry more): the store keeps exactly what was verified."""
    keep = {ENCODER_MANIFEST, *manifest.files}
    for p in Path(directory).iterdir():
        if p.name not in keep:
            shutil.rmtree(p) if p.is_dir() and not p.is_symlink() else p.unlink()


@contextmanager
def server_paths_hidden(labels: Mapping[Path, str]) -> Iterator[None]:
    """Rewrite the server's own paths in a :class:`QswapError` raised inside, to the names the
    caller knows (an admin error must not disclose the state dir's absolute path).

    Args:
        labels: server path -> what to show instead (longest paths are replaced first).
    """
    try:
        yield
    except QswapError as e:
        for path, label in sorted(labels.items(), key=lambda kv: -len(str(kv[0]))):
            for p in {str(path), str(Path(path).resolve())}:
                e.message = e.message.replace(p, label)
                e.hint = e.hint.replace(p, label)
        e.args = (e.message,)
        raise
