"""Where a run directory is: a local (or mounted) path, and never an object-storage URL read as one.

`pathlib.Path("gs://bucket/run")` is the local path `gs:/bucket/run`: a run
given a bucket would train into a folder of the working directory and lose
everything at the machine's first preemption, and a reader pointed at a
bucket would find nothing there and start over. Until flaxstate writes to
object storage itself, every public place that takes a run directory refuses
a URL here, at construction, before any work.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

OBJECT_STORES = ("gs", "gcs", "s3", "s3a", "az", "abfs", "abfss", "hdfs", "http", "https")
"""The URL schemes of object and remote storage that a path must not be read as."""

_URL = re.compile(rf"^({'|'.join(OBJECT_STORES)}):/", re.IGNORECASE)


def local_path(directory: str | os.PathLike[str], owner: str) -> Path:
    """A run directory as a local path.

    Args:
        directory: a local or mounted directory.
        owner: what took it (named in the error).

    Raises:
        ValueError: an object-storage URL (`gs://`, `s3://`, ...), naming it,
            what a path would do with it, and what to give instead.
    """
    text = os.fspath(directory)
    match = _URL.match(text)
    if match is None:
        return Path(directory)
    scheme = match.group(1)
    raise ValueError(
        f"{owner} got {text!r}, a {scheme}:// URL: flaxstate writes run directories to a local or mounted "
        f"filesystem only, and read as a path it would be a local folder {scheme + ':'!r} in "
        f"{os.getcwd()} (lost with the machine). Give a local path, or the bucket mounted as one "
        "(gcsfuse for gs://, mountpoint-s3 or s3fs-fuse for s3://)."
    )
