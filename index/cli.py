"""``qswap index build | info | add | delete | search | eval | reindex``.

Wire with ``register(subparsers)``; every handler is ``args.func(args) -> int`` and raises
:class:`~qswap.errors.QswapError` for user-facing failures (the top-level CLI prints one line
and exits 2). Only this module of :mod:`qswap.index` imports :mod:`qswap.encoders`, lazily,
so that ``import qswap.index`` stays free of torch.
"""

from __future__ import annotations

import argparse
import functools
import json
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from qswap import DEFAULT_MODEL
from qswap.encoders.runtime.documents import QUERY_RUNTIMES, RUNTIMES
from qswap.encoders.precision import PRECISIONS
from qswap.errors import ConflictError, InvalidInputError, NotFoundError, QswapError
from qswap.index.backends import BACKENDS, IndexBackend, is_milvus, open_index
from qswap.index.build import build_index
from qswap.index.config import KINDS, QUANTS, IndexConfig
from qswap.index.corpus import BAD_LINE_MODES, FORMATS, BadLine, iter_corpus
from qswap.index.evaluate import evaluate
from qswap.index.manifest import documents_precision, require_precision
from qswap.index.backends.faiss.index import DocumentIndex
from qswap.encoders.runtime.embedder import Embedder, document_embedder, load_embedder

_ADD_BATCH = 1000


def _model_arg(value: str) -> str:
    """Model names stay as given; an existing folder is recorded by absolute path."""
    p = Path(value).expanduser()
    return str(p.resolve()) if p.is_dir() else value


_QUERY_RUNTIME_HELP = ("query-embedding runtime (default: the documents' runtime; onnx, for fp32 documents, "
                       "runs without torch once the model's export is cached; torch is the reference)")
_LOCATION_HELP = "index folder, or milvus://PATH.db?collection=NAME / milvus://HOST:PORT?collection=NAME"


def _location(value: str) -> str | Path:
    """An index folder (Path) or a milvus:// location (kept as given)."""
    return value if is_milvus(value) else Path(value)


def _faiss_only(value: str) -> Path:
    if is_milvus(value):
        raise argparse.ArgumentTypeError("eval and reindex work on FAISS index folders; for a Milvus collection "
                                         "rebuild it with `index build --backend milvus --replace` and other options")
    return Path(value)


# ---------------------------------------------------------------------- parser
def register(subparsers: Any) -> None:
    """Add the ``index`` command and its subcommands to a top-level argparse CLI."""
    p = subparsers.add_parser("index", help="build, change, query and evaluate document indexes",
                              description="Document indexes: FAISS + float16 embeddings + SQLite documents.")
    sub = p.add_subparsers(dest="index_command", metavar="SUBCOMMAND", required=True)

    b = sub.add_parser("build", help="embed a corpus and build an index (resumable)",
                       description="Embed a JSONL ({id, text, ...metadata}) or BEIR corpus with the frozen text "
                                   "tower and build an index. Rerunning after an interruption resumes.")
    b.add_argument("corpus", type=Path, help="JSONL file, or BEIR folder with corpus.jsonl")
    b.add_argument("--out", "-o", type=Path, help="index folder to create or replace (faiss backend)")
    b.add_argument("--backend", choices=BACKENDS, default="faiss",
                   help="faiss: an index folder (default); milvus: a Milvus collection (--uri, --collection)")
    b.add_argument("--uri", help="Milvus URI: PATH.db for milvus-lite, http://HOST:19530 for a server")
    b.add_argument("--collection", help="Milvus collection name")
    b.add_argument("--replace", action="store_true", help="milvus: replace an existing collection")
    b.add_argument("--model", type=_model_arg, default=DEFAULT_MODEL,
                   help=f"base model name or local folder (default {DEFAULT_MODEL})")
    b.add_argument("--precision", choices=PRECISIONS, default="fp32",
                   help="document-embedding precision (default fp32); bf16 is faster on CPUs with AVX-512-BF16/AMX "
                        "but fails the quality bar (recall@10 0.993 of fp32's top-10): the manifest records it "
                        "(docs/embedding.md)")
    b.add_argument("--runtime", choices=RUNTIMES, default=None,
                   help="document-embedding runtime (default: onnx for fp32, torch for bf16; torch fp32 is the "
                        "reference)")
    b.add_argument("--format", choices=FORMATS, default="auto")
    b.add_argument("--on-bad-line", choices=BAD_LINE_MODES, default="stop",
                   help="stop at the first bad corpus line (default) or skip and list bad lines")
    b.add_argument("--batch-size", type=int, default=None, help="texts per embedding batch (default 64)")
    b.add_argument("--chunk-rows", type=int, default=None, help="documents per resumable chunk (default 4096)")
    b.add_argument("--no-progress", action="store_true")
    r = b.add_argument_group("embedding on Ray (pip install 'qswap[ray]'; see docs/ray.md)")
    r.add_argument("--ray", action="store_true", help="embed with Ray Data over a pool of embedder actors")
    r.add_argument("--address", metavar="ADDR", help="Ray cluster to join (e.g. auto; default: start a local one)")
    r.add_argument("--workers", type=int, default=1, help="embedder actors (default 1)")
    r.add_argument("--gpus-per-worker", type=float, default=0.0, metavar="G", help="GPUs per actor (default 0)")
    r.add_argument("--cpus-per-worker", type=float, default=1.0, metavar="C", help="CPUs per actor (default 1)")
    _add_config_args(b)
    b.set_defaults(func=cmd_build)

    i = sub.add_parser("info", help="show an index's manifest facts")
    i.add_argument("index", type=_location, help=_LOCATION_HELP)
    i.add_argument("--json", action="store_true")
    i.add_argument("--no-verify", action="store_true", help="skip checksum verification")
    i.set_defaults(func=cmd_info)

    a = sub.add_parser("add", help="embed and add documents from a JSONL file")
    a.add_argument("index", type=_location, help=_LOCATION_HELP)
    a.add_argument("corpus", type=Path)
    a.add_argument("--upsert", action="store_true", help="replace documents whose id exists")
    a.add_argument("--model", type=_model_arg, default=None, help="default: the model the index was built with")
    a.add_argument("--precision", choices=PRECISIONS, default=None,
                   help="default: the precision the index's documents were embedded at (another one is refused)")
    a.add_argument("--format", choices=FORMATS, default="auto")
    a.add_argument("--on-bad-line", choices=BAD_LINE_MODES, default="stop")
    a.set_defaults(func=cmd_add)

    d = sub.add_parser("delete", help="delete documents by id")
    d.add_argument("index", type=_location, help=_LOCATION_HELP)
    d.add_argument("ids", nargs="*", help="external ids")
    d.add_argument("--ids-file", type=Path, help="file with one id per line")
    d.set_defaults(func=cmd_delete)

    s = sub.add_parser("search", help="search with the base model's query tower")
    s.add_argument("index", type=_location, help=_LOCATION_HELP)
    s.add_argument("query", nargs="+", help="query text (several: one search each)")
    s.add_argument("-k", "--k", type=int, default=10)
    s.add_argument("--filter", action="append", default=[], metavar="FIELD=VALUE",
                   help="metadata equality (VALUE parsed as JSON if it can be: 2020, true, \"2020\")")
    s.add_argument("--model", type=_model_arg, default=None)
    s.add_argument("--runtime", choices=QUERY_RUNTIMES, default=None, help=_QUERY_RUNTIME_HELP)
    s.add_argument("--no-text", action="store_true")
    s.add_argument("--json", action="store_true")
    s.set_defaults(func=cmd_search)

    e = sub.add_parser("eval", help="recall@k vs exact search, bytes per document, latency",
                       description="Evaluate the index as configured, or (with index options) an in-memory "
                                   "variant built from the stored embeddings.")
    e.add_argument("index", type=_faiss_only)
    e.add_argument("-k", "--k", type=int, default=10)
    e.add_argument("--n-queries", type=int, default=1000,
                   help="perturbed-document queries when --queries is not given")
    e.add_argument("--queries", type=Path, help="query texts: JSONL with \"text\" or one query per line")
    e.add_argument("--model", type=_model_arg, default=None)
    e.add_argument("--runtime", choices=QUERY_RUNTIMES, default=None, help=_QUERY_RUNTIME_HELP)
    e.add_argument("--latency-queries", type=int, default=200)
    e.add_argument("--seed", type=int, default=0)
    e.add_argument("--threads", type=int, default=None,
                   help="FAISS (OpenMP) threads for the measurement (default: all cores)")
    e.add_argument("--json", action="store_true")
    _add_config_args(e)
    e.set_defaults(func=cmd_eval)

    r = sub.add_parser("reindex", help="rebuild FAISS with other options from the stored embeddings")
    r.add_argument("index", type=_faiss_only)
    _add_config_args(r)
    r.set_defaults(func=cmd_reindex)


def _add_config_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("index options (unset: chosen by corpus size, or kept)")
    g.add_argument("--dim", type=int, help="Matryoshka prefix kept in FAISS (e.g. 256)")
    g.add_argument("--quant", choices=QUANTS)
    g.add_argument("--kind", choices=KINDS)
    g.add_argument("--nlist", type=int, help="IVF lists")
    g.add_argument("--nprobe", type=int, help="IVF lists searched")
    g.add_argument("--hnsw-m", type=int, help="HNSW neighbours per node")
    g.add_argument("--ef-construction", type=int)
    g.add_argument("--ef-search", type=int)
    g.add_argument("--pq-m", type=int, help="PQ sub-quantisers (divides dim)")
    g.add_argument("--oversample", type=int, help="candidates per result when rescoring")
    g.add_argument("--rescore", action=argparse.BooleanOptionalAction, default=None,
                   help="re-rank candidates with stored full vectors")
    g.add_argument("--gpu", action=argparse.BooleanOptionalAction, default=None)


def _config_from(args: argparse.Namespace) -> IndexConfig:
    kw: dict[str, Any] = {k: getattr(args, k, None) for k in (
        "dim", "quant", "kind", "nlist", "nprobe", "hnsw_m", "ef_construction", "ef_search", "pq_m",
        "oversample", "rescore")}
    if getattr(args, "gpu", None) is not None:
        kw["use_gpu"] = args.gpu
    for k in ("batch_size", "chunk_rows"):
        if getattr(args, k, None) is not None:
            kw[k] = getattr(args, k)
    cfg = IndexConfig(**kw)
    cfg.validate()
    return cfg


def _config_given(args: argparse.Namespace) -> bool:
    return any(getattr(args, k, None) is not None for k in (
        "dim", "quant", "kind", "nlist", "nprobe", "hnsw_m", "ef_construction", "ef_search", "pq_m",
        "oversample", "rescore", "gpu"))


@contextmanager
def _opened(location: str | Path, read_only: bool = False) -> Iterator[Any]:
    idx = open_index(location, read_only=read_only)
    try:
        yield idx
    finally:
        idx.close()


def _model_for(index: IndexBackend, given: str | None) -> str:
    return given or index.manifest.get("build", {}).get("model") or DEFAULT_MODEL


def _embedder_for(index: IndexBackend, given: str | None, precision: str | None = None,
                  location: str | Path = "", runtime: str | None = None) -> Embedder:
    """The index's document tower, at the precision its documents were embedded at (another
    ``precision`` raises ConflictError: precisions never mix in one index), on ``runtime``
    (default: the precision's)."""
    build = index.manifest.get("build", {})
    have = documents_precision(build)
    if precision is not None:
        require_precision(build, precision, f"index {location}".strip())
    emb = load_embedder(_model_for(index, given), precision=have, runtime=runtime)
    index.space.require_same(emb.space, f"model {emb.name}")
    return emb


# ---------------------------------------------------------------------- handlers
def cmd_build(args: argparse.Namespace) -> int:
    cfg = _config_from(args)
    if args.backend == "milvus":
        if not args.uri or not args.collection or args.out:
            raise InvalidInputError("--backend milvus needs --uri and --collection (and no --out)",
                                    "e.g. --backend milvus --uri ./docs.db --collection docs")
        if getattr(args, "ray", False):
            raise InvalidInputError("--ray builds the faiss backend only", "drop --ray, or use --out")
    elif not args.out or args.uri or args.collection:
        raise InvalidInputError("the faiss backend needs --out (--uri/--collection are for --backend milvus)",
                                "e.g. --out ./index")
    if getattr(args, "ray", False) and (args.workers < 1 or args.gpus_per_worker < 0 or args.cpus_per_worker < 0):
        raise InvalidInputError("--workers must be >= 1, --gpus-per-worker and --cpus-per-worker >= 0",
                                "e.g. --workers 2 --gpus-per-worker 1")
    emb = load_embedder(args.model, precision=args.precision, runtime=args.runtime)
    idx: IndexBackend
    if args.backend == "milvus":
        from qswap.index.backends.milvus.build import build_collection
        idx = build_collection(args.corpus, args.uri, args.collection, emb.documents, emb.space, cfg,
                               on_bad_line=args.on_bad_line, progress=not args.no_progress,
                               format=args.format, model=args.model, replace=args.replace,
                               embedding=emb.record)
        where = f"milvus collection {args.collection!r} at {args.uri}"
    elif getattr(args, "ray", False):
        try:
            from qswap.index.ray_build import build_index_on_ray, init_ray
            import ray.data  # noqa: F401
        except ModuleNotFoundError as e:
            if e.name and e.name.split(".")[0] == "ray":
                raise InvalidInputError("--ray needs Ray Data", "pip install 'qswap[ray]'") from None
            raise
        init_ray(args.address)
        # Each actor computes on the CPUs it was given, not on every core of its machine.
        make = functools.partial(document_embedder, args.model, args.precision, args.runtime,
                                 max(1, int(args.cpus_per_worker)))
        idx = build_index_on_ray(args.corpus, args.out, make,
                                 emb.space, cfg, workers=args.workers, gpus_per_worker=args.gpus_per_worker,
                                 cpus_per_worker=args.cpus_per_worker, on_bad_line=args.on_bad_line,
                                 progress=not args.no_progress, format=args.format, model=args.model,
                                 embedding=emb.record)
        where = str(args.out)
    else:
        idx = build_index(args.corpus, args.out, emb.documents, emb.space, cfg, on_bad_line=args.on_bad_line,
                          progress=not args.no_progress, format=args.format, model=args.model,
                          embedding=emb.record)
        where = str(args.out)
    try:
        info = idx.info()
        c = info["config"]
        bad = info["build"].get("n_bad_lines", 0)
        print(f"built {where}: {info['documents']} documents, {c['kind']}/{c['quant']}/dim {c['dim']}"
              f"{f', {bad} bad lines skipped' if bad else ''} in {info['build'].get('seconds', 0):.1f}s")
    finally:
        idx.close()
    return 0


def cmd_info(args: argparse.Namespace) -> int:
    idx = open_index(args.index, read_only=True, verify=not args.no_verify)
    try:
        info = idx.info()
    finally:
        idx.close()
    if args.json or info.get("backend") == "milvus":
        print(json.dumps(info, indent=2, sort_keys=True, default=str))
        return 0
    c = info["config"]
    b = info["build"]
    lines = [
        f"path:        {info['path']}",
        f"documents:   {info['documents']} (rows {info['rows']}, tombstones {info['tombstones']}, "
        f"generation {info['generation']})",
        f"space:       {info['space']['name']} [{info['space']['fingerprint']}] dim {info['full_dim']}",
        f"faiss:       {info['faiss']['factory']} (kind {c['kind']}, quant {c['quant']}, dim {c['dim']}, "
        f"nprobe {c['nprobe']}, ef_search {c['ef_search']})",
        f"rescoring:   {'on, oversample ' + str(c['oversample']) if info['rescoring'] else 'off'}",
        "bytes/doc:   " + ", ".join(f"{k} {v:.0f}" for k, v in info["bytes_per_doc"].items()),
        f"built:       {info['created_at']} from {b.get('corpus', '-')} with {b.get('model', '-')}"
        f"{'; ' + str(b.get('n_bad_lines')) + ' bad lines skipped' if b.get('n_bad_lines') else ''}",
        f"updated:     {info['updated_at']} (qswap {info['qswap_version']})",
        f"documents embedded at {documents_precision(b)}"
        + (f" on {b['embedding'].get('runtime')}" if b.get("embedding", {}).get("runtime") else ""),
    ]
    print("\n".join(lines))
    return 0


def cmd_add(args: argparse.Namespace) -> int:
    with _opened(args.index) as idx:
        bad: list[BadLine] = []
        records = list(iter_corpus(args.corpus, format=args.format, on_bad_line=args.on_bad_line, bad_lines=bad))
        if not records:
            raise InvalidInputError(f"{args.corpus}: no documents to add", "give a JSONL file of {id, text} objects")
        if not args.upsert:
            present = [d for d in idx.get([r.doc.id for r in records]) if d is not None]
            if present:
                raise ConflictError(f"{len(present)} ids already in the index, e.g. {present[0].id!r}",
                                    "rerun with --upsert to replace them")
        emb = _embedder_for(idx, args.model, args.precision, args.index)
        put = idx.upsert if args.upsert else idx.add
        from tqdm import tqdm
        with tqdm(total=len(records), unit="doc", desc="adding", file=sys.stderr, dynamic_ncols=True) as bar:
            for i in range(0, len(records), _ADD_BATCH):
                part = records[i:i + _ADD_BATCH]
                put([r.doc for r in part], emb.documents([r.embed_text for r in part]))
                bar.update(len(part))
        verb = "upserted" if args.upsert else "added"
        print(f"{verb} {len(records)} documents{f' ({len(bad)} bad lines skipped)' if bad else ''}; "
              f"index holds {idx.count}")
    return 0


def cmd_delete(args: argparse.Namespace) -> int:
    ids = list(args.ids)
    if args.ids_file:
        if not args.ids_file.is_file():
            raise NotFoundError(f"{args.ids_file} does not exist", "check the path")
        ids += [ln.strip() for ln in args.ids_file.read_text(encoding="utf-8").splitlines() if ln.strip()]
    if not ids:
        raise InvalidInputError("no ids to delete", "pass ids as arguments or with --ids-file")
    with _opened(args.index) as idx:
        n = idx.delete(ids)
        print(f"deleted {n} of {len(set(ids))} ids; index holds {idx.count}")
    return 0


def parse_filter(items: list[str]) -> dict[str, Any] | None:
    """``["section=games", "year=2020"]`` -> ``{"section": "games", "year": 2020}``."""
    out: dict[str, Any] = {}
    for item in items:
        field, sep, raw = item.partition("=")
        if not sep or not field:
            raise InvalidInputError(f"bad filter {item!r}", "write filters as FIELD=VALUE, e.g. section=games")
        try:
            value = json.loads(raw)
        except json.JSONDecodeError:
            value = raw
        if isinstance(value, (list, dict)):
            value = raw
        out[field] = value
    return out or None


def cmd_search(args: argparse.Namespace) -> int:
    flt = parse_filter(args.filter)
    with _opened(args.index, read_only=True) as idx:
        emb = _embedder_for(idx, args.model, runtime=args.runtime)
        results = idx.search(emb.queries(list(args.query)), args.k, filter=flt, with_text=not args.no_text)
    if args.json:
        print(json.dumps([{"query": q, "hits": [h.__dict__ for h in hits]}
                          for q, hits in zip(args.query, results)], indent=2, ensure_ascii=False))
        return 0
    for q, hits in zip(args.query, results):
        if len(args.query) > 1:
            print(f"# {q}")
        if not hits:
            print("(no results)")
        for rank, h in enumerate(hits, 1):
            text = "" if h.text is None else " " + " ".join(h.text.split())[:100]
            print(f"{rank:>3}  {h.score:.4f}  {h.id}{text}")
    return 0


def _read_queries(path: Path) -> list[str]:
    if not path.is_file():
        raise NotFoundError(f"{path} does not exist", "check the path")
    out = []
    for n, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        s = line.strip()
        if not s:
            continue
        if s.startswith("{"):
            try:
                obj = json.loads(s)
            except json.JSONDecodeError as e:
                raise InvalidInputError(f"{path}, line {n}: not JSON ({e.msg})", "fix that line") from None
            if not isinstance(obj.get("text"), str):
                raise InvalidInputError(f"{path}, line {n}: no \"text\" string", "give {\"text\": ...} per line")
            s = obj["text"]
        out.append(s)
    if not out:
        raise InvalidInputError(f"{path}: no queries", "give one query per line")
    return out


def cmd_eval(args: argparse.Namespace) -> int:
    if args.threads is not None:
        if args.threads < 1:
            raise InvalidInputError(f"--threads must be positive, got {args.threads}", "pass e.g. --threads 1")
        import faiss
        faiss.omp_set_num_threads(args.threads)
    with DocumentIndex.open(args.index, read_only=True) as idx:
        queries = None
        if args.queries:
            emb = _embedder_for(idx, args.model, runtime=args.runtime)
            queries = emb.queries(_read_queries(args.queries))
        target = idx.with_config(_config_from(args), progress=True) if _config_given(args) else idx
        report = evaluate(target, queries, n_queries=args.n_queries, k=args.k,
                          latency_queries=args.latency_queries, seed=args.seed)
        report["variant"] = target is not idx
    if args.json:
        print(json.dumps(report, indent=2, sort_keys=True))
        return 0
    c = report["config"]
    k = report["k"]
    print(f"{'variant' if report['variant'] else 'index'}: {report['factory']} (kind {c['kind']}, quant {c['quant']}, "
          f"dim {c['dim']}, rescoring {'on x' + str(c['oversample']) if report['rescoring'] else 'off'}), "
          f"{report['documents']} documents, {report['queries']} queries")
    print(f"recall@{k}:   {report[f'recall@{k}']:.4f} (vs exact fp32 full-dimension search)")
    print("bytes/doc:   " + ", ".join(f"{key} {v:.0f}" for key, v in report["bytes_per_doc"].items()))
    print(f"latency:     p50 {report['latency_ms']['p50']:.2f} ms, p99 {report['latency_ms']['p99']:.2f} ms "
          f"(single query); batch {report['batch_qps']:.0f} queries/s")
    return 0


def cmd_reindex(args: argparse.Namespace) -> int:
    if not _config_given(args):
        raise InvalidInputError("no index option given", "pass e.g. --dim 256 --quant sq8")
    with DocumentIndex.open(args.index) as idx:
        idx.reindex(_config_from(args))
        c = idx.config
        print(f"reindexed {args.index}: {c.kind}/{c.quant}/dim {c.dim}, generation {idx.generation}")
    return 0


def main(argv: list[str] | None = None) -> int:
    """Stand-alone entry (``python -m qswap.index.cli index ...``) until the top-level CLI wires it."""
    parser = argparse.ArgumentParser(prog="qswap")
    register(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(argv)
    try:
        return int(args.func(args))
    except QswapError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
