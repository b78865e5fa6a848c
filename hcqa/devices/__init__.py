"""Devices: the Device base, memory, programs, the cpu device, opening and transfers."""

from hcqa.devices.base import Device, DeviceStatistics
from hcqa.devices.buffer import Buffer
from hcqa.devices.cpu import CpuDevice
from hcqa.devices.opening import open_device, open_devices, transfer
from hcqa.devices.program import Program
from hcqa.devices.timing import TimedSpan

__all__ = [
    "Buffer",
    "CpuDevice",
    "Device",
    "DeviceStatistics",
    "Program",
    "TimedSpan",
    "open_device",
    "open_devices",
    "transfer",
]
