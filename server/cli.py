"""``qswap serve``: run the search server (uvicorn, one worker)."""

from __future__ import annotations

import argparse
import logging
import os
import sys
import threading
from pathlib import Path

from qswap.factors import FACTOR_NAMES

# OMP_WAIT_POLICY=PASSIVE is set by the qswap entry point (qswap.cli) before torch/faiss load.
from qswap.encoders.runtime.backend import BACKENDS
from qswap.encoders.runtime.hot import DEFAULT_HOT
from qswap.encoders.precision import PRECISIONS

# flag destination -> settings field (only flags given on the command line override the environment)
_FLAG_FIELDS = {
    "host": "host", "port": "port", "index": "index", "model": "model", "device": "device",
    "encoders_root": "encoders_root", "state_dir": "state_dir", "token": "admin_token",
    "search_token": "search_token", "metrics_token": "metrics_token", "insecure": "insecure", "backend": "backend",
    "query_precision": "query_precision", "lora_factors": "lora_factors",
    "onnx_threads": "onnx_threads", "onnx_spin": "onnx_spin", "hot_encoders": "hot_encoders",
    "mixed_batches": "mixed_batches", "bulk_lane": "bulk_lane",
    "abandon_wait": "abandon_wait_s",
    "forward_lanes": "forward_lanes",
    "batch_window_ms": "batch_window_ms", "gil_switch_ms": "gil_switch_ms", "max_batch": "max_batch", "default_encoder": "default_encoder",
    "read_only_index": "read_only_index", "max_k": "max_k", "max_queries": "max_queries",
    "encoder_memory_mb": "encoder_memory_bytes", "sentinels": "sentinels", "guard_alpha": "guard_alpha",
    "guard_min_queries": "guard_min_queries",
    "feedback_dir": "feedback_dir", "feedback_max_mb": "feedback_max_bytes", "feedback_max_days": "feedback_max_age_s",
    "feedback_rate": "feedback_rate",
    "max_request_tokens": "max_request_tokens", "max_batch_tokens": "max_batch_tokens", "slice_tokens": "slice_tokens",
    "max_response_bytes": "max_response_bytes", "max_connections": "max_connections",
    "max_connections_per_address": "max_connections_per_address",
    "header_timeout": "header_timeout_s", "shutdown_timeout": "shutdown_timeout_s",
}
_SCALE = {"encoder_memory_mb": 1 << 20, "feedback_max_mb": 1 << 20, "feedback_max_days": 86400}


def register(sub: argparse._SubParsersAction) -> None:
    """Add the ``serve`` subcommand."""
    p = sub.add_parser(
        "serve", help="run the search server",
        description="Serve search over a document index with query encoders chosen per request. "
                    "With no options: the bundled multilingual-e5-small over the demo index (built on "
                    "first start). Every option can also be set as QSWAP_<OPTION> in the environment "
                    "(e.g. QSWAP_ADMIN_TOKEN).")
    p.add_argument("--host", help="address to listen on (default 127.0.0.1)")
    p.add_argument("--port", type=int, help="port (default 8000)")
    p.add_argument("--index", metavar="DIR|milvus://...",
                   help="index directory, or milvus://PATH.db?collection=NAME / milvus://HOST:PORT?collection=NAME "
                        "(default: the demo index)")
    p.add_argument("--read-only-index", action="store_true", default=None,
                   help="open the index read-only (document routes refused)")
    p.add_argument("--model", metavar="NAME|DIR", help="base model: bundled name or model directory")
    p.add_argument("--device", help="torch device (default: cuda if available, else cpu)")
    p.add_argument("--encoders-root", type=Path, metavar="DIR",
                   help="register-by-path is allowed only for directories inside DIR")
    p.add_argument("--sentinels", type=Path, metavar="DIR",
                   help="sentinel sets over the served index (a folder per sentinel: queries.jsonl + "
                        "qrels/test.tsv, see `qswap sentinels make`): every registered encoder is evaluated "
                        "on them against the base and the aliased encoders, and only one that passes is "
                        "served by name or alias (fails closed)")
    p.add_argument("--guard-alpha", type=float, metavar="P",
                   help="significance level of the server's guard, Holm-adjusted over the sentinels (default 0.05)")
    p.add_argument("--guard-min-queries", type=int, metavar="N",
                   help="judged queries a sentinel needs left in the index to judge an encoder (default 20); "
                        "fewer: the verdict is 'insufficient_evidence', not 'passed'")
    p.add_argument("--state-dir", type=Path, metavar="DIR",
                   help="registry and the server's copies of encoders (default: DATA_DIR/server)")
    p.add_argument("--default-encoder", metavar="NAME[@VERSION]", help="encoder for requests naming none "
                   "(default: base)")
    p.add_argument("--token", metavar="TOKEN", help="admin bearer token (prefer QSWAP_ADMIN_TOKEN: "
                   "command lines are visible to other users)")
    p.add_argument("--search-token", metavar="TOKEN", help="require this bearer token for search "
                   "(or QSWAP_SEARCH_TOKEN)")
    p.add_argument("--metrics-token", metavar="TOKEN", help="require this bearer token for /metrics "
                   "(or QSWAP_METRICS_TOKEN; default: the search token when one is set, else open)")
    p.add_argument("--insecure", action="store_true", default=None,
                   help="admin routes without a token, for local use (loopback host only)")
    p.add_argument("--backend", choices=BACKENDS,
                   help="query forward passes: 'shared' (the CPU default: one ONNX Runtime session of the base, adapters "
                        "bound per run), 'onnx' (one merged export per encoder), 'torch' (the reference) or 'cuda' (the default where the "
                        "model runs on a GPU: mixed-adapter batches as CUDA-graph replays, docs/gpu.md)")
    p.add_argument("--query-precision", choices=(*PRECISIONS, "fp16"),
                   help="torch backend: run batches of 16+ queries for one encoder in bf16 (default fp32; pays only where the "
                        "hardware has native bf16: AMX, AVX-512-BF16, tensor cores); cuda backend: every batch "
                        "at fp32, fp16 or bf16")
    p.add_argument("--lora-factors", choices=FACTOR_NAMES,
                   help="storage type of loaded LoRA factors (default float16: half the memory per encoder, compute "
                        "stays float32; factors outside float16's range keep float32)")
    p.add_argument("--onnx-threads", type=int, metavar="N",
                   help="ONNX Runtime intra-op threads per forward (default: all cores)")
    p.add_argument("--onnx-spin", choices=("on", "off"), default=None,
                   help="ONNX Runtime's workers busy-wait inside a forward (default on; docs/serving.md)")
    p.add_argument("--hot-encoders", type=int, metavar="N",
                   help="shared backend: the busiest encoders, each serving at least 1/(2N) of the recent rows, "
                        "run on merged graphs of their own, at most N (~110 MB each for multilingual-e5-small, "
                        "~280 MiB with the one-core twin a server builds under load; "
                        f"default {DEFAULT_HOT}; 0: never; docs/query-path.md)")
    p.add_argument("--mixed-batches", choices=("auto", "groups", "segments"), default=None,
                   help="shared backend: how a batch that mixes encoders runs (default auto; docs/query-path.md)")
    p.add_argument("--bulk-lane", choices=("on", "off"), default=None,
                   help="requests larger than one slice run on a second, lower-priority forward thread (default on; "
                        "docs/serving.md)")
    p.add_argument("--forward-lanes", type=int, metavar="N",
                   help="forward threads; one that starts while another is encoding runs on one core, so under "
                        "concurrency batches run side by side (default 2; 1: one batch at a time; docs/serving.md)")
    p.add_argument("--batch-window-ms", type=float, help="micro-batch window (default 2)")
    p.add_argument("--gil-switch-ms", type=float, metavar="MS",
                   help="Python's thread switch interval in the server (default 5; docs/serving.md)")
    p.add_argument("--max-batch", type=int, help="queries per forward pass at most (default 64)")
    p.add_argument("--max-k", type=int, help="hits per query at most (default 100)")
    p.add_argument("--max-queries", type=int, help="queries per request at most (default 64)")
    p.add_argument("--encoder-memory-mb", type=int, help="memory budget of loaded adapters (default 1024)")
    lim = p.add_argument_group("what one request may cost (all limits: docs/reliability.md)")
    lim.add_argument("--max-request-tokens", type=int, metavar="N",
                     help="tokens of one request that runs the model (search, embeddings); beyond: 422 (default 32768)")
    lim.add_argument("--max-batch-tokens", type=int, metavar="N",
                     help="rows x longest row of one forward pass (default 2048)")
    lim.add_argument("--slice-tokens", type=int, metavar="N", help="one request's share of a forward pass: larger "
                     "searches and upserts are split and other requests run between the slices (default 256)")
    lim.add_argument("--abandon-wait", type=float, metavar="S",
                     help="a client that goes away before the answer of a request larger than one slice waits as long "
                          "as that request held the server, at least S seconds, before its next one (429 meanwhile; "
                          "default 1; 0: off)")
    lim.add_argument("--max-response-bytes", type=int, metavar="N", help="one search answer at most (default 16 MiB)")
    lim.add_argument("--max-connections", type=int, metavar="N",
                     help="open client connections (default: the open-file limit minus max(128, a quarter))")
    lim.add_argument("--max-connections-per-address", type=int, metavar="N",
                     help="open connections from one client address (default: a quarter of --max-connections; "
                          "0: no limit, e.g. behind a reverse proxy)")
    lim.add_argument("--header-timeout", type=float, metavar="S",
                     help="seconds to deliver a request head (default 10)")
    lim.add_argument("--shutdown-timeout", type=float, metavar="S",
                     help="on SIGTERM, in-flight requests get this long, then 503 (default 10)")
    p.add_argument("--log-format", choices=("json", "text"), default=None, help="log lines (default json)")
    f = p.add_argument_group("learning from traffic (docs/feedback.md)")
    f.add_argument("--feedback-dir", type=Path, metavar="DIR", help="capture searches (query text, hits) and "
                   "feedback in DIR; enables POST /v1/feedback and experiments (default: off)")
    f.add_argument("--feedback-max-mb", type=int, metavar="MB", help="capture store size bound (default 1024)")
    f.add_argument("--feedback-max-days", type=float, metavar="D", help="captured impressions kept at most "
                   "this long (default 30)")
    f.add_argument("--feedback-rate", type=float, metavar="N", help="feedback requests per second from one anonymous "
                   "address (a bearer token's application is not limited); beyond: 429 (default 20; 0: no limit)")
    r = p.add_argument_group("scale-out on Ray (pip install 'qswap[ray]'; see docs/ray.md)")
    r.add_argument("--ray", action="store_true", help="serve with Ray Serve: replicas share the registry "
                   "(--state-dir) and the index (--index), encoders are multiplexed models")
    r.add_argument("--address", metavar="ADDR", help="Ray cluster to join (e.g. auto, ray://head:10001; "
                   "default: start a local one)")
    r.add_argument("--replicas", default="1", metavar="N|auto", help="ingress replicas (Ray Serve num_replicas, "
                   "default 1)")
    r.add_argument("--encoder-replicas", default=None, metavar="N|auto", help="encoder replicas (default: --replicas, "
                   "or 0 with --replicas 1; 0: no encoder deployment, each ingress replica runs its encoders itself, "
                   "without a hop)")
    r.add_argument("--autoscaling", metavar="JSON", help="Ray Serve autoscaling_config of the encoder deployment, "
                   "passed through (e.g. '{\"min_replicas\": 1, \"max_replicas\": 4}'); overrides --encoder-replicas")
    r.add_argument("--max-encoders-per-replica", type=int, default=8, metavar="M",
                   help="encoders each encoder replica keeps loaded (Ray Serve multiplexing LRU, default 8)")
    r.add_argument("--replica-cpus", type=float, default=None, metavar="C", help="CPUs reserved per ingress replica "
                   "(Ray resource accounting; default: 1, or an equal share where the replicas would not fit)")
    r.add_argument("--encoder-cpus", type=float, default=None, metavar="C", help="CPUs reserved per encoder replica "
                   "(default: --replica-cpus)")
    r.add_argument("--encoder-gpus", type=float, default=0.0, metavar="G", help="GPUs per encoder replica "
                   "(default 0; with GPUs the encoders run on cuda, the ingress replicas on CPU)")
    r.add_argument("--replica-threads", type=int, default=None, metavar="T", help="torch/FAISS threads per "
                   "replica (default: Ray's, = its CPUs)")
    r.add_argument("--max-ongoing-requests", type=int, default=None, metavar="R", help="Ray Serve "
                   "max_ongoing_requests per replica (default: --max-batch, so a micro-batch can fill)")
    r.add_argument("--print-config", nargs="?", const="serve", choices=("serve", "rayservice"), default=None,
                   help="print the Ray Serve config (serve build style YAML; 'rayservice': a KubeRay RayService "
                        "manifest around it) and exit")
    p.add_argument("--write-openapi", type=Path, metavar="PATH",
                   help="write the OpenAPI schema to PATH and exit (the committed copy: server/openapi.json)")
    p.set_defaults(func=_serve)


def _settings(args: argparse.Namespace):
    from qswap.server.config import ServerSettings
    overrides = {}
    for flag, field in _FLAG_FIELDS.items():
        v = getattr(args, flag, None)
        if v is None:
            continue
        overrides[field] = v * _SCALE[flag] if flag in _SCALE else v
    if args.log_format is not None:
        overrides["log_json"] = args.log_format == "json"
    return ServerSettings(**overrides)


def _serve(args: argparse.Namespace) -> int:
    if args.write_openapi is not None:
        from qswap.server.http.app import write_openapi
        print(write_openapi(args.write_openapi))
        return 0
    from pydantic import ValidationError

    from qswap.errors import InvalidInputError

    try:
        settings = _settings(args)
    except ValidationError as e:
        err = e.errors()[0]
        raise InvalidInputError(f"bad setting {'.'.join(map(str, err['loc']))}: {err['msg']}",
                                "see `qswap serve --help`") from None
    # Checked here, before the model stack is imported, so a bad setting fails in a second.
    settings.check()
    if getattr(args, "print_config", None) is not None:
        if not args.ray:
            raise InvalidInputError("--print-config prints the Ray Serve config", "add --ray")
        return _serve_ray(args, settings)   # before logging is configured: stdout is the config
    from qswap.server.http.app import DrainingServer, create_app
    from qswap.server.http.connections import uvicorn_config
    from qswap.server.http.logs import configure_logging

    configure_logging(settings.log_json, logging.DEBUG if getattr(args, "verbose", False) else logging.INFO)
    log = logging.getLogger("qswap.server")
    if settings.admin_mode == "disabled":
        log.warning("no admin token: admin routes (encoders, aliases, documents) are disabled; "
                    "set QSWAP_ADMIN_TOKEN (or --insecure for local use) to enable them")
    elif settings.admin_mode == "insecure":
        log.warning("--insecure: admin routes are open to loopback clients without a token")
    if getattr(args, "ray", False):
        return _serve_ray(args, settings)
    # A forward thread back from ONNX Runtime or CUDA waits up to one switch interval for the
    # event loop (busy with Python under load) to hand the interpreter over: the whole server
    # process's setting, so it is set here, not by create_app (a library embedding the app keeps its own).
    sys.setswitchinterval(settings.gil_switch_ms / 1000)
    app = create_app(settings, check=False)   # checked above
    app.state.qs.freeze_when_loaded = True   # this process is the server's (qswap.server.state)
    log.info("starting", extra={"url": f"http://{settings.host}:{settings.port}", "admin": settings.admin_mode,
                                "index": str(settings.index or "demo"), "model": settings.model})
    # One worker: the model, index and encoder pool live in this process; uvicorn's protocol
    # with a request-head timeout and a connection cap (qswap.server.http.connections).
    DrainingServer(uvicorn_config(app, settings)).run()
    # Work that ignores cancellation (a thread in a model call) must not hold the process past
    # the drain bound: the index and registry are closed and every write is atomic by now.
    stragglers = [t for t in threading.enumerate() if t is not threading.current_thread() and not t.daemon]
    if stragglers:
        log.warning("exiting with work still running", extra={"threads": [t.name for t in stragglers]})
        logging.shutdown()
        os._exit(0)
    return 0


def _serve_ray(args: argparse.Namespace, settings) -> int:
    import json

    from qswap.errors import InvalidInputError
    try:
        from qswap.server.ray.serve import RayOptions, serve_forever
    except ModuleNotFoundError as e:
        if e.name and e.name.split(".")[0] == "ray":
            raise InvalidInputError("--ray needs Ray Serve", "pip install 'qswap[ray]'") from None
        raise
    autoscaling = None
    if args.autoscaling:
        try:
            autoscaling = json.loads(args.autoscaling)
        except json.JSONDecodeError as e:
            raise InvalidInputError(f"--autoscaling is not JSON: {e}",
                                    "e.g. --autoscaling '{\"min_replicas\": 1, \"max_replicas\": 4}'") from None
        if not isinstance(autoscaling, dict):
            raise InvalidInputError("--autoscaling must be a JSON object", "see Ray Serve's autoscaling_config")
    if args.replica_threads is not None and args.replica_threads < 1:
        raise InvalidInputError(f"--replica-threads must be at least 1, got {args.replica_threads}",
                                "e.g. --replica-threads 2")
    replicas = _replica_count("--replicas", args.replicas)
    encoder_replicas = (None if args.encoder_replicas is None
                        else _replica_count("--encoder-replicas", args.encoder_replicas, minimum=0))
    if encoder_replicas is None and replicas == 1 and autoscaling is None and not args.encoder_gpus:
        # One ingress replica and nothing to scale or place apart: its own encoders spare every
        # search the hop to an encoder replica (bench/results/ray-serving/hop).
        encoder_replicas = 0
    opts = RayOptions(replicas=replicas, encoder_replicas=encoder_replicas,
                      autoscaling=autoscaling, max_encoders=args.max_encoders_per_replica,
                      replica_cpus=args.replica_cpus, encoder_cpus=args.encoder_cpus, encoder_gpus=args.encoder_gpus,
                      replica_threads=args.replica_threads, max_ongoing_requests=args.max_ongoing_requests)
    opts.check()
    if args.print_config is not None:
        from qswap.server.ray.config import config_yaml
        print(config_yaml(settings, opts, kind=args.print_config), end="")
        return 0
    return serve_forever(settings, opts, address=args.address)


def _replica_count(flag: str, text: str, minimum: int = 1) -> int | str:
    """A replica count flag: a number (``minimum`` or more) or ``auto``."""
    from qswap.errors import InvalidInputError
    if text == "auto":
        return text
    try:
        n = int(text)
    except ValueError:
        raise InvalidInputError(f"{flag} must be a number or 'auto', got {text!r}", f"e.g. {flag} 2") from None
    if n < minimum:
        raise InvalidInputError(f"{flag} must be at least {minimum}, got {n}", f"e.g. {flag} 2")
    return n
