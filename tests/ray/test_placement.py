"""`qswap serve --ray` replicas fitted to the cluster's resources before anything is deployed:
CPUs left out are shared so that the replicas fit a small node; given CPUs that cannot fit are
refused with the numbers and the flags (Ray Serve itself would wait forever)."""

from __future__ import annotations

import time

import pytest

from qswap.errors import InvalidInputError
from qswap.server.ray.placement import fit_layout, groups, packs
from qswap.server.ray.serve import RayOptions, deployment_options

TWO_CPUS = [{"CPU": 2.0}]


def test_defaults_fit_a_two_cpu_node():
    fitted = fit_layout(RayOptions(replicas=2), TWO_CPUS)   # 2 ingress + 2 encoder replicas
    assert fitted.replica_cpus == fitted.encoder_cpus == 0.5
    assert packs(groups(fitted), TWO_CPUS)
    one = fit_layout(RayOptions(), TWO_CPUS)
    assert one.replica_cpus == one.encoder_cpus == 1.0     # one CPU each when they all get one


def test_given_cpus_that_do_not_fit_are_refused_with_numbers_and_flags():
    with pytest.raises(InvalidInputError) as e:
        fit_layout(RayOptions(replicas=2, replica_cpus=1.0), TWO_CPUS)
    msg = str(e.value)
    assert "2 ingress × 1 CPU + 2 encoder × 1 CPU = 4 CPUs" in msg and "2 CPUs (1 node" in msg
    assert "--replicas" in msg and "--replica-cpus" in msg and "--num-cpus" in msg


def test_only_the_open_side_is_shared_and_nodes_are_packed_one_by_one():
    fitted = fit_layout(RayOptions(replicas=2, encoder_cpus=1.0), [{"CPU": 2.0}, {"CPU": 1.0}])
    assert fitted.encoder_cpus == 1.0 and fitted.replica_cpus == 0.5    # the 1 CPU left over, shared by 2
    given = fit_layout(RayOptions(replicas=1, replica_cpus=0.5), TWO_CPUS)
    assert given.encoder_cpus == 0.5                                    # encoders reserve what the ingress does
    # two 1-CPU nodes hold two 1-CPU replicas, not one 2-CPU replica
    assert packs(groups(RayOptions(replicas=1, replica_cpus=1.0)), [{"CPU": 1.0}, {"CPU": 1.0}])
    assert not packs(groups(RayOptions(replicas=1, replica_cpus=2.0, encoder_cpus=0.0)), [{"CPU": 1.0}, {"CPU": 1.0}])


def test_gpu_encoders_need_gpu_nodes():
    with pytest.raises(InvalidInputError, match="1 GPUs"):
        fit_layout(RayOptions(encoder_gpus=1), [{"CPU": 8.0}])
    fitted = fit_layout(RayOptions(encoder_gpus=1), [{"CPU": 4.0}, {"CPU": 4.0, "GPU": 1.0}])
    assert deployment_options_of(fitted)["QswapEncoder"]["ray_actor_options"] == {"num_cpus": 1.0, "num_gpus": 1}


def test_autoscaling_counts_its_starting_replicas():
    opts = RayOptions(replicas=1, autoscaling={"min_replicas": 3, "max_replicas": 8}, replica_cpus=1.0)
    with pytest.raises(InvalidInputError, match="3 encoder"):
        fit_layout(opts, TWO_CPUS + [{"CPU": 1.0}])


def deployment_options_of(opts: RayOptions) -> dict:
    from qswap.server.config import ServerSettings
    return deployment_options(ServerSettings(), opts)


def test_deploy_refuses_at_once_on_a_real_cluster(ray_cluster, tmp_path, tiny_model_dir, ray_index):
    """On the module's 4-CPU local cluster, 3 + 3 replicas × 1 CPU are refused before Serve starts."""
    from ray import serve

    from qswap.server.ray.serve import deploy

    from .conftest import ray_settings
    t0 = time.perf_counter()
    with pytest.raises(InvalidInputError, match="6 CPUs needed at start, the cluster has 4 CPUs"):
        deploy(ray_settings(tmp_path, tiny_model_dir, ray_index), RayOptions(replicas=3, replica_cpus=1.0))
    assert time.perf_counter() - t0 < 30
    with pytest.raises(Exception):   # nothing was deployed
        serve.status().applications["qswap"]
