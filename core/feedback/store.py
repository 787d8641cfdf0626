"""The feedback capture store: what each search showed, what the user clicked, experiments.

One SQLite file (``feedback.sqlite`` in the feedback directory) in WAL mode: appends are
crash-safe (a committed transaction survives a kill; an uncommitted one leaves no trace), and
several processes (Ray replicas over shared storage) may write it. Searches never wait on the
disk: impressions go through a bounded queue to one writer thread (when the queue is full the
impression is dropped and counted, so memory stays bounded under any load). Retention is
bounded by age and by file size; the oldest impressions go first, with their feedback.

The store keeps query text: it is off unless the operator gives ``--feedback-dir``.
"""

from __future__ import annotations

import json
import logging
import queue
import sqlite3
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator

from qswap.errors import ConflictError, InvalidInputError, NotFoundError
from qswap.feedback.experiment import ExperimentRecord, ExperimentStats

log = logging.getLogger("qswap.feedback")

DB_FILE = "feedback.sqlite"
_SCHEMA = """
CREATE TABLE IF NOT EXISTS impressions (
    request_id TEXT NOT NULL, qi INTEGER NOT NULL, ts REAL NOT NULL, domain TEXT, encoder TEXT NOT NULL,
    query TEXT NOT NULL, ids TEXT NOT NULL, teams TEXT, experiment TEXT, client TEXT,
    PRIMARY KEY (request_id, qi));
CREATE INDEX IF NOT EXISTS impressions_ts ON impressions (ts);
CREATE INDEX IF NOT EXISTS impressions_domain ON impressions (domain, ts);
CREATE TABLE IF NOT EXISTS feedback (
    seq INTEGER PRIMARY KEY AUTOINCREMENT, request_id TEXT NOT NULL, qi INTEGER NOT NULL, ts REAL NOT NULL,
    clicks TEXT NOT NULL, grades TEXT, experiment TEXT, outcome INTEGER);
CREATE INDEX IF NOT EXISTS feedback_request ON feedback (request_id, qi);
CREATE TABLE IF NOT EXISTS experiments (
    domain TEXT PRIMARY KEY, id TEXT NOT NULL, doc TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS experiment_stats (
    id TEXT PRIMARY KEY, impressions INTEGER NOT NULL DEFAULT 0, wins INTEGER NOT NULL DEFAULT 0,
    losses INTEGER NOT NULL DEFAULT 0, ties INTEGER NOT NULL DEFAULT 0, shadow_runs INTEGER NOT NULL DEFAULT 0,
    shadow_skipped INTEGER NOT NULL DEFAULT 0, overlap_sum REAL NOT NULL DEFAULT 0,
    latency_ms_sum REAL NOT NULL DEFAULT 0, clients INTEGER NOT NULL DEFAULT 0,
    counted_wins INTEGER NOT NULL DEFAULT 0, counted_losses INTEGER NOT NULL DEFAULT 0);
CREATE TABLE IF NOT EXISTS experiment_clients (
    id TEXT NOT NULL, client TEXT NOT NULL, decided INTEGER NOT NULL DEFAULT 0, PRIMARY KEY (id, client));
"""
# Columns added to a store written before them: (table, column, declaration).
_ADDED = (("impressions", "client", "TEXT"),
          ("experiment_stats", "clients", "INTEGER NOT NULL DEFAULT 0"),
          ("experiment_stats", "counted_wins", "INTEGER NOT NULL DEFAULT 0"),
          ("experiment_stats", "counted_losses", "INTEGER NOT NULL DEFAULT 0"))
_STATS = ("impressions", "wins", "losses", "ties", "clients", "counted_wins", "counted_losses", "shadow_runs",
          "shadow_skipped", "overlap_sum", "latency_ms_sum")
_IMPRESSION_COLS = "request_id, qi, domain, encoder, query, ids, teams, experiment, ts, client"


@dataclass(frozen=True)
class Impression:
    """One query of one search as the user saw it."""

    request_id: str              # the impression id the server issued for the search (its capture key)
    qi: int                      # the query's position in the request
    domain: str | None
    encoder: str                 # name@version that served it (the control's, when interleaved)
    query: str
    ids: list[str]               # shown document ids, best first
    teams: list[str] | None = None     # per position, A/B, when the list was interleaved
    experiment: str | None = None
    ts: float = field(default_factory=time.time)
    client: str | None = None    # who searched, as the server knows it (the evidence bound counts clients)


@dataclass(frozen=True)
class ShadowRun:
    """One shadow run of an experiment's candidate (``overlap`` None: skipped, the server was busy)."""

    experiment: str
    overlap: float | None
    latency_ms: float | None = None


@dataclass(frozen=True)
class Feedback:
    """A user's feedback on one impression: clicked ids, or graded judgements (id -> grade)."""

    clicks: list[str]
    grades: dict[str, int] | None = None


class FeedbackStore:
    """Append-only capture of impressions and feedback in one SQLite file.

    Args:
        directory: the feedback directory (created).
        max_bytes: the file is pruned (oldest impressions first) beyond this size.
        max_age_s: impressions older than this are pruned, with their feedback.
        queue_size: impressions waiting for the writer at most; more are dropped and counted.
    """

    def __init__(self, directory: Path, *, max_bytes: int = 1 << 30, max_age_s: float = 30 * 86400,
                 queue_size: int = 10000) -> None:
        self.directory = Path(directory)
        self.directory.mkdir(parents=True, exist_ok=True)
        self.path = self.directory / DB_FILE
        self.max_bytes = max_bytes
        self.max_age_s = max_age_s
        self.dropped = 0
        self._lock = threading.Lock()
        self._db = sqlite3.connect(self.path, check_same_thread=False, isolation_level=None, timeout=30)
        self._db.execute("PRAGMA journal_mode=WAL")
        self._db.execute("PRAGMA synchronous=NORMAL")   # WAL + NORMAL: a commit survives a process kill
        self._db.executescript(_SCHEMA)
        self._migrate()
        self._queue: queue.Queue[Impression | ShadowRun | None] = queue.Queue(maxsize=queue_size)
        self._writes_since_prune = 0
        self._writer = threading.Thread(target=self._write_loop, name="qswap-feedback", daemon=True)
        self._writer.start()

    def _migrate(self) -> None:
        """Add the columns a store written by an older server lacks (their defaults fill them)."""
        for table, column, decl in _ADDED:
            have = {row[1] for row in self._db.execute(f"PRAGMA table_info({table})")}
            if column not in have:
                self._db.execute(f"ALTER TABLE {table} ADD COLUMN {column} {decl}")

    # -- capture -----------------------------------------------------------------------------

    def record(self, items: list[Impression | ShadowRun]) -> None:
        """Queue impressions (or shadow runs) for the writer; never blocks (a full queue drops
        and counts)."""
        for item in items:
            try:
                self._queue.put_nowait(item)
            except queue.Full:
                self.dropped += 1

    def _write_loop(self) -> None:
        while True:
            item = self._queue.get()
            batch = [item]
            while len(batch) < 512:
                try:
                    batch.append(self._queue.get_nowait())
                except queue.Empty:
                    break
            stop = any(i is None for i in batch)
            rows = [(i.request_id, i.qi, i.ts, i.domain, i.encoder, i.query, json.dumps(i.ids),
                     json.dumps(i.teams) if i.teams is not None else None, i.experiment, i.client)
                    for i in batch if isinstance(i, Impression)]
            shadows = [i for i in batch if isinstance(i, ShadowRun)]
            try:
                if shadows:
                    with self._lock:
                        self._tx(lambda db: [self._bump(r.experiment, shadow_skipped=1) if r.overlap is None
                                             else self._bump(r.experiment, shadow_runs=1, overlap_sum=r.overlap,
                                                             latency_ms_sum=r.latency_ms or 0.0)
                                             for r in shadows])
                if rows:
                    counts: dict[str, int] = {}
                    for r in rows:   # interleaved impressions count towards their experiment
                        if r[8] is not None and r[7] is not None:
                            counts[r[8]] = counts.get(r[8], 0) + 1

                    def write(db: sqlite3.Connection) -> None:
                        db.executemany("INSERT OR IGNORE INTO impressions (request_id, qi, ts, domain, encoder, "
                                       "query, ids, teams, experiment, client) VALUES (?,?,?,?,?,?,?,?,?,?)", rows)
                        for exp, n in counts.items():
                            self._bump(exp, impressions=n)
                    with self._lock:
                        self._tx(write)
                    self._writes_since_prune += len(rows)
                    if self._writes_since_prune >= 1000:
                        self._writes_since_prune = 0
                        self.prune()
            except sqlite3.Error as e:   # a full disk must not kill capture for good
                self.dropped += len(rows)
                log.error("feedback capture failed", extra={"error": str(e)})
            finally:
                for _ in batch:
                    self._queue.task_done()
            if stop:
                return

    def _tx(self, fn: Any) -> Any:
        self._db.execute("BEGIN IMMEDIATE")
        try:
            out = fn(self._db)
        except BaseException:
            self._db.execute("ROLLBACK")
            raise
        self._db.execute("COMMIT")
        return out

    def flush(self) -> None:
        """Wait until every queued impression is written."""
        self._queue.join()

    def close(self) -> None:
        """Write what is queued, stop the writer and close the file."""
        if self._writer.is_alive():
            self._queue.put(None)
            self._writer.join()
        with self._lock:
            self._db.close()

    # -- feedback ----------------------------------------------------------------------------

    def impression(self, request_id: str, qi: int = 0) -> Impression:
        """The impression a request showed (raises :class:`NotFoundError` when unknown or pruned)."""
        self.flush()
        row = None
        # Another process sharing the store (a Ray replica) may have answered the search and not
        # committed it yet: its writer commits within milliseconds, so look again briefly.
        for wait in (0.0, 0.02, 0.05, 0.1):
            if wait:
                time.sleep(wait)
            with self._lock:
                row = self._db.execute(f"SELECT {_IMPRESSION_COLS} FROM impressions WHERE request_id=? AND qi=?",
                                       (request_id, qi)).fetchone()
            if row is not None:
                break
        if row is None:
            raise NotFoundError(f"no captured search with this impression id (query {qi})",
                                "send feedback for a search answered while capture was on, before it expires "
                                "(the search answer's 'impression')")
        return _impression(row)

    def add_feedback(self, request_id: str, qi: int, fb: Feedback, outcome: int | None = None,
                     max_per_client: int | None = None) -> None:
        """Record feedback on an impression (appends; a second feedback on one impression is refused).

        Args:
            request_id: the impression id the server issued for the search.
            qi: which query of the request.
            fb: clicked ids or graded judgements; ids must be among those shown.
            outcome: the interleaving outcome (+1 candidate, -1 control, 0 tie), when interleaved.
            max_per_client: decided outcomes (wins, losses) of one client that count as evidence at
                most (the experiment's bound; None: all count).
        """
        imp = self.impression(request_id, qi)
        unknown = sorted((set(fb.clicks) | set(fb.grades or {})) - set(imp.ids))
        if unknown:
            raise InvalidInputError(f"{len(unknown)} clicked or graded ids were not shown by this search",
                                    "send only ids from the search's hits")
        with self._lock:
            def write(db: sqlite3.Connection) -> None:
                if db.execute("SELECT 1 FROM feedback WHERE request_id=? AND qi=?", (request_id, qi)).fetchone():
                    raise ConflictError(f"feedback for request {request_id!r} (query {qi}) was already recorded",
                                        "send one feedback per search result list")
                db.execute("INSERT INTO feedback (request_id, qi, ts, clicks, grades, experiment, outcome) "
                           "VALUES (?,?,?,?,?,?,?)",
                           (request_id, qi, time.time(), json.dumps(fb.clicks),
                            json.dumps(fb.grades) if fb.grades is not None else None,
                            imp.experiment if outcome is not None else None, outcome))
                if outcome is not None and imp.experiment is not None:
                    self._bump(imp.experiment, **{{1: "wins", -1: "losses", 0: "ties"}[outcome]: 1})
                    if outcome:
                        self._count_evidence(imp.experiment, imp.client or "", outcome, max_per_client)
            self._tx(write)

    def _count_evidence(self, exp_id: str, client: str, outcome: int, cap: int | None) -> None:
        """A decided outcome counts as evidence while its client has given fewer than ``cap``
        (inside the feedback's transaction)."""
        row = self._db.execute("SELECT decided FROM experiment_clients WHERE id=? AND client=?",
                               (exp_id, client)).fetchone()
        if row is None:
            self._db.execute("INSERT INTO experiment_clients (id, client, decided) VALUES (?,?,1)", (exp_id, client))
            self._bump(exp_id, clients=1)
        else:
            self._db.execute("UPDATE experiment_clients SET decided = decided + 1 WHERE id=? AND client=?",
                             (exp_id, client))
        if cap is None or (row[0] if row else 0) < cap:
            self._bump(exp_id, **{"counted_wins" if outcome > 0 else "counted_losses": 1})

    def labelled(self, domain: str | None = None) -> Iterator[tuple[Impression, Feedback]]:
        """Impressions with their feedback, oldest first (optionally one domain's)."""
        self.flush()
        cols = ", ".join(f"i.{c}" for c in _IMPRESSION_COLS.split(", "))
        sql = (f"SELECT {cols}, f.clicks, f.grades FROM impressions i "
               "JOIN feedback f ON f.request_id=i.request_id AND f.qi=i.qi")
        args: tuple = ()
        if domain is not None:
            sql += " WHERE i.domain=?"
            args = (domain,)
        with self._lock:
            rows = self._db.execute(sql + " ORDER BY i.ts", args).fetchall()
        for row in rows:
            grades = json.loads(row[11]) if row[11] is not None else None
            yield _impression(row[:10]), Feedback(json.loads(row[10]), grades)

    def counts(self) -> dict[str, int]:
        """Rows kept and impressions dropped (queue full or write failed)."""
        self.flush()
        with self._lock:
            imps = self._db.execute("SELECT count(*) FROM impressions").fetchone()[0]
            fbs = self._db.execute("SELECT count(*) FROM feedback").fetchone()[0]
        return {"impressions": imps, "feedback": fbs, "dropped": self.dropped}

    # -- retention ---------------------------------------------------------------------------

    def prune(self, now: float | None = None) -> int:
        """Drop impressions past the age bound, then the oldest ones while the file is too big.

        Returns:
            Impressions removed.
        """
        now = time.time() if now is None else now
        removed = 0
        with self._lock:
            removed += self._drop_before(now - self.max_age_s)
            while self._size() > self.max_bytes:
                row = self._db.execute("SELECT ts FROM impressions ORDER BY ts LIMIT 1 OFFSET "
                                       "(SELECT max(count(*) / 10, 1) FROM impressions)").fetchone()
                if row is None:
                    removed += self._drop_before(float("inf"))
                    break
                removed += self._drop_before(row[0])
                self._db.execute("PRAGMA wal_checkpoint(TRUNCATE)")
                self._db.execute("VACUUM")
        return removed

    def _drop_before(self, ts: float) -> int:
        def drop(db: sqlite3.Connection) -> int:
            db.execute("DELETE FROM feedback WHERE (request_id, qi) IN "
                       "(SELECT request_id, qi FROM impressions WHERE ts < ?)", (ts,))
            return db.execute("DELETE FROM impressions WHERE ts < ?", (ts,)).rowcount
        return self._tx(drop)

    def _size(self) -> int:
        total = 0
        for suffix in ("", "-wal"):
            p = self.path.with_name(self.path.name + suffix)
            if p.exists():
                total += p.stat().st_size
        return total

    # -- experiments -------------------------------------------------------------------------

    def put_experiment(self, exp: ExperimentRecord) -> None:
        """Create or replace the experiment of a domain (one at a time per domain)."""
        with self._lock:
            self._tx(lambda db: (db.execute("INSERT OR REPLACE INTO experiments VALUES (?,?,?)",
                                            (exp.domain, exp.id, exp.model_dump_json())),
                                 db.execute("INSERT OR IGNORE INTO experiment_stats (id) VALUES (?)", (exp.id,))))

    def experiments(self, wait: bool = True) -> dict[str, ExperimentRecord] | None:
        """Every domain's experiment, as stored.

        Args:
            wait: wait for the writer; with ``False`` answer ``None`` at once when it is busy
                (the event loop must never wait for a disk write).
        """
        if not self._lock.acquire(blocking=wait):
            return None
        try:
            rows = self._db.execute("SELECT domain, doc FROM experiments").fetchall()
        finally:
            self._lock.release()
        return {d: ExperimentRecord.model_validate_json(doc) for d, doc in rows}

    def stats(self, exp_id: str) -> ExperimentStats:
        """An experiment's counters: impressions, outcomes, evidence, shadow runs and sums."""
        self.flush()
        with self._lock:
            row = self._db.execute(f"SELECT {', '.join(_STATS)} FROM experiment_stats WHERE id=?",
                                   (exp_id,)).fetchone()
        return ExperimentStats(**dict(zip(_STATS, row))) if row else ExperimentStats()

    def _bump(self, exp_id: str, **delta: float) -> None:
        sets = ", ".join(f"{k} = {k} + ?" for k in delta)
        self._db.execute("INSERT OR IGNORE INTO experiment_stats (id) VALUES (?)", (exp_id,))
        self._db.execute(f"UPDATE experiment_stats SET {sets} WHERE id=?", (*delta.values(), exp_id))


def _impression(row: tuple) -> Impression:
    return Impression(request_id=row[0], qi=row[1], domain=row[2], encoder=row[3], query=row[4],
                      ids=json.loads(row[5]), teams=json.loads(row[6]) if row[6] is not None else None,
                      experiment=row[7], ts=row[8], client=row[9])
