"""Code blocks of README.md and docs/*.md: each ``bash``/``python`` block is marked, and the runnable ones run.

A block's marker is the HTML comment on the line before its fence (invisible on GitHub and in the site):

- ``<!-- run -->``: the block runs as written, in document order with the file's other runnable
  blocks, in one shell, in a fresh folder (see ``tests/docs/test_snippets.py`` for the set-up);
- ``<!-- no-run: REASON -->``: it cannot run in the test suite (a cluster, a GPU, a foreground
  server, hub data ...), and REASON says why.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
#: Languages of blocks that could be run; other fences (yaml, json, text) are examples of data.
CODE_LANGS = {"bash", "sh", "shell", "console", "python", "py", "python3"}
FENCE = re.compile(r"^(?P<indent> *)(?P<fence>```+|~~~+)\s*(?P<lang>[\w+-]*)[^\n]*$")
MARKER = re.compile(r"^\s*<!--\s*(?P<kind>run|no-run)\s*(?::\s*(?P<reason>.*?))?\s*-->\s*$")


@dataclass(frozen=True)
class Snippet:
    """One fenced code block of a Markdown file."""

    path: Path
    line: int            # 1-based line of the opening fence
    lang: str
    code: str
    marker: str | None   # "run", "no-run" or None (unmarked)
    reason: str

    @property
    def where(self) -> str:
        return f"{self.path.relative_to(REPO)}:{self.line}"

    @property
    def is_python(self) -> bool:
        return self.lang in ("python", "py", "python3")


def markdown_files() -> list[Path]:
    """README.md and every Markdown page of the docs site."""
    return [REPO / "README.md", *sorted((REPO / "docs").rglob("*.md"))]


def snippets(path: Path) -> list[Snippet]:
    """The code blocks of ``path`` in a language that could run, with their markers."""
    lines = path.read_text(encoding="utf-8").splitlines()
    out: list[Snippet] = []
    i = 0
    while i < len(lines):
        m = FENCE.match(lines[i])
        if not m:
            i += 1
            continue
        fence, indent, lang = m["fence"], len(m["indent"]), m["lang"].lower()
        j = i + 1
        while j < len(lines) and not lines[j].strip().startswith(fence):
            j += 1
        if lang in CODE_LANGS:
            k = i - 1
            while k >= 0 and not lines[k].strip():
                k -= 1
            mk = MARKER.match(lines[k]) if k >= 0 else None
            code = "\n".join(x[indent:] for x in lines[i + 1:j]) + "\n"
            out.append(Snippet(path, i + 1, lang, code, mk["kind"] if mk else None,
                               (mk["reason"] or "").strip() if mk else ""))
        i = j + 1
    return out
