"""Run directories in a bucket (gs://, s3://), against real emulators: kill -9, SIGTERM, damage, a live writer, the CLI.

Tier 2 (tests/README.md): tests that start, kill or signal processes of their own, or run servers or commands.

fake-gcs-server and moto's S3 server run on 127.0.0.1 for this module only,
one after the other, started and stopped here (`flaxstate_testing.buckets`);
every worker finds them through the clients' own variables. A gs://
directory is orbax's; an s3:// one is flaxstate's own store
(`flaxstate.checkpoint.stores.s3`), since orbax writes no s3:// arrays. A
bucket has no rename and no append, so each test checks what flaxstate does
instead, by listing the bucket's objects through the emulator itself.
"""

import json
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import fsspec
import jax
import numpy as np
import optax
import pytest
from flaxstate_testing import buckets, cluster, command_line, processes, toy
from flaxstate_testing.checkpoints import assert_same, read_beside_a_rotating_writer

import flaxstate as fs
from flaxstate import tree_paths
from flaxstate.run_record import goodput, ledger

CONFIG = {"data": "grain", "n_steps": 40, "every": 10, "width": 100_000, "keep": 2}


@pytest.fixture(scope="module", params=["gs", "s3"])
def bucket(request):
    """A running emulator with a bucket `runs`, of each scheme in turn (`bucket.scheme`).

    The kill -9 in a save, the errors, the best writers and the export run on both stores; each other
    behaviour, whose store calls the ones above already make, runs on one of them, the two in turn (a test
    that starts processes costs 10 to 25 s a store on 2 cores)."""
    with buckets.fake_gcs() if request.param == "gs" else buckets.moto_s3() as server:
        server.create_bucket("runs")
        yield server


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> dict:
    """The uninterrupted run's final state (on a local disk: where it is saved does not change the values)."""
    directory = tmp_path_factory.mktemp("reference")
    cluster.run("resume", {**CONFIG, "output_dir": str(directory / "run"), "out": str(directory / "final.npz")}, 1)
    return dict(np.load(directory / "final.npz"))


def run(tmp_path, url: str, **extra) -> tuple[dict, str]:
    out = tmp_path / "final.npz"
    (output,) = cluster.run("resume", {**CONFIG, "output_dir": url, "out": str(out), **extra}, 1, timeout=240)
    return dict(np.load(out)), output


def step_folders(server, prefix: str) -> dict[str, set[str]]:
    """Each top-level folder of a run in the bucket, with the names of its objects (relative to it)."""
    folders: dict[str, set[str]] = {}
    for name in server.objects("runs", prefix + "/"):
        folder, _, rest = name[len(prefix) + 1 :].partition("/")
        folders.setdefault(folder, set()).add(rest)
    return folders


def committed(folders: dict[str, set[str]]) -> list[int]:
    return sorted(int(name) for name, files in folders.items() if name.isdigit() and "commit_success.txt" in files)


def start_start(output: str) -> int:
    return int(output.split("start ")[1].split()[0])


def cli(*args: str) -> subprocess.CompletedProcess:
    """`python -m flaxstate ARGS` as a user runs it, in a process of its own."""
    return subprocess.run(
        [sys.executable, "-m", "flaxstate", *args],
        env=processes.worker_env(),
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_kill_9_during_a_save_then_resume_from_the_bucket_bit_for_bit(bucket, reference, tmp_path):
    url = f"{bucket.scheme}://runs/killed"
    worker = processes.Watched(processes.start("resume.py", {**CONFIG, "output_dir": url, "out": str(tmp_path / "x")}))
    try:
        worker.wait_for("record 20", timeout=180)  # its save of step 20 has just begun
        processes.kill(worker.process)
    finally:
        assert worker.finish(timeout=30) == -signal.SIGKILL, worker.output[-3000:]
    folders = step_folders(bucket, "killed")
    newest = committed(folders)[-1]
    assert 10 <= newest <= 20, folders.keys()
    # A save that the kill cut short, its commit marker never written: what a kill leaves when it lands
    # later in a save, made here for certain by copying the newest step without its marker.
    filesystem = fsspec.filesystem(bucket.scheme)
    filesystem.copy(f"runs/killed/{newest}/", "runs/killed/30/", recursive=True)
    filesystem.rm("runs/killed/30/commit_success.txt")
    assert "commit_success.txt" not in step_folders(bucket, "killed")["30"]

    final, output = run(tmp_path, url)
    assert start_start(output) == newest, output[-3000:]  # the unfinished step 30 is no checkpoint
    assert_same(final, reference)
    folders = step_folders(bucket, "killed")
    steps = [name for name in folders if name.isdigit()]
    assert committed(folders) == sorted(int(step) for step in steps) == [30, 40], folders.keys()
    assert len(folders["goodput-sessions"]) == 2  # one ledger object a session, both kept

    # The command line on the bucket: the ledger's two sessions, the steps with their bytes, one step.
    report = command_line.run_here("goodput", url, "--json")
    assert report.returncode == 0, report.stderr
    sessions = json.loads(report.stdout)["sessions"]
    assert [session["restored_step"] for session in sessions] == [None, newest]
    audited = cli("audit", url, "--json")  # the restored state and its replay, against the killed session's records
    assert audited.returncode == 0, audited.stdout + audited.stderr
    (resume,) = json.loads(audited.stdout)["resumes"]
    assert resume["from_step"] == newest and resume["verdict"] in ("bit-exact", "nothing replayed"), resume
    listing = command_line.run_here("ls", url)
    assert listing.returncode == 0, listing.stderr
    rows = [line.split() for line in listing.stdout.splitlines() if line.split()[1:2] in (["30"], ["40"])]
    assert len(rows) == 2 and all(row[5] == "MB" and float(row[4]) > 1 for row in rows), listing.stdout
    shown = command_line.run_here("show", url, "--step", "30")
    assert shown.returncode == 0 and f"{url}/30" in shown.stdout, shown.stdout + shown.stderr
    compared = command_line.run_here("diff", url, url, "--step-a", "30", "--step-b", "40")
    assert compared.returncode == 1 and "step" in compared.stdout, compared.stdout + compared.stderr  # 10 steps apart


@pytest.mark.parametrize("bucket", ["s3"], indirect=True)  # one store: see `bucket`
def test_sigterm_saves_to_the_bucket_and_the_resume_is_bit_for_bit(bucket, reference, tmp_path):
    url = f"{bucket.scheme}://runs/preempted"
    _, output = run(tmp_path, url, sigterm_after_save=10, data_sleep=0.02)
    assert "preempted" in output and "done 40" not in output, output[-3000:]
    preempted_step = int(output.split("preempted")[0].split("record ")[-1])
    assert preempted_step in committed(step_folders(bucket, "preempted")), output[-3000:]
    final, output = run(tmp_path, url)
    assert start_start(output) == preempted_step
    assert_same(final, reference)


@pytest.mark.parametrize("bucket", ["gs"], indirect=True)  # one store: see `bucket`
def test_a_damaged_step_in_the_bucket_is_passed_over_and_set_aside_by_copy(bucket, reference, tmp_path, caplog):
    url = f"{bucket.scheme}://runs/damaged"
    run(tmp_path, url, n_steps=20)
    folders = step_folders(bucket, "damaged")
    damaged = folders["20"]
    assert committed(folders) == [10, 20]
    filesystem = fsspec.filesystem(bucket.scheme)
    if bucket.scheme == "gs":  # orbax's: a manifest as a torn upload would leave it
        torn = sorted(name for name in damaged if name.startswith("model/") and name.endswith("manifest.ocdbt"))[0]
        filesystem.pipe(f"runs/damaged/20/{torn}", b"not a manifest")
    else:  # flaxstate's: the largest chunk cut short (zarr alone would not notice)
        torn = max(
            (name for name in damaged if "/c/" in name), key=lambda name: filesystem.size(f"runs/damaged/20/{name}")
        )
        filesystem.pipe(f"runs/damaged/20/{torn}", b"torn")
    final, output = run(tmp_path, url)
    assert start_start(output) == 10, output[-3000:]
    assert_same(final, reference)
    aside = step_folders(bucket, "damaged")["20.damaged"]
    assert aside == damaged, (aside, damaged)  # kept whole, out of the listing
    assert committed(step_folders(bucket, "damaged")) == [30, 40]  # 20 saved again whole, then rotated

    # The directory is this run's: another run (not resumed) is refused at its first record, nothing lost.
    other = processes.start("resume.py", {**CONFIG, "output_dir": url, "out": str(tmp_path / "x"), "resume": False})
    (output,) = processes.wait_all([other], timeout=240, expect_success=False)
    assert other.returncode != 0 and "holds checkpoints of another run (steps [30, 40]" in output, output[-3000:]
    assert committed(step_folders(bucket, "damaged")) == [30, 40]
    if bucket.scheme == "s3":
        # A chunk gone, which zarr would read as zeros: step 40 is damage, named, and the reader takes 30.
        gone = sorted(name for name in step_folders(bucket, "damaged")["40"] if "/c/" in name)[0]
        filesystem.rm(f"runs/damaged/40/{gone}")
        with caplog.at_level("WARNING", logger="flaxstate"):
            restored = fs.CheckpointFileReader(url).read(None)
        assert restored is not None and restored.step == 30
        assert f"{gone} is missing" in caplog.text, caplog.text


@pytest.mark.parametrize("bucket", ["s3"], indirect=True)  # one store: see `bucket`
def test_a_reader_beside_a_live_writer_in_the_bucket_restores_the_newest_complete_step(bucket, capsys):
    from flaxstate import cli

    keep = 1 if bucket.scheme == "gs" else 3  # the writer deletes the step a reader may hold: at once, or later
    url = f"{bucket.scheme}://runs/live-{keep}"

    def inspect(step: int) -> None:
        for command in ("ls", "show"):
            assert cli.main([command, url]) == 0, capsys.readouterr().err

    steps = read_beside_a_rotating_writer(url, keep, reads=10, each=inspect)
    assert "Traceback" not in capsys.readouterr().err
    assert steps == sorted(steps) and len(set(steps)) > 1, steps  # new steps seen as the writer saved them


def test_bucket_errors_come_at_construction_naming_the_url_and_the_fix(bucket, tmp_path):
    scheme = bucket.scheme
    create = "gcloud storage buckets create" if scheme == "gs" else "aws s3 mb"
    with pytest.raises(ValueError, match=rf"{scheme}://no-such-bucket/run.*'no-such-bucket' does not exist.*{create}"):
        fs.CheckpointFileWriter(f"{scheme}://no-such-bucket/run")
    with pytest.raises(ValueError, match=rf"'{scheme}://no-such-bucket/run'.*bucket 'no-such-bucket' does not exist"):
        fs.CheckpointFileReader(Path(f"{scheme}://no-such-bucket/run"), target=lambda rng: {})  # pathlib's gs:/ too
    with pytest.raises(ValueError, match=rf"local tier.*{scheme}://runs/local.*local path"):
        fs.CheckpointFileWriter(f"{scheme}://runs/local", per_process=True)
    with pytest.raises(ValueError, match=rf"TraceWriter.*{scheme}://runs/trace"):
        fs.TraceWriter(f"{scheme}://runs/trace", at_step=5)
    with pytest.raises(ValueError, match=r"az://bucket/run.*not to az:// URLs"):
        fs.CheckpointFileWriter("az://bucket/run")
    assert not list(tmp_path.iterdir())  # nothing made locally
    # Without the client package: the extra to install, before any work.
    client, extra = ("gcsfs", "gcs") if scheme == "gs" else ("s3fs", "s3")
    blocked = (
        f"import sys; sys.modules['{client}'] = None; import flaxstate as fs; "
        f"fs.CheckpointFileWriter('{scheme}://runs/x')"
    )
    result = subprocess.run(
        [sys.executable, "-c", blocked], env=processes.worker_env(), capture_output=True, text=True, timeout=120
    )
    assert result.returncode != 0 and f"pip install 'flaxstate[{extra}]'" in result.stderr, result.stderr[-2000:]


@pytest.mark.parametrize("bucket", ["gs"], indirect=True)  # one store: see `bucket`
def test_summaries_go_to_the_bucket_and_plot_from_it(bucket, tmp_path):
    # In a process of its own, which ends while the emulator runs: tensorboardX uploads its event file
    # again when the process ends, and would wait two minutes for an emulator already stopped.
    script = (
        f"import flaxstate as fs; writer = fs.SummaryWriter('{bucket.scheme}://runs/summaries'); "
        "writer(fs.Checkpoint(state=None, grads=None, loss=0.5, n_completed_steps=10, elapsed_time=1.0, step=10)); "
        "writer.close()"
    )
    result = subprocess.run(
        [sys.executable, "-c", script], env=processes.worker_env(), capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0, result.stderr[-2000:]
    (name,) = bucket.objects("runs", "summaries/")
    assert name.startswith("summaries/events.out.tfevents."), name
    with fsspec.open(f"{bucket.scheme}://runs/{name}", "rb") as events:
        assert b"train/loss" in events.read()
    plotted = cli("plot", f"{bucket.scheme}://runs/summaries", "-o", str(tmp_path / "curves.png"))
    assert plotted.returncode == 0 and (tmp_path / "curves.png").stat().st_size > 0, plotted.stderr[-2000:]
    figure = fs.plot(f"{bucket.scheme}://runs/summaries")  # as a notebook plots a run in a bucket
    assert "loss" in [axis.get_title() for axis in figure.axes]


@pytest.mark.parametrize("bucket", ["s3"], indirect=True)  # gs's multi-process saves: the test after the next
def test_two_tiers_local_disks_and_a_bucket_over_two_processes(bucket, tmp_path):
    """Local tiers on disk, the persistent one in the bucket; both processes killed, one host replaced.

    On S3 only (each process's parts are committed by a marker object of its own, which the test checks);
    two processes' saves to gs:// are the next test's.
    """
    config = {"data": "list", "width": 64, "optimizer": "sgd", "every": 10, "global_batch": 8, "n_steps": 200}
    config |= {"local_dirs": [str(tmp_path / f"local-{i}") for i in range(2)], "save_steps": [30]}
    config |= {"sharded": True}  # each process its half: a replaced host's parts are on no other (no replica)

    def start(output_dir: str, **extra) -> list[processes.Watched]:
        config_run = {**config, "output_dir": output_dir, "out": str(tmp_path / "final.npz"), **extra}
        port = processes.free_port()
        return [processes.Watched(processes.start("resume.py", config_run, i, 2, port)) for i in range(2)]

    straight = start(str(tmp_path / "straight"))
    assert [worker.finish(timeout=240) for worker in straight] == [0, 0], straight[0].output[-3000:]
    expected = dict(np.load(tmp_path / "final.npz"))
    for i in range(2):
        shutil.rmtree(tmp_path / f"local-{i}")

    url = f"{bucket.scheme}://runs/tiers"
    workers = start(url, data_sleep=0.03, wait_saved=True)  # the persistent save committed before any kill
    try:
        for worker in workers:
            worker.wait_for("record 50", timeout=240)
        deadline = time.monotonic() + 60
        while committed(step_folders(bucket, "tiers")) != [30] and time.monotonic() < deadline:
            time.sleep(0.1)
        assert "done" not in workers[0].output, "the run ended before step 30's save was committed"
    finally:
        for worker in workers:
            processes.kill(worker.process)
            worker.finish(timeout=30)
    assert committed(step_folders(bucket, "tiers")) == [30]
    assert {"done-0", "done-1"} <= step_folders(bucket, "tiers")["30"]  # both processes wrote their parts
    shutil.rmtree(tmp_path / "local-1")  # a replaced host: the persistent tier in the bucket it is
    workers = start(url)
    assert [worker.finish(timeout=240) for worker in workers] == [0, 0], workers[0].output[-3000:]
    assert "restoring from the persistent tier" in workers[0].output, workers[0].output[-3000:]
    assert all("start 30" in worker.output for worker in workers)
    assert_same(dict(np.load(tmp_path / "final.npz")), expected)
    # The killed session's ledger object holds what was uploaded before the kill: a bucket's object is
    # written whole at most once a second, so the kill costs at most the last second's events.
    first, second = goodput.report(ledger.run_events(url))["sessions"]
    assert first["restored_step"] is None and 10 <= first["last_step"] <= 200, first
    assert second["restored_step"] == 30 and second["last_step"] == 200, second


def test_best_writers_keep_the_best_in_the_bucket(bucket):
    model = toy.BatchNormNet()
    task = fs.TrainTask(apply=model.apply, optimizer=optax.adam(1e-2), loss=toy.mse, data=toy.batches(6, 8))
    loop = fs.TrainLoop(model.init, task, jax.random.key(0), n_steps=6, n_steps_per_checkpoint=2, stdout=False)
    url = f"{bucket.scheme}://runs/best"
    with fs.LowestCheckpointFileWriter(url, metric="loss", keep=2) as best:
        for record, value in zip(loop, [3.0, 1.0, 2.0], strict=True):
            best(record.with_metrics({"eval": {"loss": value}}))
    assert committed(step_folders(bucket, f"best/{best.policy.subdir}")) == [4, 6]  # step 2 (3.0) deleted
    restored = fs.LowestCheckpointFileReader(url, metric="loss").read(None)
    assert restored.step == 4 and restored.metrics["eval"]["loss"] == 1.0


@pytest.mark.parametrize("bucket", ["gs"], indirect=True)  # S3's multi-process saves: the two tiers' test
def test_saved_by_two_processes_in_the_bucket_restores_in_one_and_the_reverse(bucket, tmp_path):
    """Restore anywhere from a bucket: a step both processes wrote restores in one process, and the reverse.

    On gs:// only: two processes' saves to S3 are the two tiers' test's (each backend's multi-process save
    is tested once, to keep the suite's time).

    The first under the smallest budget (4 KiB chunks): each process writes its half of a 40 KiB kernel from
    its device, and one process reads it back a chunk at a time onto its device.
    """

    def devices(mode: str, name: str, n_processes: int, **extra) -> str:
        config = {"mode": mode, "output_dir": f"{bucket.scheme}://runs/devices-{name}", "width": 64, **extra}
        config["out"] = str(tmp_path / f"{name}.npz")
        return cluster.run("devices", config, n_processes=n_processes, timeout=180)[0]

    bounded = {"width": 2560, "budget": 32768}
    devices("save", "two", 2, sharded=True, **bounded)
    output = devices("restore", "two", 1, **bounded)
    assert "restored on 1 devices" in output and "decoded whole" not in output, output
    objects = bucket.objects("runs", "devices-two/1/")
    assert len(objects) > 60, objects  # in 4 KiB chunks: 83 objects, 32 without a budget
    devices("save", "one", 1)
    assert "restored on 2 devices" in devices("restore", "one", 2)


def test_a_run_in_the_bucket_exports_to_the_bucket_and_a_run_starts_from_those_files(bucket):
    import safetensors.numpy

    model = toy.BatchNormNet()
    task = fs.TrainTask(apply=model.apply, optimizer=optax.adam(1e-2), loss=toy.mse, data=toy.batches(4, 8))
    loop = fs.TrainLoop(model.init, task, jax.random.key(0), n_steps=4, n_steps_per_checkpoint=2, stdout=False)
    url = f"{bucket.scheme}://runs/to-export"
    with fs.CheckpointFileWriter(url, keep=2) as writer:
        for record in loop:
            writer(record)
    params = {path: np.asarray(value) for path, value in tree_paths.flatten(record.state.params).items()}
    out = f"{bucket.scheme}://runs/exported"
    fs.export_safetensors(url, out, transpose="kernel$", max_shard_bytes=64)  # shards, and their index
    names = set(bucket.objects("runs", "exported/"))
    with fsspec.open(f"{out}/model.safetensors.index.json") as file:
        index = json.load(file)
    assert names == {"exported/model.safetensors.index.json"} | {f"exported/{n}" for n in index["weight_map"].values()}
    assert sorted(index["weight_map"]) == sorted(params) and len(names) > 2, names
    for path, value in params.items():  # the safetensors package's own reader, of each object's bytes
        with fsspec.open(f"{out}/{index['weight_map'][path]}", "rb") as file:
            stored = safetensors.numpy.load(file.read())[path]
        np.testing.assert_array_equal(stored, value.T if path.endswith("kernel") else value, err_msg=path)
    reader = fs.SafetensorsReader(out, model.init, transpose="kernel$")
    started = fs.TrainLoop(reader, task, jax.random.key(1), n_steps=2, stdout=False)
    assert int(started.state.step) == 0
    for path, value in tree_paths.flatten(started.state.params).items():
        np.testing.assert_array_equal(value, params[path], err_msg=path)
    assert reader.bytes_read == sum(value.nbytes for value in params.values())
    # The same through a map: HF-style names, the kernels (out, in), into the bucket and back, by byte ranges.
    rules = {"Dense_{n}/kernel": ("dense.{n}.weight", "o i -> i o"), "Dense_{n}/bias": "dense.{n}.bias"}
    weight_map = fs.WeightMap({**rules, "BatchNorm_0/{p}": "norm.{p}"})
    fs.export_safetensors(url, f"{out}-mapped", map=weight_map)
    with fsspec.open(f"{out}-mapped/model.safetensors", "rb") as file:
        stored = safetensors.numpy.load(file.read())
    assert sorted(stored) == sorted(weight_map.entry(path).name for path in params)
    np.testing.assert_array_equal(stored["dense.1.weight"], params["Dense_1/kernel"].T)
    mapped = fs.SafetensorsReader(f"{out}-mapped", model.init, map=weight_map)
    for path, value in tree_paths.flatten(mapped.params(jax.tree.map(np.asarray, record.state.params))).items():
        np.testing.assert_array_equal(value, params[path], err_msg=path)
    assert mapped.bytes_read == sum(value.nbytes for value in params.values())
