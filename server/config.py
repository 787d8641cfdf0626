"""Server settings: one pydantic-settings model, read from ``QSWAP_*`` environment variables.

Command-line flags of ``qswap serve`` override the environment; everything has a default so
that ``qswap serve`` alone serves the bundled model over the demo index.
"""

from __future__ import annotations

import ipaddress
from pathlib import Path
from typing import Literal

from pydantic import Field, SecretStr, model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from qswap import DEFAULT_MODEL
from qswap.encoders.runtime.hot import DEFAULT_HOT
from qswap.errors import InvalidInputError
from qswap.factors import SERVING_FACTORS
from qswap.paths import data_dir

MIN_TOKEN_CHARS = 16
_LOOPBACK_NAMES = ("localhost", "localhost.localdomain", "ip6-localhost")


def is_loopback(host: str) -> bool:
    """True for 127.0.0.0/8, ::1 and the usual localhost names."""
    if host in _LOOPBACK_NAMES:
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def device_is_cuda(device: str | None) -> bool:
    """Whether the base model will run on a GPU: ``device`` names one, or none is named and torch
    sees one (:func:`qswap.encoders.base.load_base`'s default)."""
    if device is not None:
        return str(device).split(":")[0] == "cuda"
    import torch   # only here: the settings module is imported by light tools (the CLI's help)
    return torch.cuda.is_available()


class ServerSettings(BaseSettings):
    """Everything ``qswap serve`` can be told. Environment: ``QSWAP_<FIELD>`` (e.g. ``QSWAP_ADMIN_TOKEN``)."""

    model_config = SettingsConfigDict(env_prefix="QSWAP_", extra="ignore")

    # -- what is served
    host: str = "127.0.0.1"
    port: int = Field(8000, ge=0, le=65535)
    index: Path | str | None = Field(None, description="index directory or milvus://URI?collection=NAME; none = "
                                                       "the demo index (built on first start)")
    read_only_index: bool = Field(False, description="open the index read-only (no document changes; "
                                                     "other processes may write it)")
    model: str = Field(DEFAULT_MODEL, description="base model: bundled name or local model directory")
    device: str | None = Field(None, description="torch device (default: cuda if present, else cpu)")
    default_encoder: str = Field("base", description="encoder used when a request names none "
                                                     "(an alias named 'default' overrides it)")
    # -- where state lives
    state_dir: Path = Field(default_factory=lambda: data_dir() / "server",
                            description="registry file and the server's own copies of encoders")
    encoders_root: Path | None = Field(None, description="register-by-path is allowed only inside this directory")
    sentinels: Path | None = Field(None, description="sentinel sets over the served index (one folder each: "
                                   "queries.jsonl + qrels/test.tsv); every registration is evaluated on them")
    guard_alpha: float = Field(0.05, gt=0, lt=1, description="significance level of the server's guard "
                                                             "(Holm-adjusted, over the sentinels)")
    guard_min_queries: int = Field(20, ge=1, description="judged queries a sentinel needs left in the index "
                                   "to judge an encoder; fewer: verdict 'insufficient_evidence'")
    # -- security
    admin_token: SecretStr | None = Field(None, description="bearer token for admin routes")
    search_token: SecretStr | None = Field(None, description="bearer token for search (none = open search)")
    metrics_token: SecretStr | None = Field(None, description="bearer token for /metrics (Prometheus scrapers); "
                                            "none: /metrics follows the search rule (the search token when set)")
    insecure: bool = Field(False, description="admin routes without a token, loopback only")
    # -- throughput
    backend: Literal["shared", "onnx", "torch", "cuda"] | None = Field(
        None, description="query forward passes; default: 'cuda' where the model runs on a GPU (--device cuda, or "
                          "no --device and a GPU present), else 'shared' (ONNX Runtime on the CPU)")
    onnx_threads: int | None = Field(None, ge=1, description="ONNX Runtime intra-op threads per forward (default: "
                                     "all cores)")
    onnx_spin: bool = Field(True, description="ONNX Runtime's workers busy-wait inside a forward (its default); off: "
                            "they sleep, leaving the cores to the event loop and the index (see docs/serving.md)")
    hot_encoders: int = Field(DEFAULT_HOT, ge=0, le=16, description="shared backend: merged sessions kept for the "
                              "busiest encoders, each serving at least 1/(2N) of the recent rows (~110 MB each, "
                              "~280 MiB with its one-core twin under load, for multilingual-e5-small, outside "
                              "the encoder memory budget; 0: none; see "
                              "docs/query-path.md)")
    mixed_batches: Literal["auto", "groups", "segments"] = Field(
        "auto", description="shared backend: how a batch that mixes encoders runs: one call per encoder group "
                            "(groups), one call for all its rows (segments), or by its shape (auto; see "
                            "docs/query-path.md)")
    export_retry_s: float = Field(10.0, gt=0, description="a failed background ONNX export (EMFILE, full disk) is "
                                  "tried again after this, doubling up to 5 minutes; torch serves meanwhile")
    query_precision: Literal["fp32", "bf16", "fp16"] = Field(
        "fp32", description="torch backend: bf16 runs batches of 16+ queries for one "
                            "encoder under bf16 autocast (1.16-1.33x faster forwards with AMX; see README); "
                            "cuda backend: every batch at this precision (fp16 on the cuda backend only)")
    lora_factors: Literal["float16", "bfloat16", "float32"] = Field(
        SERVING_FACTORS, description="storage type of loaded LoRA factors (compute stays float32; see docs/query-path.md)")
    gil_switch_ms: float = Field(5.0, gt=0, le=100, description="the interpreter's thread switch interval in "
                                 "`qswap serve` (Python's sys.setswitchinterval): how long a forward thread back "
                                 "from ONNX Runtime or CUDA waits for the busy event loop to hand over (see "
                                 "docs/serving.md)")
    forward_lanes: int = Field(2, ge=1, le=64, description="forward threads taking batches from one queue; a lane "
                               "that starts while another is encoding runs on one core (a single-threaded session), so "
                               "under concurrency two batches run side by side; backends without a single-threaded "
                               "session (torch, onnx) use 1 (see docs/serving.md)")
    batch_window_ms: float = Field(2.0, ge=0, le=1000, description="how long a batch waits for more requests")
    max_batch: int = Field(64, ge=1, le=4096, description="queries encoded in one forward pass at most")
    encoder_memory_bytes: int = Field(1 << 30, ge=0, description="budget for loaded adapters (LRU beyond it)")
    delete_timeout_s: float = Field(30.0, gt=0, description="how long DELETE waits for in-flight requests")
    # -- overload and shutdown
    max_pending: int = Field(256, ge=1, description="requests admitted (queued or running) at most; "
                                                    "beyond: 429 with Retry-After")
    max_pending_per_encoder: int = Field(128, ge=1, description="the same, for one encoder")
    request_timeout_s: float = Field(30.0, gt=0, le=600, description="default deadline of a search or document "
                                                                     "request (X-Request-Timeout overrides it)")
    upload_timeout_s: float = Field(120.0, gt=0, description="an uploaded archive must be extracted within this")
    shutdown_timeout_s: float = Field(10.0, gt=0, description="on SIGTERM: in-flight requests get this long, "
                                                              "then the process exits")
    # -- connections
    header_timeout_s: float = Field(10.0, gt=0, le=600, description="a connection must deliver a complete request "
                                    "head within this of opening (or of its next request's first byte); else closed")
    keep_alive_timeout_s: float = Field(30.0, gt=0, le=3600, description="an idle kept-alive connection is closed "
                                        "after this (longer than common clients' pool expiry: no reuse race)")
    max_connections: int | None = Field(None, ge=1, description="open client connections at most (default: the "
                                        "open-file limit minus max(128, a quarter of it)); at the cap a new "
                                        "connection closes an idle one (one never served first, then the oldest), or gets 429 "
                                        "when none is idle")
    max_connections_per_address: int | None = Field(
        None, ge=0, description="open connections from one client address at most (default: a quarter of "
        "max_connections, at least 8; 0: no limit; behind a reverse proxy every client has the proxy's "
        "address); beyond: 429 and closed at once")
    backlog: int = Field(2048, ge=1, description="listen backlog (the kernel caps it at net.core.somaxconn)")
    # -- limits
    max_queries: int = Field(64, ge=1, description="queries per search request")
    max_k: int = Field(100, ge=1)
    max_query_chars: int = Field(2048, ge=1, description="longer queries are cut (and flagged truncated)")
    max_request_tokens: int = Field(32768, ge=1, description="tokens of one request that runs the model (a search's "
                                    "queries, an embedding request's inputs, either tower; each text counted up to "
                                    "the model's max length); beyond: 422 limit_exceeded")
    max_batch_tokens: int = Field(2048, ge=1, description="rows x longest row of one forward pass at most")
    slice_tokens: int = Field(256, ge=1, description="one request's share of a forward pass: a larger search (or "
                              "document upsert) is split into slices of this, and other requests run between them")
    bulk_lane: bool = Field(True, description="requests larger than slice_tokens (and document rows) run on a "
                            "second, lower-priority forward thread, so one-query searches never wait behind them "
                            "(docs/serving.md)")
    abandon_wait_s: float = Field(1.0, ge=0, description="a client that goes away before the answer of a request "
                                  "larger than slice_tokens (or of document rows) has its next such request refused "
                                  "(429 with Retry-After) for as long as the abandoned one held the server, at "
                                  "least this many seconds (docs/reliability.md); 0: off")
    max_hit_text_chars: int = Field(8192, ge=1, description="a hit's text is cut at this (the hit says "
                                                          "truncated: true)")
    max_hit_metadata_bytes: int = Field(8192, ge=2, description="a hit's metadata beyond this (as JSON) is "
                                        "left out: {} and truncated: true")
    max_response_bytes: int = Field(16 << 20, ge=1024, description="one search answer at most; beyond: 422 "
                                    "limit_exceeded")
    max_body_bytes: int = Field(2 << 20, ge=1024, description="JSON request bodies")
    max_upload_bytes: int = Field(256 << 20, ge=1024, description="uploaded encoder archives (compressed)")
    max_extracted_bytes: int = Field(1 << 30, ge=1024, description="uploaded encoder archives (extracted)")
    max_archive_members: int = Field(64, ge=1)
    max_documents: int = Field(1000, ge=1, description="documents per upsert request")
    # -- learning from traffic (off by default: the capture store keeps query text)
    feedback_dir: Path | None = Field(None, description="capture searches and feedback here (SQLite); "
                                                        "enables POST /v1/feedback and experiments")
    feedback_max_bytes: int = Field(1 << 30, ge=1 << 20, description="capture store size bound (oldest "
                                                                     "impressions pruned first)")
    feedback_max_age_s: float = Field(30 * 86400.0, gt=0, description="captured impressions older than this "
                                                                      "are pruned, with their feedback")
    feedback_secret: SecretStr | None = Field(None, description="the key that signs impression ids (none: a random "
                                              "key kept in the feedback directory, impression.key)")
    max_pending_feedback: int = Field(64, ge=1, description="feedback requests admitted (queued or running) at "
                                      "most; beyond: 429 with Retry-After (they never queue behind admin or search)")
    feedback_rate: float = Field(20.0, ge=0, description="feedback requests per second from one anonymous "
                                 "address (a bearer token's application is not limited: it relays its users'; "
                                 "bursts of one second's worth; 0: no limit); beyond: 429 with Retry-After, answered after that pause (at most 1 s)")
    sync_upsert_documents: int = Field(32, ge=0, description="an upsert of more documents answers 202 at once with a "
                                       "job to poll (GET /v1/documents/jobs/ID); smaller ones answer when written "
                                       "(or 202 once their deadline passes)")
    max_embedding_inputs: int = Field(2048, ge=1, description="inputs per embeddings request (OpenAI's limit; "
                                                              "sliced like any request; max_request_tokens bounds their tokens)")
    # -- logs
    log_json: bool = True

    @property
    def admin_mode(self) -> Literal["token", "insecure", "disabled"]:
        """How admin routes are guarded: by token, open on loopback, or switched off."""
        if self.admin_token is not None:
            return "token"
        return "insecure" if self.insecure else "disabled"

    @model_validator(mode="after")
    def _pick_backend(self) -> "ServerSettings":
        # A model on a GPU with the CPU's default backend would run every query through ONNX
        # Runtime on the CPU while the GPU idles: the backend follows the device unless named.
        if self.backend is None:
            self.backend = "cuda" if device_is_cuda(self.device) else "shared"
        return self

    def check(self) -> None:
        """Refuse settings that are unsafe or cannot work (raises :class:`InvalidInputError`)."""
        if self.insecure and self.admin_token is None and not is_loopback(self.host):
            raise InvalidInputError(
                f"--insecure opens admin routes without a token; refusing to listen on {self.host}",
                "use --host 127.0.0.1 with --insecure, or set an admin token (--token / QSWAP_ADMIN_TOKEN)")
        for name in ("admin_token", "search_token", "metrics_token", "feedback_secret"):
            tok = getattr(self, name)
            if tok is not None and (not tok.get_secret_value().strip()
                                    or any(c.isspace() for c in tok.get_secret_value())):
                raise InvalidInputError(f"{name} is empty or contains whitespace",
                                        "generate one: python -c 'import secrets; print(secrets.token_urlsafe(32))'")
            if tok is not None and len(tok.get_secret_value()) < MIN_TOKEN_CHARS:
                raise InvalidInputError(
                    f"{name} is shorter than {MIN_TOKEN_CHARS} characters",
                    "generate one: python -c 'import secrets; print(secrets.token_urlsafe(32))'")
        if self.encoders_root is not None and not Path(self.encoders_root).is_dir():
            raise InvalidInputError(f"encoders root {self.encoders_root} is not a directory",
                                    "create it or point --encoders-root to an existing directory")
        if self.query_precision == "fp16" and self.backend != "cuda":
            raise InvalidInputError("--query-precision fp16 needs the cuda backend",
                                    "use --backend cuda, or --query-precision bf16 on the torch backend")
        if self.query_precision != "fp32" and self.backend not in ("torch", "cuda"):
            raise InvalidInputError(f"--query-precision {self.query_precision} needs the torch backend "
                                    f"(the {self.backend} graphs are fp32)",
                                    "drop --query-precision, or use --backend torch")
        if self.sentinels is not None and not Path(self.sentinels).is_dir():
            raise InvalidInputError(f"sentinels directory {self.sentinels} does not exist",
                                    "build one with `qswap sentinels make`, or drop --sentinels")
        if self.index is not None and not str(self.index).startswith("milvus://") and not Path(self.index).exists():
            raise InvalidInputError(f"index {self.index} does not exist",
                                    "build one with `qswap index build`, or omit --index to serve the demo")
