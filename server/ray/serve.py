"""``qswap serve --ray``: the same FastAPI app on Ray Serve, as an ingress in front of encoders.

One Serve application, two deployments:

- ``QswapIngress`` (the HTTP ingress, ``route_prefix /``): every replica runs the app of
  :func:`qswap.server.http.app.create_app` (same routes, auth, admission, deadlines, 429/504, errors)
  over the shared registry and a read-only view of the shared index. Its micro-batcher admits
  and batches searches as in one process; a batch's rows are sent to the encoder deployment,
  one call per encoder (``handle.options(multiplexed_model_id=name@version)``, all at once),
  and the vectors that come back are searched here, in one index call per filter.
- ``QswapEncoder``: the query encoders as Ray Serve multiplexed models
  (:mod:`qswap.server.ray.encoder`), with its own replica count, autoscaling, ``num_cpus`` and
  ``num_gpus``: GPU encoder replicas can sit behind CPU ingress replicas.

Nothing calls back into the ingress, so no replica ever waits on a replica of its own kind.
Registry and index are shared by all replicas (:mod:`qswap.server.ray.registry`,
:mod:`qswap.server.ray.index`).
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import threading
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from qswap.encoders import BASE_KEY
from qswap.errors import InvalidInputError
from qswap.index.ray_build import init_ray
from qswap.server.serving.batching import MicroBatcher
from qswap.server.config import ServerSettings
from qswap.server.ray.encoder import Encoded, EncoderCore, rows_of, set_threads, split_rows
from qswap.index.backends import is_milvus
from qswap.server.ray.index import SharedIndex, get_or_create_writer, qswap_error_of
from qswap.server.ray.placement import cluster_nodes, fit_layout, groups
from qswap.server.ray.registry import SharedRegistry
from qswap.server.state import ServerState
from qswap.server.ray.stats import replica_id, start_stats

log = logging.getLogger("qswap.server")

APP_NAME = "qswap"
INGRESS = "QswapIngress"
ENCODER = "QswapEncoder"
#: How long an ingress batch waits for the encoder deployment at most: the longest deadline a
#: request can ask for (its own deadline answers it earlier; this only frees the batch thread).
ENCODE_TIMEOUT_S = 600.0
LOGGING = {"enable_access_log": False, "log_level": "WARNING"}


@dataclass
class RayOptions:
    """How ``qswap serve --ray`` lays the application out on the cluster.

    Attributes:
        replicas: ingress replicas (``num_replicas``; ``"auto"`` for Ray's default autoscaling).
        encoder_replicas: encoder replicas (None: as many as ingress replicas; 0: no encoder
            deployment, each ingress replica encodes itself, with no hop: see :attr:`fused`).
        autoscaling: Ray Serve ``autoscaling_config`` of the encoder deployment (overrides
            ``encoder_replicas``).
        max_encoders: encoders each encoder replica keeps loaded (multiplexing LRU).
        replica_cpus: ``num_cpus`` of each ingress replica (None: fitted to the cluster at deploy,
            1 when every replica gets one; :mod:`qswap.server.ray.placement`).
        encoder_cpus: ``num_cpus`` of each encoder replica (None: as ``replica_cpus``).
        encoder_gpus: ``num_gpus`` of each encoder replica (0: CPU encoders).
        replica_threads: torch/FAISS threads per replica (None: Ray's, = ``num_cpus``).
        max_ongoing_requests: Ray Serve ``max_ongoing_requests`` of both deployments (None:
            ``--max-batch``, so that a micro-batch can fill).
    """

    replicas: int | str = 1
    encoder_replicas: int | str | None = None
    autoscaling: dict[str, Any] | None = None
    max_encoders: int = 8
    replica_cpus: float | None = None
    encoder_cpus: float | None = None
    encoder_gpus: float = 0.0
    replica_threads: int | None = None
    max_ongoing_requests: int | None = None

    def check(self) -> None:
        """Refuse options that cannot work (:class:`InvalidInputError`)."""
        if self.max_encoders < 1:
            raise InvalidInputError(f"--max-encoders-per-replica must be at least 1, got {self.max_encoders}",
                                    "give a positive number")
        if self.encoder_gpus < 0:
            raise InvalidInputError(f"--encoder-gpus must be 0 or more, got {self.encoder_gpus}",
                                    "e.g. --encoder-gpus 1")
        if self.fused and self.autoscaling is not None:
            raise InvalidInputError("--autoscaling scales the encoder deployment; --encoder-replicas 0 has none",
                                    "drop --autoscaling, or give encoder replicas")
        if self.fused and self.encoder_gpus:
            raise InvalidInputError("--encoder-gpus places encoder replicas; --encoder-replicas 0 has none",
                                    "drop --encoder-gpus (and use --device on the ingress), or give encoder replicas")
        if self.max_ongoing_requests is not None and self.max_ongoing_requests < 1:
            raise InvalidInputError(f"--max-ongoing-requests must be at least 1, got {self.max_ongoing_requests}",
                                    "e.g. --max-ongoing-requests 64")

    @property
    def fused(self) -> bool:
        """No encoder deployment (``--encoder-replicas 0``): each ingress replica holds and runs
        its encoders as a single process does, so a search makes no hop to another replica."""
        return self.encoder_replicas == 0

    def encoder_fanout(self) -> int:
        """Encoder replicas one ingress batch is spread over: their count, or the autoscaler's
        maximum (Ray's default autoscaling: 8 at most)."""
        if self.autoscaling is not None:
            return int(self.autoscaling.get("max_replicas", 1))
        n = self.replicas if self.encoder_replicas is None else self.encoder_replicas
        return n if isinstance(n, int) else 8

    def as_args(self) -> dict[str, Any]:
        """These options as a Serve config's application ``args`` (read by :func:`app_from_env`)."""
        return {k: v for k, v in asdict(self).items() if v is not None}


def deployment_options(settings: ServerSettings, opts: RayOptions) -> dict[str, dict[str, Any]]:
    """Ray Serve options of each deployment (``INGRESS``, ``ENCODER``), as a Serve config lists them.

    Args:
        settings: the server settings (``max_batch`` sizes the default ``max_ongoing_requests``).
        opts: the layout.

    Returns:
        deployment name -> options (``num_replicas`` or ``autoscaling_config``,
        ``max_ongoing_requests``, ``ray_actor_options``); no ``ENCODER`` entry when ``opts.fused``.
    """
    opts.check()
    # Ray Serve's default of 5 ongoing requests per replica would cap a micro-batch at 5.
    max_ongoing = opts.max_ongoing_requests or settings.max_batch
    ing_group, enc_group = groups(opts)
    ingress: dict[str, Any] = {"num_replicas": opts.replicas, "max_ongoing_requests": max_ongoing,
                               "ray_actor_options": {"num_cpus": ing_group.cpus}}
    if opts.fused:
        return {INGRESS: ingress}
    encoder_actor: dict[str, Any] = {"num_cpus": enc_group.cpus}
    if opts.encoder_gpus:
        encoder_actor["num_gpus"] = opts.encoder_gpus
    encoder: dict[str, Any] = {"max_ongoing_requests": max_ongoing, "ray_actor_options": encoder_actor}
    if opts.autoscaling is not None:
        encoder["autoscaling_config"] = opts.autoscaling
    else:
        encoder["num_replicas"] = opts.replicas if opts.encoder_replicas is None else opts.encoder_replicas
    return {INGRESS: ingress, ENCODER: encoder}


class RayIngressState(ServerState):
    """An ingress replica's state: shared registry, shared index view, a micro-batcher whose
    encode step is the encoder deployment. Loads in the replica's constructor.

    Args:
        settings: the server settings.
        encoder: the encoder deployment's handle (None: the replica encodes itself, as one
            process does: ``--encoder-replicas 0``).
        fanout: encoder replicas a batch is spread over at most (their count, or the
            autoscaler's maximum): each encoder's rows go as up to ``fanout`` calls, so that a
            batch for one encoder keeps every encoder replica busy.
    """

    def __init__(self, settings: ServerSettings, encoder: Any, fanout: int = 1) -> None:
        super().__init__(settings)
        self.encoder = encoder
        self.fanout = max(1, fanout)
        self.loop: asyncio.AbstractEventLoop | None = None
        self.stats = {"admitted": 0, "batches": 0, "encoder_calls": 0}

    def open_index(self, base: Any) -> Any:
        assert self.settings.index is not None   # the driver resolves the demo index to a path
        if is_milvus(self.settings.index):
            # Milvus is already one index for every replica, and its own writer: each replica
            # opens the collection as a single process does.
            return super().open_index(base)
        return SharedIndex(Path(self.settings.index), writable=not self.settings.read_only_index)

    def make_registry(self, **kw: Any) -> SharedRegistry:
        return SharedRegistry(**kw)

    def make_batcher(self, **kw: Any) -> MicroBatcher:
        if self.encoder is None:   # encoders in this replica (--encoder-replicas 0): the single process's worker
            return super().make_batcher(**kw)
        # The encoders run in the encoder deployment, which tokenises: here texts are only counted.
        kw["encode_flagged"] = self.encode_remote
        kw["encode"] = lambda texts, keys: self.encode_remote(texts, keys)[0]
        kw["tokenize"] = None
        kw["encode_bulk"] = None   # the bulk lane too encodes remotely
        kw["encode_single"] = None   # one forward lane: the encoder deployment's replicas run the passes
        return MicroBatcher(**kw)

    def start_loading(self) -> None:
        # Loaded in the replica's constructor: Ray Serve routes to a replica only once it is
        # constructed, so no request meets a replica that is still loading.
        pass

    def load(self) -> None:
        super().load()
        assert isinstance(self.registry, SharedRegistry)
        self.registry.start_polling()

    async def prepare_encoder(self, key: str) -> None:
        # The encoder loads on the encoder replica the call is routed to. Here: remember the
        # event loop, on which the batch thread sends its calls to the encoder deployment.
        self.loop = asyncio.get_running_loop()
        self.stats["admitted"] += 1
        if self.encoder is None:
            await super().prepare_encoder(key)

    def encode_remote(self, texts: list[str], keys: list[str]) -> Encoded:
        """Encode a batch on the encoder deployment (batch thread; blocks until it answers).

        Args:
            texts: the batch's query texts.
            keys: the encoder of each text.

        Returns:
            the vectors and truncation flags, in the order of ``texts``.
        """
        assert self.loop is not None
        self.stats["batches"] += 1
        fut = asyncio.run_coroutine_threadsafe(self._encode_groups(texts, keys), self.loop)
        return fut.result(timeout=ENCODE_TIMEOUT_S)

    async def _encode_groups(self, texts: list[str], keys: list[str]) -> Encoded:
        import numpy as np
        by_key: dict[str, list[int]] = {}
        for i, k in enumerate(keys):
            by_key.setdefault(k, []).append(i)
        size = -(-len(texts) // self.fanout)   # rows per call: the batch spread over the replicas
        chunks = [(k, rows[o:o + size]) for k, rows in by_key.items() for o in range(0, len(rows), size)]
        calls = []
        for k, rows in chunks:
            # ``base`` is on every encoder replica: no multiplexing hint, Ray balances by load.
            h = self.encoder if k == BASE_KEY else self.encoder.options(multiplexed_model_id=k)
            calls.append(h.encode.remote([texts[i] for i in rows], k))
        self.stats["encoder_calls"] += len(calls)
        done = await asyncio.gather(*calls, return_exceptions=True)
        for r in done:
            if isinstance(r, BaseException):
                raise qswap_error_of(r) from None
        dim = done[0][0].shape[1]
        emb = np.empty((len(texts), dim), dtype=np.float32)
        trunc = [False] * len(texts)
        for (_, rows), (e, t) in zip(chunks, done):
            emb[rows] = e
            for i, flag in zip(rows, t):
                trunc[i] = flag
        return emb, trunc

    def replica_stats(self) -> dict[str, Any]:
        """This replica's counters, registry view and index generation."""
        reg = self.registry
        return {"replica": replica_id(), "deployment": "ingress", "pid": os.getpid(), **self.stats,
                "aliases": reg.aliases() if reg else {}, "registered": reg.keys() if reg else None,
                "registry_reloads": getattr(reg, "reloads", 0),
                "index_generation": getattr(self.index, "generation", None) if self.index is not None else None,
                "index_documents": self.index.count if self.index is not None else None}


def _ingress_class() -> Any:
    from ray import serve

    from qswap.server.http.app import create_app

    @serve.deployment(name=INGRESS)
    @serve.ingress()
    class QswapIngress:
        def __init__(self, settings: ServerSettings, encoder: Any, threads: int | None = None,
                     fanout: int = 1) -> None:
            set_threads(threads)
            self.state = RayIngressState(settings, encoder, fanout)
            self.state.load()
            self._stop = start_stats(settings.state_dir, self.state.replica_stats)

        def __serve_build_asgi_app__(self) -> Any:
            return create_app(self.state.settings, state=self.state)

        def replica_stats(self) -> dict[str, Any]:
            return self.state.replica_stats()

    return QswapIngress


def _encoder_class(max_encoders: int, max_batch: int) -> Any:
    from ray import serve

    @serve.deployment(name=ENCODER)
    class QswapEncoder:
        def __init__(self, settings: ServerSettings, threads: int | None = None) -> None:
            self.core = EncoderCore(settings, threads)
            self._stop = start_stats(settings.state_dir, lambda: self.core.replica_stats(replica_id()))

        @serve.multiplexed(max_num_models_per_replica=max_encoders)
        async def get_encoder(self, key: str) -> Any:
            return await self.core.load(key)

        async def encode(self, texts: list[str], key: str) -> Encoded:
            """Encode ``texts`` with encoder ``key`` (batched with concurrent calls)."""
            if key != BASE_KEY:
                await self.get_encoder(key)   # loads it here, or marks it used in the LRU
            with self.core.lease(key):
                out = await self._batch((list(texts), key))
            if isinstance(out, BaseException):
                raise out
            return out

        @serve.batch(max_batch_size=max_batch, batch_wait_timeout_s=0.0, batch_size_fn=rows_of)
        async def _batch(self, items: list[tuple[list[str], str]]) -> list[Any]:
            # No waiting window: a batch is what queued while the previous one ran.
            texts, keys, counts = split_rows(items)
            try:
                emb, trunc = await asyncio.to_thread(self.core.encode_rows, texts, keys)
            except Exception as e:  # noqa: BLE001 - one bad call must not fail its neighbours
                if len(items) == 1:
                    return [e]
                out: list[Any] = []
                for ts, k in items:
                    try:
                        out.append(await asyncio.to_thread(self.core.encode_rows, ts, [k] * len(ts)))
                    except Exception as e1:  # noqa: BLE001
                        out.append(e1)
                return out
            res, o = [], 0
            for n in counts:
                res.append((emb[o:o + n], trunc[o:o + n]))
                o += n
            return res

        def replica_stats(self) -> dict[str, Any]:
            return self.core.replica_stats(replica_id())

    return QswapEncoder


def build_app(settings: ServerSettings, opts: RayOptions | None = None) -> Any:
    """The Ray Serve application (``serve.run`` it): the ingress bound to the encoder deployment.

    Args:
        settings: the server settings (the index must be a path: see :func:`prepare_index`).
        opts: the layout (default: one replica of each).

    Returns:
        the bound application.
    """
    opts = opts or RayOptions()
    options = deployment_options(settings, opts)
    enc_settings, ing_settings = settings, settings
    if opts.encoder_gpus and settings.device is None:
        # GPU encoder replicas behind CPU ingress replicas: each side on its own device.
        enc_settings = settings.model_copy(update={"device": "cuda"})
        ing_settings = settings.model_copy(update={"device": "cpu"})
    if opts.fused:
        return _ingress_class().options(**options[INGRESS], logging_config=LOGGING).bind(
            settings, None, opts.replica_threads, 1)
    enc_max_batch = min(settings.max_batch, options[ENCODER]["max_ongoing_requests"])
    encoder = _encoder_class(opts.max_encoders, max(1, enc_max_batch)).options(
        **options[ENCODER], logging_config=LOGGING).bind(enc_settings, opts.replica_threads)
    return _ingress_class().options(**options[INGRESS], logging_config=LOGGING).bind(
        ing_settings, encoder, opts.replica_threads, opts.encoder_fanout())


def prepare_index(settings: ServerSettings) -> ServerSettings:
    """Give the settings an index path (building the demo index in this process if none) and
    start that index's writer actor (none for a ``milvus://`` collection: Milvus is the writer).

    Args:
        settings: the server settings.

    Returns:
        the settings with absolute index and state-dir paths.
    """
    import ray
    if settings.index is None:
        from qswap.encoders import load_base
        from qswap.server.demo import demo_index_dir, open_demo_index
        base = load_base(settings.model, device="cpu")
        open_demo_index(base).close()
        settings = settings.model_copy(update={"index": demo_index_dir()})
    state_dir = Path(settings.state_dir).resolve()
    if is_milvus(settings.index):   # a collection of a Milvus server: no folder, no writer actor
        return settings.model_copy(update={"state_dir": state_dir})
    index = Path(settings.index).resolve()
    settings = settings.model_copy(update={"index": index, "state_dir": state_dir})
    if not settings.read_only_index:
        writer = get_or_create_writer(index)
        ray.get(writer.generation.remote())   # fails here, not on the first upsert
    return settings


def app_from_env(args: dict[str, Any] | None = None) -> Any:
    """A Ray Serve application builder for config files (``import_path:
    qswap.server.ray.serve:app_from_env``, e.g. in a KubeRay ``RayService``).

    Args:
        args: the config's application ``args``: :class:`RayOptions` fields (as
            ``qswap serve --ray --print-config`` writes them). Server settings come from
            ``QSWAP_*`` environment variables; deployment options in the config's
            ``deployments`` section override those built from ``args``.

    Returns:
        the bound application.
    """
    known = set(RayOptions.__dataclass_fields__)
    unknown = sorted(set(args or {}) - known)
    if unknown:
        raise InvalidInputError(f"unknown application args: {', '.join(unknown)}",
                                f"use only {', '.join(sorted(known))}")
    opts = RayOptions(**(args or {}))
    settings = prepare_index(ServerSettings())
    settings.check()
    return build_app(settings, opts)


def deploy(settings: ServerSettings, opts: RayOptions | None = None, *, app_name: str = APP_NAME,
           route_prefix: str = "/") -> str:
    """Deploy on the connected Ray cluster.

    Args:
        settings: the server settings.
        opts: the layout.
        app_name: the Serve application's name.
        route_prefix: where the app answers.

    Returns:
        the HTTP URL of Serve's proxy (once every replica is constructed).
    """
    from ray import serve
    opts = fit_layout(opts or RayOptions(), cluster_nodes())   # refuses what would wait forever
    settings = prepare_index(settings)
    # No per-request access log lines from Serve's proxy and replicas (qswap logs its own
    # errors): on a small machine writing and shipping them cost more than the request.
    serve.start(http_options={"host": settings.host, "port": settings.port}, logging_config=LOGGING)
    _check_listening(settings)
    serve.run(build_app(settings, opts), name=app_name, route_prefix=route_prefix, blocking=False)
    return f"http://{settings.host}:{settings.port}{route_prefix.rstrip('/')}"


def _check_listening(settings: ServerSettings) -> None:
    """Refuse when Serve was already running on this cluster with other HTTP options: it keeps them
    (``serve.start`` only logs that the new ones are ignored), so the app would answer elsewhere
    than ``--host``/``--port`` say."""
    from ray.serve.context import _get_global_client   # the one place Serve exposes its running HTTP options
    http = _get_global_client().http_config
    if (http.host, int(http.port)) != (settings.host, int(settings.port)):
        raise InvalidInputError(
            f"Ray Serve already runs on this cluster with its proxies on {http.host}:{http.port}, not "
            f"{settings.host}:{settings.port}", f"pass --host {http.host} --port {http.port}, or stop Serve "
            "first (serve shutdown)")


def serve_forever(settings: ServerSettings, opts: RayOptions, *, address: str | None) -> int:
    """``qswap serve --ray``: deploy, then wait until interrupted; then delete the app.

    Args:
        settings: the server settings.
        opts: the layout.
        address: the Ray cluster to join (None: start a local one).

    Returns:
        the exit status.
    """
    import ray
    from ray import serve
    opts.check()
    init_ray(address)
    url = deploy(settings, opts)
    log.info("serving on Ray", extra={"url": url, "ingress_replicas": opts.replicas,
                                      "encoder_replicas": opts.replicas if opts.encoder_replicas is None
                                      else opts.encoder_replicas,
                                      "max_encoders_per_replica": opts.max_encoders,
                                      "ray_address": ray.get_runtime_context().gcs_address})
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    while not stop.wait(1.0):
        pass
    log.info("stopping: deleting the Ray Serve app")
    serve.delete(APP_NAME)
    return 0
