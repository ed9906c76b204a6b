"""Training: tasks, the train loop, the evaluation loop, and going back when the loss goes bad."""

from flaxstate.training.evaluation import EvalLoop
from flaxstate.training.loop import TrainLoop
from flaxstate.training.rollback import Rollback
from flaxstate.training.startup import CheckpointSource
from flaxstate.training.task import EvalTask, TrainTask

__all__ = ["CheckpointSource", "EvalLoop", "EvalTask", "Rollback", "TrainLoop", "TrainTask"]
