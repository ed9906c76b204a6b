"""Training: tasks, the train loop, the evaluation loop."""

from flaxstate.training.evaluation import EvalLoop
from flaxstate.training.loop import TrainLoop
from flaxstate.training.startup import CheckpointSource
from flaxstate.training.task import EvalTask, TrainTask

__all__ = ["CheckpointSource", "EvalLoop", "EvalTask", "TrainLoop", "TrainTask"]
