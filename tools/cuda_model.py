"""An MLP's forward on cuda:0 (hcqa: three tiled-matmul CUDA kernels replayed as one captured
graph) against numpy's answer and against tinygrad's own forward (TinyJit) on the same GPU.

Prints a JSON document (``--json PATH`` too): the largest relative error against numpy per
side, and the median forward time (copy-in, kernels, copy-out, awaited) per side, in rounds
that interleave the two. tinygrad runs on its CUDA device when it loads (``NVRTC_PATH`` may
name libnvrtc), else on its OpenCL one; the device it used is in the output, and a side that
failed says why.
"""

from __future__ import annotations

import argparse
import itertools
import json
import statistics
import sys
import time
import traceback
from typing import Any

import numpy as np
import trio

import hcqa

DENSE = r"""
#define T 16
extern "C" __global__ void dense(float *out, const float *x, const float *w, const float *b,
                                 int rows, int n_in, int n_out, int relu) {
    __shared__ float xs[T][T];
    __shared__ float ws[T][T];
    int r = blockIdx.y * T + threadIdx.y, c = blockIdx.x * T + threadIdx.x;
    float acc = 0.0f;
    for (int k0 = 0; k0 < n_in; k0 += T) {
        xs[threadIdx.y][threadIdx.x] = (r < rows && k0 + threadIdx.x < n_in)
            ? x[r * n_in + k0 + threadIdx.x] : 0.0f;
        ws[threadIdx.y][threadIdx.x] = (c < n_out && k0 + threadIdx.y < n_in)
            ? w[(k0 + threadIdx.y) * n_out + c] : 0.0f;
        __syncthreads();
        for (int k = 0; k < T; k++) acc += xs[threadIdx.y][k] * ws[k][threadIdx.x];
        __syncthreads();
    }
    if (r < rows && c < n_out) {
        acc += b[c];
        out[r * n_out + c] = relu && acc < 0.0f ? 0.0f : acc;
    }
}
"""
SIZES = (1024, 2048, 2048, 512)


def _weights(seed: int = 0) -> list[tuple[np.ndarray[Any, Any], np.ndarray[Any, Any]]]:
    rng = np.random.default_rng(seed)
    return [
        (
            (rng.standard_normal((a, b)) / np.sqrt(a)).astype(np.float32),
            (rng.standard_normal(b) * 0.1).astype(np.float32),
        )
        for a, b in itertools.pairwise(SIZES)
    ]


def numpy_forward(x: np.ndarray[Any, Any], layers: list[Any]) -> np.ndarray[Any, Any]:
    h = x.astype(np.float64)
    for i, (w, b) in enumerate(layers):
        h = h @ w + b
        if i < len(layers) - 1:
            h = np.maximum(h, 0)
    return h.astype(np.float32)


def _err(got: np.ndarray[Any, Any], want: np.ndarray[Any, Any]) -> float:
    return float(np.max(np.abs(got - want)) / (np.max(np.abs(want)) + 1e-12))


class HcqaMLP:
    def __init__(self, g: hcqa.Device, rows: int, layers: list[Any]) -> None:
        self.g, self.rows = g, rows
        self.k = g.program("dense", DENSE)
        self.x = g.alloc(shape=(rows, SIZES[0]), dtype="float32")
        self.params = []
        for w, b in layers:
            self.params.append((g.alloc(shape=w.shape, dtype="float32"),
                                g.alloc(shape=b.shape, dtype="float32")))  # fmt: skip
        self.acts = [g.alloc(shape=(rows, n), dtype="float32") for n in SIZES[1:]]
        self.out = np.empty((rows, SIZES[-1]), np.float32)

    async def load(self, layers: list[Any]) -> None:
        for (wb, bb), (w, b) in zip(self.params, layers, strict=True):
            await wb.copyin(w)
            await bb.copyin(b)
        with hcqa.capture() as graph:
            h = self.x
            for i, ((wb, bb), act) in enumerate(zip(self.params, self.acts, strict=True)):
                n_in, n_out = SIZES[i], SIZES[i + 1]
                grid = ((n_out + 15) // 16, (self.rows + 15) // 16, 1)
                relu = int(i < len(self.params) - 1)
                self.k(act, h, wb, bb, vals=(self.rows, n_in, n_out, relu),
                       global_size=grid, local_size=(16, 16, 1))  # fmt: skip
                h = act
        self.graph = graph

    async def __call__(self, x: np.ndarray[Any, Any]) -> np.ndarray[Any, Any]:
        await self.x.copyin(x)
        await self.graph()
        await self.acts[-1].copyout(self.out)
        return self.out


def tinygrad_side(layers: list[Any]) -> tuple[Any, str]:
    """(forward(x) -> numpy, device name): CUDA if it loads, else OpenCL."""
    from tinygrad import Device, Tensor, TinyJit

    errors = []
    for dev in ("CUDA", "CL"):
        try:
            Device[dev]
            ws = [(Tensor(w, device=dev).realize(), Tensor(b, device=dev).realize())
                  for w, b in layers]  # fmt: skip

            @TinyJit
            def fwd(x: Any, ws: list[Any] = ws) -> Any:
                h = x
                for i, (w, b) in enumerate(ws):
                    h = h @ w + b
                    if i < len(ws) - 1:
                        h = h.relu()
                return h.realize()

            def forward(x: np.ndarray[Any, Any], fwd: Any = fwd, dev: str = dev) -> Any:
                return fwd(Tensor(x, device=dev)).numpy()

            return forward, dev
        except Exception as exc:
            errors.append(f"{dev}: {type(exc).__name__}: {exc}")
    raise RuntimeError("; ".join(errors))


async def run(rows: int, rounds: int) -> dict[str, Any]:
    layers = _weights()
    xs = [np.random.default_rng(10 + i).standard_normal((rows, SIZES[0])).astype(np.float32)
          for i in range(4)]  # fmt: skip
    want = [numpy_forward(x, layers) for x in xs]
    out: dict[str, Any] = {"sizes": SIZES, "rows": rows, "rounds": rounds}
    try:
        tg, dev = tinygrad_side(layers)
        for x in xs[:3]:
            tg(x)  # the JIT captures on its second call
        out["tinygrad_device"] = dev
        out["tinygrad_err"] = max(_err(tg(x), w) for x, w in zip(xs, want, strict=True))
    except Exception as exc:
        tg = None
        out["tinygrad_error"] = f"{type(exc).__name__}: {exc}"
        out["tinygrad_trace"] = traceback.format_exc()[-1500:]
    async with hcqa.open_device("cuda:0") as g:
        m = HcqaMLP(g, rows, layers)
        await m.load(layers)
        errs = []
        for x, w in zip(xs, want, strict=True):
            errs.append(_err((await m(x)).copy(), w))
        out["hcqa_err"] = max(errs)
        kernels = []
        for _ in range(5):
            async with g.timed() as span:
                m.graph.submit()
            kernels.append(span.seconds)
        out["hcqa_kernels_ms"] = statistics.median(kernels) * 1e3
        h_t, t_t, ratios = [], [], []
        for r in range(rounds):
            x = xs[r % len(xs)]
            t0 = time.perf_counter()
            await m(x)
            h = time.perf_counter() - t0
            h_t.append(h)
            if tg is not None:
                t0 = time.perf_counter()
                tg(x)
                t = time.perf_counter() - t0
                t_t.append(t)
                ratios.append(h / t)
        out["hcqa_forward_ms"] = statistics.median(h_t) * 1e3
        if t_t:
            out["tinygrad_forward_ms"] = statistics.median(t_t) * 1e3
            out["hcqa_over_tinygrad"] = statistics.median(ratios)
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rows", type=int, default=256)
    p.add_argument("--rounds", type=int, default=21)
    p.add_argument("--json", default=None)
    args = p.parse_args()
    result = trio.run(run, args.rows, args.rounds)
    text = json.dumps(result, indent=1)
    print(text)
    if args.json:
        with open(args.json, "w") as f:
            f.write(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
