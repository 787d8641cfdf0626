"""Talking to a Milvus: locations, the connection, what the server supports, and its failures as
qswap's named errors.

Every call to Milvus goes through :meth:`Connection.call`, which gives it a deadline (pymilvus
otherwise retries an unreachable server for minutes) and maps what went wrong:

- the server cannot be reached, or does not answer in time: :class:`~qswap.errors.IndexUnavailableError`
  (503 with ``Retry-After`` at the HTTP edge); nothing the caller was told succeeded is lost, a
  write that raised was not acknowledged;
- a collection that is no longer loaded (a server restarted) is loaded again and the call retried once;
- data the schema refuses: :class:`~qswap.errors.InvalidInputError`;
- anything else: :class:`~qswap.index.errors.IndexCorruptError`.

Servers differ by version (:class:`ServerFeatures`): what the connected one lacks is logged once
when it is opened, with what qswap does instead.
"""

from __future__ import annotations

import logging
import os
import re
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs

from qswap.errors import IndexUnavailableError, InvalidInputError, QswapError
from qswap.index.errors import IndexCorruptError

log = logging.getLogger("qswap.index")

#: Deadline of one call (search, query, upsert, delete) in seconds; ``QSWAP_MILVUS_TIMEOUT_S`` overrides it.
CALL_TIMEOUT_S = 10.0
#: Deadline of a build step (insert of a batch, index creation, loading a collection).
BUILD_TIMEOUT_S = 600.0
#: Consistency of reads (search, query); ``QSWAP_MILVUS_CONSISTENCY`` overrides it. "Session": this
#: process sees its own writes at once and other writers' within the server's time tick. "Strong"
#: waits for the next time tick on every read (200 ms and more on a default server: see
#: bench/results/index/milvus-server-strong), whether or not anything was written.
READ_CONSISTENCY = "Session"
CONSISTENCY_LEVELS = ("Strong", "Session", "Bounded", "Eventually")
#: At "Session", reads of a collection this process wrote less than this long ago are "Strong":
#: pymilvus' own session timestamp is not enough (a delete on a 2.3 server does not advance it, and a
#: search right after the delete still found the deleted document).
STRONG_AFTER_WRITE_S = 2.0
_WRITES = ("insert", "upsert", "delete")
_last_write: dict[tuple[str, str], float] = {}   # (uri, collection) -> monotonic time, for the whole process


# ---------------------------------------------------------------------- locations
def parse_location(location: str) -> tuple[str, str]:
    """``milvus://...?collection=NAME`` -> (pymilvus URI, collection name)."""
    scheme = "http://"
    rest = location
    for prefix, sch in (("milvus+https://", "https://"), ("milvus://", "http://")):
        if rest.startswith(prefix):
            rest, scheme = rest[len(prefix):], sch
            break
    else:
        raise InvalidInputError(f"{location!r} is not a milvus:// location",
                                "write milvus://PATH.db?collection=NAME or milvus://HOST:PORT?collection=NAME")
    where, _, query = rest.partition("?")
    names = parse_qs(query).get("collection", [])
    if not where or len(names) != 1 or not names[0]:
        raise InvalidInputError(f"{location!r} names no collection",
                                "write milvus://PATH.db?collection=NAME or milvus://HOST:PORT?collection=NAME")
    uri = where if where.endswith(".db") else scheme + where
    return uri, names[0]


# ---------------------------------------------------------------------- features by version
@dataclass(frozen=True)
class ServerFeatures:
    """What the connected Milvus supports, from its version (``get_server_version``).

    - ``multi_vector``: more than one vector field per collection (Milvus 2.4): without it the full
      vectors used for rescoring are kept in a FLOAT array field, which rescoring reads the same way;
    - ``filter_templating``: ``filter_params`` (Milvus 2.5): qswap does not need it, every filter
      value is an escaped literal (:mod:`~qswap.index.backends.milvus.expr`) on every version;
    - ``quantized_hnsw``: HNSW_SQ / HNSW_PQ (Milvus 2.6): without it such a build is refused.
    """

    version: str
    lite: bool
    multi_vector: bool
    filter_templating: bool
    quantized_hnsw: bool

    def missing(self) -> list[str]:
        """One line per feature this server lacks, saying what qswap does instead."""
        out = []
        if not self.multi_vector:
            out.append("one vector field per collection (Milvus < 2.4): full vectors for rescoring are kept "
                       "in a FLOAT array field")
        if not self.filter_templating:
            out.append("no filter templating (filter_params, Milvus >= 2.5): filter values are sent as "
                       "escaped literals, as on every version")
        if not self.quantized_hnsw:
            out.append("no HNSW_SQ / HNSW_PQ (Milvus >= 2.6): an hnsw build with sq8/sq4/pq is refused")
        return out

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "missing": self.missing()}


def server_features(version: str) -> ServerFeatures:
    """Features of a Milvus by its version string (``v2.3.5-lite``, ``v2.5.4``, ``milvus_lite-3.2.2``)."""
    if version.startswith("milvus_lite"):
        # milvus-lite 3 (an in-process engine): several vector fields, no templates, HNSW_SQ/PQ.
        return ServerFeatures(version, lite=True, multi_vector=True, filter_templating=False, quantized_hnsw=True)
    m = re.match(r"v?(\d+)\.(\d+)", version)
    major_minor = (int(m.group(1)), int(m.group(2))) if m else (99, 0)   # unknown: assume a new server
    return ServerFeatures(version, lite=False, multi_vector=major_minor >= (2, 4),
                          filter_templating=major_minor >= (2, 5), quantized_hnsw=major_minor >= (2, 6))


# ---------------------------------------------------------------------- errors
# pymilvus' names for "this row does not fit the schema": the caller's data, not a damaged index.
_INPUT_ERRORS = ("DataNotMatchException", "ParamError", "DataTypeNotSupportException")
_UNAVAILABLE_TYPES = ("MilvusUnavailableException", "ConnectError", "_InactiveRpcError", "_MultiThreadedRendezvous")
_CONNECT_FAILED = 2          # pymilvus Status.CONNECT_FAILED
_NOT_LOADED = 101            # Milvus "collection not loaded"
# what Milvus and pymilvus say while a server is down, starting, or past a call's deadline
_UNAVAILABLE_TEXT = ("unavailable", "retry timeout", "deadline_exceeded", "connection refused", "not ready",
                     "node not match")


def is_unavailable(e: BaseException) -> bool:
    """True when ``e`` says the server cannot be reached or did not answer in time (not a refusal)."""
    if type(e).__name__ in _UNAVAILABLE_TYPES or getattr(e, "code", None) == _CONNECT_FAILED:
        return True
    text = str(e).lower()
    return type(e).__name__ == "MilvusException" and any(t in text for t in _UNAVAILABLE_TEXT)


def is_not_loaded(e: BaseException) -> bool:
    return getattr(e, "code", None) == _NOT_LOADED or "not loaded" in str(e).lower()


def milvus_error(e: BaseException, what: str, uri: str = "") -> QswapError:
    """A pymilvus failure as qswap's named error (see the module doc)."""
    if isinstance(e, QswapError):
        return e
    where = f" at {_public(uri)}" if uri else ""
    if is_unavailable(e):
        return IndexUnavailableError(f"the Milvus server{where} did not answer {what} "
                                     f"({type(e).__name__}: {str(e)[:200]})",
                                     "check that the Milvus server is running and reachable; retry after "
                                     "the Retry-After seconds (nothing of this request was acknowledged)")
    if type(e).__name__ in _INPUT_ERRORS:
        return InvalidInputError(f"Milvus refused the data of {what} ({str(e)[:300]})",
                                 "metadata must be JSON with 64-bit integers; see the request schema")
    return IndexCorruptError(f"Milvus{where} refused {what} ({type(e).__name__}: {str(e)[:300]})",
                             "check that the Milvus server is up and the collection is loaded")


def _public(uri: str) -> str:
    return uri.split("@")[-1]


# ---------------------------------------------------------------------- the connection
class Connection:
    """A pymilvus client, the server's features and the deadline of each call."""

    def __init__(self, client: Any, uri: str, timeout_s: float, consistency: str = READ_CONSISTENCY) -> None:
        self.client = client
        self.uri = uri
        self.timeout_s = timeout_s
        self.consistency = consistency
        version = self.call("get_server_version", "a version check")
        self.features = server_features(str(version))

    @property
    def is_lite(self) -> bool:
        return self.uri.endswith(".db")

    def call(self, method: str, what: str, *args: Any, timeout_s: float | None = None, **kw: Any) -> Any:
        """``client.method(*args, **kw)`` under a deadline, failures mapped (see the module doc)."""
        kw["timeout"] = timeout_s or self.timeout_s
        write = (self.uri, str(args[0] if args else kw.get("collection_name"))) if method in _WRITES else None
        try:
            return getattr(self.client, method)(*args, **kw)
        except Exception as e:  # noqa: BLE001 - pymilvus and grpc raise many unrelated types
            raise milvus_error(e, what, self.uri) from None
        finally:
            if write is not None:   # also after a failure: a write that raised may have been applied
                self.wrote(write[1])

    def wrote(self, collection: str) -> None:
        """Note a change of ``collection`` made otherwise than by a write call (a build's rename)."""
        _last_write[(self.uri, collection)] = time.monotonic()

    def read_level(self, collection: str) -> str:
        """The consistency level of a read of ``collection`` now (see :data:`STRONG_AFTER_WRITE_S`)."""
        if self.consistency == "Session":
            t = _last_write.get((self.uri, collection))
            if t is not None and time.monotonic() - t < STRONG_AFTER_WRITE_S:
                return "Strong"
        return self.consistency

    def call_loaded(self, collection: str, method: str, what: str, *args: Any, **kw: Any) -> Any:
        """:meth:`call` of a read (search, query) on a collection that must be loaded, at the
        connection's read consistency: a server that restarted may have the collection unloaded;
        it is loaded again and the call retried once."""
        kw.setdefault("consistency_level", self.read_level(collection))
        try:
            return getattr(self.client, method)(*args, timeout=self.timeout_s, **kw)
        except Exception as e:  # noqa: BLE001
            if not is_not_loaded(e):
                raise milvus_error(e, what, self.uri) from None
        log.warning("Milvus at %s had collection %r unloaded (a restart?): loading it again", _public(self.uri),
                    collection)
        self.call("load_collection", "loading the collection", collection, timeout_s=BUILD_TIMEOUT_S)
        return self.call(method, what, *args, **kw)

    def close(self) -> None:
        try:
            self.client.close()
        except Exception:  # noqa: BLE001 - closing a dead connection is not an error
            pass


def read_consistency() -> str:
    """The read consistency level: ``QSWAP_MILVUS_CONSISTENCY`` if set (checked), else :data:`READ_CONSISTENCY`."""
    raw = os.environ.get("QSWAP_MILVUS_CONSISTENCY", "").strip()
    if not raw:
        return READ_CONSISTENCY
    level = next((c for c in CONSISTENCY_LEVELS if c.lower() == raw.lower()), None)
    if level is None:
        raise InvalidInputError(f"QSWAP_MILVUS_CONSISTENCY={raw!r} is not a Milvus consistency level",
                                "use one of " + ", ".join(CONSISTENCY_LEVELS))
    return level


def connect(uri: str, timeout_s: float | None = None) -> Connection:
    """Connect to a Milvus server (``http://HOST:PORT``) or milvus-lite file (``PATH.db``).

    Raises:
        IndexUnavailableError: nothing answers at ``uri`` within the deadline.
    """
    try:
        from pymilvus import MilvusClient
    except ImportError:
        raise InvalidInputError("the Milvus backend needs pymilvus", "pip install 'qswap[milvus]'") from None
    if uri.endswith(".db"):
        Path(uri).parent.mkdir(parents=True, exist_ok=True)
    timeout = timeout_s or float(os.environ.get("QSWAP_MILVUS_TIMEOUT_S", CALL_TIMEOUT_S))
    consistency = read_consistency()
    try:
        client = MilvusClient(uri=uri, token=os.environ.get("QSWAP_MILVUS_TOKEN", ""), timeout=timeout)
    except Exception as e:  # noqa: BLE001 - pymilvus raises several unrelated types when it cannot connect
        raise IndexUnavailableError(f"cannot connect to Milvus at {_public(uri)} ({type(e).__name__}: {str(e)[:200]})",
                                    "check the URI (a .db path for milvus-lite, http://host:19530 for a server) "
                                    "and that the server is running") from None
    try:
        conn = Connection(client, uri, timeout, consistency)
    except BaseException:
        client.close()
        raise
    if conn.features.missing():
        log.info("Milvus at %s is %s: %s", _public(uri), conn.features.version, "; ".join(conn.features.missing()))
    return conn
