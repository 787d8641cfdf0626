"""Documents embedded at different precisions never mix in one index: the manifest records
the precision (and its measured quality), a resumed build of another precision starts over,
and `qswap index add` refuses another precision."""

from __future__ import annotations

import pytest

from qswap.encoders.runtime.embedder import Embedder, document_embedder
from qswap.index import IndexConfig, build_index, cli
from qswap.index.build import staging_dir
from qswap.index.manifest import documents_precision, require_precision
from qswap.errors import ConflictError

BF16 = {"precision": "bf16", "runtime": "torch", "quality": {"min_cosine": 0.99997, "recall_at_10": 0.998}}


class Interrupt(Exception):
    pass


def test_manifest_records_precision(tmp_path, corpus, space, embed):
    with build_index(corpus, tmp_path / "idx", embed, space, progress=False, embedding=BF16) as idx:
        assert idx.manifest["build"]["embedding"] == BF16
        assert idx.info()["build"]["embedding"]["quality"]["min_cosine"] == 0.99997
        assert documents_precision(idx.manifest["build"]) == "bf16"
    assert documents_precision({}) == "fp32"   # indexes from before the record: all fp32
    with pytest.raises(ConflictError, match="embedded at bf16"):
        require_precision({"embedding": BF16}, "fp32")


def test_resume_with_another_precision_starts_over(tmp_path, corpus, space, embed):
    cfg = IndexConfig(batch_size=8, chunk_rows=32)
    calls = {"n": 0}

    def dying(texts):
        calls["n"] += 1
        if calls["n"] > 9:
            raise Interrupt()
        return embed(texts)

    with pytest.raises(Interrupt):
        build_index(corpus, tmp_path / "idx", dying, space, cfg, progress=False)
    assert list((staging_dir(tmp_path / "idx") / "chunks").glob("*.f16"))
    seen: list[str] = []

    def counting(texts):
        seen.extend(texts)
        return embed(texts)

    with build_index(corpus, tmp_path / "idx", counting, space, cfg, progress=False, embedding=BF16) as idx:
        assert len(seen) == 150                      # nothing of the fp32 run was reused
        assert idx.manifest["build"]["runs"] == 1 and idx.manifest["build"]["embedding"]["precision"] == "bf16"


@pytest.fixture
def precise_model(monkeypatch, space, embed):
    loaded: list[tuple[str, str]] = []

    def load(model, precision="fp32", runtime=None, threads=None):
        loaded.append((model, precision))
        return Embedder(model, space, embed, embed, {"precision": precision, "runtime": runtime or ("onnx" if precision == "fp32" else "torch")})

    monkeypatch.setattr(cli, "load_embedder", load)
    return loaded


def test_cli_add_keeps_the_index_precision(tmp_path, corpus, jsonl, capsys, precise_model):
    out = tmp_path / "idx"
    assert cli.main(["index", "build", str(corpus), "--out", str(out), "--no-progress", "--precision", "bf16"]) == 0
    new = jsonl(tmp_path / "new.jsonl", [{"id": "n1", "text": "fresh one"}])
    capsys.readouterr()
    code = cli.main(["index", "add", str(out), str(new), "--precision", "fp32"])
    err = capsys.readouterr().err
    assert code == 2 and "embedded at bf16" in err and len(err.strip().splitlines()) == 1 and "Traceback" not in err
    assert precise_model[-1] == ("multilingual-e5-small", "bf16")    # refused before loading another tower
    assert cli.main(["index", "add", str(out), str(new)]) == 0         # default: the index's own precision
    assert precise_model[-1][1] == "bf16"
    capsys.readouterr()
    assert cli.main(["index", "info", str(out)]) == 0
    assert "documents embedded at bf16 on torch" in capsys.readouterr().out


def test_load_embedder_uses_the_document_tower(tiny_model_dir):
    from qswap.encoders.runtime.documents import DocumentEncoder
    emb = cli.load_embedder(str(tiny_model_dir), precision="bf16")
    assert isinstance(emb.documents, DocumentEncoder) and emb.record["precision"] == "bf16"
    ray_embed = document_embedder(str(tiny_model_dir), "fp32", None, 1)   # what each Ray actor builds
    assert isinstance(ray_embed, DocumentEncoder) and ray_embed.threads == 1 and ray_embed.runtime == "onnx"
