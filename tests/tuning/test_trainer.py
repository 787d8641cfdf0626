"""Early stopping, freezing (bit for bit), determinism and best-epoch restore."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from qswap.tuning.data import read_triplets
from qswap.tuning.doc_cache import DocTable
from qswap.tuning.losses import build_loss
from qswap.tuning.methods import MethodConfig, QueryTower, trainable_names
from qswap.tuning.trainer import EarlyStopping, EncodedSet, TrainConfig, train

FAST = dict(lr=3e-3, batch_size=8, epoch_batches=4, max_epochs=3, patience=3)


def test_improved_only_when_both_loss_and_errors_decrease():
    s = EarlyStopping(patience=2, best_loss=1.0, best_errors=10)
    assert not s.update(1, 0.9, 10)          # loss down, errors equal: idle
    assert not s.update(2, 1.1, 5)           # errors down, loss up: idle
    assert s.should_stop and s.best_epoch == 0


def test_idle_count_resets_on_improvement_and_best_is_kept():
    s = EarlyStopping(patience=2, best_loss=1.0, best_errors=10)
    assert not s.update(1, 1.0, 9)           # equal loss is not a decrease
    assert s.update(2, 0.8, 9)
    assert s.idle == 0 and s.best_epoch == 2 and (s.best_loss, s.best_errors) == (0.8, 9)
    assert not s.update(3, 0.7, 9)
    assert not s.should_stop
    assert not s.update(4, 0.6, 12)
    assert s.should_stop and s.best_epoch == 2


@pytest.fixture(scope="module")
def sets(tiny_base, tuning_data):
    samples = read_triplets(tuning_data["train"], require_negatives=True)
    table = DocTable()
    rows = [([table.add(t) for t in s.positives], [table.add(t) for t in s.negatives]) for s in samples]
    docs = torch.from_numpy(tiny_base.encode_documents(table.texts))

    def enc(lo, hi):
        part = rows[lo:hi]
        return EncodedSet([s.query for s in samples[lo:hi]], np.array([p[0] for p, _ in part]),
                          np.array([[n[0]] for _, n in part]), docs)
    return enc(0, 96), enc(96, 120)


def _params(model):
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def test_partial_freezes_the_embedding_block_bit_for_bit(tiny_base, sets):
    base_before = _params(tiny_base.model)
    tower = QueryTower(tiny_base, MethodConfig("partial"))
    before = _params(tower.model)
    res = train(tower, build_loss("triplet"), *sets, TrainConfig(**FAST), progress=False)
    after = _params(tower.model)
    emb = [n for n in before if n.startswith("embeddings.")]
    assert emb and all(torch.equal(before[n], after[n]) for n in emb)
    assert res.best_epoch > 0
    assert any(not torch.equal(before[n], after[n]) for n in before if n.startswith("encoder."))
    # the shared base (the document tower) never changes
    assert all(torch.equal(base_before[n], p) for n, p in tiny_base.model.named_parameters())


def test_freeze_output_dense_and_first_blocks(tiny_base, sets):
    cfg = MethodConfig("partial", freeze_output_dense=True, freeze_blocks=1)
    tower = QueryTower(tiny_base, cfg)
    before = _params(tower.model)
    train(tower, build_loss("triplet"), *sets, TrainConfig(**FAST), progress=False)
    after = _params(tower.model)
    frozen = [n for n in before if n.startswith("encoder.layer.0.") or n.endswith("layer.1.output.dense.weight")]
    assert "encoder.layer.1.output.dense.weight" in frozen
    assert all(torch.equal(before[n], after[n]) for n in frozen)
    assert not torch.equal(before["encoder.layer.1.intermediate.dense.weight"],
                           after["encoder.layer.1.intermediate.dense.weight"])
    assert not torch.equal(before["encoder.layer.1.attention.output.dense.weight"],
                           after["encoder.layer.1.attention.output.dense.weight"])


def test_bf16_fused_training_with_frozen_blocks_runs_backward_only_above_them(tiny_base, sets):
    tower = QueryTower(tiny_base, MethodConfig("partial", freeze_blocks=1))
    needs_grad: dict[int, list[bool]] = {0: [], 1: []}
    for i in (0, 1):
        tower.model.encoder.layer[i].register_forward_hook(
            lambda m, a, out, i=i: needs_grad[i].append((out[0] if isinstance(out, tuple) else out).requires_grad))
    before = _params(tower.model)
    cfg = TrainConfig(**{**FAST, "epoch_batches": 3, "max_epochs": 1}, precision="bf16", fused=True, dropout=False)
    res = train(tower, build_loss("triplet"), *sets, cfg, progress=False)
    assert res.steps == 3
    # No autograd graph below the first trainable block: backward stops there.
    assert needs_grad[0] and not any(needs_grad[0])
    assert any(needs_grad[1])
    changed = {n for n, p in tower.model.named_parameters() if not torch.equal(before[n], p)}
    assert changed and all(n.startswith("encoder.layer.1.") for n in changed)


def test_backward_reaches_the_first_block_for_bias_tuning(tiny_base, sets):
    tower = QueryTower(tiny_base, MethodConfig("bias"))
    needs_grad: list[bool] = []
    tower.model.encoder.layer[0].register_forward_hook(
        lambda m, a, out: needs_grad.append((out[0] if isinstance(out, tuple) else out).requires_grad))
    train(tower, build_loss("triplet"), *sets, TrainConfig(**{**FAST, "epoch_batches": 1, "max_epochs": 1}),
          progress=False)
    assert any(needs_grad)


def test_bias_method_changes_only_biases(tiny_base, sets):
    tower = QueryTower(tiny_base, MethodConfig("bias"))
    before = _params(tower.model)
    train(tower, build_loss("triplet"), *sets, TrainConfig(**{**FAST, "lr": 1e-2}), progress=False)
    after = _params(tower.model)
    changed = [n for n in before if not torch.equal(before[n], after[n])]
    assert changed and all(n.endswith(".bias") for n in changed)
    assert set(changed) <= set(trainable_names(tiny_base.model, MethodConfig("bias")))


def test_lora_leaves_every_base_tensor_unchanged(tiny_base, sets):
    tower = QueryTower(tiny_base, MethodConfig("lora", lora_rank=4))
    base_before = _params(tiny_base.model)
    train(tower, build_loss("triplet"), *sets, TrainConfig(**{**FAST, "lr": 1e-2}), progress=False)
    changed = [n for n, p in tower.model.named_parameters() if "lora_" not in n
               and not torch.equal(p, base_before[n.replace("base_model.model.", "").replace(".base_layer", "")])]
    assert changed == []
    assert all(n.startswith("base_model") and "lora_" in n for n, _ in tower.trainable_parameters())


def test_same_seed_same_weights(tiny_base, sets):
    def run(seed):
        tower = QueryTower(tiny_base, MethodConfig("partial"))
        train(tower, build_loss("triplet"), *sets, TrainConfig(**{**FAST, "max_epochs": 1, "seed": seed}),
              progress=False)
        return tower.trainable_state()
    a, b, c = run(0), run(0), run(1)
    assert all(torch.equal(a[n], b[n]) for n in a)
    assert any(not torch.equal(a[n], c[n]) for n in a)


def test_the_best_epoch_is_kept(tiny_base, sets):
    from qswap.tuning.trainer import validate
    tower = QueryTower(tiny_base, MethodConfig("full"))
    loss = build_loss("triplet")
    res = train(tower, loss, *sets, TrainConfig(**{**FAST, "lr": 3e-2, "max_epochs": 5, "patience": 5}),
                progress=False)
    best = res.history[res.best_epoch]
    v_loss, v_err, _ = validate(tower, loss, sets[1], FAST["batch_size"])
    assert (v_loss, v_err) == (pytest.approx(best.val_loss, abs=1e-6), best.val_errors)
    assert [h.epoch for h in res.history] == list(range(len(res.history)))
    assert sum(h.improved for h in res.history) >= 1


def test_nothing_improves_at_a_tiny_rate_and_the_tower_is_the_base(tiny_base, sets):
    tower = QueryTower(tiny_base, MethodConfig("partial"))
    start = tower.trainable_state()
    res = train(tower, build_loss("triplet"), *sets,
                TrainConfig(**{**FAST, "lr": 1e-12, "patience": 2, "max_epochs": 5}), progress=False)
    assert res.best_epoch == 0 and res.stopped == "patience" and len(res.history) == 3
    assert all(torch.equal(start[n], t) for n, t in tower.trainable_state().items())


def test_error_count_falls_back_to_in_batch_positives():
    from qswap.tuning.losses import LossInput
    from qswap.tuning.trainer import count_errors
    q = torch.tensor([[1.0, 0.0], [0.0, 1.0], [0.6, 0.8]])
    p = torch.tensor([[1.0, 0.0], [1.0, 0.0], [0.0, 1.0]])
    no_neg = LossInput(q, p, torch.zeros(3, 1, 2), torch.zeros(3, 1, dtype=torch.bool))
    # own positives score 1, 0, .8; errors: q1 vs p2 (1 >= 1), q2 vs p1 (0 >= 0) and vs p3 (1 >= 0)
    assert count_errors(no_neg, "cos") == (3, 6)
    # p1 and p2 are one document (same id): not negatives of each other's query
    ids = LossInput(q, p, pos_ids=torch.tensor([0, 0, 1]))
    assert count_errors(ids, "cos") == (1, 4)
