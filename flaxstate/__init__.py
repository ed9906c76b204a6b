"""flaxstate: the functional side of training JAX/Flax models.

An immutable train state, a training loop that is a Python generator
(data-parallel, or sharded over a mesh by logical axes), and checkpoints that
survive crashes and restore anywhere.
"""

import importlib
from typing import TYPE_CHECKING, Any

from flaxstate import clusters as _clusters  # noqa: F401  (registers `flaxstate launch`'s processes with JAX)
from flaxstate.global_batches import GlobalBatches, global_batches
from flaxstate.nnx import nnx_functions, nnx_update
from flaxstate.plotting import plot
from flaxstate.records import Checkpoint, CheckpointFile, Fingerprints, Memory, Session, Summary, Timing
from flaxstate.sharding import AxisRules, BatchLayout, Partitioning, logical_shardings, sharded_like
from flaxstate.summaries import SummaryLogger, SummaryWriter
from flaxstate.tracing import TraceWriter
from flaxstate.train_state import FlaxOptimTrainState, InferenceState, StateMismatchError, TrainState
from flaxstate.training import CheckpointSource, EvalLoop, EvalTask, Rollback, TrainLoop, TrainTask
from flaxstate.xla_settings import XlaPreset, use_xla_preset

__all__ = [
    "AutoInterval",
    "AxisRules",
    "BatchLayout",
    "BestPolicy",
    "Checkpoint",
    "CheckpointError",
    "CheckpointFile",
    "CheckpointFileReader",
    "CheckpointFileWriter",
    "CheckpointSaveError",
    "CheckpointSource",
    "Continuous",
    "EvalLoop",
    "EvalTask",
    "EveryRecord",
    "EverySeconds",
    "Fingerprints",
    "FlaxOptimTrainState",
    "GlobalBatches",
    "HighestCheckpointFileReader",
    "HighestCheckpointFileWriter",
    "HostMemoryBudget",
    "InferenceState",
    "LocalTier",
    "LowestCheckpointFileReader",
    "LowestCheckpointFileWriter",
    "Memory",
    "Partitioning",
    "Plan",
    "Rollback",
    "RunHistory",
    "SaveContext",
    "SaveDecision",
    "SavePolicy",
    "Session",
    "StateMismatchError",
    "Summary",
    "SummaryLogger",
    "SummaryWriter",
    "Timing",
    "TraceWriter",
    "TrainLoop",
    "TrainState",
    "TrainTask",
    "WeightMap",
    "XlaPreset",
    "global_batches",
    "logical_shardings",
    "nnx_functions",
    "nnx_update",
    "export_safetensors",
    "SafetensorsReader",
    "plan",
    "plot",
    "sharded_like",
    "use_xla_preset",
]

__version__ = "0.1.0"

if TYPE_CHECKING:
    from flaxstate.checkpoint import (
        AutoInterval,
        BestPolicy,
        CheckpointError,
        CheckpointFileReader,
        CheckpointFileWriter,
        CheckpointSaveError,
        Continuous,
        EveryRecord,
        EverySeconds,
        HighestCheckpointFileReader,
        HighestCheckpointFileWriter,
        HostMemoryBudget,
        LocalTier,
        LowestCheckpointFileReader,
        LowestCheckpointFileWriter,
        RunHistory,
        SaveContext,
        SaveDecision,
        SavePolicy,
    )
    from flaxstate.checkpoint.safetensors import SafetensorsReader, WeightMap, export_safetensors
    from flaxstate.planning import Plan, plan

_ELSEWHERE = {
    **dict.fromkeys(("Plan", "plan"), "flaxstate.planning"),
    **dict.fromkeys(("SafetensorsReader", "WeightMap", "export_safetensors"), "flaxstate.checkpoint.safetensors"),
}
_LAZY = {name: _ELSEWHERE.get(name, "flaxstate.checkpoint") for name in __all__ if name not in globals()}
"""The public names not imported above, each with its module (the checkpoint package's unless `_ELSEWHERE` says):
their modules import orbax and tensorstore (0.2 s), so they are imported at their first use, and `import
flaxstate` for a training loop alone takes 0.03 s beyond JAX and Flax."""
_SUBPACKAGES = ("checkpoint", "planning")


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        value = getattr(importlib.import_module(_LAZY[name]), name)
    elif name in _SUBPACKAGES:
        value = importlib.import_module(f"flaxstate.{name}")
    else:
        raise AttributeError(f"module 'flaxstate' has no attribute {name!r}")
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *_LAZY})
