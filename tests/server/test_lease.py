"""One lease type for a held encoder: shared with jobs, released once by the last holder."""

from __future__ import annotations

import gc
import threading

import pytest

from qswap.server.registry.lease import Lease


def test_a_lease_is_released_once_by_its_last_holder():
    released: list[str] = []
    lease = Lease("k@1", lambda: released.append("k@1"))
    job = lease.share()
    with lease:
        pass                         # the owner is done; the job still holds it
    assert released == [] and not lease.released
    lease.release()                  # idempotent: the owner's share is gone already
    assert released == []
    job()
    job()                            # a second call does nothing
    assert released == ["k@1"] and lease.released
    with pytest.raises(RuntimeError, match="released"):
        lease.share()


def test_shares_released_on_many_threads_release_exactly_once():
    released: list[int] = []
    lease = Lease("k@1", lambda: released.append(1))
    shares = [lease.share() for _ in range(64)]
    threads = [threading.Thread(target=s) for s in shares] + [threading.Thread(target=lease.release)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert released == [1]


def test_a_dropped_lease_releases_when_it_asks_to():
    released: list[str] = []
    Lease("evicted", lambda: released.append("evicted"), release_on_collect=True)
    Lease("kept", lambda: released.append("kept"))
    gc.collect()
    assert released == ["evicted"]


def test_registry_leases_hold_the_reference(tmp_path, tiny_base):
    from qswap.encoders import BASE_KEY, EncoderPool
    from qswap.server.registry.facade import EncoderRegistry

    reg = EncoderRegistry(state_dir=tmp_path, pool=EncoderPool(tiny_base), space=tiny_base.space, backend=None)
    reg.load_state()
    try:
        with reg.lease() as lease:
            done = lease.share()
            assert lease.key == BASE_KEY and reg.in_flight(BASE_KEY) == 1
        assert reg.in_flight(BASE_KEY) == 1   # the job's share
        done()
        assert reg.in_flight(BASE_KEY) == 0
        with reg.held(BASE_KEY):
            assert reg.in_flight(BASE_KEY) == 1
        assert reg.in_flight(BASE_KEY) == 0
    finally:
        reg.close()
