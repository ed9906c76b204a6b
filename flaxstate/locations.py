"""Where a run directory is: a local (or mounted) path, or a bucket's URL, and never a URL read as a path.

`pathlib.Path("gs://bucket/run")` is the local path `gs:/bucket/run`: a run
given a bucket would train into a folder of the working directory and lose
everything at the machine's first preemption. Every public place that takes a
run directory goes through `run_directory`, at construction, before any work:

- a local path comes back as an absolute `pathlib.Path`;
- a `gs://` URL comes back as an `etils.epath.Path`: the path type orbax
  itself takes, whose files go through gcsfs (fsspec) and whose arrays go
  through tensorstore's own gcs driver (orbax's). Its client must be
  installed (`pip install 'flaxstate[gcs]'`) and its bucket must answer,
  or the construction fails naming the URL and what was tried;
- an `s3://` URL likewise, through s3fs (`pip install 'flaxstate[s3]'`);
  its arrays go through tensorstore's s3 driver (`checkpoint.objects`:
  orbax writes no s3:// arrays);
- any other URL is refused, naming what to give instead.

The two path types share the methods flaxstate calls on a run directory
(`/`, `name`, `with_name`, `exists`, `is_dir`, `iterdir`, `mkdir`, `open`,
`read_text`, `write_text`, `unlink`), except the few that this module gives
one meaning for both: `tree_size`, `remove_tree`, `size`, `key`. Object
storage has no rename and no append: the modules that would rename or append
(`checkpoint.storage`'s set-aside, `checkpoint.ledger`) ask `is_url` first.
"""

from __future__ import annotations

import os
import re
import shutil
from pathlib import Path
from typing import Any, cast

from flaxstate import private_apis

OBJECT_STORES = ("gs", "gcs", "s3", "s3a", "az", "abfs", "abfss", "hdfs", "http", "https")
"""The URL schemes of object and remote storage that a path must not be read as."""

BUCKETS = {"gs": ("gcsfs", "gcs"), "s3": ("s3fs", "s3")}
"""The schemes flaxstate writes run directories to: each one's client module and the extra that installs it."""

_URL = re.compile(rf"^({'|'.join(OBJECT_STORES)}):/", re.IGNORECASE)
_URL_HEAD = re.compile(rf"^({'|'.join(OBJECT_STORES)}):/+", re.IGNORECASE)
_MOUNTS = {
    "s3": "mountpoint-s3 or s3fs-fuse",
    "s3a": "mountpoint-s3 or s3fs-fuse",
    "gcs": "gcsfuse, or a gs:// URL",
}


def scheme_of(directory: str | os.PathLike[str]) -> str | None:
    """The object-storage scheme of a URL (`"gs"`, `"s3"`, ...), or `None` for a path."""
    match = _URL.match(os.fspath(directory))
    return None if match is None else match.group(1).lower()


def is_url(path: str | os.PathLike[str]) -> bool:
    """Whether `path` is an object-storage URL (an `etils.epath.Path` of a bucket, or its text)."""
    return scheme_of(path) is not None


def local_path(directory: str | os.PathLike[str], owner: str) -> Path:
    """A directory that must be on this machine (a local tier, a trace), as a local path.

    Args:
        directory: a local or mounted directory.
        owner: what took it (named in the error).

    Raises:
        ValueError: an object-storage URL, naming it, what a path would do
            with it, and what to give instead.
    """
    scheme = scheme_of(directory)
    if scheme is None:
        return Path(directory).absolute()
    text = os.fspath(directory)
    raise ValueError(
        f"{owner} got {text!r}, a {scheme}:// URL, and writes only to a local or mounted filesystem: read as "
        f"a path it would be a local folder {scheme + ':'!r} in {os.getcwd()} (lost with the machine). Give a "
        "local path."
    )


def run_directory(directory: str | os.PathLike[str], owner: str) -> Path:
    """A run directory: an absolute local path, or a checked bucket URL (see the module).

    Args:
        directory: a local or mounted directory, `gs://bucket/path` or `s3://bucket/path`.
        owner: what took it (named in errors).

    Returns:
        a `pathlib.Path`, or for a bucket an `etils.epath.Path` (typed as
        `Path`: it has the methods flaxstate calls on a run directory).

    Raises:
        ValueError: a URL of a scheme flaxstate does not write to; a bucket
            whose client package is missing (naming the extra to install),
            that does not exist, or that could not be reached (naming the
            URL and what was tried).
    """
    scheme = scheme_of(directory)
    if scheme is None:
        return Path(directory).absolute()
    text = _url_text(directory)
    if scheme not in BUCKETS:
        mount = _MOUNTS.get(scheme, "a filesystem mount of it")
        raise ValueError(
            f"{owner} got {text!r}: flaxstate writes run directories to local or mounted filesystems and "
            f"to gs:// and s3:// buckets, not to {scheme}:// URLs (read as a path it would be a local folder "
            f"{scheme + ':'!r} in {os.getcwd()}, lost with the machine). Give a local path, a gs:// or s3:// "
            f"URL, or the storage mounted as a directory ({mount})."
        )
    client, extra = BUCKETS[scheme]
    try:
        __import__(client)
    except ImportError as error:
        raise ValueError(
            f"{owner} got {text!r}, and writing to {scheme}:// needs the {client} package ({error}): "
            f"pip install 'flaxstate[{extra}]'."
        ) from error
    from etils import epath

    path = epath.Path(text.rstrip("/"))
    _check_bucket(path, text, owner)
    return cast(Path, path)


def _url_text(directory: str | os.PathLike[str]) -> str:
    """A URL's text, with the second slash that `pathlib.Path("gs://b/r")` drops (`gs:/b/r`) given back."""
    return _URL_HEAD.sub(lambda match: f"{match.group(1).lower()}://", os.fspath(directory), count=1)


def _check_bucket(path: object, text: str, owner: str) -> None:
    """Raises `ValueError` unless the bucket of `path` exists and answers (see `run_directory`)."""
    from etils import epath

    scheme, bucket = text.split("://")[0], text.split("/")[2]
    if not bucket:
        raise ValueError(f"{owner} got {text!r}, a URL with no bucket: give {scheme}://<bucket>/<path>.")
    if scheme == "s3":
        endpoint = os.environ.get("AWS_ENDPOINT_URL_S3") or os.environ.get("AWS_ENDPOINT_URL")
        tried = f"the endpoint {endpoint} (AWS_ENDPOINT_URL)" if endpoint else "Amazon S3"
        credentials = "AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY, or aws configure"
        create = f"aws s3 mb s3://{bucket}"
    else:
        emulator = os.environ.get("STORAGE_EMULATOR_HOST")
        tried = f"the emulator at {emulator} (STORAGE_EMULATOR_HOST)" if emulator else "Google Cloud Storage"
        credentials = "gcloud auth application-default login, or GOOGLE_APPLICATION_CREDENTIALS"
        create = f"gcloud storage buckets create gs://{bucket}"
    unsigned = scheme == "s3" and not _aws_credentials()
    no_credentials = (
        f"{owner} got {text!r}, and no AWS credentials were found, so {tried} cannot be asked whether the bucket "
        f"{bucket!r} exists (unsigned, it answers as if it did not): set AWS_ACCESS_KEY_ID and "
        "AWS_SECRET_ACCESS_KEY, or AWS_PROFILE for a profile of ~/.aws/credentials (aws configure writes one)."
    )
    try:
        exists = epath.Path(f"{scheme}://{bucket}").exists()
    except Exception as error:  # the clients raise their own errors: credentials, network, permissions
        if unsigned:
            raise ValueError(no_credentials) from error
        raise ValueError(
            f"{owner} got {text!r}, and the bucket {bucket!r} could not be reached at {tried}: "
            f"{type(error).__name__}: {error}. Check the credentials ({credentials}) and the network, "
            "before any training."
        ) from error
    if not exists and unsigned:
        raise ValueError(no_credentials)
    if not exists:
        raise ValueError(
            f"{owner} got {text!r}, and the bucket {bucket!r} does not exist at {tried} (or these credentials "
            f"cannot see it): create it ({create}) or give another."
        )


def _aws_credentials() -> bool:
    """Whether botocore finds AWS credentials (variables, a profile, instance metadata...) as s3fs will."""
    try:
        import botocore.session
    except ImportError:  # s3fs not installed: its own error says so later
        return True
    try:
        return botocore.session.get_session().get_credentials() is not None
    except Exception:  # noqa: BLE001 - a broken profile: let the client's own error speak
        return True


def as_path(directory: str | os.PathLike[str]) -> Path:
    """A directory already checked by `run_directory` (or written by flaxstate) as its path type, unchecked.

    Never `pathlib.Path` of a URL, which would make it a local folder.
    """
    if not is_url(directory):
        return Path(directory).absolute()
    from etils import epath

    return cast(Path, epath.Path(_url_text(directory)))


def key(path: Path) -> str:
    """One name for a directory, whatever spelling reached it (a local path resolved; a URL as written)."""
    return str(path) if is_url(path) else str(path.absolute().resolve())


def size(path: Path) -> int:
    """The bytes of one file."""
    if is_url(path):
        return int(cast(object, path.stat()).length)  # type: ignore[attr-defined]  # epath's StatResult
    return path.stat().st_size


def tree_size(path: Path) -> int:
    """The bytes of every file under a directory (0 where it holds none; what is deleted meanwhile counts 0)."""
    total = 0
    if not is_url(path):
        for folder, _, names in os.walk(path):
            for name in names:
                try:
                    total += os.stat(os.path.join(folder, name)).st_size
                except FileNotFoundError:
                    continue
        return total
    try:
        for child in path.iterdir() if path.is_dir() else []:
            total += tree_size(child) if child.is_dir() else size(child)
    except FileNotFoundError:
        pass
    return total


def tree_listing(path: Path) -> dict[str, int]:
    """Every file under a directory by its '/'-joined path below it, with its bytes (empty where there is none)."""
    if not is_url(path):
        return {
            os.path.relpath(os.path.join(folder, name), path): os.stat(os.path.join(folder, name)).st_size
            for folder, _, names in os.walk(path)
            for name in names
        }
    import fsspec.core  # with the bucket extras, as every URL here

    filesystem = _filesystem(path)
    root = fsspec.core.strip_protocol(str(path)).rstrip("/") + "/"
    try:
        found = filesystem.find(root, detail=True)
    except FileNotFoundError:
        return {}
    return {name.removeprefix(root): int(info["size"]) for name, info in found.items() if info["type"] == "file"}


def read_range(path: Path, start: int, end: int) -> bytes:
    """Bytes `[start, end)` of one file: a seek and a read on a disk, one ranged request to a bucket."""
    if not is_url(path):
        with open(path, "rb") as file:
            file.seek(start)
            return file.read(end - start)
    import fsspec.core  # with the bucket extras, as every URL here

    return bytes(_filesystem(path).cat_file(fsspec.core.strip_protocol(str(path)), start=start, end=end))


def upload(source: Path, target: Path) -> None:
    """Copies the local file `source` to the bucket URL `target`: one object, seen once whole."""
    import fsspec.core

    _filesystem(target).put_file(str(source), fsspec.core.strip_protocol(str(target)))


def move_tree(source: Path, target: Path, *, commit_marker: str | None = None) -> None:
    """Moves a directory to a new name of the same parent: a rename on a disk.

    A bucket has no rename: its objects are copied to `target`, then
    `commit_marker` (a file whose presence makes `source` a complete step)
    is deleted, then the rest. A reader sees the step whole until the marker
    goes, and not at all after it; a crash midway leaves both copies, and the
    move is done again.
    """
    if not is_url(source):
        source.rename(target)
        return
    filesystem = _filesystem(source)
    filesystem.copy(f"{source}/", f"{target}/", recursive=True)
    if commit_marker is not None:
        try:
            (source / commit_marker).unlink()
        except FileNotFoundError:
            pass
    remove_tree(source)


def _filesystem(path: Path) -> Any:
    """The fsspec filesystem that `etils.epath` reads a URL with (one instance a process, shared with orbax)."""
    return private_apis.bucket_filesystem(path)


def forget_listings(path: Path) -> None:
    """Drops what this process's bucket client remembers of listings, so that the next one asks the bucket.

    gcsfs keeps every listing it made (its `dircache`) and forgets only what
    it changed itself: a reader beside a writer of another process would
    list the steps of its first look forever, and take a step deleted since
    for damage. Each listing of steps forgets first. Nothing on a disk.
    """
    if is_url(path):
        _filesystem(path).invalidate_cache()


def remove_tree(path: Path) -> None:
    """Removes a directory and everything under it; one already gone, or going, is no error."""
    if not is_url(path):
        shutil.rmtree(path, ignore_errors=True)
        return
    try:
        path.rmtree()  # type: ignore[attr-defined]  # epath's
    except FileNotFoundError:
        pass
