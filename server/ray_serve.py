"""``qswap serve --ray``: the same FastAPI app on Ray Serve, with encoders as multiplexed models.

One deployment, ``QswapReplica``, is the HTTP ingress: every replica runs the app of
:func:`qswap.server.app.create_app` (same routes, checks, errors) over the same base model.
Ray Serve's proxy spreads requests over replicas. A search is admitted as in one process (the
encoder resolved to an exact ``name@version`` from the shared alias table and held); then:

- the encoder is loaded in this replica (or is ``base``): the local micro-batcher serves it;
- otherwise the request goes through the deployment's own handle with
  ``multiplexed_model_id=name@version``: Ray Serve routes it to a replica that holds that
  encoder, or to one that will load it. Each replica keeps at most
  ``--max-encoders-per-replica`` encoders in Ray Serve's per-replica LRU
  (``@serve.multiplexed``); an encoder it drops is detached from the replica's pool.

Registry and index are shared by all replicas (:mod:`qswap.server.ray_registry`,
:mod:`qswap.server.ray_index`). Replica count and autoscaling are Ray Serve's own settings.
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import threading
import time
from pathlib import Path
from typing import Any, Callable

from qswap.encoders import BASE_KEY
from qswap.errors import InvalidInputError, QswapError
from qswap.index.ray_build import init_ray
from qswap.server.batching import EmbedOutcome, MicroBatcher, SearchOutcome
from qswap.server.config import ServerSettings
from qswap.server.errors import DeadlineExceededError, NotReadyError
from qswap.server.ray_index import SharedIndex, get_or_create_writer
from qswap.server.ray_registry import SharedRegistry
from qswap.server.state import ServerState

log = logging.getLogger("qswap.server")

APP_NAME = "qswap"
REPLICA_STATS_DIR = "replicas"
STATS_EVERY_S = 0.5
DEPLOYMENT = "QswapReplica"


class _Lease:
    """What Ray Serve's multiplexed LRU holds per encoder; dropping it detaches the encoder."""

    def __init__(self, registry: SharedRegistry, key: str) -> None:
        self.registry = registry
        self.key = key
        self._released = False

    def __del__(self) -> None:
        # Serve calls this once when its LRU evicts the encoder; the garbage collector may
        # call it again later, when the same key may be loaded anew: only the first counts.
        if self._released:
            return
        self._released = True
        try:
            self.registry.unload(self.key)
        except Exception:  # noqa: BLE001 - never fail an eviction
            log.exception("unloading an evicted encoder failed")


class RoutingBatcher:
    """The replica's batcher as the routes see it: local when the encoder is here, else routed."""

    def __init__(self, local: MicroBatcher, replica: "ReplicaCore") -> None:
        self.local = local
        self.replica = replica

    def start(self) -> None:
        self.local.start()

    def stop(self, timeout: float = 10.0) -> None:
        self.local.stop(timeout)

    def drain(self) -> None:
        """SIGTERM: stop admitting here (forwarded requests in flight finish)."""
        self.local.drain()

    @property
    def pending(self) -> int:
        return self.local.pending

    @property
    def thread(self) -> threading.Thread:
        return self.local.thread

    async def call(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        return await self.local.call(fn, *args, **kwargs)

    async def embed(self, texts: list[str], key: str, on_done: Callable[[], None] | None = None,
                    timeout_s: float | None = None) -> EmbedOutcome:
        """Embeddings run on this replica (the encoder is loaded here first if it is not)."""
        if key != BASE_KEY:
            try:
                await self.replica.touch(key)
            except BaseException:
                if on_done is not None:
                    on_done()   # the batcher never saw it: release the reference here
                raise
        return await self.local.embed(texts, key, on_done, timeout_s=timeout_s)

    async def search(self, texts: list[str], key: str, k: int, filter: dict[str, Any] | None = None,
                     with_text: bool = True, on_done: Callable[[], None] | None = None,
                     timeout_s: float | None = None, tokens: list[int] | None = None) -> SearchOutcome:
        r = self.replica
        resident = key == BASE_KEY or r.state.registry.is_loaded(key)
        if resident or r.forwarding >= r.max_forwarding:
            # Here: the encoder is loaded here, or too many of this replica's requests already
            # wait on other replicas. The cap keeps a share of every replica's request slots
            # for work that waits on nobody, so replicas forwarding to each other cannot all
            # end up waiting for a slot on the other (a deadlock).
            if key != BASE_KEY:
                try:
                    await r.touch(key)   # loads it here if it is not resident
                except BaseException:
                    if on_done is not None:
                        on_done()   # the batcher never saw it: release the reference here
                    raise
            r.stats["local" if resident else "overflow_local"] += 1
            return await self.local.search(texts, key, k, filter, with_text, on_done, timeout_s=timeout_s,
                                           tokens=tokens)
        r.stats["forwarded"] += 1
        r.forwarding += 1
        try:
            if timeout_s is None:
                return await r.forward(texts, key, k, filter, with_text)
            try:   # the same deadline as a local request: the caller gets 504, not a late answer
                return await asyncio.wait_for(r.forward(texts, key, k, filter, with_text), timeout_s)
            except asyncio.TimeoutError:
                raise DeadlineExceededError(
                    "the request did not finish within its deadline and was dropped",
                    "retry later, or give a longer X-Request-Timeout") from None
        finally:
            r.forwarding -= 1
            if on_done is not None:
                on_done()


class RayServerState(ServerState):
    """A replica's state: shared registry, shared index view, routing batcher; loads eagerly."""

    def __init__(self, settings: ServerSettings, replica: "ReplicaCore") -> None:
        super().__init__(settings)
        self.replica = replica
        self.local_batcher: MicroBatcher | None = None

    def open_index(self, base: Any) -> Any:
        assert self.settings.index is not None   # the driver resolves the demo index to a path
        return SharedIndex(Path(self.settings.index), writable=not self.settings.read_only_index)

    def make_registry(self, **kw: Any) -> SharedRegistry:
        return SharedRegistry(**kw)

    def make_batcher(self, **kw: Any) -> RoutingBatcher:
        self.local_batcher = MicroBatcher(**kw)
        return RoutingBatcher(self.local_batcher, self.replica)

    def start_loading(self) -> None:
        # Loaded in the replica's constructor: Ray Serve routes to a replica only once it is
        # constructed, so no request meets a replica that is still loading.
        pass

    def load(self) -> None:
        super().load()
        assert isinstance(self.registry, SharedRegistry)
        self.registry.start_polling()

    async def prepare_encoder(self, key: str) -> None:
        # Where the encoder loads is decided by the routing batcher: here if it is resident,
        # otherwise on the replica Ray Serve routes the request to.
        return None


def _unwrap(e: BaseException) -> BaseException:
    """A qswap error raised on another replica, as itself; a lost replica as a 503."""
    import ray
    if isinstance(e, ray.exceptions.RayTaskError) and isinstance(e.cause, QswapError):
        return e.cause
    if isinstance(e, (ray.exceptions.RayActorError, ray.exceptions.ActorDiedError,
                      ray.exceptions.ActorUnavailableError)):
        return NotReadyError("the replica serving this request went away", "retry the request")
    return e


class ReplicaCore:
    """Everything one replica does besides HTTP (kept apart from Ray Serve's class decorators)."""

    def __init__(self, settings: ServerSettings, max_encoders: int, app_name: str, deployment: str,
                 threads: int | None = None, max_ongoing: int = 64) -> None:
        from ray import serve
        if threads:
            # Ray sets OMP_NUM_THREADS to the actor's num_cpus (1 by default): say otherwise here.
            import faiss
            import torch
            torch.set_num_threads(threads)
            faiss.omp_set_num_threads(threads)
        self.settings = settings
        self.app_name = app_name
        self.deployment = deployment
        self.stats = {"local": 0, "forwarded": 0, "overflow_local": 0, "served_for_others": 0,
                      "encoder_requests": 0, "loads": 0}
        self.forwarding = 0   # this replica's requests now waiting on another replica (event loop only)
        self.max_forwarding = max(1, max_ongoing // 2)
        self._handle: Any = None
        self.state = RayServerState(settings, self)

        async def load_encoder(key: str) -> _Lease:
            reg = self.state.registry
            assert isinstance(reg, SharedRegistry)
            if not reg.is_loaded(key):
                self.stats["loads"] += 1
                await asyncio.to_thread(reg.ensure_loaded, key)
            return _Lease(reg, key)

        self.get_encoder = serve.multiplexed(max_num_models_per_replica=max_encoders)(load_encoder)
        self.state.load()
        self._stop = threading.Event()
        threading.Thread(target=self._write_stats_loop, name="qswap-replica-stats", daemon=True).start()

    def _write_stats_loop(self, every_s: float = STATS_EVERY_S) -> None:
        """Each replica's counters as ``<state dir>/replicas/<replica id>.json`` (atomic), so that
        operators and benchmarks can read every replica without going through the router."""
        from qswap.atomic import atomic_write_json
        folder = Path(self.settings.state_dir) / REPLICA_STATS_DIR
        folder.mkdir(parents=True, exist_ok=True)
        while not self._stop.wait(every_s):
            try:
                st = self.replica_stats()
                atomic_write_json(folder / f"{st['replica']}.json", {**st, "written_at": time.time()})
            except Exception:  # noqa: BLE001 - observability must not take the replica down
                log.exception("writing replica stats failed")

    @property
    def handle(self) -> Any:
        if self._handle is None:
            from ray import serve
            self._handle = serve.get_deployment_handle(self.deployment, app_name=self.app_name)
        return self._handle

    async def touch(self, key: str) -> None:
        """Mark ``key`` used in Serve's LRU (and report it held here, for routing)."""
        self.stats["encoder_requests"] += 1
        await self.get_encoder(key)

    async def forward(self, texts: list[str], key: str, k: int, filter: dict[str, Any] | None,
                      with_text: bool) -> SearchOutcome:
        try:
            return await self.handle.options(multiplexed_model_id=key).search_here.remote(
                texts, key, k, filter, with_text)
        except Exception as e:
            raise _unwrap(e) from None

    async def search_here(self, texts: list[str], key: str, k: int, filter: dict[str, Any] | None,
                          with_text: bool) -> SearchOutcome:
        """Serve a request routed here for encoder ``key`` (loading it if needed)."""
        state = self.state
        state.require_ready()
        reg = state.registry
        assert reg is not None and self.state.local_batcher is not None
        self.stats["served_for_others"] += 1
        self.stats["encoder_requests"] += 1
        held = reg.acquire(encoder=key)   # NotFoundError if it was deleted meanwhile
        try:
            await self.get_encoder(held)
            if not reg.is_loaded(held):   # dropped by the LRU between load and use
                await asyncio.to_thread(reg.ensure_loaded, held)
        except BaseException:
            reg.release(held)
            raise
        return await self.state.local_batcher.search(texts, held, k, filter, with_text,
                                                     on_done=lambda: reg.release(held))

    def replica_stats(self) -> dict[str, Any]:
        from ray import serve
        ctx = serve.get_replica_context()
        reg = self.state.registry
        return {"replica": ctx.replica_id.unique_id, "pid": os.getpid(), **self.stats,
                "resident": sorted(k for k in (reg.keys() if reg else []) if reg.is_loaded(k)),
                "aliases": reg.aliases() if reg else {}, "registered": reg.keys() if reg else None,
                "registry_reloads": getattr(reg, "reloads", 0),
                "index_generation": self.state.index.generation if self.state.index is not None else None}


def _deployment_class() -> Any:
    from ray import serve

    from qswap.server.app import create_app

    @serve.deployment(name=DEPLOYMENT)
    @serve.ingress()
    class QswapReplica:
        def __init__(self, settings: ServerSettings, max_encoders: int, app_name: str,
                     threads: int | None = None, max_ongoing: int = 64) -> None:
            self.core = ReplicaCore(settings, max_encoders, app_name, DEPLOYMENT, threads, max_ongoing)

        def __serve_build_asgi_app__(self) -> Any:
            return create_app(self.core.settings, state=self.core.state)

        async def search_here(self, texts: list[str], key: str, k: int, filter: dict[str, Any] | None,
                              with_text: bool) -> SearchOutcome:
            return await self.core.search_here(texts, key, k, filter, with_text)

        def replica_stats(self) -> dict[str, Any]:
            return self.core.replica_stats()

    return QswapReplica


def build_app(settings: ServerSettings, *, replicas: int | str = 1, max_encoders: int = 8,
              autoscaling: dict[str, Any] | None = None, replica_cpus: float = 1.0,
              replica_threads: int | None = None, max_ongoing_requests: int | None = None,
              app_name: str = APP_NAME) -> Any:
    """The Ray Serve application (``serve.run`` it). ``replicas`` may be ``"auto"``; an
    ``autoscaling`` dict is Ray Serve's ``autoscaling_config``, passed through."""
    if max_encoders < 1:
        raise InvalidInputError(f"--max-encoders-per-replica must be at least 1, got {max_encoders}",
                                "give a positive number")
    # Ray Serve's default of 5 ongoing requests per replica would cap each micro-batch at 5:
    # by default let a replica take as many as one batch holds.
    max_ongoing = max_ongoing_requests or settings.max_batch
    if max_ongoing < 2:
        raise InvalidInputError(f"--max-ongoing-requests must be at least 2, got {max_ongoing}",
                                "a replica needs a slot for its own requests and one for routed ones")
    options: dict[str, Any] = {"ray_actor_options": {"num_cpus": replica_cpus}, "max_ongoing_requests": max_ongoing,
                               "logging_config": {"enable_access_log": False, "log_level": "WARNING"}}
    if autoscaling is not None:
        options["autoscaling_config"] = autoscaling
    else:
        options["num_replicas"] = replicas
    return _deployment_class().options(**options).bind(settings, max_encoders, app_name, replica_threads,
                                                                 max_ongoing)


def prepare_index(settings: ServerSettings) -> ServerSettings:
    """Give the settings an index path (building the demo index in this process if none) and
    start that index's writer actor."""
    import ray
    if settings.index is None:
        from qswap.encoders import load_base
        from qswap.server.demo import demo_index_dir, open_demo_index
        base = load_base(settings.model, device="cpu")
        open_demo_index(base).close()
        settings = settings.model_copy(update={"index": demo_index_dir()})
    index = Path(settings.index).resolve()
    settings = settings.model_copy(update={"index": index, "state_dir": Path(settings.state_dir).resolve()})
    if not settings.read_only_index:
        writer = get_or_create_writer(index)
        ray.get(writer.generation.remote())   # fails here, not on the first upsert
    return settings


def app_from_env(args: dict[str, Any] | None = None) -> Any:
    """A Ray Serve application builder for config files (``import_path:
    qswap.server.ray_serve:app_from_env``, e.g. in a KubeRay ``RayService``): settings from
    ``QSWAP_*`` environment variables, ``QSWAP_RAY_MAX_ENCODERS`` encoders per replica (default 8).
    Replica count and autoscaling come from the config's deployment options."""
    settings = prepare_index(ServerSettings())
    settings.check()
    max_encoders = int((args or {}).get("max_encoders_per_replica") or os.environ.get("QSWAP_RAY_MAX_ENCODERS", 8))
    return build_app(settings, max_encoders=max_encoders)


def deploy(settings: ServerSettings, *, replicas: int | str = 1, max_encoders: int = 8,
           autoscaling: dict[str, Any] | None = None, replica_cpus: float = 1.0,
           replica_threads: int | None = None, max_ongoing_requests: int | None = None,
           app_name: str = APP_NAME, route_prefix: str = "/") -> str:
    """Deploy on the connected Ray cluster; returns the HTTP URL once every replica is ready."""
    from ray import serve
    settings = prepare_index(settings)
    # No per-request access log lines from Serve's proxy and replicas (qswap logs its own
    # errors): on a small machine writing and shipping them cost more than the request.
    serve.start(http_options={"host": settings.host, "port": settings.port},
                logging_config={"enable_access_log": False, "log_level": "WARNING"})
    app = build_app(settings, replicas=replicas, max_encoders=max_encoders, autoscaling=autoscaling,
                    replica_cpus=replica_cpus, replica_threads=replica_threads,
                    max_ongoing_requests=max_ongoing_requests, app_name=app_name)
    serve.run(app, name=app_name, route_prefix=route_prefix, blocking=False)
    return f"http://{settings.host}:{settings.port}{route_prefix.rstrip('/')}"


def serve_forever(settings: ServerSettings, *, address: str | None, replicas: int | str, max_encoders: int,
                  autoscaling: dict[str, Any] | None = None, replica_cpus: float = 1.0,
                  replica_threads: int | None = None, max_ongoing_requests: int | None = None) -> int:
    """``qswap serve --ray``: deploy, then wait until interrupted; then delete the app."""
    from ray import serve
    init_ray(address)
    url = deploy(settings, replicas=replicas, max_encoders=max_encoders, autoscaling=autoscaling,
                 replica_cpus=replica_cpus, replica_threads=replica_threads,
                 max_ongoing_requests=max_ongoing_requests)
    import ray
    log.info("serving on Ray", extra={"url": url, "replicas": replicas, "max_encoders_per_replica": max_encoders,
                                      "ray_address": ray.get_runtime_context().gcs_address})
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    while not stop.wait(1.0):
        pass
    log.info("stopping: deleting the Ray Serve app")
    serve.delete(APP_NAME)
    time.sleep(0.1)
    return 0
