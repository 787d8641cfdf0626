"""What operators' tools expect: JSON log lines with ISO 8601 times and nothing else on stderr
(library warnings included), the standard process_* metrics, counters typed as counters."""

from __future__ import annotations

import json
import logging
import re
import subprocess
import sys
import warnings
from datetime import datetime

import pytest

from qswap.server.http.logs import JsonFormatter, configure_logging
from qswap.server.http.metrics import Metrics


def test_log_time_is_iso_8601_utc():
    record = logging.LogRecord("qswap.server", logging.INFO, __file__, 1, "hello", None, None)
    line = json.loads(JsonFormatter().format(record))
    ts = datetime.fromisoformat(line["ts"].replace("Z", "+00:00"))
    assert line["ts"].endswith("Z") and abs(ts.timestamp() - record.created) < 1e-5


@pytest.fixture
def restore_logging():
    root = logging.getLogger()
    saved = (list(root.handlers), root.level)
    libs = {n: (list(logging.getLogger(n).handlers), logging.getLogger(n).propagate) for n in ("transformers",)}
    yield
    logging.captureWarnings(False)
    root.handlers[:], _ = saved[0], root.setLevel(saved[1])
    for n, (handlers, propagate) in libs.items():
        logging.getLogger(n).handlers[:] = handlers
        logging.getLogger(n).propagate = propagate


def test_library_warnings_and_logs_are_json_lines(capsys, restore_logging):
    from transformers.utils import logging as hf_logging
    configure_logging(json_lines=True)
    hf_logging.set_verbosity_warning()   # another test may have quietened transformers
    with warnings.catch_warnings():
        warnings.simplefilter("always")
        warnings.warn("a library's deprecation", UserWarning)
    hf_logging.get_logger("transformers.modeling_utils").warning("a transformers warning")
    lines = [ln for ln in capsys.readouterr().err.splitlines() if ln.strip()]
    parsed = [json.loads(ln) for ln in lines]   # every line is one JSON object
    assert any("a library's deprecation" in p["msg"] and p["logger"] == "py.warnings" for p in parsed), lines
    assert any(p["msg"] == "a transformers warning" and p["level"] == "warning" for p in parsed), lines


def test_transformers_imported_after_the_set_up_logs_json_lines():
    """The set-up does not import transformers (a second of every start); when something imports
    it later, its records still come out as JSON lines through the one handler."""
    script = """
import logging, sys
from qswap.server.http.logs import configure_logging
configure_logging(json_lines=True)
assert "transformers" not in sys.modules, "the logging set-up imported transformers"
from transformers.utils import logging as hf_logging
hf_logging.set_verbosity_warning()
hf_logging.get_logger("transformers.modeling_utils").warning("a transformers warning")
assert logging.getLogger("transformers").handlers == []
"""
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-3000:]
    parsed = [json.loads(ln) for ln in out.stderr.splitlines() if ln.strip()]   # every line is one JSON object
    assert any(p["msg"] == "a transformers warning" and p["logger"] == "transformers.modeling_utils"
               for p in parsed), out.stderr


def test_process_metrics_and_a_dropped_counter():
    m = Metrics()
    m.capture_dropped.set_function(lambda: 3)
    text = m.render()[0].decode()
    assert "process_resident_memory_bytes" in text and "python_info" in text
    assert re.search(r"# TYPE qswap_capture_dropped(_total)? counter", text)
    assert "qswap_capture_dropped_total 3.0" in text
