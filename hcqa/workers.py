"""The former home of process pipelines, kept so that ``"hcqa.workers:add_one"`` stage
names and ``from hcqa.workers import open_process_pipeline`` keep working; everything
lives in :mod:`hcqa.processes` now (its ``__init__`` tells the story, "The former home")."""

from __future__ import annotations

from hcqa.processes import (
    PipelineItem,
    ProcessPipeline,
    ProcessPipelineStatistics,
    ProcessStage,
    open_process_pipeline,
)
from hcqa.processes.stages import add_one, identity

__all__ = [
    "PipelineItem",
    "ProcessPipeline",
    "ProcessPipelineStatistics",
    "ProcessStage",
    "add_one",
    "identity",
    "open_process_pipeline",
]
