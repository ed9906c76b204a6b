"""One directory of checkpoints on orbax: save, list, read. With `layout`, `saving`, `damage` and `budget`, the
only modules that import orbax.

The layout of a step is `flaxstate.checkpoint.layout`'s. Arrays are saved as
the global arrays the loop holds (replicated arrays are stored once) and
restored into whatever sharding the caller asks for, so a checkpoint saved on
N devices or P processes restores on any other number. Saves are
asynchronous and atomic (`flaxstate.checkpoint.saving`); a failed save is
raised, naming its step, at the next save or when the writer waits (see
`flaxstate.background` for the end of a script). Only missing or damaged
files count as damage (`flaxstate.checkpoint.damage`). A step deleted while
it is read (a live writer rotating) is `VanishedStepError`, never damage.
Arrays are stored uncompressed: zstd took 2.2x the CPU time of a save and
gained 6% of the bytes of a trained float32 state (`benchmarks/checkpoint.py`).
"""

from __future__ import annotations

import hashlib
import logging
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import jax
import numpy as np
import orbax.checkpoint as ocp

from flaxstate import background, locations, tree_paths
from flaxstate.checkpoint import damage, formats, layout, saving, steps
from flaxstate.checkpoint import meta as meta_format
from flaxstate.checkpoint.best import BestPolicy
from flaxstate.checkpoint.budget import UNBOUNDED, HostMemoryBudget
from flaxstate.checkpoint.damage import DamagedCheckpointError
from flaxstate.checkpoint.errors import CheckpointError, CheckpointSaveError
from flaxstate.checkpoint.layout import (
    META,
    SET_ASIDE,
    TMP_MARK,
    Rename,
    StoredCheckpoint,
    renamed_against,
    state_dict_of,
    to_json,
)
from flaxstate.checkpoint.saving import Metrics, Tree
from flaxstate.checkpoint.steps import attempts
from flaxstate.checkpoint.stores.lifecycle import CommitMarker, Lifecycle, RenameIntoPlace
from flaxstate.locations import as_path

logger = logging.getLogger("flaxstate")
COMMIT_SUCCESS_FILE = ocp.path.atomicity_types.COMMIT_SUCCESS_FILE
"""The file orbax writes last into a step in a bucket, which has no rename: a step without it is unfinished."""


def barrier_prefix(directory: Path) -> str:
    """The prefix of orbax's barrier names for the saves of one directory: its own, so that two writers of a
    process (the run's, the best one's, a tier's) can save the same step at once on several processes (with one
    namespace, the second's `async_commit_complete.<step>` barrier is "already ongoing"). Made from the directory
    alone, so that every process, and a restarted run's processes, agree on it."""
    return "flaxstate-" + hashlib.sha256(str(directory).encode()).hexdigest()[:16]


class _Manager(ocp.CheckpointManager):
    """orbax's manager without its own preemption check: the loop decides when a preemption notice stops the run.

    JAX's preemption sync point counts the calls of one process with the number each caller passes: orbax's
    `save(step)` asks with the step, the loop with its own count of checks, and once orbax's larger number had been
    the process's last, the sync point JAX set was one the loop's count had passed: a notice that came between
    records was never acted on (`flaxstate.training.interrupts`).
    """

    def reached_preemption(self, step: int) -> bool:
        return False


class CheckpointStore(saving.SaveSlot):
    """The checkpoints of one directory: save, list, read.

    Args:
        directory: the orbax `CheckpointManager` directory.
        keep: how many checkpoints to keep (the newest, or with `best`, the best).
        best: keep the best by a metric instead of the newest.
        read_only: open for reading; nothing is created.
        host_memory_budget: bytes a save or a restore may hold beyond the state: arrays are stored in chunks
            and written and read chunk by chunk (`flaxstate.checkpoint.budget`); `None`, orbax's own.

    Close it (`close()`, or `with CheckpointStore(...) as store:`) when done.
    """

    shared = True
    """Every process writes this one directory together: only the primary process changes it."""

    def __init__(
        self,
        directory: str | Path,
        keep: int | None = None,
        best: BestPolicy | None = None,
        read_only: bool = False,
        host_memory_budget: HostMemoryBudget = UNBOUNDED,
    ) -> None:
        super().__init__()
        self.directory = as_path(directory)
        self._steps: Lifecycle = (
            CommitMarker(COMMIT_SUCCESS_FILE) if locations.is_url(self.directory) else RenameIntoPlace(TMP_MARK)
        )
        """How orbax makes a step complete here: renamed into place on a disk, a marker written last in a bucket."""
        best_options: dict[str, Any] = {}
        if best is not None:
            best_options = {"best_fn": lambda metrics: best.score(metrics[best.key]), "best_mode": best.mode}
        # In one process the asynchrony is ours (a thread runs a synchronous orbax save); else orbax's.
        self._own_thread = jax.process_count() == 1
        options = ocp.CheckpointManagerOptions(
            max_to_keep=keep,
            create=not read_only,
            enable_async_checkpointing=not (read_only or self._own_thread),
            multiprocessing_options=ocp.options.MultiprocessingOptions(
                barrier_sync_key_prefix=barrier_prefix(self.directory)
            ),
            **best_options,
        )
        damage.quiet_orbax()
        self._manager = _listing(
            lambda: _Manager(self.directory, options=options, item_handlers=layout.handlers(host_memory_budget)),
            self.directory,
        )
        self._listed = True
        """Whether the manager's listing is the one it made when opened (the first `steps()` takes it as is)."""
        self._layouts: dict[int, tuple[dict[str, Any], dict[str, Any], dict[str, Any]]] = {}
        """The newest step `read_paths` read: its meta, items' trees and layout (a complete step never changes)."""
        if not read_only:
            background.track(self)

    def _release(self) -> None:
        super()._release()
        self._manager.close()

    # Writing.

    def _holds(self, step: int) -> bool:
        return step in self._manager.all_steps()

    def _start(self, step: int, state_dict: Tree, meta: Tree, metrics: Metrics, *, saved: bool) -> None:
        """An orbax save: in a thread of ours in one process, else orbax's own asynchronous save."""
        if saved:
            raise self.refuse_replacing(step)
        self._listed = False
        items = {
            **formats.CURRENT.save_items(state_dict, ocp.args.PyTreeSave),
            META: ocp.args.JsonSave(to_json({**meta, "format_version": formats.CURRENT.version, "time": time.time()})),
        }
        args, metrics = ocp.args.Composite(**items), dict(metrics or {}) or None
        if self._own_thread:
            self._pending = saving.BackgroundSave(step, lambda: self._manager.save(step, args=args, metrics=metrics))
            return
        try:
            self._manager.save(step, args=args, metrics=metrics)
        except Exception as error:
            raise CheckpointSaveError(
                f"saving the checkpoint of step {step} to {self.directory} failed: {error}"
            ) from error
        self._pending = saving.OrbaxAsyncSave(step, self._manager)

    # Reading.

    def steps(self) -> list[int]:
        """The steps of the complete checkpoints, oldest first (listed again, except once on a disk: see below)."""
        if self._listed and not locations.is_url(self.directory):
            # A reader opens the store and asks at once: on a disk, orbax's listing as it opened it is fresh. A
            # bucket's may have come from a listing cached earlier in this process: it is always made again.
            self._listed = False
            return sorted(self._manager.all_steps())
        locations.forget_listings(self.directory)
        return _listing(lambda: (self._manager.reload(), sorted(self._manager.all_steps()))[1], self.directory)

    def _reading(self, step: int, read: Callable[[], Any]) -> Any:
        """Runs a read of one step (`steps.reading`: a step deleted meanwhile comes out as `VanishedStepError`)."""
        return steps.reading(self.directory / str(step), read)

    def read_meta(self, step: int) -> dict[str, Any]:
        """Returns the JSON meta of one checkpoint, checked against the format.

        Raises:
            CheckpointError: the step holds no flaxstate meta, or was written
                by a newer flaxstate.
            DamagedCheckpointError: its meta is not valid JSON or does not
                validate (naming the file and the field).
            VanishedStepError: the step was deleted meanwhile.
        """
        return self._reading(step, lambda: _read_meta(self.directory / str(step)))

    def set_aside(self, step: int, suffix: str = SET_ASIDE) -> Path:
        """Moves a step out of orbax's sight (`<step><suffix>`, `.damaged` by default), keeping its files.

        Called on the primary process; the others see the move at their next
        listing. Returns the new path.
        """
        self.wait()
        target = self._steps.set_aside(self.directory / str(step), suffix)
        self._listed = False
        self._manager.reload()
        return target

    def remove_unfinished(self, step: int | None = None) -> list[Path]:
        """Removes orbax's temporary directories of saves that did not finish (of `step`, or of every step).

        Only a writer calls this, when no save of its own is running: such a
        directory is never a checkpoint, and orbax never lists or restores it.
        A failed save's last writes can still land on tensorstore's threads
        after its failure was raised, so a directory that comes back within
        `VANISHING_SECONDS` is removed again.
        """
        if jax.process_index() != 0 or not self.directory.is_dir():
            return []
        return saving.remove_until_quiet(lambda: self._steps.unfinished(self.directory, step))

    def unfinished(self) -> list[Path]:
        """The directories of saves that did not finish (or are running).

        On a disk, orbax renames `<step>.orbax-checkpoint-tmp-*` to `<step>`
        when a save is complete. A bucket has no rename: orbax writes into
        `<step>` and writes its `commit_success.txt` last, so a `<step>`
        without it is unfinished (orbax never lists it). The marker's strategy
        forgets a bucket's cached listing first.
        """
        return self._steps.unfinished(self.directory)

    def delete(self, steps: list[int]) -> None:
        """Removes whole checkpoints (orbax deletes them on the primary process)."""
        self.wait()
        for step in steps:
            self._manager.delete(step)
        self._listed = False
        self._manager.reload()

    def stored_tree(self, step: int, with_optimizer: bool = True) -> dict[str, Any]:
        """Returns the stored state-dict layout with array metadata as leaves."""
        return self._stored(step, with_optimizer)[2]

    def _stored(self, step: int, with_optimizer: bool) -> tuple[dict[str, Any], dict[str, Any], dict[str, Any]]:
        """A step's meta, its items' trees, and the state-dict layout of those trees (metadata only)."""

        meta = self.read_meta(step)  # a read of its own (vanishing judged once, there)

        def read() -> tuple[dict[str, Any], dict[str, Any]]:
            trees = _item_trees(self._manager, step)
            return trees, formats.of(meta).layout(trees, with_optimizer, step)

        return (meta, *self._reading(step, read))

    def read_paths(self, step: int, paths: list[str]) -> dict[str, np.ndarray]:
        """Reads some arrays of a checkpoint by their state-dict paths, as numpy, and no other (partial restores).

        Raises:
            CheckpointError: a checkpoint of format 1 (one item: read it whole), or a path it does not hold.
        """
        if step not in self._layouts:  # read once a step: a diff reads a step's arrays one call each
            self._layouts = {step: self._stored(step, True)}
        meta, trees, stored = self._layouts[step]
        stored_format = formats.of(meta)
        if not stored_format.partial_reads:
            raise CheckpointError(
                f"{self.directory / str(step)} has format {stored_format.version}: read it whole (read())."
            )
        missing = sorted(set(paths) - set(tree_paths.flatten(stored)))
        if missing:
            raise CheckpointError(f"{self.directory / str(step)} holds no array at {', '.join(missing)}.")
        by_item = stored_format.split({path: path for path in paths})
        items = _partial_items(trees, by_item)
        restored = self._reading(step, lambda: self._manager.restore(step, args=ocp.args.Composite(**items)))
        out = {}
        for item, inner_paths in by_item.items():
            flat = tree_paths.flatten(restored[item])
            out.update({path: np.asarray(flat[inner]) for inner, path in inner_paths.items()})
        return out

    def read(
        self,
        step: int,
        template: Mapping[str, Any] | None,
        *,
        with_optimizer: bool = True,
        rename: Rename = None,
    ) -> StoredCheckpoint:
        """Restores one checkpoint, checked against a template state dict.

        Args:
            step: the checkpoint's step.
            template: the state dict to restore into: its leaves' shapes,
                dtypes and shardings are the restored arrays' (numpy leaves
                restore as numpy); `None` restores numpy arrays of the stored tree.
            with_optimizer: read the optimizer item; `False` never opens it.
            rename: regex rules from stored '/'-joined paths to the template's.

        Returns:
            the state dict (template layout) and the meta.

        Raises:
            StateMismatchError: the stored tree differs from the template's,
                naming every missing, unexpected and mismatched path.
            CheckpointError: the step is not a flaxstate checkpoint.
        """
        meta, trees, stored = self._stored(step, with_optimizer)
        stored_format = formats.of(meta)
        stored_flat = tree_paths.flatten(stored)
        new_path, restore_args = _restore_plan(
            stored_flat, template, rename, with_optimizer, f"the checkpoint of step {step} in {self.directory}"
        )
        if template is None:
            damage.check_claimed_sizes(self.directory / str(step), stored_flat)

        def item_args(prefix: str, tree: Any) -> ocp.args.PyTreeRestore:
            args = jax.tree_util.tree_map_with_path(
                lambda key_path, leaf: restore_args(prefix + tree_paths.path_name(key_path)), tree
            )
            return ocp.args.PyTreeRestore(restore_args=args)

        read_items = stored_format.read_items(with_optimizer)
        items = {item.name: item_args(item.prefix, trees[item.name]) for item in read_items}
        restored = self._reading(step, lambda: self._manager.restore(step, args=ocp.args.Composite(**items)))
        flat = stored_format.join(
            {item.name: tree_paths.flatten(restored[item.name]) for item in read_items}, with_optimizer
        )
        flat = {new_path[path]: value for path, value in flat.items() if path in new_path}
        return StoredCheckpoint(state_dict=state_dict_of(flat), meta=meta)


def _read_meta(step_dir: Path) -> dict[str, Any]:
    """A step's meta item, read and checked (`CheckpointStore.read_meta`).

    The item is one JSON file that orbax's `JsonSave` wrote (`meta/metadata`):
    read as JSON, not through `CheckpointManager.restore`, whose event loop
    and threads cost a restore 10-15 ms here, once more than plain orbax's.
    """
    where = step_dir / META / meta_format.FILE
    try:
        return meta_format.read(where, step_dir)
    except FileNotFoundError:
        if not step_dir.is_dir():
            raise FileNotFoundError(f"{step_dir} does not exist") from None
        if not (step_dir / META).is_dir():
            raise CheckpointError(
                f"{step_dir} is not a flaxstate checkpoint (it has no '{META}' item); "
                "point the reader at a directory that flaxstate's writers wrote."
            ) from None
        raise DamagedCheckpointError(f"{where} is missing: the step is damaged") from None


def _item_trees(manager: ocp.CheckpointManager, step: int) -> dict[str, Any]:
    """Each item's tree of array metadata (shapes, dtypes) of a step, read once."""
    metadata = manager.item_metadata(step)
    return {
        name: item.tree if hasattr(item, "tree") else item
        for name, item in metadata.items()
        if item is not None and name != META
    }


def _partial_items(trees: Mapping[str, Any], by_item: Mapping[str, Mapping[str, str]]) -> dict[str, Any]:
    """orbax's partial restores of some arrays of each item (`{item: {inner path: path}}`), as numpy."""
    items = {}
    for item, inner_paths in by_item.items():
        flat = tree_paths.flatten(trees[item])
        wanted = tree_paths.unflatten({inner: flat[inner] for inner in inner_paths})
        restore_args = jax.tree.map(lambda _: ocp.RestoreArgs(restore_type=np.ndarray), wanted)
        items[item] = ocp.args.PyTreeRestore(item=wanted, restore_args=restore_args, partial_restore=True)
    return items


def _restore_plan(
    stored_flat: Mapping[str, Any], template: Mapping[str, Any] | None, rename: Rename, with_optimizer: bool, what: str
) -> tuple[dict[str, str], Callable[[str], Any]]:
    """How a step's stored arrays restore into a template: each stored path's new path, and its orbax arguments.

    Raises:
        StateMismatchError: the renamed stored tree differs from the template's, naming every differing path.
    """
    new_path, expected = renamed_against(stored_flat, template, rename, with_optimizer, what)

    def restore_args(path: str) -> Any:
        target: Any = expected.get(new_path.get(path, ""))
        if getattr(target, "sharding", None) is None:  # no template, or a host (numpy) leaf
            return ocp.RestoreArgs(restore_type=np.ndarray)
        return ocp.ArrayRestoreArgs(sharding=target.sharding, global_shape=target.shape, dtype=target.dtype)

    return new_path, restore_args


def _listing(list_steps: Callable[[], Any], directory: Path) -> Any:
    """Runs a listing of a directory again when a step was deleted under it (a live writer's rotation).

    Raises:
        KeyboardInterrupt: Ctrl-C, wherever orbax wrapped it.
        CheckpointError: steps kept vanishing for the `steps.attempts()`.
    """
    for _ in attempts():
        try:
            return list_steps()
        except (FileNotFoundError, NotADirectoryError):  # orbax's paths say either of a step being deleted
            time.sleep(0.05)
        except Exception as error:
            damage.reraise_interrupt(error)
            raise
    raise CheckpointError(f"{directory}: its steps kept vanishing while they were listed; is a writer deleting them?")
