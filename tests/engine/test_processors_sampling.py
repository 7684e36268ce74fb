"""Speculative sampling with processors is distribution-exact: the statistical test of
``selfspec_helpers`` (the first three tokens' marginals and the first two's joint, each cell
within 4.5 standard errors), with a penalty and with ``min_p``, single and batched."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from transformers.generation.logits_process import LogitsProcessorList, RepetitionPenaltyLogitsProcessor

from conftest import make_tiny_model
from helpers import perturbed_copy
from selfspec_helpers import one_thread, violations  # noqa: F401 (a fixture)
from specdecode import GenerationConfig, SpeculativeDecoder
from specdecode.drafters import DraftModelDrafter
from specdecode.drafters import DraftModelDrafter
from specdecode.engine.batched import BatchedSpeculativeDecoder
from specdecode.engine.sampling import Sampler

pytestmark = pytest.mark.usefixtures("one_thread")

VOCAB, N = 8, 2000
PROMPT = [5, 3, 6, 5]
#: (V, V) cells (x1, x2) where the second token repeats the first or a prompt token.
REPEATS = (torch.eye(VOCAB) + torch.zeros(VOCAB, VOCAB).index_fill_(1, torch.tensor(sorted(set(PROMPT))), 1)).clamp(
    max=1).double()


def processed_probs(target, ids: torch.Tensor, prompt_len: int, config: GenerationConfig) -> torch.Tensor:
    """(m, V) sampling laws after each row's ids, written independently of ``engine.processors``:
    transformers' repetition penalty, OpenAI's frequency / presence penalties on the output, then
    ``Sampler.probs`` (temperature, top-k, top-p, min_p)."""
    logits = target(ids).logits[:, -1].float()
    if config.repetition_penalty != 1.0:
        logits = LogitsProcessorList([RepetitionPenaltyLogitsProcessor(config.repetition_penalty)])(ids, logits)
    out = ids[:, prompt_len:]
    counts = torch.zeros(ids.shape[0], VOCAB).scatter_add_(1, out, torch.ones(out.shape, dtype=torch.float))
    logits = logits - counts * config.frequency_penalty - (counts > 0).float() * config.presence_penalty
    return Sampler(config, VOCAB, "cpu").probs(logits).double()


def exact_marginals(target, config: GenerationConfig) -> dict[str, torch.Tensor]:
    """Exact laws of the first three tokens (marginals), the first two (joint), and "repeat": the
    probability that the second token repeats the first or a prompt token, and "x2=x1" and "x3=x2" (what
    the penalties move; x3's row in a verification block must count a drafted x2)."""
    v = torch.arange(VOCAB)
    with torch.inference_mode():
        p = torch.tensor([PROMPT])
        seq2 = torch.cat([p.repeat(VOCAB, 1), v[:, None]], 1)
        seq3 = torch.cat([seq2.repeat_interleave(VOCAB, 0), v.repeat(VOCAB)[:, None]], 1)
        p1, p2, p3 = (processed_probs(target, s, len(PROMPT), config) for s in (p, seq2, seq3))
    j12 = p1[0][:, None] * p2
    j123 = j12[:, :, None] * p3.view(VOCAB, VOCAB, VOCAB)
    return {"x1": p1[0], "x2": j12.sum(0), "x3": j123.sum((0, 1)), "x1x2": j12, "repeat": (j12 * REPEATS).sum().view(1),
            "x2=x1": j12.diagonal().sum().view(1), "x3=x2": j123.diagonal(dim1=1, dim2=2).sum().view(1)}


def frequencies(firsts: torch.Tensor) -> dict[str, torch.Tensor]:
    n = firsts.shape[0]
    freq = {f"x{j + 1}": torch.bincount(firsts[:, j], minlength=VOCAB).double() / n for j in range(3)}
    freq["x1x2"] = torch.bincount(firsts[:, 0] * VOCAB + firsts[:, 1], minlength=VOCAB * VOCAB).double().view(
        VOCAB, VOCAB) / n
    freq["repeat"] = (freq["x1x2"] * REPEATS).sum().view(1)
    freq["x2=x1"] = freq["x1x2"].diagonal().sum().view(1)
    freq["x3=x2"] = (firsts[:, 1] == firsts[:, 2]).double().mean().view(1)  # x3 is verified after a drafted x2
    return freq


@pytest.fixture(scope="module")
def models():
    target = make_tiny_model("qwen2", num_layers=1, vocab_size=VOCAB, seed=2)
    with torch.no_grad():
        target.get_output_embeddings().weight.mul_(0.25)  # spread-out distributions: rejections happen
    return target, perturbed_copy(target, noise=2.0, seed=3)


@pytest.mark.parametrize(
    "options",
    [dict(frequency_penalty=2.0, presence_penalty=1.0), dict(repetition_penalty=8.0), dict(min_p=0.75)],
    ids=["frequency-presence", "repetition", "min_p"],
)
def test_sampling_with_processors_keeps_the_processed_target_law(models, options):
    target, draft = models
    config = GenerationConfig(max_new_tokens=3, num_speculative_tokens=3, stop_on_eos=False, temperature=1.0,
                              **options)
    exact = exact_marginals(target, config)
    plain_law = exact_marginals(target, dataclasses.replace(config, repetition_penalty=1.0, frequency_penalty=0.0,
                                                            presence_penalty=0.0, min_p=0.0))
    single = SpeculativeDecoder(target, DraftModelDrafter(draft), compile=False)
    firsts = torch.zeros((N, 3), dtype=torch.long)
    drafted = accepted = 0
    for i in range(N):
        result = single.generate(PROMPT, dataclasses.replace(config, seed=10_000 + i))
        firsts[i] = torch.tensor(result.token_ids[:3])
        drafted += result.stats.num_drafted_tokens
        accepted += result.stats.num_accepted_tokens
    freq = frequencies(firsts)
    assert violations(exact, freq, N) == []
    assert violations(plain_law, freq, N) != []  # the processors change the law, and the test sees it
    assert 0 < accepted < drafted  # rejections happen: the residual distribution is exercised
    batched = BatchedSpeculativeDecoder(target, DraftModelDrafter(draft), max_batch_size=4, max_length=32,
                                        num_speculative_tokens=3, compile=False)
    results = batched.generate([PROMPT] * N, [dataclasses.replace(config, seed=20_000 + i) for i in range(N)])
    freq = frequencies(torch.tensor([r.token_ids[:3] for r in results]))
    assert violations(exact, freq, N) == []
    assert violations(plain_law, freq, N) != []
