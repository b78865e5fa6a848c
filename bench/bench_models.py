"""Models on hcqa against tinygrad's own TinyJit: the same function, device and process.

Usage: ``python -m bench.bench_models [--quick]`` (needs ``pip install -e '.[models]'``).

Each case is one tinygrad function, captured twice: by ``hcqa.models.from_tinygrad`` (one hcqa
Graph: copy-in, the lifted kernels, copy-out; ``await m(x)``) and by ``TinyJit`` as its users
call it (``jit(Tensor(x)).numpy()``: a copy-in, the replay and the copy-out included). The two
calls alternate round by round (``interleave``); the ratio is the median of per-round ratios of
hcqa's p50 to tinygrad's, so the host's load drifts alike on both sides.

1. a chain of 100 dependent elementwise kernels on 16 floats (launch cost alone): target
   <= 0.5x;
2. an MLP 256-512-512-10, batch 8: target <= 0.8x;
3. a GPT-like block (2 layers, d=256, 4 heads, 32 tokens): target <= 1.0x;
   each on cpu:0 and opencl:0 (PoCL);
4. a decoder with a KV cache: greedy tokens per second, hcqa's graph vs tinygrad's jit
   (report);
5. SqueezeNet 1x3x224x224 (the onnx wheel's architecture, seeded weights) on cpu:0: hcqa on
   tinygrad's kernels, tinygrad's jit, and onnxruntime (one thread) directly and as one hcqa
   kernel (report).
"""

from __future__ import annotations

import math
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np

import hcqa
from bench._series import (
    AsyncOp,
    fmt_ns,
    fmt_ratio,
    info,
    interleave,
    paired_ratio,
    sync_op,
    verdict,
)
from bench._util import markdown_table, print_footer, run_quick_cli

TARGETS = {"chain100": 0.5, "mlp": 0.8, "gpt": 1.0}
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))  # the test helpers


def _weights(where: str, rng: np.random.Generator, *shape: int, scale: float = 0.1) -> Any:
    from tinygrad import Tensor

    return Tensor((rng.standard_normal(shape) * scale).astype(np.float32), device=where).realize()


def chain(where: str, rng: np.random.Generator) -> tuple[Callable[..., Any], list[np.ndarray]]:
    def fn(x: Any) -> Any:
        for _ in range(100):
            x = (x + 1).contiguous()
        return x

    return fn, [np.zeros(16, np.float32)]


def mlp(where: str, rng: np.random.Generator) -> tuple[Callable[..., Any], list[np.ndarray]]:
    w1, w2, w3 = (
        _weights(where, rng, 256, 512),
        _weights(where, rng, 512, 512),
        _weights(where, rng, 512, 10),
    )

    def fn(x: Any) -> Any:
        return ((x @ w1).relu() @ w2).relu() @ w3

    return fn, [rng.standard_normal((8, 256)).astype(np.float32)]


def gpt(where: str, rng: np.random.Generator) -> tuple[Callable[..., Any], list[np.ndarray]]:
    from tinygrad import Tensor

    d, heads, seq = 256, 4, 32
    layers = [
        [_weights(where, rng, d, 3 * d), _weights(where, rng, d, d),
         _weights(where, rng, d, 4 * d), _weights(where, rng, 4 * d, d)]
        for _ in range(2)
    ]  # fmt: skip
    mask = Tensor(np.triu(np.full((seq, seq), -np.inf, np.float32), 1), device=where).realize()

    def fn(x: Any) -> Any:
        for wqkv, wo, w1, w2 in layers:
            h = x.layernorm()
            q, k, v = (h @ wqkv).reshape(seq, 3, heads, d // heads).permute(1, 2, 0, 3)
            att = ((q @ k.transpose(-1, -2)) / math.sqrt(d // heads) + mask).softmax(-1)
            x = x + (att @ v).permute(1, 0, 2).reshape(seq, d) @ wo
            x = x + ((x.layernorm() @ w1).gelu() @ w2)
        return x

    return fn, [rng.standard_normal((seq, d)).astype(np.float32)]


CASES = {"chain100": chain, "mlp": mlp, "gpt": gpt}


def tinygrad_call(fn: Callable[..., Any], where: str, example: list[np.ndarray]) -> AsyncOp:
    """tinygrad's jit as its users call it: Tensors in, ``.numpy()`` out (blocks the loop)."""
    from tinygrad import Tensor, TinyJit

    jit = TinyJit(fn)

    def call() -> None:
        jit(*(Tensor(a, device=where) for a in example)).numpy()

    for _ in range(3):
        call()
    return sync_op(call)


async def cases(quick: bool, rows: list[list[object]], lines: list[str]) -> None:
    from hcqa import models

    rounds = 5 if quick else 15
    kinds = ["cpu:0"]
    from _kinds import opencl_missing  # tests/_kinds.py: skips opencl:0 where it can't run

    if opencl_missing() is None:
        kinds.append("opencl:0")
    for spec in kinds:
        async with hcqa.open_device(spec) as dev:
            where = models.tinygrad_device(dev)
            for case, make in CASES.items():
                fn, example = make(where, np.random.default_rng(0))
                m = await models.from_tinygrad(fn, example, device=dev, name=case)
                want = await m(*example)
                from tinygrad import Tensor

                got = fn(*(Tensor(a, device=where) for a in example)).numpy()
                exact = bool(np.array_equal(want, got))

                async def ours(m: Any = m, example: list[np.ndarray] = example) -> None:
                    await m(*example)

                ops = {"hcqa": ours, "tinygrad": tinygrad_call(fn, where, example)}
                per = 20 if case == "chain100" else 10
                s = await interleave(ops, rounds=rounds, per_round=per)
                ratio = paired_ratio(s["hcqa"], s["tinygrad"])
                st = m.statistics()
                rows.append([f"{case} {spec}", st.kernels, fmt_ns(s["hcqa"].p50),
                             fmt_ns(s["tinygrad"].p50), fmt_ratio(ratio),
                             "bit-exact" if exact else "differs"])  # fmt: skip
                target = TARGETS[case]
                lines.append(verdict(f"{case} on {spec} <= {target}x tinygrad's jit call",
                                     ratio <= target, fmt_ratio(ratio)))  # fmt: skip


async def decoder(quick: bool, rows: list[list[object]], lines: list[str]) -> None:
    from tinygrad import Tensor, TinyJit, Variable

    from hcqa import models

    vocab, dim, ctx = 256, 128, 64
    steps = 16 if quick else 48
    async with hcqa.open_device("cpu:0") as dev:
        where = models.tinygrad_device(dev)
        rng = np.random.default_rng(4)
        emb, wq, wk, wv, wo = (_weights(where, rng, vocab, dim, scale=0.5),
                               *(_weights(where, rng, dim, dim, scale=0.5) for _ in range(3)),
                               _weights(where, rng, dim, vocab, scale=0.5))  # fmt: skip

        def make() -> Callable[..., Any]:
            ck = Tensor.zeros(ctx, dim, device=where).contiguous().realize()
            cv = Tensor.zeros(ctx, dim, device=where).contiguous().realize()

            def step(tok: Any, start_pos: Any) -> Any:
                h = emb[tok]
                ck[start_pos : start_pos + 1].assign(h @ wk).realize()
                cv[start_pos : start_pos + 1].assign(h @ wv).realize()
                keys, values = ck[: start_pos + 1], cv[: start_pos + 1]
                att = ((h @ wq) @ keys.T / dim**0.5).softmax(-1)
                return ((h + att @ values) @ wo).argmax(-1).cast("int32")

            return step

        m = await models.from_tinygrad(make(), [np.array([1], np.int32)], device=dev,
                                       variables={"start_pos": (0, ctx - 1)})  # fmt: skip
        jit = TinyJit(make())
        sp = Variable("start_pos", 0, ctx - 1)

        def theirs() -> list[int]:
            toks = [1]
            for pos in range(steps):
                t = jit(Tensor(np.array([toks[-1]], np.int32), device=where),
                        start_pos=sp.bind(pos))  # fmt: skip
                toks.append(int(t.numpy()[0]))
            return toks

        async def ours() -> list[int]:
            toks = [1]
            for pos in range(steps):
                toks.append(int((await m(np.array([toks[-1]], np.int32), start_pos=pos))[0]))
            return toks

        same = theirs() == await ours()

        async def run_ours() -> None:
            await ours()

        s = await interleave({"hcqa": run_ours, "tinygrad": sync_op(theirs)},
                             rounds=3 if quick else 7, per_round=1, units={"hcqa": steps,
                             "tinygrad": steps})  # fmt: skip
        ratio = paired_ratio(s["hcqa"], s["tinygrad"])
        rows.append(["decoder cpu:0 (per token)", m.statistics().kernels, fmt_ns(s["hcqa"].p50),
                     fmt_ns(s["tinygrad"].p50), fmt_ratio(ratio),
                     "same tokens" if same else "TOKENS DIFFER"])  # fmt: skip
        lines.append(
            info(
                "decoder tokens/s",
                f"hcqa {1e9 / s['hcqa'].p50:.0f}, tinygrad "
                f"{1e9 / s['tinygrad'].p50:.0f} ({fmt_ratio(1 / ratio)} tinygrad's rate)",
            )
        )


async def squeezenet(quick: bool, rows: list[list[object]], lines: list[str]) -> None:
    import onnxruntime as ort
    from _onnx_zoo import with_weights  # tests/_onnx_zoo.py: the zoo file, seeded weights
    from tinygrad import Tensor, TinyJit
    from tinygrad.nn.onnx import OnnxRunner

    from hcqa import models

    with tempfile.TemporaryDirectory() as tmp:
        path = with_weights("squeezenet", Path(tmp))
        x = np.random.default_rng(5).standard_normal((1, 3, 224, 224)).astype(np.float32)
        async with hcqa.open_device("cpu:0") as dev:
            t0 = time.perf_counter()
            m = await models.load_onnx(path, device=dev)
            load = time.perf_counter() - t0
            r = await models.load_onnx(path, device=dev, backend="onnxruntime")
            opts = ort.SessionOptions()
            opts.intra_op_num_threads = opts.inter_op_num_threads = 1
            sess = ort.InferenceSession(str(path), opts, providers=["CPUExecutionProvider"])
            runner = OnnxRunner(str(path)).to("CPU")
            jit = TinyJit(lambda t: runner({"data_0": t})["softmaxout_1"])

            def tg() -> None:
                jit(Tensor(x, device="CPU")).numpy()

            for _ in range(3):
                tg()
            want = sess.run(None, {"data_0": x})[0]
            err = float(np.abs(await m(x) - want).max())

            async def ours() -> None:
                await m(x)

            async def ours_ort() -> None:
                await r(x)

            ops = {"hcqa": ours, "tinygrad": sync_op(tg), "hcqa ort": ours_ort,
                   "ort": sync_op(lambda: sess.run(None, {"data_0": x}))}  # fmt: skip
            s = await interleave(ops, rounds=3 if quick else 5, per_round=2, warmup=1)
        base = s["tinygrad"]
        for name in ("hcqa", "hcqa ort", "ort"):
            rows.append([f"squeezenet cpu:0 {name}", "", fmt_ns(s[name].p50), fmt_ns(base.p50),
                         fmt_ratio(paired_ratio(s[name], base)),
                         f"max |diff| vs ort {err:.1e}" if name == "hcqa" else ""])  # fmt: skip
        kernel = fmt_ratio(paired_ratio(s["hcqa ort"], s["ort"]))
        lines.append(
            info(
                "squeezenet",
                f"hcqa's onnxruntime kernel is {kernel} a direct "
                f"session.run; load (tinygrad capture or cache) {load:.1f} s",
            )
        )


async def main(quick: bool) -> None:
    t0 = time.perf_counter()
    rows: list[list[object]] = []
    lines: list[str] = []
    await cases(quick, rows, lines)
    await decoder(quick, rows, lines)
    await squeezenet(quick, rows, lines)
    print(f"# bench_models{' --quick' if quick else ''}: hcqa models vs tinygrad 0.14 TinyJit")
    print(markdown_table(["case", "launches", "hcqa p50", "tinygrad p50",
                          "hcqa / tinygrad (paired)", "notes"], rows))  # fmt: skip
    print_footer(None, lines, t0)


def cli(argv: Sequence[str] | None = None) -> None:
    run_quick_cli(main, __doc__, list(sys.argv[1:] if argv is None else argv))


if __name__ == "__main__":
    cli()
