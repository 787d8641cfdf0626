"""qswap serve --ray --print-config: a Serve config Ray accepts, a RayService around it, GPU wiring.

No cluster: the configs are checked against Ray Serve's own schema (``ServeDeploySchema``), the
application they name is built (``app_from_env``'s arguments, ``build_app``'s deployments) without
deploying it.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from qswap.cli import main

TOKEN = "a-secret-admin-token-0123456789"


def _print(capsys: pytest.CaptureFixture, tmp_path: Path, *extra: str) -> tuple[int, str, str]:
    (tmp_path / "idx").mkdir(exist_ok=True)
    rc = main(["serve", "--ray", "--index", str(tmp_path / "idx"), "--state-dir", str(tmp_path / "state"),
               "--replicas", "2", "--max-encoders-per-replica", "10", "--max-batch", "32", *extra])
    out = capsys.readouterr()
    return rc, out.out, out.err


def test_serve_config_validates_and_wires_gpu_encoders(capsys, tmp_path, monkeypatch):
    from ray.serve.schema import ServeDeploySchema

    from qswap.server.ray.serve import RayOptions
    monkeypatch.setenv("QSWAP_ADMIN_TOKEN", TOKEN)
    rc, out, err = _print(capsys, tmp_path, "--print-config", "--encoder-gpus", "1", "--encoder-replicas", "3")
    assert rc == 0, err
    assert TOKEN not in out   # tokens come from the cluster's environment, never from the file
    cfg = yaml.safe_load(out)
    schema = ServeDeploySchema.model_validate(cfg)
    app = schema.applications[0]
    assert app.import_path == "qswap.server.ray.serve:app_from_env" and app.route_prefix == "/"
    deps = {d.name: d for d in app.deployments}
    assert set(deps) == {"QswapIngress", "QswapEncoder"}
    assert deps["QswapEncoder"].ray_actor_options.num_gpus == 1.0
    assert deps["QswapIngress"].ray_actor_options.num_gpus is None   # CPU ingress replicas
    assert (deps["QswapIngress"].num_replicas, deps["QswapEncoder"].num_replicas) == (2, 3)
    assert deps["QswapEncoder"].max_ongoing_requests == 32   # --max-batch: a micro-batch can fill
    # the application's args are RayOptions (what app_from_env builds from), settings are QSWAP_* vars
    opts = RayOptions(**app.args)
    assert (opts.max_encoders, opts.encoder_gpus, opts.encoder_replicas) == (10, 1.0, 3)
    env = app.runtime_env["env_vars"]
    assert env["QSWAP_INDEX"] == str((tmp_path / "idx").resolve())
    assert env["QSWAP_MAX_BATCH"] == "32" and "QSWAP_ADMIN_TOKEN" not in env


def test_rayservice_manifest_embeds_the_serve_config(capsys, tmp_path):
    from ray.serve.schema import ServeDeploySchema
    rc, out, err = _print(capsys, tmp_path, "--print-config", "rayservice", "--encoder-gpus", "0.5")
    assert rc == 0, err
    m = yaml.safe_load(out)
    assert (m["apiVersion"], m["kind"]) == ("ray.io/v1", "RayService")
    spec = m["spec"]
    cfg = yaml.safe_load(spec["serveConfigV2"])   # KubeRay takes the Serve config as a YAML string
    ServeDeploySchema.model_validate(cfg)
    assert cfg["http_options"]["host"] == "0.0.0.0"
    cluster = spec["rayClusterConfig"]
    import ray
    assert cluster["rayVersion"] == ray.__version__
    head = cluster["headGroupSpec"]["template"]["spec"]["containers"][0]
    assert {"name": "QSWAP_ADMIN_TOKEN", "valueFrom": {"secretKeyRef": {"name": "qswap", "key": "admin-token"}}} \
        in head["env"]
    groups = {g["groupName"]: g for g in cluster["workerGroupSpecs"]}
    assert set(groups) == {"cpu", "gpu"}
    gpu = groups["gpu"]["template"]["spec"]["containers"][0]
    assert gpu["resources"]["limits"]["nvidia.com/gpu"] == "1"
    for g in groups.values():
        assert g["minReplicas"] <= g["replicas"] <= g["maxReplicas"]
        assert g["template"]["spec"]["volumes"][0]["persistentVolumeClaim"]["claimName"] == "qswap-shared"


def test_print_config_refuses_what_it_cannot_deploy(capsys, tmp_path):
    rc = main(["serve", "--ray", "--print-config"])   # no --index: the demo index is per machine
    err = capsys.readouterr().err
    assert rc == 2 and "needs --index" in err and len(err.strip().splitlines()) == 1
    rc = main(["serve", "--print-config", "--index", str(tmp_path)])
    assert rc == 2 and "add --ray" in capsys.readouterr().err
    rc, _, err = _print(capsys, tmp_path, "--print-config", "--encoder-gpus", "-1")
    assert rc == 2 and "--encoder-gpus" in err


def test_build_app_puts_encoders_on_gpus_and_the_ingress_on_cpu(tmp_path, tiny_model_dir):
    from qswap.server.config import ServerSettings
    from qswap.server.ray.serve import ENCODER, INGRESS, RayOptions, build_app
    s = ServerSettings(index=tmp_path, state_dir=tmp_path / "state", model=str(tiny_model_dir))
    app = build_app(s, RayOptions(replicas=2, encoder_gpus=1, encoder_cpus=2, max_encoders=4))
    ingress = app._bound_deployment
    encoder = next(a._bound_deployment for a in ingress.init_args if hasattr(a, "_bound_deployment"))
    assert (ingress.name, encoder.name) == (INGRESS, ENCODER)
    assert encoder.ray_actor_options == {"num_cpus": 2, "num_gpus": 1}
    assert "num_gpus" not in ingress.ray_actor_options and ingress.num_replicas == 2
    # each side on its device: CUDA for the encoders, CPU for the ingress (registration checks, documents)
    assert encoder.init_args[0].device == "cuda" and ingress.init_args[0].device == "cpu"


def test_serve_config_without_encoder_deployment(capsys, tmp_path):
    from ray.serve.schema import ServeDeploySchema

    from qswap.server.ray.serve import RayOptions
    rc, out, err = _print(capsys, tmp_path, "--print-config", "--encoder-replicas", "0")
    assert rc == 0, err
    app = ServeDeploySchema.model_validate(yaml.safe_load(out)).applications[0]
    assert [d.name for d in app.deployments] == ["QswapIngress"]
    assert RayOptions(**app.args).fused
    rc, _, err = _print(capsys, tmp_path, "--print-config", "--encoder-replicas", "-1")
    assert rc == 2 and "--encoder-replicas must be at least 0" in err


def test_one_replica_runs_its_encoders_itself_by_default(capsys, tmp_path):
    from ray.serve.schema import ServeDeploySchema
    (tmp_path / "idx").mkdir()
    base = ["serve", "--ray", "--index", str(tmp_path / "idx"), "--state-dir", str(tmp_path / "state"),
            "--print-config"]
    for extra, names in (([], ["QswapIngress"]), (["--encoder-replicas", "1"], ["QswapIngress", "QswapEncoder"]),
                         (["--replicas", "2"], ["QswapIngress", "QswapEncoder"])):
        assert main(base + extra) == 0
        app = ServeDeploySchema.model_validate(yaml.safe_load(capsys.readouterr().out)).applications[0]
        assert [d.name for d in app.deployments] == names, extra


def test_print_config_over_a_milvus_collection_keeps_the_location(capsys, tmp_path):
    from ray.serve.schema import ServeDeploySchema
    loc = "milvus://milvus.milvus.svc:19530?collection=docs"
    rc = main(["serve", "--ray", "--print-config", "--index", loc, "--state-dir", str(tmp_path / "state")])
    out = capsys.readouterr()
    assert rc == 0, out.err
    cfg = yaml.safe_load(out.out)
    ServeDeploySchema.model_validate(cfg)
    env = cfg["applications"][0]["runtime_env"]["env_vars"]
    assert env["QSWAP_INDEX"] == loc and env["QSWAP_STATE_DIR"] == str((tmp_path / "state").resolve())
