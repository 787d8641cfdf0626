"""Fresh request ids: 32 hex digits, distinct, and not repeated by a forked child."""

from __future__ import annotations

import os
import re

from qswap.server.http.logs import new_request_id


def test_fresh_ids_are_32_hex_digits_and_distinct():
    ids = [new_request_id(None) for _ in range(2000)]
    assert all(re.fullmatch(r"[0-9a-f]{32}", i) for i in ids)
    assert len(set(ids)) == len(ids)
    assert new_request_id("client-id.42") == "client-id.42"
    assert new_request_id("bad id") != "bad id"


def test_a_forked_child_draws_other_ids_than_its_parent():
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:   # the child: its next id, then out without running the parent's cleanup
        try:
            os.write(write, new_request_id(None).encode())
        finally:
            os._exit(0)
    os.close(write)
    try:
        child = os.read(read, 64).decode()
    finally:
        os.close(read)
        os.waitpid(pid, 0)
    assert len(child) == 32 and child != new_request_id(None)
