"""The truncated draft head (FR-Spec): exact greedy and sampling, the head itself, bad input."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from conftest import VOCAB, make_tiny_model
from helpers import perturbed_copy
from selfspec_helpers import (  # noqa: F401  (one_thread is a fixture)
    REPETITIVE,
    autoregressive,
    exact_marginals,
    one_thread,
    sample_counts,
    violations,
)
from specdecode import GenerationConfig, InvalidArgumentError, SpeculativeDecoder
from specdecode.drafters import CascadeDrafter, DraftHead, DraftModelDrafter
from specdecode.engine.batch_cache import BatchKVCache
from specdecode.engine.sampling import Sampler
from specdecode.errors import UnsupportedModelError

pytestmark = pytest.mark.usefixtures("one_thread")



class Spy:
    """Wraps a drafter's ``propose`` to record the model-drafted tokens of every block."""

    def __init__(self, drafter) -> None:
        self.drafter, self.model_tokens = drafter, []
        propose = drafter.propose

        def recording(sequences, max_tokens, exits=None, exit_rule="row"):
            before = getattr(drafter, "num_ngram_tokens", 0)
            draft = propose(sequences, max_tokens, exits, exit_rule)
            m = getattr(drafter, "num_ngram_tokens", 0) - before  # one row: its n-gram tokens come first
            self.model_tokens += draft.tokens[0, m : draft.num_tokens[0]].tolist()
            return draft

        drafter.propose = recording


def _make(method: str, draft, head: DraftHead):
    return CascadeDrafter(draft, head=head) if method == "cascade" else DraftModelDrafter(draft, head=head)


# --- the head itself ---------------------------------------------------------------------------


def test_truncated_logits_are_the_rows_of_the_full_logits(arch):
    """Gemma 2's final soft-capping still applies: the stock forward runs around the swapped head."""
    model = make_tiny_model(arch, num_layers=2)
    ids = torch.tensor([3, 4, 10, 17, 30, 47])
    head = DraftHead.truncated(ids[torch.randperm(6, generator=torch.Generator().manual_seed(0))]).bind(model)
    assert head.ids.tolist() == ids.tolist() and head.weight.is_contiguous() and head.weight.shape == (6, 32)
    x = torch.tensor([REPETITIVE])
    with torch.no_grad():
        full = model(x).logits
        with head.applied():
            cut = model(x).logits
        again = model(x).logits
    assert cut.shape == (1, len(REPETITIVE), 6)
    torch.testing.assert_close(cut, full[..., ids], rtol=1e-5, atol=1e-5)
    assert torch.equal(again, full)  # restored
    assert "forward" not in model.get_output_embeddings().__dict__


def test_bias_rows():
    """A head with a bias gets its bias rows."""
    model = make_tiny_model("llama", num_layers=1)
    with torch.no_grad():
        biased = torch.nn.Linear(32, VOCAB, bias=True)
        biased.weight.copy_(model.lm_head.weight)
        biased.bias.normal_(generator=torch.Generator().manual_seed(0))
    model.lm_head = biased
    ids = [3, 9, 27]
    x = torch.tensor([[4, 5, 6]])
    head = DraftHead.truncated(ids).bind(model)
    with torch.no_grad():
        full = model(x).logits
        with head.applied():
            torch.testing.assert_close(model(x).logits, full[..., ids])


@pytest.mark.parametrize("scheme, lm_head", [("int8", None), ("int4", None), ("int4", "int4")],
                         ids=["int8", "int4", "int4-head-int4"])
def test_a_quantized_head_cuts_its_own_rows(scheme, lm_head):
    """A weight-only quantized LM head (``specdecode.models.quantize``) gives its K rows through ``select_rows``
    (an int4 head: K = 4 rows, padded to the kernel's 16 and cut back)."""
    from specdecode.models import quantize
    model = make_tiny_model("qwen2", num_layers=1, hidden_size=64, intermediate_size=128).to(torch.bfloat16)
    assert quantize.quantize_model(model, scheme, lm_head).head == (lm_head or "int8")
    lm_head = model.get_output_embeddings()
    assert callable(getattr(lm_head, "select_rows", None)), type(lm_head)
    ids = [3, 9, 27, 40]
    x = torch.tensor([[4, 5, 6]])
    head = DraftHead.truncated(ids).bind(model)
    with torch.no_grad():
        full = model(x).logits
        with head.applied():
            cut = model(x).logits
        assert "forward" not in lm_head.__dict__ and "forward" not in lm_head._modules
        assert torch.equal(model(x).logits, full)
    torch.testing.assert_close(cut, full[..., ids])


def test_the_head_is_restored_after_an_exception():
    model = make_tiny_model("llama", num_layers=1)
    head = DraftHead.truncated([3, 5]).bind(model)
    with pytest.raises(RuntimeError, match="boom"):
        with head.applied():
            raise RuntimeError("boom")
    assert "forward" not in model.get_output_embeddings().__dict__
    assert model(torch.tensor([[3, 4]])).logits.shape[-1] == VOCAB


def test_probs_over_equals_probs_of_a_row_masked_outside_the_ids():
    config = GenerationConfig(temperature=0.7, top_k=3, top_p=0.8, seed=0)
    sampler = Sampler(config, 12, "cpu")
    ids = torch.tensor([1, 4, 5, 9, 11])
    logits = torch.randn(2, 5, generator=torch.Generator().manual_seed(1))
    row = torch.full((2, 12), float("-inf"))
    row[:, ids] = logits
    q = sampler.probs_over(logits, ids)
    torch.testing.assert_close(q, sampler.probs(row))
    assert q.shape == (2, 12) and torch.all(q[:, [0, 2, 3, 6, 7, 8, 10]] == 0)


# --- greedy exactness ----------------------------------------------------------------------------


@pytest.mark.parametrize("method", ["draft", "cascade"])
@pytest.mark.parametrize("num_others", [2, 20])
def test_greedy_equals_autoregressive(arch, method, num_others):
    """Float32 greedy output is the target's, also when many target tokens lie outside the K ids."""
    target = make_tiny_model(arch, num_layers=2)
    draft = perturbed_copy(target, noise=0.5, seed=1)
    prompt = torch.tensor([REPETITIVE])
    config = GenerationConfig(max_new_tokens=30, num_speculative_tokens=4, stop_on_eos=False)
    expected = autoregressive(target, prompt, config)
    # K: every other token the target produces, its most frequent one left out (so drafts get
    # accepted and rejected), plus ``num_others`` tokens it never produces.
    produced = sorted(set(expected), key=lambda t: (-expected.count(t), t))
    ids = produced[1::2] + [t for t in range(3, VOCAB) if t not in produced][:num_others]
    spy = Spy(_make(method, draft, DraftHead.truncated(ids)))
    result = SpeculativeDecoder(target, spy.drafter).generate(prompt, config)
    assert result.token_ids == expected, (arch, method)
    outside = [t for t in expected if t not in ids]
    assert len(outside) >= len(expected) // 4, "the test needs target tokens outside K"
    assert spy.model_tokens and set(spy.model_tokens) <= set(ids)  # the model part proposes within K only
    assert result.stats.num_accepted_tokens > 0
    if method == "cascade":  # the check kept n-gram tokens (within K) and continued from K-column logits
        assert spy.drafter.num_ngram_tokens > 0


def test_full_head_is_the_default_and_unchanged():
    target = make_tiny_model("qwen2", num_layers=2)
    draft = perturbed_copy(target, noise=0.5, seed=1)
    prompt = torch.tensor([REPETITIVE])
    config = GenerationConfig(max_new_tokens=16, num_speculative_tokens=3, stop_on_eos=False)
    a = SpeculativeDecoder(target, DraftModelDrafter(draft)).generate(prompt, config).stats
    b = SpeculativeDecoder(target, DraftModelDrafter(draft, head=DraftHead.full())).generate(prompt, config).stats
    assert DraftModelDrafter(draft).head.size is None
    assert (a.num_drafted_tokens, a.num_accepted_tokens) == (b.num_drafted_tokens, b.num_accepted_tokens)


# --- sampling ------------------------------------------------------------------------------------


@pytest.mark.parametrize("method", ["draft", "cascade"])
def test_sampling_preserves_target_distribution_when_its_top_token_is_outside_k(method, monkeypatch):
    vocab, n = 8, 600
    model = make_tiny_model("qwen2", num_layers=1, vocab_size=vocab, seed=2)
    draft = perturbed_copy(model, noise=1.0, seed=3)
    prompt = [3, 6, 1]  # short: the cascade's n-gram part fires after some first tokens, not all
    config = GenerationConfig(max_new_tokens=4, num_speculative_tokens=3, stop_on_eos=False, temperature=1.0)
    exact = exact_marginals(model, prompt, config, vocab)
    top2 = torch.topk(exact["x1"], 2).indices.tolist()
    assert float(exact["x1"][top2[0]]) > 0.2, "the setup needs a likely top token"
    # The target's two likeliest first tokens and its likeliest second token left out (K = 5 or 6).
    ids = [t for t in range(vocab) if t not in top2 and t != int(exact["x2"].argmax())]
    drafter = _make(method, draft, DraftHead.truncated(ids))
    dec = SpeculativeDecoder(model, drafter)
    freq = sample_counts(dec, prompt, config, n, vocab)
    assert violations(exact, freq, n) == []
    assert float(freq["x1"][top2[0]]) > 0.1  # reached through the residual max(0, p - q) only
    # Negative controls: the draft model's own (full) law is rejected by the same test, and so is
    # the output of a rejection test that uses an unnormalised q (q / 2: the same draws, wrong ratio p/q).
    assert violations(exact_marginals(draft, prompt, config, vocab), freq, n) != []
    probs_over = Sampler.probs_over
    monkeypatch.setattr(Sampler, "probs_over", lambda self, logits, ids: probs_over(self, logits, ids) / 2)
    wrong = sample_counts(SpeculativeDecoder(model, _make(method, draft, DraftHead.truncated(ids))),
                          prompt, config, n, vocab)
    assert violations(exact, wrong, n) != []
    monkeypatch.undo()
    spy = Spy(_make(method, draft, DraftHead.truncated(ids)))
    spied = SpeculativeDecoder(model, spy.drafter)
    runs = [spied.generate(prompt, dataclasses.replace(config, seed=s)).stats for s in range(30)]
    assert 0 < sum(r.num_accepted_tokens for r in runs) < sum(r.num_drafted_tokens for r in runs)
    assert set(spy.model_tokens) <= set(ids)


def test_draft_probs_are_zero_outside_k():
    model = make_tiny_model("llama", num_layers=1)
    drafter = DraftModelDrafter(model, head=DraftHead.truncated([4, 8, 15, 16, 23, 42]))
    sampler = Sampler(GenerationConfig(temperature=1.0, seed=0), VOCAB, "cpu")
    prompt = torch.tensor([[5, 6, 7]])
    drafter.bind(BatchKVCache(model, 1, 16))
    drafter.join(0, prompt[:, :2], sampler)  # the sequence's last token is fed by propose
    draft = drafter.propose([prompt[0].tolist()], [3])
    (q,) = draft.probs
    assert q.shape == (3, VOCAB) and draft.num_tokens == [3]
    torch.testing.assert_close(q.sum(-1), torch.ones(3))
    outside = torch.ones(VOCAB, dtype=torch.bool)
    outside[[4, 8, 15, 16, 23, 42]] = False
    assert torch.all(q[:, outside] == 0)
    assert set(draft.tokens[0].tolist()) <= {4, 8, 15, 16, 23, 42}


# --- bad input -----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "ids, message",
    [
        ([], "non-empty 1-D list of integer token ids"),
        ([[1, 2]], "non-empty 1-D list"),
        ([1.5, 2.0], "integer token ids"),
        ([3, -1], "draft-head token id -1 is negative"),
        ([3, 5, 3], "draft-head token id 3 is given more than once"),
    ],
)
def test_bad_ids_are_refused(ids, message):
    with pytest.raises(InvalidArgumentError, match=message):
        DraftHead.truncated(ids)


def test_ids_past_the_head_or_the_target_vocabulary_are_refused():
    model = make_tiny_model("llama", num_layers=1)
    with pytest.raises(InvalidArgumentError, match=r"token id 48 is out of range: .* 48 rows, allowed ids 0\.\.47"):
        DraftModelDrafter(model, head=DraftHead.truncated([3, 48]))
    drafter = DraftModelDrafter(model, head=DraftHead.truncated([3, 40]))
    with pytest.raises(InvalidArgumentError, match=r"token id 40 is outside the target's vocabulary 0\.\.31"):
        drafter.bind(BatchKVCache(model, 1, 16))
        drafter.join(0, torch.tensor([[5]]), Sampler(GenerationConfig(), 32, "cpu"))


def test_a_model_without_an_output_embedding_is_refused():
    model = make_tiny_model("llama", num_layers=1)
    model.get_output_embeddings = lambda: None
    with pytest.raises(UnsupportedModelError, match="get_output_embeddings"):
        DraftHead.truncated([3, 4]).bind(model)
