"""`flaxstate launch`: N processes that find each other with `jax.distributed.initialize()`, restarted after a
failure, with signals sent to real processes (the launcher's and its children's).

The scripts are small Python files written by each test; every launcher runs
in a subprocess with a hard timeout, and its output is read as it comes.
"""

from flaxstate import launch


def test_a_restart_takes_the_autotune_flags_its_cached_programs_were_compiled_with(tmp_path):
    """JAX's cache key hashes XLA_FLAGS: a restart whose flags differ from the round that filled the cache finds
    none of its programs. The results are loaded only by a round that must compile, and the rounds after it keep
    that round's flags while its programs are in the cache."""
    cache = tmp_path / "processes-1"
    cache.mkdir()
    results = cache / "autotune" / "process-0.textproto"
    dump = f"--xla_gpu_dump_autotune_results_to={results}"
    load = f"--xla_gpu_load_autotune_results_from={results}"
    assert launch.autotune_flags(str(cache), 0) == (dump,)  # a first round: nothing to load
    results.write_text("version: 3")  # XLA dumped its results ...
    (cache / "jit_update-0123abcd-cache").write_bytes(b"program")  # ... and JAX cached the programs
    assert launch.autotune_flags(str(cache), 0) == (dump,)  # a restart: the first round's flags, a cache hit
    for entry in cache.iterdir():  # the cache cleared, the results kept: compiled again, with the results loaded
        if entry.is_file():
            entry.unlink()
    assert launch.autotune_flags(str(cache), 0) == (dump, load)
    (cache / "jit_update-4567cdef-cache").write_bytes(b"program")  # compiled with the load
    assert launch.autotune_flags(str(cache), 0) == (dump, load)  # the next restart keeps it
    assert launch.autotune_flags(str(cache), 1) == (dump.replace("process-0", "process-1"),)  # each process its own


def test_a_round_s_failure_names_the_process_and_how_it_ended_and_gives_the_shell_s_status():
    killed, exited = launch.Failure(2, -9), launch.Failure(0, 3)
    assert str(killed) == "process 2 was killed by SIGKILL" and killed.exit_status == 128 + 9
    assert str(exited) == "process 0 exited with status 3" and exited.exit_status == 3
    assert str(launch.Failure(1, -200)) == "process 1 was killed by signal 200"
