"""`flaxstate.clusters`: which manager started a process, from the variables each sets, and what a run's ledger
and `flaxstate goodput` say of it. (Real managers: tests/cluster/test_slurm_processes.py; the launcher:
tests/test_launch_processes.py.)"""

import warnings

import pytest

from flaxstate import clusters, launch
from flaxstate.run_record import goodput

SLURM_TASK = {  # what `srun -n 2` sets in its second task (a one-node cluster, job 81 requeued twice)
    "SLURM_JOB_ID": "81",
    "SLURM_STEP_ID": "0",
    "SLURM_STEP_NODELIST": "localhost",
    "SLURM_NTASKS": "2",
    "SLURM_PROCID": "1",
    "SLURM_LOCALID": "1",
    "SLURM_RESTART_COUNT": "2",
}


JOBSET_POD = {  # the pod of Job 1's second pod, of a JobSet of 3 Jobs of 4 pods, started again twice
    "JOBSET_NAME": "train",
    "HOSTNAME": "train-workers-1-1",
    "JOB_COMPLETION_INDEX": "1",
    "JOB_GLOBAL_INDEX": "1",
    "GLOBAL_REPLICAS": "3",
    "JOB_PARALLELISM": "4",
    "JOBSET_RESTART_ATTEMPT": "2",
}


@pytest.fixture(autouse=True)
def no_manager(monkeypatch):
    names = [*SLURM_TASK, *JOBSET_POD, "SLURM_STEP_NUM_TASKS", "SLURM_JOB_NUM_NODES", clusters.RESTARTS]
    for name in [*names, clusters.COORDINATOR, clusters.JOBSET_COORDINATOR, "JAX_COORDINATOR_PORT"]:
        monkeypatch.delenv(name, raising=False)


def test_a_process_started_by_hand_has_no_manager():
    assert clusters.manager() is None


def test_a_slurm_task_names_its_job_and_its_requeues_and_a_first_run_has_none(monkeypatch):
    for name, value in SLURM_TASK.items():
        monkeypatch.setenv(name, value)
    assert clusters.manager() == {"name": "slurm", "job": "81", "restarts": 2}
    monkeypatch.delenv("SLURM_RESTART_COUNT")  # SLURM sets it from the first requeue on
    assert clusters.manager() == {"name": "slurm", "job": "81", "restarts": 0}


def test_the_launcher_inside_a_slurm_job_is_the_manager_that_restarts_the_processes(monkeypatch):
    for name, value in SLURM_TASK.items():
        monkeypatch.setenv(name, value)
    monkeypatch.setenv(clusters.RESTARTS, "1")
    assert clusters.manager() == {"name": "flaxstate launch", "restarts": 1}


def session(at, manager, step):
    return [
        {
            "event": "session",
            "time": at,
            "pid": 1,
            "startup": 1.0,
            "restored_step": step - 10 or None,
            "run_id": "r",
            "manager": manager,
        },
        {
            "event": "record",
            "time": at + 11.0,
            "step": step,
            "steps": 10,
            "elapsed": 10.0,
            "compile": 0.0,
            "data_wait": 0.0,
            "idle": 0.0,
            "outside": 0.0,
            "run_id": "r",
        },
    ]


def test_goodput_shows_each_session_s_manager_and_restart_and_a_ledger_without_them_shows_no_row():
    first, second = {"name": "slurm", "job": "81", "restarts": 0}, {"name": "slurm", "job": "81", "restarts": 1}
    events = session(0.0, first, 10) + session(100.0, second, 20)
    report = goodput.report(events)
    assert [account["manager"] for account in report["sessions"]] == [first, second]
    [row] = [line for line in goodput.format_report(report).splitlines() if line.startswith("started by")]
    assert row.split()[2:] == ["slurm,", "restart", "0", "slurm,", "restart", "1"]
    older = session(0.0, None, 10) + session(100.0, None, 20)  # a ledger of an earlier flaxstate's
    assert "started by" not in goodput.format_report(goodput.report(older))


BATCH_SHELL = {  # what sbatch sets in a batch script's own shell: a job, and no job step
    "SLURM_JOB_ID": "81",
    "SLURM_NTASKS": "2",
    "SLURM_PROCID": "0",
    "SLURM_LOCALID": "0",
    "SLURM_JOB_NODELIST": "localhost",
}


def test_a_batch_script_s_shell_is_told_to_run_the_training_under_srun(monkeypatch):
    # jax#30073: JAX's SlurmCluster is not present there (no SLURM_STEP_NODELIST), and its own error says only
    # "coordinator_address should be defined". flaxstate's environment is present there alone and says why.
    shell = clusters.REGISTERED["slurm-batch-shell"]
    for name, value in BATCH_SHELL.items():
        monkeypatch.setenv(name, value)
    assert shell.is_env_present()
    with pytest.raises(RuntimeError, match=r"shell of a SLURM batch script \(job 81\).*2 tasks are started by srun"):
        shell.get_coordinator_address(timeout_secs=None, override_coordinator_port=None)
    for name, value in SLURM_TASK.items():  # a task of `srun`'s step: JAX's SlurmCluster's, not this one's
        monkeypatch.setenv(name, value)
    assert not shell.is_env_present()


@pytest.mark.parametrize(
    ("variables", "refused"),
    [
        ({}, None),  # no SLURM: the launcher's own machine
        (BATCH_SHELL, None),  # a one-node job's batch script: the launcher starts and restarts its processes
        (
            {**BATCH_SHELL, "SLURM_JOB_NUM_NODES": "2"},
            "SLURM job 81 has 2 nodes: start the training's processes with srun",
        ),
        ({**SLURM_TASK, "SLURM_STEP_NUM_TASKS": "2"}, "runs in each of the 2 tasks of a SLURM job step (job 81)"),
        ({**SLURM_TASK, "SLURM_NTASKS": "1", "SLURM_PROCID": "0"}, None),  # `srun -n 1 flaxstate launch ...`
    ],
)
def test_the_launcher_refuses_a_slurm_job_whose_processes_only_srun_can_start(monkeypatch, variables, refused):
    for name, value in variables.items():
        monkeypatch.setenv(name, value)
    if refused is None:
        assert clusters.launcher_refusal() is None
    else:
        assert refused in clusters.launcher_refusal() and "srun" in clusters.launcher_refusal()
        with pytest.raises(ValueError, match="srun"):
            launch.launch(["true"], 2)  # before any process starts


def jobset_pod() -> tuple:
    """What flaxstate's JobSet environment answers JAX: the coordinator, the process count and this process's id."""
    pod = clusters.REGISTERED["jobset"]
    return pod.get_coordinator_address(None, None), pod.get_process_count(), pod.get_process_id()


def detected(process_id: int) -> tuple:
    """What JAX's own detection (`jax.distributed.initialize(process_id=...)`, no other argument) reads here, past
    flaxstate's checks of the join (process 0 waits for no coordinator): the coordinator, count and id."""
    from jax._src.clusters import ClusterEnv

    return ClusterEnv.auto_detect_unset_distributed_params(None, None, process_id, None, None, 300)[:3]


def test_a_jobset_pod_is_numbered_job_by_job_over_every_job_and_names_its_jobset_s_restart(monkeypatch):
    for name, value in JOBSET_POD.items():
        monkeypatch.setenv(name, value)
    assert jobset_pod() == ("train-workers-0-0.train:55527", 12, 5)  # Job 1's pod 1 of 4: 1 x 4 + 1, of 3 x 4
    monkeypatch.setenv("JOBSET_COORDINATOR", "train-workers-0-0.jobs")  # the JobSet's spec.coordinator, elsewhere
    assert jobset_pod() == ("train-workers-0-0.jobs:55527", 12, 5)
    monkeypatch.setenv("JAX_COORDINATOR_PORT", "1234")  # JAX's own variable for the port
    assert detected(process_id=0) == ("train-workers-0-0.jobs:1234", 12, 0)
    assert clusters.manager() == {"name": "jobset", "job": "train", "restarts": 2}
    monkeypatch.setenv("JOBSET_RESTART_ATTEMPT", "")  # an annotation the JobSet has not set yet
    assert clusters.manager() == {"name": "jobset", "job": "train", "restarts": 0}


def test_a_jobset_pod_is_read_from_its_variables_before_jax_s_k8s_cluster_asks_the_kubernetes_api(monkeypatch):
    # JAX's K8sCluster is present wherever KUBERNETES_SERVICE_HOST is, and then asks the API (and warns where
    # the `kubernetes` package is missing): a JobSet's pod is found by its variables first, and nothing warns.
    for name, value in {**JOBSET_POD, "KUBERNETES_SERVICE_HOST": "10.0.0.1"}.items():
        monkeypatch.setenv(name, value)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert detected(process_id=0) == ("train-workers-0-0.train:55527", 12, 0)
    names = [cls.__name__ for cls in clusters.private_apis.cluster_types()]
    assert names.index("CheckedJobSetCluster") < names.index("K8sCluster")


@pytest.mark.parametrize(
    ("changed", "said"),
    [
        ({"JOB_PARALLELISM": None}, "the JobSet pod's JOB_PARALLELISM is '', not a whole number"),
        ({"GLOBAL_REPLICAS": "two"}, "the JobSet pod's GLOBAL_REPLICAS is 'two', not a whole number"),
        ({"JOB_COMPLETION_INDEX": "4"}, "JOB_COMPLETION_INDEX=4 and JOB_GLOBAL_INDEX=1 are not within"),
        ({"JOB_GLOBAL_INDEX": "3"}, "JOB_PARALLELISM=4 pods a Job and GLOBAL_REPLICAS=3 Jobs"),
        ({"HOSTNAME": "trainer"}, "HOSTNAME 'trainer' is not <jobset>-<replicated job>-<job>-<pod>"),
    ],
)
def test_a_pod_template_that_misses_or_misstates_a_variable_is_named_with_where_it_comes_from(
    monkeypatch, changed, said
):
    for name, value in {**JOBSET_POD, **changed}.items():
        if value is None:
            monkeypatch.delenv(name, raising=False)
        else:
            monkeypatch.setenv(name, value)
    with pytest.raises(ValueError, match="docs/guides/cluster.md") as refused:
        jobset_pod()
    assert said in str(refused.value)
