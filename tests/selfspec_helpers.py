"""Helpers shared by the self-speculative / prompt-lookup / draft-control tests."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from conftest import VOCAB
from specdecode import GenerationConfig, SpeculativeDecoder
from specdecode.drafters import DraftModelDrafter
from specdecode.engine.protocol import Drafter
from specdecode.engine.sampling import Sampler


# A prompt that repeats itself: n-gram matches make the cascade's and prompt lookup's blocks mix
# matched and model-drafted tokens.
REPETITIVE = [5, 9, 12, 7, 5, 9, 12, 7, 5, 9, 12, 7, 20, 21, 5, 9]


@pytest.fixture(autouse=False)
def one_thread():
    """Tiny models run fastest single-threaded (and leave the other core alone)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def prompt_ids(length: int, seed: int, vocab: int = VOCAB) -> torch.Tensor:
    """(1, length) random ids in 3..vocab-1 (no pad/bos/eos)."""
    return torch.randint(3, vocab, (1, length), generator=torch.Generator().manual_seed(seed))


def cache_snapshot(cache, lengths) -> list[tuple[int, torch.Tensor, torch.Tensor]]:
    """Per layer and row b, (length, keys, values) of the row's first ``lengths[b]`` positions of the
    round's cache (``BatchKVCache``, rows in slots 0 .. n - 1), cloned: its confirmed positions
    (drafting may write past them). A ``DynamicCache``: every layer whole, ``lengths`` ignored."""
    if hasattr(cache, "num_slots"):
        return [(n, layer.keys[b, :, :n].clone(), layer.values[b, :, :n].clone())
                for layer in cache.layers for b, n in enumerate(lengths)]
    return [(layer.get_seq_length(), layer.keys.clone(), layer.values.clone()) for layer in cache.layers]


def assert_same_cache(before, after) -> None:
    assert len(before) == len(after)
    for i, ((n0, k0, v0), (n1, k1, v1)) in enumerate(zip(before, after)):
        assert n0 == n1, f"layer {i}: length {n0} -> {n1}"
        assert k0.shape == k1.shape and torch.equal(k0, k1), f"layer {i}: keys changed"
        assert v0.shape == v1.shape and torch.equal(v0, v1), f"layer {i}: values changed"


def autoregressive(target, prompt, config: GenerationConfig) -> list[int]:
    return SpeculativeDecoder(target).generate(prompt, config).token_ids


# --- distribution tests -------------------------------------------------------------


def exact_marginals(target, prompt: list[int], config: GenerationConfig, vocab: int) -> dict[str, torch.Tensor]:
    """Exact laws of the first three sampled tokens under ``Sampler.probs`` warping.

    Returns {"x1": (V,), "x2": (V,), "x3": (V,), "x1x2": (V, V)}: marginals and the
    joint of the first two, by enumerating every prefix (V + V^2 sequences, batched).
    """
    sampler = Sampler(config, vocab, "cpu")
    v = torch.arange(vocab)
    with torch.inference_mode():
        p = torch.tensor([prompt])
        seq2 = torch.cat([p.repeat(vocab, 1), v[:, None]], 1)
        seq3 = torch.cat([seq2.repeat_interleave(vocab, 0), v.repeat(vocab)[:, None]], 1)
        p1, p2, p3 = (sampler.probs(target(s).logits[:, -1]).double() for s in (p, seq2, seq3))
    j12 = p1[0][:, None] * p2
    j123 = j12[:, :, None] * p3.view(vocab, vocab, vocab)
    return {"x1": p1[0], "x2": j12.sum(0), "x3": j123.sum((0, 1)), "x1x2": j12}


def sample_counts(decoder, prompt: list[int], config: GenerationConfig, n: int, vocab: int) -> dict[str, torch.Tensor]:
    """Empirical frequencies of the same quantities from ``n`` seeded generations."""
    firsts = torch.zeros((n, 3), dtype=torch.long)
    for i in range(n):
        ids = decoder.generate(prompt, dataclasses.replace(config, seed=10_000 + i)).token_ids
        firsts[i] = torch.tensor(ids[:3])
    freq = {f"x{j + 1}": torch.bincount(firsts[:, j], minlength=vocab).double() / n for j in range(3)}
    freq["x1x2"] = torch.bincount(firsts[:, 0] * vocab + firsts[:, 1], minlength=vocab * vocab).double().view(
        vocab, vocab
    ) / n
    return freq


def violations(exact: dict, freq: dict, n: int, z: float = 4.5) -> list[str]:
    """Cells whose frequency is more than z standard errors (+ one count) from the exact probability."""
    bad = []
    for key, p in exact.items():
        f = freq[key]
        tol = z * torch.sqrt(p * (1 - p) / n) + 1.0 / n
        for idx in (torch.abs(f - p) > tol).nonzero().tolist():
            bad.append(f"{key}{idx}: sampled {float(f[tuple(idx)]):.4f}, exact {float(p[tuple(idx)]):.4f}")
    return bad


class CacheCheckingDrafter(Drafter):
    """Wraps a self-speculative drafter; asserts around every ``propose`` that each row's confirmed
    positions of the target cache come back tensor-equal (all but its pending token)."""

    supports_exit_policy = True

    def __init__(self, inner: Drafter) -> None:
        self.inner = inner
        self.who = inner.who
        self.checked = 0
        self._cache = None

    @property
    def num_forwards(self) -> int:
        return self.inner.num_forwards

    def bind(self, target_cache) -> None:
        self._cache = target_cache
        self.inner.bind(target_cache)

    def warm_up(self, max_rows, max_block) -> None:
        self.inner.warm_up(max_rows, max_block)

    def join(self, slot, prompt_ids, sampler) -> None:
        self.inner.join(slot, prompt_ids, sampler)

    def propose(self, sequences, max_tokens, exits=None, exit_rule="row"):
        lengths = [len(s) - 1 for s in sequences]
        before = cache_snapshot(self._cache, lengths)
        draft = self.inner.propose(sequences, max_tokens, exits, exit_rule)
        assert_same_cache(before, cache_snapshot(self._cache, lengths))
        self.checked += 1
        return draft

    def rollback(self, num_valid) -> None:
        self.inner.rollback(num_valid)

    def move(self, src, dst, num_valid) -> None:
        self.inner.move(src, dst, num_valid)


#: Every speculative method with the options it needs on the tiny 4-layer models (the
#: quantized exactness tests run each of them).
METHOD_OPTIONS = {
    "draft": {},
    "cascade": {},
    "layer-skip": dict(skip_layers="attn=1;mlp=2"),
    "early-exit": dict(exit_layer=2),
    "prompt-lookup": {},
}


def saved_model_with_quantizer_log(tmp_path, monkeypatch, model, record) -> tuple:
    """Save ``model`` (and a tiny tokenizer) to ``tmp_path/m``, make an empty dense-copy folder
    ``tmp_path/dense``, and log every ``loading.quantized_tensors(model, scheme, head, group_size=g)``
    call as ``record(scheme, head, g)`` in the returned list. Returns (folder, dense folder, calls)."""
    from conftest import make_tiny_tokenizer
    from specdecode.models import loading
    from specdecode.models.quantize import INT4_GROUP_SIZE

    folder = tmp_path / "m"
    model.save_pretrained(folder)
    make_tiny_tokenizer().save_pretrained(folder)
    dense = tmp_path / "dense"
    dense.mkdir()
    calls: list = []
    real = loading.quantized_tensors

    def logged(m, scheme, head="int8", group_size=INT4_GROUP_SIZE):
        calls.append(record(scheme, head, group_size))
        return real(m, scheme, head, group_size=group_size)

    monkeypatch.setattr(loading, "quantized_tensors", logged)
    return folder, dense, calls


def quantized_pair(arch: str, scheme: str, draft_head: str | None = None, group_size: int | None = None,
                   **model_kw):
    """A ``SpeculativeGenerator`` on tiny ``arch`` models (target 4 layers, draft 2; ``model_kw`` for
    ``make_tiny_model``), both quantized with ``scheme`` in int4 groups of ``group_size`` (None: 32);
    the draft's LM head in ``draft_head`` (None: int8)."""
    from torch import nn

    from conftest import make_tiny_model, make_tiny_tokenizer
    from specdecode import SpeculativeGenerator
    from specdecode.models import LoadedModel
    from specdecode.models.quantize import quantize_model

    tok = make_tiny_tokenizer()
    target = make_tiny_model(arch, num_layers=4, seed=0, **model_kw)
    draft = make_tiny_model(arch, num_layers=2, seed=5, **model_kw)
    for model, head in ((target, None), (draft, draft_head)):
        summary = quantize_model(model, scheme, head, group_size)
        assert not any(type(m) is nn.Linear for m in model.modules())  # it really is quantized
        assert summary.layers[scheme] > 0 and summary.bytes_after < summary.bytes_before / 2
        assert summary.head == (head or "int8")
    return SpeculativeGenerator(LoadedModel(target, tok, "tiny", scheme), LoadedModel(draft, tok, "tiny-draft", scheme))


class DraftSpy(DraftModelDrafter):
    """A ``DraftModelDrafter`` that records each row's block as (position of its first token, tokens)."""

    def __init__(self, *a, **k) -> None:
        super().__init__(*a, **k)
        self.drafts: list[tuple[int, list[int]]] = []

    def propose(self, sequences, max_tokens, exits=None, exit_rule="row"):
        draft = super().propose(sequences, max_tokens, exits, exit_rule)
        for b, seq in enumerate(sequences):
            self.drafts.append((len(seq), draft.tokens[b, : draft.num_tokens[b]].tolist()))
        return draft


def spread_pair(vocab: int = 8):
    """A tiny qwen2 target with spread-out distributions (vocab ``vocab``) and a draft that disagrees
    with it often, with the two rows' prompts the batched sampling tests share: (target, draft, prompts)."""
    from conftest import make_tiny_model
    from helpers import perturbed_copy

    model = make_tiny_model("qwen2", num_layers=1, vocab_size=vocab, seed=2)
    with torch.no_grad():
        model.get_output_embeddings().weight.mul_(0.5)
    return model, perturbed_copy(model, noise=2.0, seed=3), [[5, 3, 6, 5, 3, 4, 6, 5, 7], [4, 4, 6, 1]]
