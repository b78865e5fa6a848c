"""Real architectures for the model tests: the onnx wheel's light model-zoo files with seeded
weights, made by :mod:`hcqa.cli._zoo` (the code ``hcqa demo --model`` builds its model with)."""

from __future__ import annotations

from hcqa.cli._zoo import light_model, with_weights

__all__ = ["light_model", "with_weights"]
