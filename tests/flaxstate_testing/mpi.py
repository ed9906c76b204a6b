"""Open MPI's `mpirun` (Debian's `openmpi-bin`) on loopback, as the tests run it.

`command(n, *program)` is the `mpirun` command line that starts `n` ranks of a program on this machine: its
out-of-band and byte-transfer channels on the loopback interface only, each rank's lines tagged with its rank
(`[1,0]<stdout>:`), each rank run under `python -m flaxstate_testing.mpi status`, which prints the rank's exit status
(`exit N`, or `killed by SIGNAME`) before it ends: mpirun reports one status for the whole job.

JAX finds the ranks through Open MPI's variables (its `OmpiCluster`: `OMPI_MCA_orte_hnp_uri`, whose first address
is the coordinator's host, `OMPI_COMM_WORLD_SIZE`, `OMPI_COMM_WORLD_RANK`, `OMPI_COMM_WORLD_LOCAL_RANK`).
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import sys


def missing() -> str | None:
    """Why `mpirun` cannot run here (Open MPI not installed), or `None`."""
    if shutil.which("mpirun") is None:
        return "Open MPI's mpirun is not installed: apt-get install openmpi-bin"
    return None


def command(n_ranks: int, *program: str, sigkill_timeout: float | None = None) -> list[str]:
    """The `mpirun` command line that runs `program` as `n_ranks` ranks on this machine, over loopback.

    Args:
        n_ranks: the ranks (processes) to start, more than the cores if need be (`--oversubscribe`).
        program: the command each rank runs.
        sigkill_timeout: seconds mpirun waits, once signalled (SIGTERM, SIGINT), before it sends the ranks
            SIGTERM, and again before SIGKILL (`odls_base_sigkill_timeout`; Open MPI's default is 1).
    """
    options = ["--mca", "odls_base_sigkill_timeout", str(sigkill_timeout)] if sigkill_timeout is not None else []
    return [
        "mpirun",
        *("-np", str(n_ranks), "--oversubscribe", "--tag-output"),
        *(["--allow-run-as-root"] if os.geteuid() == 0 else []),
        *("--mca", "oob_tcp_if_include", "lo", "--mca", "btl_tcp_if_include", "lo", *options),
        *(sys.executable, "-m", "flaxstate_testing.mpi", "status", *program),
    ]


TAG = re.compile(r"\[\d+,(\d+)\]<std(?:out|err)>:")
"""mpirun's tag of each piece of a rank's output (`--tag-output`): `[job,rank]<stdout>:`."""


def rank_lines(output: str, rank: int) -> list[str]:
    """Rank `rank`'s lines of mpirun's tagged output, without their tags (a line written in pieces is tagged once
    a piece: the pieces are joined)."""
    lines = []
    for line in output.splitlines():
        if (first := TAG.match(line)) and int(first[1]) == rank:
            lines.append(TAG.sub("", line))
    return lines


def status(program: list[str]) -> int:
    """Runs `program`, outlives the signals sent to its process group, and prints its exit status."""
    # mpirun signals each rank's process group: the program gets them; this process waits on.
    for signum in (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1, signal.SIGUSR2):
        signal.signal(signum, lambda *_: None)
    # Each print of the workers is one write (they flush): unbuffered, a print of several values is several
    # writes, which mpirun tags one by one ("record[1,0]<stdout>: 30").
    code = subprocess.call(program, env={k: v for k, v in os.environ.items() if k != "PYTHONUNBUFFERED"})
    os.write(1, f"{f'killed by {signal.Signals(-code).name}' if code < 0 else f'exit {code}'}\n".encode())
    return code if code >= 0 else 128 - code


if __name__ == "__main__":
    assert sys.argv[1] == "status", sys.argv
    sys.exit(status(sys.argv[2:]))
