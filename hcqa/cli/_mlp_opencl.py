"""``hcqa demo --device opencl``: the demo's MLP as OpenCL kernels on two OpenCL devices.

Theory of operation
-------------------
Each layer, ``relu(x @ W + b)``, is one launch of :data:`LAYER`, a tiled matmul: a work-group
of 16 x 16 work-items computes a 16 x 16 tile of the output, staging 16 x 16 tiles of ``x``
and ``W`` in local memory. The NDRange covers the ``batch x hidden`` output, so ``global_size``
(work-groups, as hcqa counts them) is ``(hidden / 16, batch / 16, 1)`` and ``local_size``
``(16, 16, 1)``: batch size and width must be multiples of 16.

A :class:`~hcqa.Pipeline` stage runs one program, so each layer is one stage, with its weights
as the stage's params and its sizes as ``vals``. The first half of the layers are stages on
the first device and the second half on the second, with one transfer between them; the
sequential baseline is every layer on the first device. Both devices are ``opencl:0`` by
default: two hcqa devices (own queues and timelines) on one OpenCL device, whose compute units
they then share.

The weights reach the devices as in the cpu demo, ``Buffer.load`` from the weights file,
through each device's own queue.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import hcqa
from hcqa.cli._mlp import F32, Layout, MlpSpec, Timed, _timed, load_params
from hcqa.trace import region

if TYPE_CHECKING:
    from hcqa.cli._console import Bar

__all__ = ["FULL", "LAYER", "TILE", "build_pipelines", "check_spec", "run_opencl"]

TILE = 16

# out = relu(x @ w + b): x is batch x hidden, w hidden x hidden (row-major), b hidden.
LAYER = """
#define T 16
__kernel void layer(__global float *out, __global const float *x, __global const float *w,
                    __global const float *b, int hidden) {
    __local float xs[T][T];
    __local float ws[T][T];
    const int c = get_global_id(0), r = get_global_id(1);
    const int lc = get_local_id(0), lr = get_local_id(1);
    float acc = 0.0f;
    for (int k0 = 0; k0 < hidden; k0 += T) {
        xs[lr][lc] = x[r * hidden + k0 + lc];
        ws[lr][lc] = w[(k0 + lr) * hidden + c];
        barrier(CLK_LOCAL_MEM_FENCE);
        for (int k = 0; k < T; k++) acc += xs[lr][k] * ws[k][lc];
        barrier(CLK_LOCAL_MEM_FENCE);
    }
    acc += b[c];
    out[r * hidden + c] = acc > 0.0f ? acc : 0.0f;
}
"""

# Smaller than the cpu demo's default: a CPU OpenCL runs this naive tiled kernel several times
# slower than BLAS, and a default run should take seconds, not minutes.
FULL = MlpSpec(batches=32, batch_size=64, hidden=256)


def check_spec(spec: MlpSpec) -> str | None:
    """Why ``spec`` can't run as OpenCL tiles (None: it can)."""
    for name, value in (("--batch-size", spec.batch_size), ("--hidden", spec.hidden)):
        if value % TILE:
            return f"{name} must be a multiple of {TILE} with --device opencl (got {value})"
    return None


async def _programs(device: hcqa.Device, layers: range) -> dict[int, hcqa.Program]:
    """One program per layer (the same source, built off the loop), so a trace names and
    colours each layer's kernels apart: ``layer1``, ``layer2``, ..."""
    return {
        layer: await device.program_async(f"layer{layer + 1}", LAYER, entry="layer")
        for layer in layers
    }


async def _stages(
    device: hcqa.Device,
    progs: dict[int, hcqa.Program],
    params: Sequence[hcqa.Buffer],
    layers: range,
    spec: MlpSpec,
) -> list[hcqa.Stage]:
    groups = (spec.hidden // TILE, spec.batch_size // TILE, 1)
    return [
        hcqa.Stage(
            device=device,
            program=progs[layer],
            params=(params[2 * i], params[2 * i + 1]),
            vals=(spec.hidden,),
            name=f"layer{layer + 1}",
            global_size=groups,
            local_size=(TILE, TILE, 1),
        )
        for i, layer in enumerate(layers)
    ]


async def build_pipelines(
    d0: hcqa.Device, d1: hcqa.Device, spec: MlpSpec, path: str, layout: Layout, depth: int
) -> tuple[hcqa.Pipeline, hcqa.Pipeline]:
    """(the layers split over d0 -> d1, every layer on d0), one stage per layer."""
    half = spec.layers // 2
    h = spec.hidden
    first = await load_params(d0, path, layout, range(half), h)
    second = await load_params(d1, path, layout, range(half, spec.layers), h)
    rest_on_d0 = await load_params(d0, path, layout, range(half, spec.layers), h)
    on_d0 = await _programs(d0, range(spec.layers))
    on_d1 = await _programs(d1, range(half, spec.layers))
    split = [
        *await _stages(d0, on_d0, first, range(half), spec),
        *await _stages(d1, on_d1, second, range(half, spec.layers), spec),
    ]
    whole = await _stages(d0, on_d0, first + rest_on_d0, range(spec.layers), spec)
    shape = (spec.batch_size, spec.hidden)
    return (
        hcqa.Pipeline(split, in_shape=shape, depth=depth),
        hcqa.Pipeline(whole, in_shape=shape, depth=depth),
    )


async def run_opencl(
    spec: MlpSpec,
    path: str,
    layout: Layout,
    depth: int,
    xs: Sequence[F32],
    bar: Bar,
    warm: int,
    warm_seconds: float = 0.0,
    specs: tuple[str, str] = ("opencl:0", "opencl:0"),
) -> Timed:
    """The layers split over two OpenCL devices against every layer on the first one."""
    async with hcqa.open_devices(*specs) as (d0, d1):
        with region("set-up: weights loaded, kernels built"):
            pipe, seq = await build_pipelines(d0, d1, spec, path, layout, depth)
        sides = ("pipeline (OpenCL)", "1 OpenCL device")
        runs = await _timed(pipe, seq, xs, bar, warm, warm_seconds, sides)
        names = (d0.name, d1.name)
    return Timed.of(
        runs,
        pipe_label=f"pipeline, 2 OpenCL devices ({names[0]}, {names[1]})",
        seq_label=f"sequential, 1 OpenCL device ({names[0]})",
        pipe_desc=f"{spec.layers} OpenCL kernel stages, one per layer",
    )
