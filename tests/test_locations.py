"""Where run directories may be: local paths, gs:// and s3:// buckets (tests/checkpoint/test_buckets_processes.py),
nothing else.

A URL of a store flaxstate does not write to, or a bucket given where a
local directory is needed (a local tier, a trace), is refused at
construction, naming the URL and what to give instead, and nothing lands in
a local 'az:', 's3:' or 'gs:' folder.
"""

import http.server
import threading
from pathlib import Path

import pytest

import flaxstate as fs
from flaxstate.locations import as_path, local_path, scheme_of


@pytest.mark.parametrize("url", ["gcs://bucket/run", "AZ://Container/Run", "az://container/run", Path("hdfs://n/run")])
def test_every_public_place_that_takes_a_run_directory_refuses_other_urls_and_creates_nothing(
    url, tmp_path, monkeypatch
):
    monkeypatch.chdir(tmp_path)
    makers = [
        lambda: fs.CheckpointFileWriter(url),
        lambda: fs.LowestCheckpointFileWriter(url, metric="loss"),
        lambda: fs.CheckpointFileReader(url, target=lambda *_: {}),
        lambda: fs.CheckpointFileReader([tmp_path / "local", url]),
        lambda: fs.HighestCheckpointFileReader(url, metric="acc"),
        lambda: fs.SummaryWriter(url),
    ]
    for make in makers:
        with pytest.raises(ValueError, match=r"flaxstate writes run directories to .* not to (gcs|az|hdfs):// URLs"):
            make()
    assert list(tmp_path.iterdir()) == []  # no local az: folder, no ledger


@pytest.mark.parametrize("url", ["gs://bucket/run", "s3://bucket/run"])
def test_places_that_write_this_machine_refuse_any_bucket(url, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    makers = [
        lambda: fs.CheckpointFileWriter(url, per_process=True),
        lambda: fs.CheckpointFileReader([url, tmp_path / "persistent"]),
        lambda: fs.TraceWriter(url, at_step=1),
    ]
    for make in makers:
        with pytest.raises(ValueError, match=r"URL, and writes only to a local or mounted filesystem"):
            make()
    assert list(tmp_path.iterdir()) == []


def test_paths_pass_unchanged_and_a_url_read_as_a_path_is_still_a_url():
    assert local_path("runs/digits", "x") == Path("runs/digits").absolute()
    assert local_path(Path("/tmp/gs:/x"), "x") == Path("/tmp/gs:/x")  # a folder named gs: inside a path is a path
    assert scheme_of(Path("gs://b/run")) == "gs"  # pathlib made it gs:/b/run
    assert str(as_path(Path("gs://b/run"))) == "gs://b/run"


class _Forbidden(http.server.BaseHTTPRequestHandler):
    """Answers every request 403 with an empty body, as S3 answers an unsigned request for a private bucket."""

    def _forbidden(self) -> None:
        self.send_response(403)
        self.send_header("Content-Length", "0")
        self.end_headers()

    do_HEAD = do_GET = do_PUT = do_POST = _forbidden

    def log_message(self, *args: object) -> None:
        pass


def test_an_s3_bucket_without_any_aws_credentials_names_the_variables_not_a_missing_bucket(tmp_path, monkeypatch):
    for name in (
        "AWS_ACCESS_KEY_ID",
        "AWS_SECRET_ACCESS_KEY",
        "AWS_SESSION_TOKEN",
        "AWS_PROFILE",
        "AWS_DEFAULT_PROFILE",
    ):
        monkeypatch.delenv(name, raising=False)
    for name in ("AWS_CONTAINER_CREDENTIALS_RELATIVE_URI", "AWS_CONTAINER_CREDENTIALS_FULL_URI"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(tmp_path / "no-credentials"))
    monkeypatch.setenv("AWS_CONFIG_FILE", str(tmp_path / "no-config"))
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")  # no instance metadata asked for: nothing leaves
    # An endpoint that refuses every unsigned request, as S3 does (403): its answer cannot tell a bucket's existence.
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Forbidden)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    monkeypatch.setenv("AWS_ENDPOINT_URL", f"http://127.0.0.1:{server.server_address[1]}")
    try:
        with pytest.raises(ValueError, match="no AWS credentials were found") as raised:
            fs.CheckpointFileWriter("s3://existing-bucket/run")
    finally:
        server.shutdown()
        server.server_close()
    assert "AWS_ACCESS_KEY_ID" in str(raised.value) and "AWS_PROFILE" in str(raised.value)
    assert "does not exist" not in str(raised.value)
