"""hcqa: an asynchronous, actor-based scheduler for accelerator command queues on trio."""

from hcqa.aio import open_asyncio_host
from hcqa.batcher import Batcher, BatcherStatistics, open_batcher
from hcqa.devices import (
    Buffer,
    Device,
    DeviceStatistics,
    Program,
    TimedSpan,
    open_device,
    open_devices,
    transfer,
)
from hcqa.devices.cpu import CpuDevice
from hcqa.errors import (
    DeviceClosed,
    DeviceFault,
    HcqaError,
    InvalidCommand,
    OutOfMemory,
    QueueFull,
    SignalTimeout,
)
from hcqa.graph import Graph, GraphStatistics, capture
from hcqa.pipeline import Pipeline, PipelineStatistics, Stage
from hcqa.processes import (
    ProcessPipeline,
    ProcessPipelineStatistics,
    ProcessStage,
    open_process_pipeline,
)
from hcqa.queue import Queue
from hcqa.signals import Fence, Signal, SignalStatistics
from hcqa.trace import Tracer
from hcqa.variables import Variable

__version__ = "0.1.0"

__all__ = [
    "Batcher",
    "BatcherStatistics",
    "Buffer",
    "CpuDevice",
    "Device",
    "DeviceClosed",
    "DeviceFault",
    "DeviceStatistics",
    "Fence",
    "Graph",
    "GraphStatistics",
    "HcqaError",
    "InvalidCommand",
    "OutOfMemory",
    "Pipeline",
    "PipelineStatistics",
    "ProcessPipeline",
    "ProcessPipelineStatistics",
    "ProcessStage",
    "Program",
    "Queue",
    "QueueFull",
    "Signal",
    "SignalStatistics",
    "SignalTimeout",
    "Stage",
    "TimedSpan",
    "Tracer",
    "Variable",
    "capture",
    "open_asyncio_host",
    "open_batcher",
    "open_device",
    "open_devices",
    "open_process_pipeline",
    "transfer",
]
