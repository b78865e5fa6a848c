"""Queue actors (trio tasks) and the engines (threads) that execute for them."""

from hcqa.actors.actor import Batch, QueueActor, QueueStatistics
from hcqa.actors.engine import Engine

__all__ = ["Batch", "Engine", "QueueActor", "QueueStatistics"]
