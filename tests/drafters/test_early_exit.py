"""Early-exit drafting: the target's first N layers + final norm + LM head, on the shared cache."""

from __future__ import annotations

import copy

import pytest
import torch

from conftest import make_tiny_model
from selfspec_helpers import CacheCheckingDrafter, autoregressive, one_thread, prompt_ids  # noqa: F401
from specdecode import DraftModelDrafter, GenerationConfig, InvalidArgumentError, SpeculativeDecoder
from specdecode.drafters.early_exit import EarlyExitDrafter, exit_skip_set
from specdecode.drafters.layer_skip import SkipSet
from specdecode.engine.batch_cache import BatchKVCache, batch_prefill
from specdecode.engine.sampling import Sampler

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.mark.parametrize("bad", [0, 4, -1, 7, True, 1.5, None])
def test_exit_layer_out_of_range(bad):
    model = make_tiny_model("llama", num_layers=4)
    with pytest.raises(InvalidArgumentError) as e:
        EarlyExitDrafter(model, bad)
    assert f"exit layer {bad!r} is out of range" in str(e.value)
    assert "the model has 4 decoder layers, so the draft must keep 1..3 of them" in str(e.value)


def test_exit_skip_set():
    assert exit_skip_set(1, 4) == SkipSet(attn=(1, 2, 3), mlp=(1, 2, 3))
    assert exit_skip_set(3, 4) == SkipSet(attn=(3,), mlp=(3,))


def _truncated(model, n):
    """An independent copy of ``model`` with only its first ``n`` decoder layers."""
    small = copy.deepcopy(model)
    small.model.layers = torch.nn.ModuleList(list(small.model.layers)[:n])
    small.config.num_hidden_layers = n
    if getattr(small.config, "layer_types", None):
        small.config.layer_types = small.config.layer_types[:n]
    return small


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_draft_equals_truncated_model(arch, temperature):
    """The early-exit draft is exactly a model cut after N layers (same norm and head):
    same tokens and, when sampling, the same distributions, for every exit layer."""
    model = make_tiny_model(arch, num_layers=4)
    seq = prompt_ids(9, 2)  # longer than the sliding window (6), and so is the draft block
    config = GenerationConfig(temperature=temperature, seed=5, num_speculative_tokens=6)
    def draft(drafter):
        sampler = Sampler(config, 48, "cpu")  # same seed for both
        cache = BatchKVCache(model, 1, 64)
        batch_prefill(model, cache, seq[:, :-1], 0)  # the target's prefill
        drafter.bind(cache)
        drafter.join(0, seq[:, :-1], sampler)
        block = drafter.propose([seq[0].tolist()], [6])
        return block.tokens[0, : block.num_tokens[0]], block.probs[0] if block.probs is not None else None

    for n in (1, 2, 3):
        got, got_q = draft(EarlyExitDrafter(model, n))
        want, want_q = draft(DraftModelDrafter(_truncated(model, n)))
        assert got.tolist() == want.tolist() and len(got) == 6, (arch, n)
        if temperature:
            torch.testing.assert_close(got_q, want_q, rtol=1e-5, atol=1e-6)
        else:
            assert got_q is None


@pytest.mark.parametrize("gamma", [1, 3, 8])
def test_greedy_equals_autoregressive(arch, gamma):
    model = make_tiny_model(arch, num_layers=4)
    prompt = prompt_ids(5, gamma)
    config = GenerationConfig(max_new_tokens=20, num_speculative_tokens=gamma, stop_on_eos=False)
    expected = autoregressive(model, prompt, config)
    for n in (1, 3):
        drafter = CacheCheckingDrafter(EarlyExitDrafter(model, n))
        result = SpeculativeDecoder(model, drafter).generate(prompt, config)
        assert result.token_ids == expected, (arch, gamma, n)
        assert drafter.checked == result.stats.num_draft_blocks > 0
