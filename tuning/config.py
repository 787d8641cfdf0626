"""What a tuning run takes (:class:`RunConfig`, ``qswap tune run``'s options) and returns."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from qswap import DEFAULT_MODEL
from qswap.tuning.losses import build_loss
from qswap.tuning.methods import MethodConfig
from qswap.tuning.run_report import RunReport
from qswap.tuning.trainer import TrainConfig

from qswap.tuning.choices import MINE_CHOICES, QUERY_RUNTIMES
SEEN_QUERIES = "training_queries.json"   # ids of the train + validation queries, in the encoder directory


@dataclass
class LossConfig:
    """Which loss and its options (see :func:`qswap.tuning.losses.build_loss`)."""

    kind: str = "triplet"
    metric: str = "cos"
    margin: float = 0.1
    temperature: float | None = None
    in_batch: bool = True
    bidirectional: bool = False
    doc_side: bool = False
    pair_alpha: float = 0.1
    matryoshka_dims: list[int] = field(default_factory=list)

    def build(self) -> Any:
        """The loss these options describe."""
        return build_loss(self.kind, metric=self.metric, margin=self.margin, temperature=self.temperature,
                          in_batch=self.in_batch, bidirectional=self.bidirectional, doc_side=self.doc_side,
                          pair_alpha=self.pair_alpha, matryoshka_dims=self.matryoshka_dims or None)


@dataclass
class RunConfig:
    """Everything ``qswap tune run`` takes."""

    out: Path
    base: str = DEFAULT_MODEL
    train_file: Path | None = None          # triplets JSONL
    beir_dir: Path | None = None            # or a BEIR directory (queries -> relevant docs)
    lang: str | None = None                 # BEIR training language ("en" when per-language files)
    validation: float = 0.1                 # fraction (< 1) or count
    test: float = 0.1
    max_samples: int | None = None
    index: str | Path | None = None         # a qswap index (folder or milvus://) of the base's space
    mine: str = "auto"                      # auto | corpus | index | none (see _mining_source)
    mine_k: int = 30
    negatives: int = 1                      # negatives per query used in training
    fn_cutoff: float = 0.95
    method: MethodConfig = field(default_factory=MethodConfig)
    loss: LossConfig = field(default_factory=LossConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    eval_langs: list[str] = field(default_factory=list)
    sentinels: list[str] = field(default_factory=list)
    name: str | None = None
    version: str = "1"
    cache_dir: Path | None = None
    device: str | None = None
    progress: bool = True
    register_url: str | None = None
    token: str | None = None
    force: bool = False
    query_runtime: str = "onnx"             # onnx: the serving path's fast runtime; torch: the reference
    export_dir: Path | None = None          # ONNX export cache (default <data dir>/onnx-cache)
    recipe: dict[str, Any] | None = None    # the recipe's name and the settings it resolved to (report.json)

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d.pop("token", None)   # never write a credential into a report
        return {k: str(v) if isinstance(v, Path) else v for k, v in d.items()}


@dataclass
class RunResult:
    """What a run wrote: the encoder directory, its report, and the server's answer when it registered it."""

    encoder_dir: Path
    report: RunReport
    registration: dict[str, Any] | None = None
