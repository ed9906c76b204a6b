"""Every private API of a dependency that flaxstate uses resolves on this stack, and does what flaxstate needs.

A dependency that moves one fails here by name, not as a silent fallback in a user's run.
"""

import fsspec
import jax
import pytest
from etils import epath

from flaxstate import launch, private_apis


def test_each_private_name_is_listed_with_what_it_is_for():
    assert set(private_apis.PRIVATE_APIS) == {
        "jax._src.lib._profiler.TraceMe.is_enabled",
        "jax._src.clusters.ClusterEnv",
        "jax._src.clusters.ClusterEnv._cluster_types",
        "jax._src.clusters.ClusterEnv.auto_detect_unset_distributed_params",
        "jax._src.distributed.State.initialize",
        "jax._src.lib.xla_client.make_cpu_client",
        "jax._src.xla_bridge.backends_are_initialized",
        "jax.config.values",
        "etils.epath.Path._backend.fs",
        "orbax.checkpoint._src.serialization.jax_array_handlers._async_serialize_shardings",
    }
    assert all(private_apis.PRIVATE_APIS.values())


def test_the_profiler_flag_is_jax_s_own_and_says_whether_a_trace_is_taken(tmp_path):
    tracing = private_apis.profiler_tracing()
    assert tracing() is False  # the fallback says True always
    with jax.profiler.trace(str(tmp_path)):
        assert tracing() is True
    assert tracing() is False


def test_jax_asks_its_cluster_environments_in_the_order_of_the_list_flaxstate_reorders():
    from jax._src.clusters import cluster

    order = private_apis.cluster_types()
    assert order is cluster.ClusterEnv._cluster_types  # the list JAX's auto-detection walks, not a copy
    assert {"SlurmCluster", "OmpiCluster"} <= {cls.__name__ for cls in order}


def test_jax_s_detection_and_join_are_the_functions_jax_distributed_initialize_calls():
    from jax._src import distributed

    detect, join = private_apis.join_code()
    assert (detect.co_name, join.co_name) == ("auto_detect_unset_distributed_params", "initialize")
    assert join is distributed.global_state.initialize.__func__.__code__  # the method the public function calls


def test_the_launcher_s_cluster_is_one_of_jax_s_cluster_environments(monkeypatch):
    base = private_apis.cluster_env()
    assert base is not None
    launched = [cls for cls in base.__subclasses__() if getattr(cls, "name", None) == "flaxstate"]
    assert len(launched) == 1
    monkeypatch.setenv(launch.COORDINATOR, "127.0.0.1:1234")
    monkeypatch.setenv(launch.PROCESS_COUNT, "2")
    monkeypatch.setenv(launch.PROCESS_ID, "1")
    assert launched[0].is_env_present()
    assert launched[0].get_coordinator_address(None, None) == "127.0.0.1:1234"
    assert (launched[0].get_process_count(), launched[0].get_process_id()) == (2, 1)


def test_a_cpu_client_of_its_own_gives_the_host_devices_asked_for():
    devices = private_apis.cpu_devices(3)
    assert len(devices) == 3 and {device.platform for device in devices} == {"cpu"}
    assert len(jax.devices()) == 1  # this process's own backend is left as it was


@pytest.mark.parametrize("url, protocol", [("gs://bucket/run", "gcs"), ("s3://bucket/run", "s3")])
def test_the_bucket_filesystem_is_the_instance_etils_epath_reads_with(url, protocol):
    filesystem = private_apis.bucket_filesystem(epath.Path(url))
    assert isinstance(filesystem, fsspec.AbstractFileSystem)
    assert protocol in filesystem.protocol
    assert private_apis.bucket_filesystem(epath.Path(url + "/other")) is filesystem  # one instance a process


def test_a_moved_private_name_is_an_import_error_naming_it_and_its_use():
    class NoBackend:
        pass

    with pytest.raises(ImportError, match=r"etils\.epath\.Path\._backend\.fs for the fsspec filesystem"):
        private_apis.bucket_filesystem(NoBackend())


def test_orbax_s_sharding_file_writer_is_found():
    # What it writes is checked where a budget saves device arrays (tests/checkpoint/test_budget_processes.py):
    # plain orbax restores them from it without being told their shardings.
    assert callable(private_apis.orbax_sharding_file_writer())
