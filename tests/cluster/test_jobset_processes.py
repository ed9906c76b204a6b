"""Training in a Kubernetes JobSet's pods, by the variables that examples/kubernetes/jobset.yaml gives them.

Tier 2 (tests/README.md): tests that start, kill or signal processes of their own, or run servers or commands.

No Kubernetes runs here: each pod is a process of this machine, given the variables that the example's pod template
gives a pod of its JobSet. The template is read from the example itself: its literal values, and its downward
API's `fieldRef`s resolved from the labels and annotations that JobSet's controller puts on every pod
(`labelAndAnnotateObject` in kubernetes-sigs/jobset), with Kubernetes' own `JOB_COMPLETION_INDEX`. The pods join
with `jax.distributed.initialize()` and no arguments (flaxstate's `JobSetCluster`), and train as two processes that
no manager started. The coordinator's host name, which the cluster's DNS resolves to the coordinator pod, is this
machine's own here, and its coordinator listens on the address that name resolves to, a loopback one.
"""

import ipaddress
import json
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from flaxstate_testing import managed, processes
from flaxstate_testing.checkpoints import assert_equal_files
from flaxstate_testing.managed import CONFIG, WORKER

JOBSET = Path(__file__).parents[2] / "examples" / "kubernetes" / "jobset.yaml"

JOIN = [sys.executable, "-m", "flaxstate_testing.workers.join"]
"""The worker that only joins the pods and says so."""


def pod_variables(spec: dict, job: int, pod: int) -> dict[str, str]:
    """The variables of pod `pod` of Job `job` of the JobSet `spec`: its template's `env`, resolved."""
    name = spec["metadata"]["name"]
    [replicated] = spec["spec"]["replicatedJobs"]
    coordinator = spec["spec"]["coordinator"]
    placed = {  # what JobSet's controller labels and annotates each pod with (those the example reads)
        "jobset.sigs.k8s.io/jobset-name": name,
        "jobset.sigs.k8s.io/replicatedjob-name": replicated["name"],
        "jobset.sigs.k8s.io/global-replicas": str(replicated["replicas"]),
        "jobset.sigs.k8s.io/job-index": str(job),
        "jobset.sigs.k8s.io/job-global-index": str(job),
        "jobset.sigs.k8s.io/restart-attempt": str(spec.get("status", {}).get("restarts", 0)),
        "jobset.sigs.k8s.io/coordinator": (
            f"{name}-{coordinator['replicatedJob']}-{coordinator['jobIndex']}-{coordinator['podIndex']}.{name}"
        ),
    }
    [container] = replicated["template"]["spec"]["template"]["spec"]["containers"]
    variables = {"JOB_COMPLETION_INDEX": str(pod), "HOSTNAME": f"{name}-{replicated['name']}-{job}-{pod}"}
    for each in container["env"]:
        if "value" in each:
            variables[each["name"]] = each["value"]
        else:
            field = each["valueFrom"]["fieldRef"]["fieldPath"]  # metadata.labels['...'] or metadata.annotations['...']
            variables[each["name"]] = placed[field.split("['")[1].rstrip("']")]
    return variables


def jobset(jobs: int, pods: int, restarts: int = 0) -> dict:
    """The example's JobSet with `jobs` Jobs of `pods` pods each (the template's JOB_PARALLELISM with them), started
    again `restarts` times."""
    spec = yaml.safe_load(JOBSET.read_text())
    [replicated] = spec["spec"]["replicatedJobs"]
    replicated["replicas"] = jobs
    replicated["template"]["spec"].update(parallelism=pods, completions=pods)
    [container] = replicated["template"]["spec"]["template"]["spec"]["containers"]
    [parallelism] = [each for each in container["env"] if each["name"] == "JOB_PARALLELISM"]
    parallelism["value"] = str(pods)
    spec["status"] = {"restarts": restarts}
    return spec


def start_pods(spec: dict, command: list[str], cwd: Path, **overrides: str) -> list[processes.Watched]:
    """Starts one process a pod of `spec`, running `command`, its coordinator on this machine's host name."""
    host = socket.gethostname()
    address = socket.gethostbyname(host)
    assert ipaddress.ip_address(address).is_loopback, f"this machine's name {host} resolves to {address}: not loopback"
    port = processes.free_port()
    [replicated] = spec["spec"]["replicatedJobs"]
    started = []
    for job in range(replicated["replicas"]):
        for pod in range(replicated["template"]["spec"]["parallelism"]):
            variables = pod_variables(spec, job, pod)
            variables["JOBSET_COORDINATOR"] = host  # the cluster's DNS name of the coordinator pod, resolved here
            env = {
                **processes.worker_env(),
                **variables,
                "JAX_COORDINATOR_PORT": str(port),
                "JAX_COORDINATOR_BIND_ADDRESS": f"{address}:{port}",  # JAX's default binds every interface
                **overrides,
            }
            process = subprocess.Popen(
                command, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                start_new_session=True,
            )  # fmt: skip
            started.append(processes.Watched(process))
    return started


@pytest.fixture
def pods():
    """The pods of a test, killed by their process groups when it ends, passed or failed."""
    with processes.reaped() as started:
        yield started


@pytest.fixture(scope="module")
def straight(tmp_path_factory):
    """The final parameters' file of `managed.CONFIG`'s run on two processes that no cluster manager started."""
    return managed.straight(tmp_path_factory.mktemp("straight"))


@pytest.mark.parametrize("jobs, pods_a_job", [(2, 1), (1, 2)])
def test_a_jobset_s_pods_train_bit_for_bit_as_flaxstate_launch_and_goodput_names_the_jobset_s_restart(
    tmp_path, straight, pods, jobs, pods_a_job
):
    config = dict(CONFIG, output_dir=str(tmp_path / "run"), out=str(tmp_path / "pods.npz"), resume=True)
    pods.extend(start_pods(jobset(jobs, pods_a_job, restarts=1), [*WORKER, json.dumps(config)], tmp_path))
    assert [each.finish(timeout=300) for each in pods] == [0, 0], [each.output for each in pods]
    # Both trained every record, one process of two each (JAX found them through the pods' variables).
    assert all("record 40 " in each.output for each in pods), [each.output for each in pods]

    assert_equal_files(tmp_path / "pods.npz", straight)
    assert_equal_files(tmp_path / "pods.npz", managed.launched(config, tmp_path))
    report = subprocess.run(
        [sys.executable, "-m", "flaxstate", "goodput", str(tmp_path / "run")], capture_output=True, text=True
    )
    assert report.returncode == 0 and "jobset, restart 1" in report.stdout, report.stdout + report.stderr


def test_a_pod_template_without_a_variable_or_with_a_loopback_coordinator_is_one_line_before_the_join(tmp_path, pods):
    two = jobset(1, 2)
    pods.extend(start_pods(two, [*JOIN, "{}"], tmp_path, JOB_PARALLELISM=""))
    for each in pods:
        assert each.finish(timeout=120) != 0
        assert "the JobSet pod's JOB_PARALLELISM is '', not a whole number" in each.output, each.output
        assert "docs/guides/cluster.md" in each.output and "joined" not in each.output, each.output

    pods.extend(loopback := start_pods(two, [*JOIN, "{}"], tmp_path, JOBSET_COORDINATOR="localhost"))
    for each in loopback:
        assert each.finish(timeout=120) != 0
        assert "is this machine's loopback interface, and the 2 processes run on 2 nodes" in each.output, each.output
        assert "joined" not in each.output, each.output
