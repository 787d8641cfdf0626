"""server/registry/records.py: the registry as a snapshot plus a journal (one line per change), its crash
safety, the migration of a plain registry.json, paging of the listing, and processes sharing a
state dir (Ray replicas) reading only what changed."""

from __future__ import annotations

import json
import os
import threading
from pathlib import Path

import pytest

from qswap.errors import IntegrityError
from qswap.server.registry import records
from qswap.server.registry.records import JOURNAL_FILE, REGISTRY_FILE

from .conftest import ADMIN, LiveServer, server_settings


def _make(kind, tmp_path, tiny_base, made):
    from qswap.encoders import EncoderPool
    from qswap.encoders.runtime.backend import TorchBackend

    def make():
        pool = EncoderPool(tiny_base)
        r = kind(state_dir=tmp_path / "state", pool=pool, space=tiny_base.space, backend=TorchBackend(pool))
        r.load_state()
        made.append(r)
        return r
    return make


@pytest.fixture()
def registry(tmp_path, tiny_base):
    from qswap.server.registry.facade import EncoderRegistry
    made: list = []
    yield _make(EncoderRegistry, tmp_path, tiny_base, made)
    for r in made:
        r.close()


@pytest.fixture()
def replicas(tmp_path, tiny_base):
    from qswap.server.ray.registry import SharedRegistry
    made: list = []
    yield _make(SharedRegistry, tmp_path, tiny_base, made)
    for r in made:
        r.close()


def _lines(state: Path) -> list[dict]:
    p = state / JOURNAL_FILE
    return [json.loads(line) for line in p.read_bytes().splitlines()] if p.exists() else []


def _killed(reg) -> None:
    """What a killed server leaves: its state-dir lock released by the OS, no clean stop (no fold)."""
    fd, reg.table._state_fd = reg.table._state_fd, None
    os.close(fd)


def test_a_change_appends_one_line_and_leaves_the_snapshot_alone(registry, encoders_root, tmp_path):
    state = tmp_path / "state"
    reg = registry()
    snap = os.stat(state / REGISTRY_FILE)          # written at start (the journal folded)
    reg.register(encoders_root / "ft1")
    reg.register(encoders_root / "bias1")
    reg.set_alias("games", "ft@1")
    reg.delete("bias@1")
    lines = _lines(state)
    assert [sorted(k for k in line if k != "seq") for line in lines] == [["put"], ["put"], ["alias"], ["drop"]]
    assert [line["seq"] for line in lines] == [1, 2, 3, 4]
    assert list(lines[0]["put"]) == ["ft@1"] and lines[3]["drop"] == ["bias@1"]
    assert os.stat(state / REGISTRY_FILE).st_ino == snap.st_ino   # never rewritten per change
    reg.close()                                     # a clean stop folds the journal into the snapshot
    assert _lines(state) == []
    data = json.loads((state / REGISTRY_FILE).read_text())
    assert data["seq"] == 4 and list(data["encoders"]) == ["ft@1"] and data["aliases"] == {"games": "ft@1"}
    reg2 = registry()
    assert reg2.keys() == ["ft@1"] and reg2.aliases() == {"games": "ft@1"}


def test_a_torn_last_line_is_not_committed_and_is_overwritten(registry, encoders_root, tmp_path):
    state = tmp_path / "state"
    reg = registry()
    reg.register(encoders_root / "ft1")
    _killed(reg)
    with open(state / JOURNAL_FILE, "ab") as f:     # an append killed half-way: no newline
        f.write(b'{"alias":{"games":"ft@1"},"se')
    reg2 = registry()
    assert reg2.keys() == ["ft@1"] and reg2.aliases() == {}
    # The start folded the journal; a torn tail left after a start is overwritten by the next change.
    with open(state / JOURNAL_FILE, "ab") as f:
        f.write(b'{"drop":["ft@1"],"se')
    reg2.set_alias("sound", "ft@1")
    assert [sorted(line) for line in _lines(state)] == [["alias", "seq"]]
    _killed(reg2)
    reg3 = registry()
    assert reg3.keys() == ["ft@1"] and reg3.aliases() == {"sound": "ft@1"}


def test_a_crash_between_snapshot_and_journal_reset_replays_nothing_twice(registry, encoders_root, tmp_path):
    state = tmp_path / "state"
    reg = registry()
    reg.register(encoders_root / "ft1")
    reg.set_alias("games", "ft@1")
    reg.delete_alias("games")
    reg.delete("ft@1")
    journal = (state / JOURNAL_FILE).read_bytes()
    reg.close()                                     # folds: snapshot at seq 4, journal emptied
    (state / JOURNAL_FILE).write_bytes(journal)     # as if the crash came before the journal's reset
    reg2 = registry()
    assert reg2.keys() == [] and reg2.aliases() == {}
    reg2.register(encoders_root / "bias1")
    assert _lines(state)[-1]["seq"] == 5


def test_a_corrupt_committed_line_refuses_to_start(registry, encoders_root, tmp_path):
    state = tmp_path / "state"
    reg = registry()
    reg.register(encoders_root / "ft1")
    _killed(reg)
    (state / JOURNAL_FILE).write_bytes(b"not json\n" + (state / JOURNAL_FILE).read_bytes())
    with pytest.raises(IntegrityError, match="registry.journal in the state dir is not a valid registry file"):
        registry()


def test_a_plain_registry_json_migrates_on_start(tmp_path, tiny_model_dir, index_dir, encoders_root):
    s = server_settings(tmp_path, tiny_model_dir, index_dir, encoders_root=encoders_root, admin_token=ADMIN,
                        read_only_index=True)
    state = tmp_path / "state"
    with LiveServer(s) as srv, srv.client(ADMIN) as c:
        assert c.post("/v1/encoders", json={"path": "ft1"}).status_code == 201
        assert c.put("/v1/aliases/games", json={"encoder": "ft@1"}).status_code == 200
    # The format before the journal: the same table without "seq", no journal file.
    old = json.loads((state / REGISTRY_FILE).read_text())
    del old["seq"]
    (state / REGISTRY_FILE).write_text(json.dumps(old))
    (state / JOURNAL_FILE).unlink(missing_ok=True)
    with LiveServer(s) as srv, srv.client(ADMIN) as c:
        assert c.get("/v1/aliases").json()["aliases"] == {"games": "ft@1"}
        assert c.post("/v1/encoders", json={"path": "bias1"}).status_code == 201
        assert _lines(state)[-1]["seq"] == 1 and list(_lines(state)[-1]["put"]) == ["bias@1"]
        assert c.post("/v1/search", json={"query": "chess", "domain": "games"}).status_code == 200
    with LiveServer(s) as srv, srv.client() as c:
        assert [e["key"] for e in c.get("/v1/encoders").json()["encoders"]] == ["base", "bias@1", "ft@1"]


def test_listing_pages_with_a_cursor(tmp_path, tiny_model_dir, index_dir, encoders_root):
    s = server_settings(tmp_path, tiny_model_dir, index_dir, encoders_root=encoders_root, admin_token=ADMIN,
                        read_only_index=True)
    with LiveServer(s) as srv, srv.client(ADMIN) as c:
        for d in ("ft1", "ft2", "bias1", "part1"):
            assert c.post("/v1/encoders", json={"path": d}).status_code == 201
        whole = c.get("/v1/encoders").json()
        keys = [e["key"] for e in whole["encoders"]]
        assert keys == ["base", "bias@1", "ft@1", "ft@2", "part@1"] and whole["next"] is None
        for limit in (1, 2, 3, 5, 1000):
            got, after, pages = [], None, 0
            while True:
                r = c.get("/v1/encoders", params={"limit": limit, **({"after": after} if after else {})})
                assert r.status_code == 200, r.text
                body = r.json()
                assert len(body["encoders"]) <= limit and body["default"] == "base"
                got += [e["key"] for e in body["encoders"]]
                pages += 1
                after = body["next"]
                if after is None:
                    break
            assert got == keys and pages == -(-len(keys) // limit)
        # A cursor is a position, not a record: one deleted meanwhile still works.
        page = c.get("/v1/encoders", params={"limit": 2, "after": "ft@1"}).json()
        assert [e["key"] for e in page["encoders"]] == ["ft@2", "part@1"] and page["next"] is None
        assert c.delete("/v1/encoders/ft@1").status_code == 200
        page = c.get("/v1/encoders", params={"limit": 1, "after": "ft@1"}).json()
        assert [e["key"] for e in page["encoders"]] == ["ft@2"] and page["next"] == "ft@2"
        for bad in ({"limit": 0}, {"limit": 1001}, {"limit": "x"}, {"after": "a b"}):
            r = c.get("/v1/encoders", params=bad)
            assert r.status_code == 422 and r.json()["error"], r.text


def test_replicas_read_only_the_lines_they_have_not_read(replicas, encoders_root, tmp_path):
    state = tmp_path / "state"
    a, b = replicas(), replicas()
    a.register(encoders_root / "ft1")
    assert b.reload_if_changed() and b.keys() == ["ft@1"]
    assert b.table.position.offset == os.stat(state / JOURNAL_FILE).st_size
    assert not b.reload_if_changed()                 # nothing new: nothing read
    journal = state / JOURNAL_FILE
    first = journal.read_bytes()
    journal.write_bytes(b"#" * (len(first) - 1) + b"\n")   # b never reads a line twice: it would refuse this one
    a.set_alias("games", "ft@1")
    a.register(encoders_root / "bias1")
    # A request naming an encoder b does not know yet reads the new lines at once.
    assert b.resolve(encoder="bias") == "bias@1" and b.aliases() == {"games": "ft@1"}
    journal.write_bytes(first + journal.read_bytes()[len(first):])
    b.delete("bias@1")                               # a change made on b: a's next read sees it
    assert a.reload_if_changed() and a.keys() == ["ft@1"]
    assert [line["seq"] for line in _lines(state)] == [1, 2, 3, 4]
    a.table.compact()                                # folded meanwhile: b reads the new snapshot
    a.set_alias("sound", "ft@1")
    assert b.reload_if_changed() and b.aliases() == {"games": "ft@1", "sound": "ft@1"}
    assert b.keys() == ["ft@1"]


def test_replicas_poll_changes_in_the_background(replicas, encoders_root):
    a, b = replicas(), replicas()
    b.start_polling(poll_s=0.01)
    seen = threading.Event()
    real = b.table.swap

    def swap(recs, aliases):
        real(recs, aliases)
        if "ft@1" in recs and aliases.get("games") == "ft@1":
            seen.set()
    b.table.swap = swap
    a.register(encoders_root / "ft1")
    a.set_alias("games", "ft@1")
    assert seen.wait(30) and b.aliases() == {"games": "ft@1"}


def test_the_journal_folds_when_it_outgrows_the_snapshot(registry, encoders_root, tmp_path, monkeypatch):
    state = tmp_path / "state"
    monkeypatch.setattr(records, "COMPACT_MIN_BYTES", 0)
    reg = registry()
    reg.register(encoders_root / "ft1")              # the journal line is larger than the empty snapshot
    assert _lines(state) == []
    assert list(json.loads((state / REGISTRY_FILE).read_text())["encoders"]) == ["ft@1"]
    reg.set_alias("games", "ft@1")                   # a short line: kept in the journal
    assert [sorted(line) for line in _lines(state)] == [["alias", "seq"]]


#: A record as earlier servers wrote it: plain objects, a failed evaluation, a check with fields of
#: another version (``z``), and a malformed self-reported manifest record (kept by a forced registration).
OLD_RECORD = {
    "key": "ft@1", "name": "ft", "version": "1", "kind": "bias", "space": "abc", "files": {"a": "00"},
    "registered_at": 1.0, "source": "path:ft1", "created_at": 0.5, "training": {"steps": 3},
    "guard": {"checks": "not a list"}, "guard_status": "refused", "forced": True,
    "evaluation": {"source": "server", "passed": False, "verdict": "refused", "alpha": 0.05, "sentinels": "fp",
                   "encoder_digest": "d1", "checks": [{"name": "de", "against": "base", "n": 40, "p_holm": 0.01,
                                                       "delta": -0.1, "verdict": "regressed", "degraded": True,
                                                       "z": 2.5}]},
}


def test_stored_guard_records_read_typed_and_write_back_what_they_read():
    """The registry files keep plain JSON; a record read back gives typed guard records (the same
    models the HTTP answer and the client use), and writing it again loses no field."""
    from qswap.guard import GuardRecord, GuardStatus

    rec = records._record("ft@1", json.loads(json.dumps(OLD_RECORD)), "registry.json")
    assert isinstance(rec.evaluation, GuardRecord) and rec.evaluation.verdict is GuardStatus.REFUSED
    assert [c.name for c in rec.evaluation.regressed()] == ["de"] and rec.evaluation.encoder_digest == "d1"
    assert rec.guard is None   # malformed self-reported record: it decides nothing
    back = json.loads(json.dumps(rec.to_json()))
    assert back["evaluation"]["checks"][0]["z"] == 2.5 and back["evaluation"]["verdict"] == "refused"
    assert {k: v for k, v in back.items() if k != "guard"} == {k: v for k, v in OLD_RECORD.items() if k != "guard"}
    assert records._record("ft@1", back, "journal").evaluation == rec.evaluation
