"""Schema fuzzing of the live server (schemathesis): every operation, with the admin token, a
fixed seed and a bounded number of examples. Whatever the schema calls valid must not be
refused, nothing may answer 5xx, and every answer must match the schema."""

from __future__ import annotations

import io
import shutil
import tarfile
from pathlib import Path
from typing import Iterator

import pytest

from .conftest import ADMIN, LiveServer, server_settings

EXAMPLES = 10   # per operation; the campaign that found the bugs ran ~22k cases in all


@pytest.fixture(scope="module")
def fuzz_server(tmp_path_factory, tiny_model_dir, index_dir, encoders_root) -> Iterator[LiveServer]:
    tmp = tmp_path_factory.mktemp("fuzz")
    index = tmp / "index"
    shutil.copytree(index_dir, index)   # the fuzzer writes documents: a private copy
    s = server_settings(tmp, tiny_model_dir, index, encoders_root=encoders_root, admin_token=ADMIN,
                        max_k=20, max_queries=8, max_documents=16)
    with LiveServer(s) as srv:
        yield srv


def _tar_gz(src: Path) -> bytes:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w:gz") as tar:
        tar.add(src, arcname=src.name)
    return buf.getvalue()


@pytest.mark.slow
def test_schemathesis_every_operation(fuzz_server, encoders_root):
    import schemathesis
    from hypothesis import HealthCheck, Phase, given, settings
    from schemathesis.checks import (content_type_conformance, positive_data_acceptance,
                                     response_schema_conformance, status_code_conformance)

    from hypothesis import strategies as st

    # The schema says the upload is a gzip tar of an encoder directory; no schema language can
    # say "an encoder directory", so archives are drawn from real ones (hostile archives have
    # their own test, tests/server/test_hostile.py).
    archives = [_tar_gz(encoders_root / name) for name in ("ft1", "bias1", "alien")]
    schemathesis.openapi.media_type("application/gzip", st.sampled_from(archives))
    schema = schemathesis.openapi.from_url(f"{fuzz_server.url}/openapi.json")
    auth = {"Authorization": f"Bearer {ADMIN}"}
    checks = [response_schema_conformance, status_code_conformance, content_type_conformance,
              positive_data_acceptance]
    failures: list[str] = []
    operations = 0
    calls = {"n": 0}
    for result in schema.get_all_operations():
        op = result.ok()
        operations += 1

        @settings(max_examples=EXAMPLES, derandomize=True, deadline=None, database=None,
                  phases=[Phase.explicit, Phase.generate], suppress_health_check=list(HealthCheck))
        @given(case=op.as_strategy())
        def run(case) -> None:
            response = case.call(base_url=fuzz_server.url, headers=auth, timeout=30)
            calls["n"] += 1
            timeout = (case.headers or {}).get("X-Request-Timeout")
            # 504 is the request's own deadline (a fuzzed X-Request-Timeout of microseconds).
            own_deadline = response.status_code == 504 and timeout is not None and float(timeout) < 5
            assert response.status_code < 500 or own_deadline, (
                f"{op.label}: {response.status_code} {response.text[:300]}")
            case.validate_response(response, checks=checks, headers=auth)

        try:
            run()
        except Exception as e:   # collect every operation's failure, then report all
            failures.append(f"{op.label}: {type(e).__name__}: {str(e)[:1500]}")
    assert operations >= 12
    assert calls["n"] >= operations * 3
    assert not failures, "\n\n".join(failures)
