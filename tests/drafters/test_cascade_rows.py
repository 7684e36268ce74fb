"""The cascade (``drafters.cascade``) over many rows: each row's greedy output equals target-only
decoding (float32), n-gram tokens are checked, proposed and accepted, long-prompt rows get
n-gram matches alone, and ``generate`` proposes the batched engine's blocks at B = 1."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from conftest import make_tiny_model
from helpers import perturbed_copy
from selfspec_helpers import REPETITIVE, exact_marginals, one_thread, spread_pair, violations  # noqa: F401 (a fixture)
from specdecode import DraftControl, GenerationConfig, SpeculativeDecoder
from specdecode.drafters import PromptLookupDrafter
from specdecode.drafters.cascade import LONG_PROMPT_BLOCK, CascadeDrafter
from specdecode.drafters.draft_head import DraftHead
from specdecode.drafters.draft_model import DraftModelDrafter
from specdecode.engine.batch_cache import BatchKVCache
from specdecode.engine.batched import BatchedSpeculativeDecoder
from specdecode.engine.sampling import Sampler
from specdecode.errors import InvalidArgumentError

pytestmark = pytest.mark.usefixtures("one_thread")

# Prompts that repeat themselves (n-gram matches happen), of different lengths; two are longer
# than LONG (16 and 12 tokens), one past the sliding window (6) of the Mistral and Gemma models.
PROMPTS = [[5, 9, 12], REPETITIVE, [7, 3, 30, 7, 3, 30, 8], [44], [13, 14, 15, 13, 14, 15, 16, 13, 14, 15, 16, 13]]
LENGTHS = [20, 9, 25, 14, 17]
LONG = 9  # max_model_prompt_tokens: rows 1 and 4 are long


def _configs(**kw) -> list[GenerationConfig]:
    return [GenerationConfig(max_new_tokens=m, **kw) for m in LENGTHS]


def _alone(target, prompts, configs) -> list[list[int]]:
    dec = SpeculativeDecoder(target, compile=False)
    return [dec.generate(p, c).token_ids for p, c in zip(prompts, configs)]


def _continuous(dec: BatchedSpeculativeDecoder, prompts, configs) -> list[list[int]]:
    """Two requests first; the others join one per step while the batch runs (``add`` during ``step``)."""
    out: dict[int, list[int]] = {}
    ids = [dec.add(prompts[0], configs[0]), dec.add(prompts[1], configs[1])]
    pending = list(zip(prompts[2:], configs[2:]))
    while dec.has_work or pending:
        for event in dec.step():
            out.setdefault(event.request_id, []).extend(event.token_ids)
        if pending:
            ids.append(dec.add(*pending.pop(0)))
    return [out.get(i, []) for i in ids]


def test_greedy_rows_equal_target_alone(arch):
    """B = 1 and B = 3 (rows joining mid-flight, finishing at different lengths), with the check on
    and off and with long-prompt rows; n-gram tokens are proposed and accepted every time."""
    target = make_tiny_model(arch, num_layers=3)
    draft = perturbed_copy(target, noise=0.3, seed=1)
    configs = _configs()
    expected = _alone(target, PROMPTS, configs)
    for check, limit in ((True, None), (False, LONG), (True, LONG)):
        for batch in (1, 3):
            drafter = CascadeDrafter(draft, ngram_check=check, max_model_prompt_tokens=limit)
            dec = BatchedSpeculativeDecoder(target, drafter, max_batch_size=batch, max_length=96,
                                            num_speculative_tokens=4)
            got = _continuous(dec, PROMPTS, configs)
            case = (arch, check, limit, batch)
            assert got == expected, case
            assert dec.stats.max_rows == batch, case
            assert 0 < drafter.num_ngram_accepted <= drafter.num_ngram_tokens, case
            assert 0 < dec.stats.num_accepted_tokens < dec.stats.num_drafted_tokens, case


class _BatchSpy(CascadeDrafter):
    """Keeps every block of row 0."""

    def __init__(self, *a, **k) -> None:
        super().__init__(*a, **k)
        self.blocks: list[list[int]] = []

    def propose(self, sequences, max_tokens, exits=None, exit_rule="row"):
        draft = super().propose(sequences, max_tokens, exits, exit_rule)
        self.blocks.append(draft.tokens[0, : draft.num_tokens[0]].tolist())
        return draft


@pytest.mark.parametrize("arch", ["qwen2", "mistral"])
def test_generate_and_the_batched_engine_propose_the_same_blocks(arch):
    """The cascade under ``SpeculativeDecoder`` (``generate``) and under the batched engine at B = 1
    proposes the same blocks, n-gram tokens kept by the check and followed by model tokens included."""
    target = make_tiny_model(arch, num_layers=3)
    draft = perturbed_copy(target, noise=0.3, seed=1)
    configs = _configs(num_speculative_tokens=4)
    for check, limit in ((True, None), (False, None), (True, LONG)):
        single = _BatchSpy(draft, ngram_check=check, max_model_prompt_tokens=limit)
        dec = SpeculativeDecoder(target, single, compile=False)
        for p, c in zip(PROMPTS, configs):
            dec.generate(p, c)
        ngram = single.num_ngram_tokens
        batched = _BatchSpy(draft, ngram_check=check, max_model_prompt_tokens=limit)
        bdec = BatchedSpeculativeDecoder(target, batched, max_batch_size=1, max_length=96, num_speculative_tokens=4)
        bdec.generate(PROMPTS, _configs())
        assert batched.blocks == single.blocks, (arch, check, limit)
        assert batched.num_ngram_tokens == ngram > 0, (arch, check, limit)


class _BatchDraftSpy(DraftModelDrafter):
    def __init__(self, *a, **k) -> None:
        super().__init__(*a, **k)
        self.blocks: list[list[int]] = []

    def propose(self, sequences, max_tokens, exits=None, exit_rule="row"):
        draft = super().propose(sequences, max_tokens, exits, exit_rule)
        self.blocks.append(draft.tokens[0, : draft.num_tokens[0]].tolist())
        return draft


@pytest.mark.parametrize("arch", ["llama", "gemma2"])
def test_draft_context_window(arch):
    """A draft context window of 3 tokens (the draft model and the cascade): at B = 1 the blocks are
    the same under ``generate`` and the batched engine; at B = 3 (rows joining mid-flight) every row
    equals target-only decoding."""
    target = make_tiny_model(arch, num_layers=3)
    draft = perturbed_copy(target, noise=0.3, seed=1)
    configs = _configs(num_speculative_tokens=4)
    expected = _alone(target, PROMPTS, configs)
    for single, batched in ((_BatchDraftSpy(draft, 3), _BatchDraftSpy(draft, 3)),
                            (_BatchSpy(draft, context_window=3), _BatchSpy(draft, context_window=3))):
        dec = SpeculativeDecoder(target, single, compile=False)
        assert [dec.generate(p, c).token_ids for p, c in zip(PROMPTS, configs)] == expected
        bdec = BatchedSpeculativeDecoder(target, batched, max_batch_size=1, max_length=96, num_speculative_tokens=4)
        assert [r.token_ids for r in bdec.generate(PROMPTS, _configs())] == expected
        assert batched.blocks == single.blocks, type(batched).__name__
    for make in (lambda: DraftModelDrafter(draft, context_window=3),
                 lambda: CascadeDrafter(draft, max_model_prompt_tokens=LONG, context_window=3)):
        drafter = make()
        dec = BatchedSpeculativeDecoder(target, drafter, max_batch_size=3, max_length=96, num_speculative_tokens=4)
        assert _continuous(dec, PROMPTS, _configs()) == expected, type(drafter).__name__
        assert 0 < dec.stats.num_accepted_tokens < dec.stats.num_drafted_tokens


@pytest.mark.parametrize("arch", ["qwen2", "gemma2"])
def test_truncated_draft_head(arch):
    """FR-Spec's truncated head (K = 12 of 48 tokens) for the draft model and the cascade: at B = 1
    the blocks are the same under ``generate`` and the batched engine; at B = 3 every row equals
    target-only decoding, greedy, and sampling rows' q are zero outside the K tokens."""
    target = make_tiny_model(arch, num_layers=3)
    draft = perturbed_copy(target, noise=0.3, seed=1)
    configs = _configs(num_speculative_tokens=4)
    expected = _alone(target, PROMPTS, configs)
    common = sorted({t for out in expected for t in out})[:8]  # K tokens: some the target picks, some it never does
    ids = sorted({*common, 0, 1, 40, 41, 42, 43, 44, 45, 46, 47})[:12]
    head = DraftHead.truncated(ids)
    for single, batched in ((_BatchDraftSpy(draft, head=head), _BatchDraftSpy(draft, head=head)),
                            (_BatchSpy(draft, head=head), _BatchSpy(draft, head=head))):
        dec = SpeculativeDecoder(target, single, compile=False)
        assert [dec.generate(p, c).token_ids for p, c in zip(PROMPTS, configs)] == expected
        bdec = BatchedSpeculativeDecoder(target, batched, max_batch_size=1, max_length=96, num_speculative_tokens=4)
        assert [r.token_ids for r in bdec.generate(PROMPTS, _configs())] == expected
        assert batched.blocks == single.blocks, type(batched).__name__
        if type(batched) is _BatchDraftSpy:  # the draft model proposes among the K tokens only
            assert {t for block in batched.blocks for t in block} <= set(ids)
    for make in (lambda: DraftModelDrafter(draft, head=head),
                 lambda: CascadeDrafter(draft, max_model_prompt_tokens=LONG, head=head)):
        drafter = make()
        dec = BatchedSpeculativeDecoder(target, drafter, max_batch_size=3, max_length=96, num_speculative_tokens=4)
        assert _continuous(dec, PROMPTS, _configs()) == expected, type(drafter).__name__
        assert 0 < dec.stats.num_accepted_tokens < dec.stats.num_drafted_tokens
    drafter = DraftModelDrafter(draft, head=head)
    drafter.bind(BatchKVCache(target, 2, 64))
    vocab = target.config.vocab_size
    for slot, prompt in enumerate(PROMPTS[:2]):
        drafter.join(slot, torch.tensor([prompt]), Sampler(GenerationConfig(temperature=1.0, seed=slot), vocab, "cpu"))
    block = drafter.propose([PROMPTS[0] + [7], PROMPTS[1] + [7]], [4, 4])
    outside = torch.ones(vocab, dtype=torch.bool)
    outside[ids] = False
    for b, q in enumerate(block.probs):
        assert q.shape == (4, vocab) and (q[:, outside] == 0).all() and torch.allclose(q.sum(-1), torch.ones(4))
        assert set(block.tokens[b].tolist()) <= set(ids)


def test_long_prompt_rows_are_prompt_lookup_without_the_draft_model():
    """Every prompt longer than the limit: no draft forward at all, and the blocks of prompt lookup
    with γ = ``LONG_PROMPT_BLOCK`` (γ is 8 here)."""
    target = make_tiny_model("mistral", num_layers=3)
    draft = perturbed_copy(target, noise=0.3, seed=1)
    prompts = [p for p in PROMPTS if len(p) > 2]
    configs = _configs()[: len(prompts)]
    cascade = CascadeDrafter(draft, max_model_prompt_tokens=2)
    dec = BatchedSpeculativeDecoder(target, cascade, max_batch_size=3, max_length=96, num_speculative_tokens=8)
    got = [r.token_ids for r in dec.generate(prompts, configs)]
    lookup = BatchedSpeculativeDecoder(target, PromptLookupDrafter(), max_batch_size=3, max_length=96,
                                       num_speculative_tokens=LONG_PROMPT_BLOCK)
    reference = [r.token_ids for r in lookup.generate(prompts, configs)]
    assert got == reference == _alone(target, prompts, configs)
    assert cascade.num_forwards == 0
    assert (dec.stats.num_drafted_tokens, dec.stats.num_accepted_tokens) == (
        lookup.stats.num_drafted_tokens, lookup.stats.num_accepted_tokens)
    assert cascade.num_ngram_tokens == dec.stats.num_drafted_tokens > 0


def test_adaptive_exit_both_rules():
    target = make_tiny_model("gemma3", num_layers=3)
    draft = perturbed_copy(target, noise=0.3, seed=1)
    configs = _configs()
    expected = _alone(target, PROMPTS, configs)
    for rule in ("row", "batch"):
        drafter = CascadeDrafter(draft, max_model_prompt_tokens=LONG)
        dec = BatchedSpeculativeDecoder(target, drafter, max_batch_size=3, max_length=96,
                                        draft_control=DraftControl(adaptive_exit=True, max_draft_tokens=6),
                                        exit_rule=rule)
        assert _continuous(dec, PROMPTS, configs) == expected, rule
        assert drafter.num_ngram_accepted > 0, rule


def test_static_fast_path_greedy_equals_target_alone():
    """The fast path's static mode (buckets, padding rows, no torch.compile) on a sliding-window model."""
    target = make_tiny_model("mistral", num_layers=3)
    draft = perturbed_copy(target, noise=0.3, seed=1)
    configs = _configs()
    expected = _alone(target, PROMPTS, configs)
    for check in (True, False):
        drafter = CascadeDrafter(draft, ngram_check=check, max_model_prompt_tokens=LONG)
        dec = BatchedSpeculativeDecoder(target, drafter, max_batch_size=3, max_length=96, num_speculative_tokens=4,
                                        compile=True, graphs=False)
        assert _continuous(dec, PROMPTS, configs) == expected, check
        assert dec.runner.num_eager_forwards == 0
        assert drafter.num_ngram_accepted > 0


class _Recording(CascadeDrafter):
    """Keeps each block with its rows' n-gram token counts (the leading tokens of each row)."""

    def __init__(self, *a, **k) -> None:
        super().__init__(*a, **k)
        self.blocks = []

    def propose(self, sequences, max_tokens, exits=None, exit_rule="row"):
        draft = super().propose(sequences, max_tokens, exits, exit_rule)
        self.blocks.append(([m for _, m in self._last], draft))
        return draft


def test_sampling_rows_run_with_one_hot_rows_for_ngram_tokens():
    """Sampling (fixed seeds) and greedy rows together: reproducible output; a sampling row's probs
    have one-hot rows at its n-gram tokens, then the draft model's distributions."""
    target = make_tiny_model("llama", num_layers=3)
    draft = perturbed_copy(target, noise=0.3, seed=1)
    configs = [GenerationConfig(max_new_tokens=m, temperature=1.0, seed=i) for i, m in enumerate(LENGTHS)]
    configs[3] = GenerationConfig(max_new_tokens=LENGTHS[3])  # a greedy row among them
    runs = []
    for _ in range(2):
        drafter = _Recording(draft, ngram_check=False)
        dec = BatchedSpeculativeDecoder(target, drafter, max_batch_size=3, max_length=96, num_speculative_tokens=4)
        runs.append([r.token_ids for r in dec.generate(PROMPTS, configs)])
        assert [len(out) for out in runs[-1]] == LENGTHS
    assert runs[0] == runs[1]
    for ngram, block in drafter.blocks:
        for b, m in enumerate(ngram):
            q = block.probs[b] if block.probs is not None else None
            if q is None:
                continue
            k = block.num_tokens[b]
            assert q.shape[0] == k and torch.allclose(q.sum(-1), torch.ones(k))
            one_hot = torch.zeros(m, q.shape[1]).scatter_(1, block.tokens[b, :m].unsqueeze(1), 1.0)
            assert torch.equal(q[:m], one_hot)
    assert drafter.num_ngram_tokens > 0


def test_sampling_rows_keep_the_target_law():
    """Two sampling rows of one batch (temperatures 0.5 and 1.5), unchecked n-gram tokens (one-hot q)
    and the draft model's, one row long (n-gram matches alone): each row's first three tokens follow
    the target's law at its own temperature (``selfspec_helpers.violations``, with a negative control)."""
    vocab, n = 8, 400
    model, draft, prompts = spread_pair(vocab)
    base = GenerationConfig(max_new_tokens=6, stop_on_eos=False)  # 6: blocks of n-gram and model tokens
    temps = (0.5, 1.5)
    drafter = CascadeDrafter(draft, ngram_check=False, max_model_prompt_tokens=5)
    dec = BatchedSpeculativeDecoder(model, drafter, max_batch_size=2, max_length=32, num_speculative_tokens=3)
    firsts = [torch.zeros((n, 3), dtype=torch.long) for _ in temps]
    for i in range(n):
        configs = [dataclasses.replace(base, temperature=t, seed=1000 * r + i) for r, t in enumerate(temps)]
        for r, res in enumerate(dec.generate(prompts, configs)):
            firsts[r][i] = torch.tensor(res.token_ids[:3])
    assert 0 < dec.stats.num_accepted_tokens < dec.stats.num_drafted_tokens
    assert 0 < drafter.num_ngram_accepted < drafter.num_ngram_tokens
    for r, t in enumerate(temps):
        config = dataclasses.replace(base, temperature=t)
        freq = {f"x{j + 1}": torch.bincount(firsts[r][:, j], minlength=vocab).double() / n for j in range(3)}
        freq["x1x2"] = torch.bincount(firsts[r][:, 0] * vocab + firsts[r][:, 1], minlength=vocab**2).double().view(
            vocab, vocab
        ) / n
        assert violations(exact_marginals(model, prompts[r], config, vocab), freq, n) == [], f"row {r}"
        other = dataclasses.replace(base, temperature=temps[1 - r])  # negative control
        assert violations(exact_marginals(model, prompts[r], other, vocab), freq, n) != [], f"row {r}"


def test_a_sampling_block_is_one_hot_ngram_rows_then_the_draft_models_distributions():
    target = make_tiny_model("llama", num_layers=2)
    draft = perturbed_copy(target, noise=0.3, seed=1)
    vocab = target.config.vocab_size
    drafter = CascadeDrafter(draft, ngram_check=False)
    drafter.bind(BatchKVCache(target, 2, 64))
    sequences = [[7, 8, 9, 7], [5, 6, 11, 12]]  # row 0's match gives [8, 9, 7]; row 1 has none
    for slot, sequence in enumerate(sequences):  # the engine's join: the prompt, its next token not yet cached
        drafter.join(slot, torch.tensor([sequence[:-1]]), Sampler(GenerationConfig(temperature=1.0, seed=slot),
                                                                   vocab, "cpu"))
    block = drafter.propose(sequences, [5, 5])
    assert block.num_tokens == [5, 5] and block.tokens[0, :3].tolist() == [8, 9, 7]
    # 5 draft forwards; the 2 deferred prompt prefills are not decode-phase forwards
    assert drafter.num_ngram_tokens == 3 and drafter.num_forwards == 5
    q0, q1 = block.probs
    assert q0.shape == q1.shape == (5, vocab)
    assert torch.equal(q0[:3], torch.zeros(3, vocab).scatter_(1, torch.tensor([[8], [9], [7]]), 1.0))
    for q, tokens in ((q0[3:], block.tokens[0, 3:5]), (q1, block.tokens[1])):
        assert torch.allclose(q.sum(-1), torch.ones(q.shape[0]))
        assert (q.gather(1, tokens.unsqueeze(1)) > 0).all()  # the model part's tokens were sampled from q
        assert (q.amax(-1) < 1).all()  # distributions, not point masses
    drafter.rollback([6, 4])  # row 0 kept 2 of its n-gram tokens, row 1 none of its block
    assert drafter.num_ngram_accepted == 2


def test_bad_options_are_refused():
    draft = make_tiny_model("qwen2", num_layers=2)
    with pytest.raises(InvalidArgumentError, match="ngram_check must be True or False, got 1"):
        CascadeDrafter(draft, ngram_check=1)
    with pytest.raises(InvalidArgumentError, match="max_model_prompt_tokens=0 is out of range"):
        CascadeDrafter(draft, max_model_prompt_tokens=0)
    with pytest.raises(InvalidArgumentError, match="min_ngram"):
        CascadeDrafter(draft, max_ngram=1, min_ngram=2)
    with pytest.raises(InvalidArgumentError, match="context_window=0 is out of range"):
        CascadeDrafter(draft, context_window=0)
    with pytest.raises(InvalidArgumentError, match="context_window=-1 is out of range"):
        DraftModelDrafter(draft, context_window=-1)
