"""``qswap serve --ray --print-config``: the deployment as a Serve config and a KubeRay RayService.

Operators who deploy with their own tooling (``serve deploy``, KubeRay, Argo, Helm) get the
same application ``qswap serve --ray`` would run: a ``serve build``-style config whose
application is :func:`qswap.server.ray.serve.app_from_env` (server settings as ``QSWAP_*``
environment variables, the layout as application ``args``, each deployment's options listed
so that they can be edited), and a ``RayService`` manifest that embeds it as ``serveConfigV2``.
Tokens are never printed: the config expects them in the cluster's environment, the manifest
reads them from a Kubernetes secret.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

from qswap import __version__
from qswap.errors import InvalidInputError
from qswap.index.backends import is_milvus
from qswap.server.config import ServerSettings
from qswap.server.ray.serve import APP_NAME, ENCODER, INGRESS, RayOptions, deployment_options

IMPORT_PATH = "qswap.server.ray.serve:app_from_env"
SECRETS = {"admin_token": "admin-token", "search_token": "search-token"}
#: The container image the manifest names: replace it with yours (rayproject/ray of the same
#: Ray version, plus ``pip install 'qswap[ray]'`` and the base model).
IMAGE = f"registry.example.com/qswap:{__version__}"
SHARED_MOUNT = "/shared"


def _env_value(v: Any) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    return str(v)


def settings_env(settings: ServerSettings) -> dict[str, str]:
    """The ``QSWAP_*`` variables that reproduce ``settings`` (those not at their default; no tokens).

    Args:
        settings: the server settings.

    Returns:
        variable name -> value.
    """
    env: dict[str, str] = {}
    for name, f in ServerSettings.model_fields.items():
        if name in SECRETS or name in ("host", "port"):
            continue
        v = getattr(settings, name)
        if name == "state_dir" or (name == "index" and not is_milvus(v)):   # a location stays as given
            v = Path(v).resolve()
        elif v == f.get_default(call_default_factory=True):
            continue
        if v is None:
            continue
        env[f"QSWAP_{name.upper()}"] = _env_value(v)
    return env


def serve_config(settings: ServerSettings, opts: RayOptions) -> dict[str, Any]:
    """The Ray Serve config (``ServeDeploySchema``) of ``qswap serve --ray`` with these settings.

    Args:
        settings: the server settings (``--index`` is required: a deployed service serves a
            built index).
        opts: the layout.

    Returns:
        the config as plain data (dump it as YAML).
    """
    if settings.index is None:
        raise InvalidInputError("--print-config needs --index", "build the index first (qswap index build) "
                                "on storage every node mounts, and give its path")
    options = deployment_options(settings, opts)
    deployments = [{"name": name, **options[name]} for name in (INGRESS, ENCODER) if name in options]
    return {
        "proxy_location": "EveryNode",
        "http_options": {"host": settings.host, "port": settings.port},
        "logging_config": {"enable_access_log": False, "log_level": "WARNING"},
        "applications": [{
            "name": APP_NAME,
            "route_prefix": "/",
            "import_path": IMPORT_PATH,
            "args": opts.as_args(),
            "runtime_env": {"env_vars": settings_env(settings)},
            "deployments": deployments,
        }],
    }


def _container(name: str, settings: ServerSettings, resources: dict[str, Any] | None = None) -> dict[str, Any]:
    env = [{"name": f"QSWAP_{field.upper()}", "valueFrom": {"secretKeyRef": {"name": "qswap", "key": key}}}
           for field, key in SECRETS.items() if field == "admin_token" or getattr(settings, field) is not None]
    c: dict[str, Any] = {"name": name, "image": IMAGE, "env": env,
                         "volumeMounts": [{"name": "shared", "mountPath": SHARED_MOUNT}]}
    if resources:
        c["resources"] = resources
    return c


def _pod(container: dict[str, Any]) -> dict[str, Any]:
    return {"spec": {"containers": [container], "volumes": [
        {"name": "shared", "persistentVolumeClaim": {"claimName": "qswap-shared"}}]}}   # ReadWriteMany


def rayservice(settings: ServerSettings, opts: RayOptions) -> dict[str, Any]:
    """A KubeRay ``RayService`` (``ray.io/v1``) that runs :func:`serve_config` on its cluster.

    Args:
        settings: the server settings (index and state dir must be on the shared volume).
        opts: the layout.

    Returns:
        the manifest as plain data (dump it as YAML).
    """
    import yaml
    cfg = serve_config(settings, opts)
    cfg["http_options"] = {"host": "0.0.0.0", "port": settings.port}   # reachable from the pod network
    head = _container("ray-head", settings)
    head["ports"] = [{"containerPort": 6379, "name": "gcs"}, {"containerPort": 8265, "name": "dashboard"},
                     {"containerPort": settings.port, "name": "serve"}]
    workers = [{"groupName": "cpu", "replicas": 1, "minReplicas": 1, "maxReplicas": 8, "rayStartParams": {},
                "template": _pod(_container("ray-worker", settings, {"limits": {"cpu": "4", "memory": "8Gi"}}))}]
    if opts.encoder_gpus:
        gpus = str(max(1, math.ceil(opts.encoder_gpus)))
        workers.append({"groupName": "gpu", "replicas": 1, "minReplicas": 0, "maxReplicas": 4,
                        "rayStartParams": {},
                        "template": _pod(_container("ray-worker", settings,
                                                    {"limits": {"cpu": "4", "memory": "16Gi", "nvidia.com/gpu": gpus}}))})
    import ray
    return {
        "apiVersion": "ray.io/v1",
        "kind": "RayService",
        "metadata": {"name": "qswap"},
        "spec": {
            "serveConfigV2": yaml.safe_dump(cfg, sort_keys=False),
            "rayClusterConfig": {
                "rayVersion": ray.__version__,
                "headGroupSpec": {"rayStartParams": {"dashboard-host": "0.0.0.0", "num-cpus": "0"},
                                  "template": _pod(head)},
                "workerGroupSpecs": workers,
            },
        },
    }


def config_yaml(settings: ServerSettings, opts: RayOptions, kind: str = "serve") -> str:
    """``--print-config``: the Serve config (``kind="serve"``) or the RayService manifest, as YAML.

    Args:
        settings: the server settings.
        opts: the layout.
        kind: ``serve`` or ``rayservice``.

    Returns:
        the YAML text.
    """
    import yaml
    if kind == "rayservice":
        head = (f"# KubeRay RayService for qswap {__version__}: kubectl apply -f this file. Replace the image\n"
                f"# ({IMAGE}); create secret 'qswap' (key admin-token); index and state dir on the\n"
                f"# ReadWriteMany volume mounted at {SHARED_MOUNT}.\n")
        return head + yaml.safe_dump(rayservice(settings, opts), sort_keys=False)
    head = (f"# Ray Serve config for qswap {__version__}: serve deploy this file on a cluster with qswap[ray];\n"
            "# set QSWAP_ADMIN_TOKEN (and QSWAP_SEARCH_TOKEN) in the cluster's environment.\n")
    return head + yaml.safe_dump(serve_config(settings, opts), sort_keys=False)
