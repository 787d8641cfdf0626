"""Progress lines when stderr is not a terminal (logs, CI): never silent for minutes."""

from __future__ import annotations

import numpy as np

from qswap.tuning.progress import Progress, encode_with_progress


def test_lines_without_a_terminal(capsys):
    p = Progress(10, "mining", "queries", every_s=0.0)
    for _ in range(5):
        p.update(2)
    p.close()
    err = capsys.readouterr().err.splitlines()
    assert err[0].startswith("qswap: mining: 2/10 queries (") and "s left)" in err[0]
    assert len(err) == 5 and err[-1].startswith("qswap: mining: 10 queries in ")


def test_encode_with_progress_keeps_order_and_reports(capsys):
    texts = [str(i) for i in range(600)]
    out = encode_with_progress(lambda t: np.array([[float(x)] for x in t]), texts, "encoding", chunk=256)
    assert out[:, 0].tolist() == [float(i) for i in range(600)]
    assert "qswap: encoding: 600 queries in" in capsys.readouterr().err
    assert encode_with_progress(lambda t: np.zeros((len(t), 1)), texts, "quiet", enabled=False).shape == (600, 1)
    assert capsys.readouterr().err == ""
