"""Every runnable snippet of the README and the docs runs; every other one says why it cannot.

The runnable blocks of one file run in document order in one bash process, in an empty folder,
with ``qswap`` on the ``PATH`` as the README says to put it: the files a page reads, it makes
itself (``qswap demo``). Two substitutions make them run here, and only these:

- ``export QSWAP_MODEL=multilingual-e5-small`` names a tiny random-weight model folder instead
  (the real model would take minutes to embed with; the commands are the same);
- ``localhost:8000`` becomes a free port, which ``qswap serve`` reads from ``QSWAP_PORT``.

A server a snippet starts in the background is stopped with the snippets' process group.
"""

from __future__ import annotations

import os
import shlex
import signal
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from .snippets import REPO, Snippet, markdown_files, snippets

MODEL_LINE = "export QSWAP_MODEL=multilingual-e5-small"
ALL = [s for p in markdown_files() for s in snippets(p)]
RUNNABLE_FILES = sorted({s.path for s in ALL if s.marker == "run"})


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _script(blocks: list[Snippet], model: Path, port: int) -> str:
    parts = ["set -euo pipefail"]
    for s in blocks:
        code = s.code.replace(MODEL_LINE, f"export QSWAP_MODEL={shlex.quote(str(model))}")
        code = code.replace("localhost:8000", f"localhost:{port}")
        parts.append(f"echo '>>> {s.where}'")
        parts.append(f"python - <<'QSWAP_SNIPPET_PY'\n{code}QSWAP_SNIPPET_PY" if s.is_python else code)
    return "\n".join(parts) + "\n"


def test_every_code_block_is_marked() -> None:
    unmarked = [s.where for s in ALL if s.marker is None]
    assert not unmarked, ("code blocks without <!-- run --> or <!-- no-run: REASON --> on the line "
                          f"before the fence: {unmarked}")
    no_reason = [s.where for s in ALL if s.marker == "no-run" and len(s.reason) < 8]
    assert not no_reason, f"no-run blocks must say why they cannot run: {no_reason}"


def test_the_readme_tour_is_run() -> None:
    """The README's tour of the main jobs is among what runs (a guard against marking it all no-run)."""
    readme = [s for s in ALL if s.path == REPO / "README.md" and s.marker == "run"]
    text = "".join(s.code for s in readme)
    for job in ("qswap demo", "qswap index build", "qswap tune run", "qswap sentinels make", "qswap serve",
                "/v1/encoders", "/v1/aliases/", "/v1/search", "/v1/info"):
        assert job in text, f"the README's runnable tour lacks {job}"
    assert MODEL_LINE in text


@pytest.mark.parametrize("path", RUNNABLE_FILES, ids=lambda p: str(p.relative_to(REPO)))
def test_runnable_snippets_run(path: Path, tmp_path: Path, tiny_model_dir: Path) -> None:
    blocks = [s for s in snippets(path) if s.marker == "run"]
    port = _free_port()
    script = _script(blocks, tiny_model_dir, port)
    assert "multilingual-e5-small" not in script.replace(MODEL_LINE, ""), \
        "a runnable snippet would load the real bundled model: name the base through $QSWAP_MODEL"
    work = tmp_path / "work"
    work.mkdir()
    bindir = str(Path(sys.executable).parent)
    env = {**os.environ, "QSWAP_DATA_DIR": str(tmp_path / "data"), "QSWAP_PORT": str(port),
           "PATH": bindir + os.pathsep + os.environ.get("PATH", ""), "QSWAP_LOG_JSON": "false"}
    env.pop("QSWAP_ADMIN_TOKEN", None)
    log = tmp_path / "snippets.log"
    # Output to a file, not a pipe: a server left in the background would hold a pipe open.
    with open(log, "w") as f:
        proc = subprocess.Popen(["bash", "-c", script], cwd=work, env=env, stdout=f,
                                stderr=subprocess.STDOUT, start_new_session=True)
        try:
            proc.wait(timeout=420)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        finally:
            try:        # a server a snippet left in the background
                os.killpg(proc.pid, signal.SIGTERM)
            except ProcessLookupError:
                pass
    out = log.read_text(errors="replace")
    assert proc.returncode == 0, f"{path.name}: a snippet failed (exit {proc.returncode})\n{out[-8000:]}"
    assert "Traceback" not in out, out[-8000:]
    for s in blocks:
        assert f">>> {s.where}" in out, f"{s.where} did not run"
