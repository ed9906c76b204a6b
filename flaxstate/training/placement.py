"""Where a loop runs: its devices, and, sharded over a mesh, how its state and batches lie there.

`TrainLoop` and `EvalLoop` take the same `devices=` or `mesh=` with
`axis_rules=`. Without a mesh they are data-parallel: every device holds the
whole state and computes on its part of the batch, split over the local
devices. With one, each state leaf is sharded by its logical axes through the
rules, and the batch over the mesh axes of the logical axis `batch`; each
process then feeds the part of the global batch that its devices hold.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import jax
from jax.sharding import Mesh, NamedSharding

from flaxstate.sharding import AxisRules, BatchLayout, logical_shardings
from flaxstate.training import batching

PyTree = Any


@dataclasses.dataclass(frozen=True)
class Placement:
    """A loop's devices, and for a sharded loop its rules and batch layout.

    Attributes:
        mesh: the devices (data-parallel: one axis, `batching.AXIS`).
        axis_rules: flax-style logical axis rules (`None`: data-parallel).
        batch_layout: how a batch lies on the mesh (`None`: data-parallel).
    """

    mesh: Mesh
    axis_rules: AxisRules | None = None
    batch_layout: BatchLayout | None = None

    @classmethod
    def create(
        cls,
        owner: str,
        devices: Sequence[jax.Device] | None,
        mesh: Mesh | None,
        axis_rules: AxisRules | None,
    ) -> Placement:
        """A data-parallel placement on `devices`, or a sharded one on `mesh` by `axis_rules`.

        Raises:
            ValueError: only one of `mesh` and `axis_rules`, or `mesh` with
                `devices`; rules naming a mesh axis the mesh does not have.
        """
        if (mesh is None) != (axis_rules is None):
            raise ValueError(
                f"{owner} shards the state when given both mesh= and axis_rules= (flax-style logical axis rules); "
                f"got only {'mesh' if mesh is not None else 'axis_rules'}. Pass both, or neither for data-parallel "
                "work."
            )
        if mesh is None:
            return cls(batching.mesh_of(devices))
        if devices is not None:
            raise ValueError(f"{owner} takes devices= or mesh=, not both: a sharded loop runs on the mesh's devices.")
        return cls(mesh, axis_rules, BatchLayout.create(mesh, axis_rules))

    @property
    def sharded(self) -> bool:
        return self.batch_layout is not None

    @property
    def n_local_devices(self) -> int:
        """How many of the mesh's devices this process holds."""
        return batching.local_device_count(self.mesh)

    @property
    def n_local_parts(self) -> int:
        """How many parts this process's batch splits into: its devices, or the batch parts they hold."""
        if self.batch_layout is None:
            return self.n_local_devices
        return len(self.batch_layout.local_parts())

    @property
    def parts(self) -> str:
        """What those parts are, for an error."""
        if self.batch_layout is None:
            return "local devices"
        return f"parts of the batch axes {self.batch_layout.axes} that this process's devices hold"

    def check_batch(self, batch: batching.Batch, task_name: str, n_microbatches: int = 1) -> None:
        """Checks that this process's batch splits into its parts, then into microbatches.

        Raises:
            ValueError: naming the sizes, the parts and M.
        """
        batching.check_divisible(batch, self.n_local_parts, task_name, n_microbatches, self.parts)

    def global_batch_size(self, local_size: int) -> int:
        """The global batch's size when this process feeds `local_size` examples."""
        if self.batch_layout is None:
            return local_size * jax.process_count()
        return local_size * self.batch_layout.n_parts // self.n_local_parts

    @property
    def replicated(self) -> NamedSharding:
        return batching.replicated(self.mesh)

    def state_shardings(self, state: PyTree) -> Any:
        """The state's shardings: one per leaf from its logical axes, or replicated (one sharding for all)."""
        if self.batch_layout is None:
            return self.replicated
        return logical_shardings(state, self.mesh, self.axis_rules)

    def to_devices(self, batch: batching.Batch, stacked: bool) -> batching.Batch:
        """This process's batch as global arrays (several processes) or as it is (see `batching.to_devices`)."""
        sharding = self.batch_layout.sharding(stacked) if self.batch_layout is not None else None
        return batching.to_devices(batch, self.mesh, stacked=stacked, sharding=sharding)
