"""``qswap serve``: run the search server (uvicorn, one worker)."""

from __future__ import annotations

import argparse
import logging
import os
from pathlib import Path

# torch and faiss each bundle their own OpenMP runtime; with the default (active) wait policy
# the idle threads of one spin while the other computes, and on a small machine a query's
# forward pass and index search alternate: measured on 2 cores, multilingual-e5-small query
# encode 140-1400 ms -> 19 ms, flat search 12 ms -> 0.6 ms with PASSIVE. The variable is read
# when a runtime loads, so it must be set before torch/faiss are imported: qswap.cli imports
# this module first. An explicit OMP_WAIT_POLICY in the environment wins.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

# flag destination -> settings field (only flags given on the command line override the environment)
_FLAG_FIELDS = {
    "host": "host", "port": "port", "index": "index", "model": "model", "device": "device",
    "encoders_root": "encoders_root", "state_dir": "state_dir", "token": "admin_token",
    "search_token": "search_token", "insecure": "insecure", "backend": "backend",
    "query_precision": "query_precision",
    "batch_window_ms": "batch_window_ms", "max_batch": "max_batch", "default_encoder": "default_encoder",
    "read_only_index": "read_only_index", "max_k": "max_k", "max_queries": "max_queries",
    "encoder_memory_mb": "encoder_memory_bytes",
}


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
    p.add_argument("--index", type=Path, metavar="DIR", help="index directory (default: the demo index)")
    p.add_argument("--read-only-index", action="store_true", default=None,
                   help="open the index read-only (document routes refused)")
    p.add_argument("--model", metavar="NAME|DIR", help="base model: bundled name or model directory")
    p.add_argument("--device", help="torch device (default: cuda if available, else cpu)")
    p.add_argument("--encoders-root", type=Path, metavar="DIR",
                   help="register-by-path is allowed only for directories inside DIR")
    p.add_argument("--state-dir", type=Path, metavar="DIR",
                   help="registry and the server's copies of encoders (default: DATA_DIR/server)")
    p.add_argument("--default-encoder", metavar="NAME[@VERSION]", help="encoder for requests naming none "
                   "(default: base)")
    p.add_argument("--token", metavar="TOKEN", help="admin bearer token (prefer QSWAP_ADMIN_TOKEN: "
                   "command lines are visible to other users)")
    p.add_argument("--search-token", metavar="TOKEN", help="require this bearer token for search "
                   "(or QSWAP_SEARCH_TOKEN)")
    p.add_argument("--insecure", action="store_true", default=None,
                   help="admin routes without a token, for local use (loopback host only)")
    p.add_argument("--backend", choices=("shared", "onnx", "torch"),   # qswap.encoders.backend.BACKENDS (not imported: torch loads after OMP_WAIT_POLICY)
                   help="query forward passes: 'shared' (default: one ONNX Runtime session of the base, adapters bound "
                        "per run), 'onnx' (one merged export per encoder) or 'torch' (the reference)")
    p.add_argument("--query-precision", choices=("fp32", "bf16"),
                   help="torch backend: run batches of 16+ queries for one encoder in bf16 (default fp32; pays only where the "
                        "hardware has native bf16: AMX, AVX-512-BF16, tensor cores)")
    p.add_argument("--batch-window-ms", type=float, help="micro-batch window (default 2)")
    p.add_argument("--max-batch", type=int, help="queries per forward pass at most (default 64)")
    p.add_argument("--max-k", type=int, help="hits per query at most (default 100)")
    p.add_argument("--max-queries", type=int, help="queries per request at most (default 64)")
    p.add_argument("--encoder-memory-mb", type=int, help="memory budget of loaded adapters (default 1024)")
    p.add_argument("--log-format", choices=("json", "text"), default=None, help="log lines (default json)")
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
        overrides[field] = v * (1 << 20) if flag == "encoder_memory_mb" else v
    if args.log_format is not None:
        overrides["log_json"] = args.log_format == "json"
    return ServerSettings(**overrides)


def _serve(args: argparse.Namespace) -> int:
    if args.write_openapi is not None:
        from qswap.server.app import write_openapi
        print(write_openapi(args.write_openapi))
        return 0
    import uvicorn
    from pydantic import ValidationError

    from qswap.errors import InvalidInputError
    from qswap.server.app import create_app
    from qswap.server.logs import configure_logging

    try:
        settings = _settings(args)
    except ValidationError as e:
        err = e.errors()[0]
        raise InvalidInputError(f"bad setting {'.'.join(map(str, err['loc']))}: {err['msg']}",
                                "see `qswap serve --help`") from None
    settings.check()
    configure_logging(settings.log_json, logging.DEBUG if getattr(args, "verbose", False) else logging.INFO)
    log = logging.getLogger("qswap.server")
    if settings.admin_mode == "disabled":
        log.warning("no admin token: admin routes (encoders, aliases, documents) are disabled; "
                    "set QSWAP_ADMIN_TOKEN (or --insecure for local use) to enable them")
    elif settings.admin_mode == "insecure":
        log.warning("--insecure: admin routes are open to loopback clients without a token")
    app = create_app(settings)
    log.info("starting", extra={"url": f"http://{settings.host}:{settings.port}", "admin": settings.admin_mode,
                                "index": str(settings.index or "demo"), "model": settings.model})
    # One worker: the model, index and encoder pool live in this process. uvicorn's "auto"
    # picks uvloop and httptools when they are installed.
    uvicorn.run(app, host=settings.host, port=settings.port, workers=1, loop="auto", http="auto",
                access_log=False, log_config=None, server_header=False)
    return 0
