"""`flaxstate.joining`: `jax.distributed.initialize()` under a manager refuses a join that cannot complete, in one
line, before any client is made, and says while it waits how long it has waited and for whom. (With real
managers and processes: tests/cluster/.)"""

import re
import threading
import time

import pytest
from flaxstate_testing.processes import free_port
from jax._src import distributed

from flaxstate import clusters, joining

SLURM_TASK = {  # what `srun -n 2` sets in its second task, on one node
    "SLURM_JOB_ID": "81",
    "SLURM_STEP_ID": "0",
    "SLURM_STEP_NODELIST": "localhost",
    "SLURM_STEP_NUM_NODES": "1",
    "SLURM_NTASKS": "2",
    "SLURM_PROCID": "1",
    "SLURM_LOCALID": "1",
}
MPI_RANK = {  # what `mpirun -np 4` sets in rank 1 on two nodes of two ranks each, its out-of-band channel on lo
    "OMPI_MCA_orte_hnp_uri": "1531576320.0;tcp://127.0.0.1:34911",
    "OMPI_COMM_WORLD_SIZE": "4",
    "OMPI_COMM_WORLD_RANK": "1",
    "OMPI_COMM_WORLD_LOCAL_RANK": "1",
    "OMPI_COMM_WORLD_LOCAL_SIZE": "2",
}


def join(**arguments):
    """`jax.distributed.initialize(**arguments)` past its first check, that no JAX backend is up yet (this test
    process has one): JAX's own join (`State.initialize`), with its own detection of the cluster."""
    distributed.global_state.initialize(**arguments)


@pytest.fixture
def manager(monkeypatch):
    """Sets a manager's variables (none of another's left), and leaves JAX's join as it was, whatever happened."""
    for name in [*SLURM_TASK, *MPI_RANK, clusters.COORDINATOR, "JAX_COORDINATOR_ADDRESS", "JAX_COORDINATOR_PORT"]:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv(joining.REPORT_EVERY_VARIABLE, "0.5")
    yield lambda variables: [monkeypatch.setenv(name, value) for name, value in variables.items()]
    assert distributed.global_state.client is None and distributed.global_state.service is None


def test_the_checked_environments_come_before_jax_s_own_and_the_launcher_s_before_all():
    names = [cls.__name__ for cls in clusters.private_apis.cluster_types()]
    assert names[0] == "CheckedLaunchedCluster" and names[1] == "CheckedJobSetCluster"
    assert names.index("CheckedSlurmCluster") < names.index("SlurmCluster")
    assert names.index("CheckedOmpiCluster") < names.index("OmpiCluster")


def test_a_count_that_is_not_srun_s_is_refused_before_the_join(manager):
    # JAX alone would wait its 300 s for 2 processes that never come, then fail with a gRPC deadline.
    manager(SLURM_TASK)
    with pytest.raises(joining.JoinError) as refused:
        join(num_processes=4, initialization_timeout=60)
    assert str(refused.value) == (
        "jax.distributed.initialize() would wait for 4 processes, and srun started 2 (SLURM_NTASKS=2): the join "
        "would wait out its 60 s for processes that never come. Leave num_processes out (JAX reads it from "
        "SLURM_NTASKS), or start 4 (srun -n 4)."
    )


def test_a_count_that_is_not_the_launcher_s_is_refused_naming_its_option(manager):
    manager({**SLURM_TASK, clusters.COORDINATOR: "127.0.0.1:1", clusters.PROCESS_COUNT: "3", clusters.PROCESS_ID: "1"})
    # In a SLURM task too (`srun -n 1 flaxstate launch --processes 3`), the launcher's processes are its own.
    with pytest.raises(joining.JoinError, match=r"flaxstate launch started 3 \(FLAXSTATE_PROCESS_COUNT=3\).*"):
        join(num_processes=2)
    with pytest.raises(joining.JoinError, match=re.escape("or start 2 (flaxstate launch --processes 2).")):
        join(num_processes=2)


@pytest.mark.parametrize(
    ("variables", "address", "nodes"),
    [
        ({**SLURM_TASK, "SLURM_STEP_NUM_NODES": "2"}, "127.0.0.1:1234", "2 processes run on 2 nodes"),
        ({**SLURM_TASK, "SLURM_STEP_NUM_NODES": "2"}, "localhost:1234", "2 processes run on 2 nodes"),
        (MPI_RANK, None, "4 processes run on 2 nodes"),  # mpirun's own address, on lo (`oob_tcp_if_include lo`)
    ],
)
def test_a_loopback_coordinator_in_a_job_of_several_nodes_is_refused(manager, monkeypatch, variables, address, nodes):
    manager(variables)
    if address is not None:
        monkeypatch.setenv("JAX_COORDINATOR_ADDRESS", address)
    with pytest.raises(joining.JoinError, match=f"is this machine's loopback interface, and the {nodes}"):
        join(initialization_timeout=60)


def test_a_coordinator_that_cannot_be_reached_is_named_with_the_wait_and_the_fix(manager, monkeypatch, capfd):
    port = free_port()  # nothing listens there: process 0 never started
    manager(SLURM_TASK)
    monkeypatch.setenv("JAX_COORDINATOR_PORT", str(port))
    with pytest.raises(joining.JoinError) as refused:
        join(initialization_timeout=2)
    assert str(refused.value).startswith(
        f"process 1 of 2 (started by srun) could not reach the coordinator at localhost:{port} (process 0's) "
        "within 2 s: nothing answers there (Connection refused). Check that process 0 started"
    )
    assert "initialization_timeout=S" in str(refused.value)
    waited = re.findall(
        r"^flaxstate: process 1 of 2 \(started by srun\) has waited (\d+) s for the coordinator at "
        rf"localhost:{port} \(process 0's\): nothing answers there",
        capfd.readouterr().err,
        re.M,
    )
    assert len(waited) >= 2 and waited == sorted(waited), waited


def test_a_coordinator_host_that_does_not_resolve_is_named(manager, monkeypatch):
    manager({**SLURM_TASK, "SLURM_STEP_NODELIST": "no-such-node.invalid"})
    with pytest.raises(
        joining.JoinError,
        match=r"no-such-node.invalid:\d+ \(process 0's\) within 1 s: its host "
        "no-such-node.invalid does not resolve here",
    ):
        join(initialization_timeout=1)


def test_a_process_in_jax_s_join_says_how_long_it_has_waited_until_the_join_ends(monkeypatch, capfd):
    monkeypatch.setenv(joining.REPORT_EVERY_VARIABLE, "0.2")
    join = joining.Join("mpirun", 3, "OMPI_COMM_WORLD_SIZE", 1, "host:1", 3, 0, 300.0, "mpirun -np 3")
    ended = threading.Event()

    def initialize():  # stands for JAX's join, which the watch follows by its frame
        import sys

        watched = joining.watch(join, sys._getframe())
        time.sleep(1.5)
        ended.set()
        return watched

    thread = initialize()
    thread.join(5)
    assert ended.is_set() and not thread.is_alive()  # it ends with the join
    lines = capfd.readouterr().err.splitlines()
    assert len(lines) >= 3, lines
    assert lines[0] == (
        "flaxstate: process 0 of 3 (started by mpirun) has waited 0 s in jax.distributed.initialize for the other 2 "
        "processes to join at the coordinator host:1; it waits 300 s in all (initialization_timeout)."
    )
