"""Fitting ``qswap serve --ray``'s replicas on the Ray cluster's resources, before deploying.

Ray Serve accepts a deployment that the cluster cannot hold and then waits for resources
forever, warning every 30 s. qswap checks first: each replica reserves ``num_cpus`` (and
``num_gpus``) on one node; the replicas at start (``num_replicas``, or an autoscaler's
``min_replicas``) must pack onto the alive nodes, or the start fails with the numbers and the
flags to change.

CPUs per replica that are not given (``--replica-cpus`` / ``--encoder-cpus`` left out) fit the
cluster: 1 CPU each when every replica gets one, else the cluster's CPUs shared equally (2 ingress
+ 2 encoder replicas on a 2-CPU node: 0.5 each). These are Ray's accounting units, not threads:
``--replica-threads`` sets those.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass, replace
from typing import Any

from qswap.errors import InvalidInputError

# ``opts`` below is a qswap.server.ray.serve.RayOptions (not imported: serve imports this module).
RayOptions = Any

log = logging.getLogger("qswap.server")

#: CPUs per replica when they fit (the most a replica's default reserves).
DEFAULT_REPLICA_CPUS = 1.0
#: The smallest share a replica is given by default (below it, the cluster is too small).
MIN_REPLICA_CPUS = 0.1


@dataclass(frozen=True)
class Group:
    """Replicas of one deployment as the scheduler sees them: ``count`` × (``cpus``, ``gpus``)."""

    name: str
    count: int
    cpus: float
    gpus: float = 0.0


def start_replicas(n: int | str, autoscaling: dict[str, Any] | None = None) -> int:
    """Replicas a deployment starts with: ``n``, ``auto`` (Ray's autoscaling: 1), or the
    autoscaler's ``initial_replicas`` / ``min_replicas`` (at least 1 is needed to serve)."""
    if autoscaling is not None:
        return max(1, int(autoscaling.get("initial_replicas") or autoscaling.get("min_replicas") or 1))
    return n if isinstance(n, int) else 1


def groups(opts: RayOptions) -> list[Group]:
    """The ingress and encoder replica groups of ``opts`` (CPUs: 1 where not given)."""
    ing_cpus = DEFAULT_REPLICA_CPUS if opts.replica_cpus is None else opts.replica_cpus
    enc_cpus = ing_cpus if opts.encoder_cpus is None else opts.encoder_cpus
    enc_n = opts.replicas if opts.encoder_replicas is None else opts.encoder_replicas
    return [Group("ingress", start_replicas(opts.replicas), ing_cpus),
            Group("encoder", start_replicas(enc_n, opts.autoscaling), enc_cpus, opts.encoder_gpus)]


def cluster_nodes() -> list[dict[str, float]]:
    """Total resources of each alive node of the connected Ray cluster."""
    import ray
    return [dict(n.get("Resources", {})) for n in ray.nodes() if n.get("Alive")]


def packs(gs: list[Group], nodes: list[dict[str, float]]) -> bool:
    """True when every replica of ``gs`` finds a node with its CPUs and GPUs free (best fit,
    largest first: each replica goes where the least room is left after it)."""
    free = [[float(n.get("CPU", 0.0)), float(n.get("GPU", 0.0))] for n in nodes]
    for g in sorted(gs, key=lambda g: (g.gpus, g.cpus), reverse=True):
        for _ in range(g.count):
            fits = [f for f in free if f[0] + 1e-9 >= g.cpus and f[1] + 1e-9 >= g.gpus]
            if not fits:
                return False
            slot = min(fits, key=lambda f: (f[1] - g.gpus, f[0] - g.cpus))
            slot[0] -= g.cpus
            slot[1] -= g.gpus
    return True


def fit_layout(opts: RayOptions, nodes: list[dict[str, float]]) -> RayOptions:
    """``opts`` with CPUs per replica that fit ``nodes`` (see the module doc).

    Raises:
        InvalidInputError: the replicas do not fit; the message has the numbers and the flags.
    """
    if opts.replica_cpus is not None and opts.encoder_cpus is None:
        opts = replace(opts, encoder_cpus=opts.replica_cpus)    # encoders reserve what the ingress does
    fitted = opts if opts.replica_cpus is not None else _share_cpus(opts, nodes)
    gs = groups(fitted)
    if not packs(gs, nodes):
        raise InvalidInputError(_refusal(gs, nodes),
                                "start fewer replicas (--replicas, --encoder-replicas, --autoscaling min_replicas), "
                                "reserve less per replica (--replica-cpus, --encoder-cpus, e.g. 0.5), or give Ray "
                                "more (ray start --num-cpus N on more nodes); docs/ray.md, 'Replicas and CPUs'")
    if fitted is not opts:
        log.info("replica CPUs fitted to the cluster", extra={
            "ingress_cpus": fitted.replica_cpus, "encoder_cpus": fitted.encoder_cpus,
            "cluster_cpus": sum(float(n.get("CPU", 0.0)) for n in nodes)})
    return fitted


def _share_cpus(opts: RayOptions, nodes: list[dict[str, float]]) -> RayOptions:
    """CPUs for the replicas whose CPUs were not given: 1 each if all fit, else an equal share."""
    ing, enc = groups(opts)
    fixed = sum(g.count * g.cpus for g, given in ((ing, opts.replica_cpus is not None),
                                                   (enc, opts.encoder_cpus is not None)) if given)
    open_count = (ing.count if opts.replica_cpus is None else 0) + (enc.count if opts.encoder_cpus is None else 0)
    total = sum(float(n.get("CPU", 0.0)) for n in nodes)
    share = DEFAULT_REPLICA_CPUS
    if open_count and (total - fixed) < open_count * DEFAULT_REPLICA_CPUS:
        share = max(MIN_REPLICA_CPUS, math.floor((total - fixed) / open_count * 100) / 100)
    share = _largest_packing_share(opts, nodes, share)
    ing_cpus = share if opts.replica_cpus is None else opts.replica_cpus
    enc_cpus = share if opts.encoder_cpus is None else opts.encoder_cpus
    return replace(opts, replica_cpus=ing_cpus, encoder_cpus=enc_cpus)


def _largest_packing_share(opts: RayOptions, nodes: list[dict[str, float]], share: float) -> float:
    """Shrink ``share`` in 0.05 steps until the replicas pack (nodes of unequal size), down to the minimum."""
    while share > MIN_REPLICA_CPUS:
        trial = replace(opts, replica_cpus=share if opts.replica_cpus is None else opts.replica_cpus,
                        encoder_cpus=share if opts.encoder_cpus is None else opts.encoder_cpus)
        if packs(groups(trial), nodes):
            return share
        share = round(share - 0.05, 2)
    return MIN_REPLICA_CPUS


def _refusal(gs: list[Group], nodes: list[dict[str, float]]) -> str:
    need = " + ".join(f"{g.count} {g.name} × {g.cpus:g} CPU" + (f" + {g.gpus:g} GPU" if g.gpus else "")
                      for g in gs)
    cpus = sum(g.count * g.cpus for g in gs)
    gpus = sum(g.count * g.gpus for g in gs)
    have = ", ".join(f"{float(n.get('CPU', 0)):g} CPU" + (f" {float(n.get('GPU', 0)):g} GPU" if n.get("GPU") else "")
                     for n in nodes) or "no alive node"
    total = sum(float(n.get("CPU", 0.0)) for n in nodes)
    what = f"{need} = {cpus:g} CPUs" + (f" and {gpus:g} GPUs" if gpus else "")
    return (f"the Ray replicas do not fit the cluster: {what} needed at start, the cluster has "
            f"{total:g} CPUs ({len(nodes)} node{'s' if len(nodes) != 1 else ''}: {have})")
