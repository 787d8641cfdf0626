"""The "most changed layers" diagnostic (paper tables 14-15)."""

from __future__ import annotations

import pytest
import torch

from qswap.tuning.layers import changes_report, layer_changes, most_changed


def test_changes_by_hand():
    orig = {"encoder.layer.3.output.dense.weight": torch.tensor([1.0, 2.0]),
            "encoder.layer.1.intermediate.dense.bias": torch.tensor([0.5, 1.0]),
            "encoder.layer.0.output.dense.bias": torch.tensor([3.0, 4.0])}
    tuned = {"encoder.layer.3.output.dense.weight": torch.tensor([1.0, 3.0]),     # max 2 -> 3
             "encoder.layer.1.intermediate.dense.bias": torch.tensor([0.5, 1.5]),  # max 1 -> 1.5
             "encoder.layer.0.output.dense.bias": torch.tensor([3.0, 4.0])}        # unchanged
    ch = {c.name: c for c in layer_changes(orig, tuned)}
    assert set(ch) == {"encoder.layer.3.output.dense.weight", "encoder.layer.1.intermediate.dense.bias"}
    w = ch["encoder.layer.3.output.dense.weight"]
    assert w.max_weight == 3.0 and w.relative_max_change == pytest.approx((3 - 2) / (3 + 2))
    assert w.max_abs_change == 1.0 and w.relative_norm_change == pytest.approx(1 / 5 ** 0.5)
    top = most_changed(list(ch.values()), top=1)
    assert top["max_weight"] == [{"layer": "3.output.dense.weight", "max_weight": 3.0}]
    assert top["relative_max_change"][0]["layer"] == "3.output.dense.weight"     # 0.2 vs 0.2
    rep = changes_report(orig, tuned)
    assert rep["changed_tensors"] == 2 and rep["compared_tensors"] == 3


def test_zero_original_has_no_relative_norm():
    c = layer_changes({"b": torch.zeros(2)}, {"b": torch.tensor([0.0, 1.0])})[0]
    assert c.relative_norm_change is None
    assert most_changed([c])["relative_norm_change"] == []
