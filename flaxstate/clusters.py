"""The cluster managers a process may run under, what `import flaxstate` needs of them, apart from the launcher.

`flaxstate launch` (`flaxstate.launch`, the supervisor) tells its processes where
their peers are through the variables below; importing flaxstate registers
`LaunchedCluster`, one of JAX's cluster environments, present where the
launcher set them, so that `jax.distributed.initialize()` with no arguments
joins them as it joins a job step's tasks under SLURM (JAX's own
`SlurmCluster`: `SLURM_JOB_ID`, `SLURM_STEP_NODELIST`, `SLURM_NTASKS`,
`SLURM_PROCID`, `SLURM_LOCALID`).

Importing flaxstate also registers `JobSetCluster`, a Kubernetes JobSet's pods
read from their variables (`JOBSET_NAME` and the others below), and puts a
checked copy of each manager's environment (JAX's `SlurmCluster` and
`OmpiCluster`, `LaunchedCluster` and `JobSetCluster`) ahead of the original:
asked for this process's id in `jax.distributed.initialize()`, it checks and
watches the join (`flaxstate.joining`).

`manager()` says which manager started this process and how many times it
started the job again before: the run's ledger keeps it with each session, so
that `flaxstate goodput` shows each session with its restart.
"""

from __future__ import annotations

import os
from typing import Any

from flaxstate import joining, private_apis

COORDINATOR = "FLAXSTATE_COORDINATOR_ADDRESS"
PROCESS_COUNT = "FLAXSTATE_PROCESS_COUNT"
PROCESS_ID = "FLAXSTATE_PROCESS_ID"
LOCAL_PROCESS_ID = "FLAXSTATE_LOCAL_PROCESS_ID"
RESTARTS = "FLAXSTATE_RESTARTS"
"""The rounds `flaxstate launch` started before this one (torchrun's `TORCHELASTIC_RESTART_COUNT`)."""
LOST_FILE = "FLAXSTATE_LOST_FILE"
"""A file of process indices that a cluster's health check declares lost (one a line), read after a failure."""

SLURM_JOB = "SLURM_JOB_ID"
SLURM_STEP = "SLURM_STEP_ID"
"""Set in the tasks of a job step (`srun`), not in the batch script's own shell."""
SLURM_TASKS = "SLURM_NTASKS"
SLURM_RESTARTS = "SLURM_RESTART_COUNT"
"""The times SLURM requeued the job before this run of it (absent before the first requeue)."""
SLURM_STEP_NODES = "SLURM_STEP_NUM_NODES"
OMPI_SIZE = "OMPI_COMM_WORLD_SIZE"
OMPI_LOCAL_SIZE = "OMPI_COMM_WORLD_LOCAL_SIZE"

# A Kubernetes JobSet's pods, from the variables its pod template gives them (docs/guides/cluster.md has the YAML):
# Kubernetes sets JOB_COMPLETION_INDEX in an Indexed Job's pods; the others come from the labels and annotations
# that JobSet puts on each pod, through the downward API, and the Job's parallelism as written in the template.
JOBSET = "JOBSET_NAME"
"""The JobSet's name (the pods' label `jobset.sigs.k8s.io/jobset-name`)."""
JOBSET_POD_INDEX = "JOB_COMPLETION_INDEX"
"""The pod's index in its Job (Kubernetes sets it in an Indexed Job's pods)."""
JOBSET_JOB_INDEX = "JOB_GLOBAL_INDEX"
"""The Job's index among all the JobSet's Jobs (the annotation `jobset.sigs.k8s.io/job-global-index`)."""
JOBSET_JOBS = "GLOBAL_REPLICAS"
"""How many Jobs the JobSet runs, over all its replicated Jobs (the annotation `jobset.sigs.k8s.io/global-replicas`)."""
JOBSET_PODS_PER_JOB = "JOB_PARALLELISM"
"""The pods of each Job (its `parallelism`, which no annotation carries: the template writes it again)."""
JOBSET_COORDINATOR = "JOBSET_COORDINATOR"
"""The coordinator pod's host name (the annotation `jobset.sigs.k8s.io/coordinator`, set where the JobSet names a
`coordinator`); without it, the first pod of the first Job (`<jobset>-<replicated job>-0-0.<jobset>`)."""
JOBSET_RESTARTS = "JOBSET_RESTART_ATTEMPT"
"""The times the JobSet was started again (the annotation `jobset.sigs.k8s.io/restart-attempt`)."""
JOBSET_PORT = "55527"
"""The coordinator's port in a JobSet, JAX's own for Kubernetes (`JAX_COORDINATOR_PORT` gives another)."""
JOBSET_NEEDS = (JOBSET_POD_INDEX, JOBSET_JOB_INDEX, JOBSET_JOBS, JOBSET_PODS_PER_JOB)


def manager() -> dict[str, Any] | None:
    """The manager that started this process, innermost first, and the restarts of the job it made before.

    Returns:
        `{"name": "flaxstate launch", "restarts": N}` under the launcher,
        `{"name": "slurm", "job": ID, "restarts": N}` in a SLURM job,
        `{"name": "jobset", "job": NAME, "restarts": N}` in a Kubernetes JobSet's pod, or
        `None` (a process started by hand, or by a manager that says nothing).
    """
    if RESTARTS in os.environ:
        return {"name": "flaxstate launch", "restarts": int(os.environ[RESTARTS])}
    if SLURM_JOB in os.environ:
        return {"name": "slurm", "job": os.environ[SLURM_JOB], "restarts": int(os.environ.get(SLURM_RESTARTS, "0"))}
    if JOBSET in os.environ:
        return {"name": "jobset", "job": os.environ[JOBSET], "restarts": int(os.environ.get(JOBSET_RESTARTS) or "0")}
    return None


def launcher_refusal() -> str | None:
    """Why `flaxstate launch` must not start processes here, under SLURM, or `None` where it may.

    Inside a one-node job (its batch script, or a job step of one task) the
    launcher does what it does on any machine: it starts N processes there and
    starts them again after a failure, and SLURM requeues the job as a whole.
    Inside a job step of several tasks each task would start N processes of
    its own, and a job of several nodes needs processes on every node, which
    only `srun` starts: both are refused, naming `srun`.
    """
    if SLURM_JOB not in os.environ:
        return None
    job = os.environ[SLURM_JOB]
    tasks = int(os.environ.get("SLURM_STEP_NUM_TASKS", os.environ.get(SLURM_TASKS, "1")))
    if SLURM_STEP in os.environ and tasks > 1:
        return (
            f"flaxstate launch runs in each of the {tasks} tasks of a SLURM job step (job {job}): each would start "
            f"processes of its own. Start the training's processes with srun alone (`srun -n {tasks} python "
            "train.py`); SLURM restarts the job (--requeue: docs/guides/cluster.md)."
        )
    nodes = int(os.environ.get("SLURM_JOB_NUM_NODES", "1"))
    if nodes > 1:
        return (
            f"flaxstate launch starts processes on this node only, and SLURM job {job} has {nodes} nodes: start "
            "the training's processes with srun (one task a GPU or a node); SLURM restarts the job (--requeue: "
            "docs/guides/cluster.md)."
        )
    return None


REGISTERED: dict[str, Any] = {}
"""The cluster environments this module registered with JAX, by name (none with a JAX that has no clusters)."""


def batch_shell_error() -> str:
    """What `jax.distributed.initialize()` says in a SLURM batch script's own shell (jax#30073)."""
    return (
        f"jax.distributed.initialize() was called in the shell of a SLURM batch script (job "
        f"{os.environ.get(SLURM_JOB, '?')}), not in a task of a job step: the job's "
        f"{os.environ.get(SLURM_TASKS, '?')} tasks are started by srun alone. Run the training with srun in the "
        f"batch script (`srun python train.py`, as examples/slurm/train.sbatch does)."
    )


def _slurm_nodes() -> int | None:
    nodes = os.environ.get(SLURM_STEP_NODES)
    return None if nodes is None else int(nodes)


def jobset_numbers() -> tuple[int, int, int, int]:
    """A JobSet pod's numbers from its variables: (its pod index in its Job, its Job's index, the Jobs, the pods of
    each Job).

    Raises:
        ValueError: a variable is missing, is not a whole number, or is out of range; naming it and where it comes
            from (docs/guides/cluster.md).
    """
    numbers = []
    for name in JOBSET_NEEDS:
        value = os.environ.get(name, "")
        if not value.strip().isdigit():
            raise ValueError(
                f"the JobSet pod's {name} is {value!r}, not a whole number: its pod template must set "
                f"{', '.join(JOBSET_NEEDS)} (the downward API's annotations and the Job's parallelism, as "
                "docs/guides/cluster.md's JobSet does)"
            )
        numbers.append(int(value))
    pod, job, jobs, pods = numbers
    if not (pod < pods and job < jobs):
        raise ValueError(
            f"the JobSet pod's {JOBSET_POD_INDEX}={pod} and {JOBSET_JOB_INDEX}={job} are not within its "
            f"{JOBSET_PODS_PER_JOB}={pods} pods a Job and {JOBSET_JOBS}={jobs} Jobs: {JOBSET_PODS_PER_JOB} must be "
            "the Job's parallelism, and every replicated Job of the JobSet must run the training with that many pods "
            "(docs/guides/cluster.md)"
        )
    return pod, job, jobs, pods


def jobset_coordinator() -> str:
    """The host name of a JobSet's coordinator pod (`JOBSET_COORDINATOR`), or else of its first Job's first pod."""
    named = os.environ.get(JOBSET_COORDINATOR, "").strip()
    if named:
        return named
    hostname = os.environ.get("HOSTNAME", "")
    prefix = hostname.rsplit("-", 2)[0] if hostname.count("-") >= 2 else ""
    if not prefix:
        raise ValueError(
            f"the JobSet pod's HOSTNAME {hostname!r} is not <jobset>-<replicated job>-<job>-<pod>, and "
            f"{JOBSET_COORDINATOR} is unset: name the coordinator in the JobSet (spec.coordinator) and give its "
            "annotation jobset.sigs.k8s.io/coordinator to the pods as JOBSET_COORDINATOR (docs/guides/cluster.md)"
        )
    return f"{prefix}-0-0.{os.environ[JOBSET]}"


def jobset_processes() -> int:
    """A JobSet's processes, one a pod over all its Jobs; also its hosts, each pod a network of its own (its
    loopback is no other pod's)."""
    _, _, jobs, pods = jobset_numbers()
    return jobs * pods


def _ompi_nodes() -> int | None:
    """The nodes of an Open MPI job, where every node runs as many ranks as this one (mpirun's default)."""
    size, local = os.environ.get(OMPI_SIZE), os.environ.get(OMPI_LOCAL_SIZE)
    return None if size is None or local is None else -(-int(size) // int(local))


CHECKED = {
    # the environment's name: (who starts the processes, the variable of its count, how to start N, its nodes)
    "flaxstate": ("flaxstate launch", PROCESS_COUNT, "flaxstate launch --processes {n}", lambda: 1),
    "slurm": ("srun", SLURM_TASKS, "srun -n {n}", _slurm_nodes),
    "ompi": ("mpirun", OMPI_SIZE, "mpirun -np {n}", _ompi_nodes),
    "jobset": ("the JobSet", f"{JOBSET_JOBS} x {JOBSET_PODS_PER_JOB}", "Jobs x parallelism = {n}", jobset_processes),
}
"""The managers whose joins flaxstate checks and watches (`flaxstate.joining`)."""


def _checked(parent: Any, at: int | None = None) -> Any:
    """A copy of the cluster environment `parent` that checks and watches the join (`flaxstate.joining`) when
    `jax.distributed.initialize()` asks it for this process's id, put ahead of `parent` in JAX's order (`at`: at
    that place instead)."""
    manager, count_from, fix_count, nodes = CHECKED[parent.name]

    def before_join(own_id: int | None) -> None:
        found = joining.jax_join_frames()
        if found is None:  # not asked by JAX's auto-detection, or asked before in this call
            return
        asked, initialize = found
        started = parent.get_process_count()
        wanted = asked.get("num_processes") or started
        join = joining.Join(
            manager=manager,
            started=started,
            count_from=count_from,
            nodes=nodes(),
            coordinator=asked.get("coordinator_address") or parent.get_coordinator_address(None, None),
            num_processes=wanted,
            process_id=asked["process_id"] if own_id is None else own_id,
            timeout=float(asked.get("initialization_timeout") or 300),
            fix_count=fix_count.format(n=wanted),
        )
        joining.check(join)
        joining.wait_for_coordinator(join)
        joining.watch(join, initialize)

    class Checked(parent):
        __doc__ = f"{parent.__name__}, its join checked and watched (flaxstate.joining)."
        name = parent.name

        @classmethod
        def get_process_id(cls) -> int:
            process_id: int = super().get_process_id()
            before_join(process_id)
            return process_id

        @classmethod
        def get_local_process_id(cls) -> int | None:  # asked where the call gave the process's id
            local: int | None = super().get_local_process_id()
            before_join(None)
            return local

    Checked.__name__ = Checked.__qualname__ = f"Checked{parent.__name__}"
    order = private_apis.cluster_types()
    if Checked in order and parent in order:
        order.remove(Checked)
        order.insert(order.index(parent) if at is None else at, Checked)
    return Checked


def _register_cluster() -> None:
    """Registers `LaunchedCluster`, and `SlurmBatchShell` after JAX's `SlurmCluster`, with JAX's cluster
    environments, and the checked copies of the managers' environments ahead of them (a JAX without them is left
    alone)."""
    base: Any = private_apis.cluster_env()
    if base is None:  # pragma: no cover - a JAX that moved its clusters: the launcher's variables stay unread
        return

    class LaunchedCluster(base):
        """The processes of `flaxstate launch` (see the module)."""

        name = "flaxstate"

        @classmethod
        def is_env_present(cls) -> bool:
            return COORDINATOR in os.environ

        @classmethod
        def get_coordinator_address(cls, timeout_secs: int | None, override_coordinator_port: str | None) -> str:
            address = os.environ[COORDINATOR]
            return f"{address.rsplit(':', 1)[0]}:{override_coordinator_port}" if override_coordinator_port else address

        @classmethod
        def get_process_count(cls) -> int:
            return int(os.environ[PROCESS_COUNT])

        @classmethod
        def get_process_id(cls) -> int:
            return int(os.environ[PROCESS_ID])

        @classmethod
        def get_local_process_id(cls) -> int | None:
            local = os.environ.get(LOCAL_PROCESS_ID)
            return None if local is None else int(local)

    class SlurmBatchShell(base):
        """A SLURM job's batch script run without `srun`: present where `SLURM_JOB_ID` is set and no job step's
        (`SLURM_STEP_ID`, which JAX's `SlurmCluster` needs with `SLURM_STEP_NODELIST`). Asked where the
        coordinator is, it says why there is none and what to do, instead of JAX's "coordinator_address should
        be defined"."""

        name = "slurm-batch-shell"

        @classmethod
        def is_env_present(cls) -> bool:
            return SLURM_JOB in os.environ and SLURM_STEP not in os.environ and COORDINATOR not in os.environ

        @classmethod
        def get_coordinator_address(cls, timeout_secs: int | None, override_coordinator_port: str | None) -> str:
            raise RuntimeError(batch_shell_error())

        @classmethod
        def get_process_count(cls) -> int:
            return int(os.environ.get(SLURM_TASKS, "1"))

        @classmethod
        def get_process_id(cls) -> int:
            return int(os.environ.get("SLURM_PROCID", "0"))

        @classmethod
        def get_local_process_id(cls) -> int | None:
            return None

    class JobSetCluster(base):
        """A Kubernetes JobSet's pods, from their variables alone (see the module's JOBSET names): one process a
        pod, numbered Job by Job, over all the JobSet's Jobs. JAX's own `K8sCluster` asks the Kubernetes API (the
        `kubernetes` package and a service account that may read pods and Jobs) and counts one Job's pods only."""

        name = "jobset"

        @classmethod
        def is_env_present(cls) -> bool:
            return JOBSET in os.environ and JOBSET_POD_INDEX in os.environ and COORDINATOR not in os.environ

        @classmethod
        def get_coordinator_address(cls, timeout_secs: int | None, override_coordinator_port: str | None) -> str:
            return f"{jobset_coordinator()}:{override_coordinator_port or JOBSET_PORT}"

        @classmethod
        def get_process_count(cls) -> int:
            return jobset_processes()

        @classmethod
        def get_process_id(cls) -> int:
            pod, job, _, pods = jobset_numbers()
            return job * pods + pod

        @classmethod
        def get_local_process_id(cls) -> int | None:
            return None  # one process a pod, which sees its node's devices

    REGISTERED.update({"flaxstate": LaunchedCluster, "slurm-batch-shell": SlurmBatchShell, "jobset": JobSetCluster})
    # The launcher's processes are its own wherever its variables are set, also in a SLURM job step's task
    # (`srun -n 1 flaxstate launch ...`), whose variables JAX's SlurmCluster would read first; a JobSet's pods
    # next, ahead of JAX's K8sCluster, which would ask the Kubernetes API.
    REGISTERED["checked-flaxstate"] = _checked(LaunchedCluster, at=0)
    REGISTERED["checked-jobset"] = _checked(JobSetCluster, at=1)
    for parent in base.__subclasses__():  # JAX's own, named in CHECKED
        if parent is not LaunchedCluster and getattr(parent, "name", None) in CHECKED:
            REGISTERED[f"checked-{parent.name}"] = _checked(parent)


_register_cluster()
