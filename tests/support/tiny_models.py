"""The tiny-model shapes the tests use, built with the same builder as `primerl init-tiny-model`
(`primerl.trainer.tiny_model`). `conftest.py` builds each shape once per session (fixtures `tiny_model` and
`small_tiny_model`); no test writes into those directories."""

from __future__ import annotations

from primerl.trainer.tiny_model import TinyModelSpec

DEFAULT_SPEC = TinyModelSpec(seed=0)
"""The demo's shape (hidden 128, 2 layers): what vLLM serves in the daemon tests."""

SMALL_SPEC = TinyModelSpec(seed=0, hidden_size=64, num_layers=1, num_attention_heads=2, num_key_value_heads=1)
"""One layer of hidden 64: for trainer and checkpoint tests that step the model many times."""
