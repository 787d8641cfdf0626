"""Reading apt's package lists: locating, decompressing and parsing deb822 stanzas.

apt stores what ``apt-get update`` fetched under ``/var/lib/apt/lists`` as one file per
index, named after the URL (``..._main_binary-amd64_Packages.lz4``,
``..._main_i18n_Translation-de.lz4``), plain or compressed depending on the apt set-up.
Both kinds are deb822 files: stanzas of ``Field: value`` lines separated by blank lines,
with continuation lines starting with a space.
"""

from __future__ import annotations

import bz2
import gzip
import lzma
import re
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import IO

from qswap.errors import InvalidInputError, NotFoundError

DEFAULT_LISTS_DIR = Path("/var/lib/apt/lists")

#: The command that fetches the lists this module reads (English plus three translations).
APT_UPDATE_COMMAND = 'apt-get -o Acquire::Languages="en,de,fr,it" update'


def apt_update_command(langs: tuple[str, ...] | list[str] = ("en", "de", "fr", "it")) -> str:
    """The ``apt-get update`` command that fetches Translation lists for ``langs`` (English always)."""
    langs = ["en", *(lang for lang in langs if lang != "en")]
    return f'apt-get -o Acquire::Languages="{",".join(langs)}" update'

_COMPRESSED = r"(?:\.(?:lz4|gz|xz|bz2|zst))?"
_PACKAGES_RE = re.compile(rf"_Packages{_COMPRESSED}$")


def _translation_re(lang: str) -> re.Pattern[str]:
    return re.compile(rf"_i18n_Translation-{re.escape(lang)}{_COMPRESSED}$")


def find_packages_files(lists_dir: Path) -> list[Path]:
    """Every ``Packages`` index in ``lists_dir``, sorted by name (the order stanzas are read in)."""
    return sorted(p for p in Path(lists_dir).iterdir() if p.is_file() and _PACKAGES_RE.search(p.name))


def find_translation_files(lists_dir: Path, lang: str) -> list[Path]:
    """Every ``Translation-<lang>`` index in ``lists_dir``, sorted by name."""
    pattern = _translation_re(lang)
    return sorted(p for p in Path(lists_dir).iterdir() if p.is_file() and pattern.search(p.name))


def find_release_files(lists_dir: Path) -> list[Path]:
    """The ``InRelease``/``Release`` files (suite, codename, date of the snapshot)."""
    return sorted(
        p for p in Path(lists_dir).iterdir() if p.is_file() and p.name.endswith(("_InRelease", "_Release"))
    )


def _lz4_stream(path: Path) -> Iterator[bytes]:
    """Lines of an lz4 file: the ``lz4`` Python package if installed, else the ``lz4cat`` program."""
    try:
        import lz4.frame  # type: ignore[import-not-found]
    except ImportError:
        lz4cat = shutil.which("lz4cat")
        if lz4cat is None:
            raise NotFoundError(
                f"cannot decompress {path}: neither the Python package 'lz4' nor the program 'lz4cat' is installed",
                "pip install lz4, or apt-get install lz4",
            ) from None
        yield from _program_stream([lz4cat, str(path)], path)
        return
    try:
        with lz4.frame.open(path, "rb") as f:
            yield from f
    except RuntimeError as e:  # lz4.frame reports corrupt frames as RuntimeError
        raise InvalidInputError(f"{path}: corrupt lz4 data ({e})", f"delete it and run: {APT_UPDATE_COMMAND}") from e


def _program_stream(cmd: list[str], path: Path) -> Iterator[bytes]:
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    assert proc.stdout is not None and proc.stderr is not None
    try:
        yield from proc.stdout
    finally:
        proc.stdout.close()
        err = proc.stderr.read().decode(errors="replace").strip()
        proc.stderr.close()
        rc = proc.wait()
    if rc != 0:
        raise InvalidInputError(
            f"{path}: {Path(cmd[0]).name} failed with status {rc}: {err.splitlines()[-1] if err else 'no message'}",
            f"the file is corrupt or truncated; delete it and run: {APT_UPDATE_COMMAND}",
        )


def _open_python(path: Path) -> IO[bytes]:
    suffix = path.suffix
    if suffix == ".gz":
        return gzip.open(path, "rb")
    if suffix == ".xz":
        return lzma.open(path, "rb")
    if suffix == ".bz2":
        return bz2.open(path, "rb")
    return open(path, "rb")


def iter_lines(path: Path) -> Iterator[bytes]:
    """Raw lines of a list file, decompressed according to its suffix (lz4, gz, xz, bz2, zst, none)."""
    path = Path(path)
    if path.suffix == ".lz4":
        yield from _lz4_stream(path)
        return
    if path.suffix == ".zst":
        zstd = shutil.which("zstd")
        if zstd is None:
            raise NotFoundError(f"cannot decompress {path}: the program 'zstd' is not installed", "apt-get install zstd")
        yield from _program_stream([zstd, "-dc", str(path)], path)
        return
    try:
        with _open_python(path) as f:
            yield from f
    except (OSError, EOFError, lzma.LZMAError) as e:
        raise InvalidInputError(
            f"{path}: cannot decompress ({e})", f"the file is corrupt or truncated; delete it and run: {APT_UPDATE_COMMAND}"
        ) from e


def iter_stanzas(path: Path) -> Iterator[dict[str, str]]:
    """Parse a deb822 list file into dicts ``field -> value``.

    Multi-line values keep their continuation lines verbatim (leading space included),
    joined with ``\\n``, so :func:`split_description` can apply Debian's description rules.
    Raises :class:`InvalidInputError` with the line number for lines that are not deb822.
    """
    fields: dict[str, str] = {}
    last: str | None = None
    lineno = 0
    for lineno, raw in enumerate(iter_lines(path), start=1):
        try:
            line = raw.decode("utf-8").rstrip("\r\n")
        except UnicodeDecodeError as e:
            raise InvalidInputError(
                f"{path}:{lineno}: not UTF-8 ({e.reason})", f"Debian lists are UTF-8; delete the file and run: {APT_UPDATE_COMMAND}"
            ) from e
        if not line.strip(" \t"):  # ASCII only: a translated line of just U+00A0 is content
            if fields:
                yield fields
            fields, last = {}, None
            continue
        if line[0] in " \t":
            if last is None:
                raise InvalidInputError(
                    f"{path}:{lineno}: continuation line outside a field", "a deb822 stanza must start with 'Field: value'"
                )
            fields[last] += "\n" + line
            continue
        name, sep, value = line.partition(":")
        if not sep or not name or " " in name:
            raise InvalidInputError(f"{path}:{lineno}: expected 'Field: value', got {line[:60]!r}", "is this a deb822 list file?")
        last = name
        fields[name] = value.strip()
    if fields:
        yield fields


def split_description(value: str) -> tuple[str, str]:
    """Split a ``Description`` field into (short description, long description as plain text).

    Debian rules (Policy 5.6.13): the first line is the synopsis; each following line starts
    with one space; a line of `` .`` separates paragraphs; lines starting with two spaces are
    shown verbatim (lists, code). Ordinary lines are joined into one line per paragraph,
    verbatim lines keep their own line, paragraphs are separated by a blank line.
    """
    first, _, rest = value.partition("\n")
    paragraphs: list[str] = []
    current: list[str] = []
    flowing = False  # whether the last piece of `current` is an ordinary (re-flowable) line
    for raw in rest.split("\n") if rest else []:
        line = raw[1:] if raw[:1] in (" ", "\t") else raw
        if line.strip() == ".":
            if current:
                paragraphs.append("".join(current).strip("\n"))
            current, flowing = [], False
        elif line[:1] in (" ", "\t"):
            # Verbatim: keep the line, minus the one extra space that marks it as verbatim.
            current.append(("\n" if current else "") + line[1:].rstrip())
            flowing = False
        else:
            text = line.strip()
            if not text:
                continue
            current.append((" " if flowing else "\n" if current else "") + text)
            flowing = True
    if current:
        paragraphs.append("".join(current).strip("\n"))
    return first.strip(), "\n\n".join(p for p in paragraphs if p)


def normalise_text(text: str) -> str:
    """Case- and whitespace-insensitive form of a text, used as the key that folds duplicates."""
    return " ".join(text.lower().split())


def read_release_info(lists_dir: Path) -> list[dict[str, str]]:
    """Origin, suite, codename and date of each release file: where and when the lists are from."""
    out = []
    for path in find_release_files(lists_dir):
        info = {"file": path.name}
        try:
            text = path.read_text(encoding="utf-8", errors="replace")
        except OSError:
            continue
        for line in text.splitlines():
            if not line.strip() or line.startswith("-----BEGIN PGP SIGNED"):
                continue
            key, sep, value = line.partition(":")
            if key in ("Origin", "Suite", "Codename", "Version", "Date") and sep:
                info[key.lower()] = value.strip()
            if key in ("MD5Sum", "SHA256"):
                break
        out.append(info)
    return out
