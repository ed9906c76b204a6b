"""The private APIs of flaxstate's dependencies, in one place: used only where no public API does the work.

Each is imported here and nowhere else, guarded: a dependency that moves or
renames one makes its function here fall back where a fallback exists (a
profiler annotation on every dispatch, the launcher's variables left unread)
or raise an `ImportError` that names the dependency, the name and what needs
it. `tests/test_private_apis.py` resolves every one of them on each supported
stack, so an upgrade that breaks one fails there, by name, before a user meets
the fallback.

The public APIs that replaced the other private uses: `fsspec.core.strip_protocol`
(a bucket URL's path), `orbax.checkpoint.path.atomicity_types.COMMIT_SUCCESS_FILE`.
"""

from __future__ import annotations

from collections.abc import Callable
from types import CodeType
from typing import Any

PRIVATE_APIS = {
    "jax._src.lib._profiler.TraceMe.is_enabled": "whether a profiler trace is taken (the step annotations)",
    "jax._src.clusters.ClusterEnv": "a cluster environment for jax.distributed.initialize() (flaxstate launch)",
    "jax._src.clusters.ClusterEnv._cluster_types": (
        "the order in which jax.distributed.initialize() asks the cluster environments (flaxstate's checked ones "
        "ahead of JAX's SLURM and Open MPI environments)"
    ),
    "jax._src.clusters.ClusterEnv.auto_detect_unset_distributed_params": (
        "the call of jax.distributed.initialize() that asks a cluster environment, and its arguments (the join's "
        "checks, flaxstate.joining)"
    ),
    "jax._src.distributed.State.initialize": "JAX's join, watched while it waits (flaxstate.joining)",
    "jax._src.lib.xla_client.make_cpu_client": "N host devices to compile a plan for (fs.plan(target='cpu:N'))",
    "jax._src.xla_bridge.backends_are_initialized": "whether XLA read its flags already (fs.use_xla_preset)",
    "jax.config.values": "JAX's options by name, kept with a checkpoint's environment (xla_settings.in_force)",
    "etils.epath.Path._backend.fs": "the fsspec filesystem that etils.epath (and orbax) read a bucket with",
    "orbax.checkpoint._src.serialization.jax_array_handlers._async_serialize_shardings": (
        "the sharding file of device arrays that a budget saves chunk by chunk (what orbax's ArrayHandler writes)"
    ),
}
"""Each private name flaxstate uses, and what for (`tests/test_private_apis.py` resolves every one)."""


def _missing(name: str, error: Exception) -> ImportError:
    return ImportError(
        f"flaxstate uses {name} for {PRIVATE_APIS[name]}, and this version of its package has none "
        f"({type(error).__name__}: {error}): install the versions pyproject.toml names, or report it to flaxstate."
    )


def profiler_tracing() -> Callable[[], bool]:
    """`() -> whether a profiler trace is being taken` (a C++ flag read); `() -> True` where JAX has none.

    With the fallback, every dispatch is annotated (0.7 us each), as if a trace were always taken.
    """
    try:
        from jax._src.lib import _profiler

        is_enabled: Callable[[], bool] = _profiler.TraceMe.is_enabled
    except (ImportError, AttributeError):
        return lambda: True
    return is_enabled


def cluster_env() -> type | None:
    """JAX's base class of cluster environments (`jax._src.clusters.ClusterEnv`), or `None` where JAX has none."""
    try:
        from jax._src import clusters

        base: type = clusters.ClusterEnv
    except (ImportError, AttributeError):
        return None
    return base


def cluster_types() -> list[type]:
    """JAX's cluster environments in the order `jax.distributed.initialize()` asks them (the list itself, to put an
    environment ahead of another), or an empty list where JAX has none."""
    base = cluster_env()
    types: list[type] = getattr(base, "_cluster_types", []) if base is not None else []
    return types


def join_code() -> tuple[CodeType, CodeType] | None:
    """The code of JAX's detection of the cluster (`ClusterEnv.auto_detect_unset_distributed_params`) and of its
    join (`State.initialize`), to find their frames in a call of `jax.distributed.initialize()`; `None` where JAX
    has neither (the join is then neither checked nor watched)."""
    try:
        from jax._src import clusters, distributed

        detect: CodeType = clusters.ClusterEnv.__dict__["auto_detect_unset_distributed_params"].__func__.__code__
        join: CodeType = distributed.State.initialize.__code__
    except (ImportError, AttributeError):
        return None
    return detect, join


def cpu_devices(count: int) -> list[Any]:
    """`count` host devices of a CPU client of their own, to compile for (never to run collectives on).

    Raises:
        ImportError: JAX has no `make_cpu_client` where flaxstate looks for it.
    """
    name = "jax._src.lib.xla_client.make_cpu_client"
    try:
        from jax._src.lib import xla_client

        make_cpu_client: Any = xla_client.make_cpu_client
    except (ImportError, AttributeError) as error:
        raise _missing(name, error) from error
    return list(make_cpu_client(num_devices=count).devices())


def bucket_filesystem(path: Any) -> Any:
    """The fsspec filesystem that `etils.epath` reads the bucket URL `path` with (one instance a process).

    It is the instance orbax's reads and writes go through, so that what
    flaxstate forgets of its listings (`locations.forget_listings`) is what
    they list from.

    Raises:
        ImportError: `etils.epath.Path` keeps its backend elsewhere.
    """
    name = "etils.epath.Path._backend.fs"
    try:
        backend: Any = path._backend
        filesystem = backend.fs
    except AttributeError as error:
        raise _missing(name, error) from error
    return filesystem(path)


def orbax_sharding_file_writer() -> Callable[..., Any] | None:
    """orbax's writer of an item's `_sharding` file (`(shardings, infos, *, primary_host) -> coroutine`), or `None`.

    With the fallback, a budget's save of device arrays writes no sharding file: as orbax's own
    `ArrayHandler(enable_write_sharding_file=False)`, a restore then needs the arrays' shardings, which
    flaxstate's reader always gives.
    """
    try:
        from orbax.checkpoint._src.serialization import jax_array_handlers

        write: Callable[..., Any] = jax_array_handlers._async_serialize_shardings
    except (ImportError, AttributeError):
        return None
    return write


def backends_initialized() -> bool:
    """Whether JAX has started its backends (`xla_bridge.backends_are_initialized`): XLA has read `XLA_FLAGS`.

    Where JAX has no such function, whether `jax.devices()` was called is not known: `False`.
    """
    try:
        from jax._src import xla_bridge

        initialized: Callable[[], bool] = xla_bridge.backends_are_initialized
    except (ImportError, AttributeError):
        return False
    return bool(initialized())


def jax_config_values() -> dict[str, Any]:
    """JAX's options by name (`jax.config.values`); `{}` where JAX keeps them otherwise."""
    import jax

    values = getattr(jax.config, "values", None)
    return dict(values) if isinstance(values, dict) else {}
