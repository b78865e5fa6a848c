"""Which backend opens which device spec: ``"cpu:0"`` → ``hcqa.devices.cpu:CpuDevice``.

Theory of operation
-------------------
A backend is a package with a :class:`~hcqa.devices.Device` subclass (see
docs/architecture.md, "The backend seam"). It is registered here by *kind* -- the part of
a device spec before the colon -- with the dotted path of its class, not the class: the
core never imports a backend, and a backend's own dependencies (a driver, a vendor
library) are imported only when a spec names it. ``open_devices`` parses every spec with
:func:`parse_spec` before anything is opened, then builds each device with
:func:`device_class`; a backend that can't be imported is refused with an
:class:`~hcqa.errors.InvalidCommand` carrying its ``missing`` hint.
"""

from __future__ import annotations

import importlib
import re
from typing import TYPE_CHECKING

import attrs

from hcqa.errors import InvalidCommand, install_hint

if TYPE_CHECKING:
    from hcqa.devices.base import Device

__all__ = ["Backend", "device_class", "kinds", "parse_spec", "register", "shared"]


@attrs.frozen
class Backend:
    """One registered backend: ``kind`` opens as ``target`` (``"package.module:Class"``);
    ``missing`` says how to get it when it can't be imported."""

    kind: str
    target: str
    missing: str
    # The same spec may be opened several times in one call, each an hcqa device of its
    # own (own queues) on the one driver device: the k-th is named "<kind>:N#k" (k >= 2).
    shared: bool = False


_BACKENDS: dict[str, Backend] = {}
_KIND = re.compile(r"^[a-z][a-z0-9_]*$")


def register(kind: str, target: str, *, missing: str, shared: bool = False) -> None:
    """Register (or replace) the backend that opens ``kind:N`` specs (``shared``: see
    :class:`Backend`)."""
    if not isinstance(kind, str) or not _KIND.match(kind):
        raise InvalidCommand(f"backend kind must be a lowercase identifier (got {kind!r})")
    module, _, name = target.partition(":")
    if not module or not name:
        raise InvalidCommand(
            f"backend target must look like 'package.module:Class' (got {target!r})"
        )
    _BACKENDS[kind] = Backend(kind, target, missing, shared)


def shared(kind: str) -> bool:
    """Whether a spec of ``kind`` may be opened several times in one call."""
    return _BACKENDS[kind].shared


def kinds() -> tuple[str, ...]:
    """The registered kinds, in registration order."""
    return tuple(_BACKENDS)


def parse_spec(spec: object) -> tuple[str, int, str]:
    """(kind, index, name) of a device spec like ``"cpu:0"``; InvalidCommand if malformed
    or of no registered kind."""
    known = " or ".join(f"'{k}:N'" for k in _BACKENDS)
    if not isinstance(spec, str):
        raise InvalidCommand(f"device spec must be a str like 'cpu:0' (got {type(spec).__name__})")
    text = spec.strip()
    kind, colon, index = text.partition(":")
    if kind not in _BACKENDS or not colon or not index.isascii() or not index.isdigit():
        hint = f"; did you mean '{text}:0'?" if text in _BACKENDS else ""
        raise InvalidCommand(f"device spec must look like {known} (got {spec!r}{hint})")
    n = int(index)
    return kind, n, f"{kind}:{n}"


def device_class(kind: str, name: str) -> type[Device]:
    """Import the class of backend ``kind`` (for the device ``name``, named in errors)."""
    backend = _BACKENDS[kind]
    module, _, attr = backend.target.partition(":")
    try:
        cls: type[Device] = getattr(importlib.import_module(module), attr)
    except ImportError as exc:
        raise InvalidCommand(f"{name}: {backend.missing} ({exc})") from exc
    return cls


# -- the backends hcqa ships (one line each) ------------------------------------------------

register("cpu", "hcqa.devices.cpu:CpuDevice", missing="the cpu backend failed to import")
register(
    "cuda",
    "hcqa.devices.cuda.device:CudaDevice",
    missing=f"the CUDA backend needs NVIDIA's cuda-bindings: {install_hint('cuda')}",
    shared=True,
)
register(
    "opencl",
    "hcqa.devices.opencl.device:OpenCLDevice",
    missing=f"the OpenCL backend needs PyOpenCL: {install_hint('opencl')}",
    shared=True,
)
