"""Models: a trained network as hcqa programs, called like an async function.

A :class:`Model` awaits the copy-in of its inputs, a replay of its captured graph on the
swapped-in buffers, and the copy-out of its outputs. The reader of tinygrad models is
``hcqa.models._tinygrad``, the only module of hcqa that imports tinygrad (an import-linter
contract in pyproject.toml says so).

The layer sits above the pipelines, the processes, the batcher and the graphs (a model may
use them all), and below serving and the command line, which use models (see
docs/architecture.md, "The layers").
"""
