"""What the processes of one run tell each other: a JSON value gathered from every process.

Both the training loop (data positions, the run id) and the checkpoint
readers (which local steps each process holds) need it, and neither may
reach into the other's modules.
"""

from __future__ import annotations

import json
from typing import Any

import jax
import numpy as np
from jax.experimental import multihost_utils


def allgather_json(value: Any) -> list[Any]:
    """Returns every process's `value` (JSON-serializable), in process order (a collective; one process: `[value]`)."""
    if jax.process_count() == 1:
        return [json.loads(json.dumps(value))]
    encoded = np.frombuffer(json.dumps(value).encode(), dtype=np.uint8)
    lengths = multihost_utils.process_allgather(np.asarray([encoded.size], dtype=np.int32))
    padded = np.zeros(int(np.max(lengths)), dtype=np.uint8)
    padded[: encoded.size] = encoded
    gathered = multihost_utils.process_allgather(padded)
    return [
        json.loads(bytes(row[: int(length)]).decode())
        for row, length in zip(np.asarray(gathered), np.asarray(lengths).reshape(-1), strict=True)
    ]
