"""``engine.sampling.Sampler.probs`` under top-p (``Sampler.nucleus_probs``): the nucleus found among a row's most
likely tokens on a CPU, or by sorting every logit, is the one transformers' ``TopPLogitsWarper`` finds, but for a
group of tied logits across the boundary, kept whole; and the CPU forms of the greedy choice, the finiteness
flags and the Exp(1) draws."""

from __future__ import annotations

import pytest
import torch

from helpers import transformers_probs
from specdecode.config import GenerationConfig
from specdecode.engine import sampling
from specdecode.engine.sampling import Sampler

SETTINGS = [dict(temperature=0.7, top_p=0.9), dict(temperature=1.0, top_p=0.5), dict(temperature=1.3, top_p=0.95),
            dict(temperature=1.0, top_k=40, top_p=0.8), dict(temperature=1.2, top_p=0.9, min_p=0.02)]


def _logits(rows: int, vocab: int, seed: int) -> torch.Tensor:
    """Rows from peaked (a nucleus of a few tokens) to flat (a nucleus of most of the vocabulary)."""
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(rows, vocab, generator=g) * torch.linspace(0.2, 4.0, rows).unsqueeze(1)
    logits[:, :5] += torch.linspace(0.0, 9.0, rows).unsqueeze(1)
    return logits


@pytest.mark.parametrize("candidates", [(8, 64), ()], ids=["most-likely-first", "sort"])
@pytest.mark.parametrize("settings", SETTINGS, ids=lambda s: "-".join(f"{k}{v}" for k, v in s.items()))
def test_the_nucleus_is_transformers_top_p_without_ties(settings, candidates, monkeypatch):
    """Same kept tokens, same probabilities (to float32 rounding) as transformers' warpers over all V logits
    (no ties here), for rows whose nucleus fits the first candidate, the second, or neither (those sort all V);
    "sort": every row sorts, as on a GPU."""
    monkeypatch.setattr(sampling, "NUCLEUS_CANDIDATES", candidates)
    V = 500
    logits = _logits(48, V, seed=1)
    want = transformers_probs(settings, logits)
    nucleus = (want > 0).sum(-1)
    got = Sampler(GenerationConfig(seed=0, **settings), V, "cpu").probs(logits)
    assert torch.equal(got > 0, want > 0)
    assert torch.allclose(got, want, atol=1e-6, rtol=1e-5)
    # every path ran: nuclei within 8 tokens, within 64, and past 64
    assert (nucleus <= 8).any() and ((nucleus > 8) & (nucleus <= 64)).any()
    if "top_k" not in settings:
        assert (nucleus > 64).any()


@pytest.mark.parametrize("candidates", [(8, 64), (2, 4), ()], ids=["within-8", "past-4", "sort"])
def test_tied_logits_across_the_boundary_are_kept_together(candidates, monkeypatch):
    """Tokens 3, 7 and 11 share a logit, and the nucleus' boundary falls inside their group: all three are
    kept, whatever the candidates (found among 8, past 4 tokens so by the sort, or sorted at once).
    transformers' warper keeps part of the group, as ``torch.sort`` orders it; the tokens above the group
    (before it, less than top_p) and below it are the same."""
    monkeypatch.setattr(sampling, "NUCLEUS_CANDIDATES", candidates)
    logits = torch.full((1, 30), -4.0)
    logits[0, 20], logits[0, [3, 7, 11]] = 2.0, 1.0  # p: about 0.46 for token 20, 0.17 each for the group
    settings = dict(temperature=1.0, top_p=0.6)
    got = Sampler(GenerationConfig(**settings), 30, "cpu").probs(logits)[0]
    assert sorted(torch.nonzero(got).flatten().tolist()) == [3, 7, 11, 20]
    assert torch.allclose(got[[3, 7, 11]], got[3].expand(3)) and torch.allclose(got.sum(), torch.tensor(1.0))
    warper = torch.nonzero(transformers_probs(settings, logits)[0]).flatten().tolist()
    assert 20 in warper and set(warper) < {3, 7, 11, 20} and len(warper) >= 2


def test_a_rows_nucleus_does_not_depend_on_its_neighbours(monkeypatch):
    """Each row gets, bit for bit, what it gets alone, whichever candidate its neighbours needed: a seeded
    request draws the same tokens in a batch as alone."""
    monkeypatch.setattr(sampling, "NUCLEUS_CANDIDATES", (8, 64))
    logits = _logits(12, 500, seed=2)
    sampler = Sampler(GenerationConfig(temperature=1.0, top_p=0.9, seed=0), 500, "cpu")
    together = sampler.probs(logits)
    for i in range(len(logits)):
        assert torch.equal(together[i], sampler.probs(logits[i:i + 1])[0]), i
    nucleus = (together > 0).sum(-1)  # rows of each path side by side
    assert (nucleus <= 8).any() and ((nucleus > 8) & (nucleus <= 64)).any() and (nucleus > 64).any()


def test_a_nan_row_and_a_row_of_one_token_keep_their_meaning(monkeypatch):
    """A NaN row stays NaN (``race`` then gives -1, the invalid-distribution error), as over the whole
    vocabulary; a row whose first token holds top_p is that token alone; the row beside them (a nucleus of 2-4
    tokens, found among its 4 most likely) is unaffected."""
    monkeypatch.setattr(sampling, "NUCLEUS_CANDIDATES", (4,))
    logits = _logits(3, 50, seed=3)
    logits[0, 10:13] = torch.tensor([9.0, 8.5, 8.0])
    logits[1] = float("nan")
    logits[2, 7] = 40.0
    logits = torch.cat([logits, torch.full((1, 50), -float("inf"))])  # a row every processor masked: NaN too
    sampler = Sampler(GenerationConfig(temperature=1.0, top_p=0.9, seed=0), 50, "cpu")
    got = sampler.probs(logits)
    want = transformers_probs(dict(temperature=1.0, top_p=0.9), logits)
    assert torch.isnan(got[1]).all() and torch.isnan(want[1]).all()
    assert torch.isnan(got[3]).all() and torch.isnan(want[3]).all()
    assert torch.equal(got[2], torch.nn.functional.one_hot(torch.tensor(7), 50).float())
    assert torch.allclose(got[0], want[0], atol=1e-6) and torch.equal(got[0] > 0, want[0] > 0)
    assert 2 <= int((got[0] > 0).sum()) <= 4
    assert sampler.sample(got[1:2]).tolist() == [-1]


def test_the_nucleus_path_is_used_under_top_p_only(monkeypatch):
    """``probs`` takes ``nucleus_probs`` under top-p (on every device), and not without top-p or when greedy."""
    calls = []
    original = Sampler.nucleus_probs

    def spied(self, scores):
        calls.append(scores.shape)
        return original(self, scores)

    monkeypatch.setattr(Sampler, "nucleus_probs", spied)
    logits = _logits(2, 100, seed=4)
    Sampler(GenerationConfig(temperature=0.8, top_p=0.9), 100, "cpu").probs(logits)
    assert calls == [(2, 100)]
    Sampler(GenerationConfig(temperature=0.8, top_k=5), 100, "cpu").probs(logits)
    Sampler(GenerationConfig(temperature=0.0, top_p=0.9), 100, "cpu").probs(logits)
    assert calls == [(2, 100)]


def test_exponential_draws_are_torchs_own_on_a_cpu():
    """``Sampler.exponential`` fills what ``Tensor.exponential_`` gives with the same generator, bit for bit, and
    leaves the generator where it leaves it: seeded tokens do not change with the faster method. If a torch
    release changes its CPU method, this fails and the docstring's claim must go."""
    for seed, shape in ((0, (3, 1000)), (1, (7,)), (2, (2, 151936))):
        sampler = Sampler(GenerationConfig(temperature=1.0, seed=seed), 10, "cpu")
        reference = torch.Generator().manual_seed(seed)
        out = torch.empty(shape)
        assert sampler.exponential(out) is out
        assert torch.equal(out, torch.empty(shape).exponential_(generator=reference))
        assert torch.equal(sampler.generator.get_state(), reference.get_state())
    row = torch.zeros(3, 50)  # a row of a larger tensor, in place (``draw_tokens`` draws a seeded row so)
    Sampler(GenerationConfig(temperature=1.0, seed=4), 10, "cpu").exponential(row[1])
    assert torch.equal(row[1], torch.empty(50).exponential_(generator=torch.Generator().manual_seed(4)))
    assert not row[0].any() and not row[2].any()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_greedy_tokens_and_finite_rows_are_argmax_and_isfinite(dtype):
    """``greedy_tokens`` and ``finite_rows`` (their CPU forms: ``max(-1).indices``, and the largest and smallest
    logits) give what ``argmax`` and ``isfinite(...).all(-1)`` give: on ties (the first of equal values, common
    in bfloat16), NaN (taken as the largest), +inf and -inf, in 2-d and 3-d. Eagerly: inside the compiled bucket
    functions (``--compile`` on a CPU) they are inductor's; the fast-path tests compare those runs' tokens with
    eager decoding."""
    g = torch.Generator().manual_seed(5)
    logits = (torch.randn(4, 6, 3000, generator=g) * 4).to(dtype)
    logits[0, :, 17] = logits[0, :, 2900] = 40.0  # tied maxima: the first one
    logits[1, 2, 50] = float("nan")
    logits[1, 3, 60] = float("inf")
    logits[1, 4, 70] = -float("inf")
    logits[2, 0, 5] = logits[2, 0, 9] = float("nan")
    for x in (logits, logits[:, 0], logits[1]):
        assert torch.equal(sampling.greedy_tokens(x), x.argmax(-1))
        assert torch.equal(sampling.finite_rows(x), torch.isfinite(x).all(-1))
    assert sampling.greedy_tokens(logits)[0].tolist() == [17] * 6
    assert sampling.finite_rows(logits[1]).tolist() == [True, True, False, False, False, True]


@pytest.mark.parametrize("settings", [dict(temperature=0.8, top_p=0.9), dict(temperature=0.8, top_p=0.9, top_k=20,
                                                                              min_p=0.05)], ids=["top-p", "all"])
def test_off_a_cpu_top_p_reads_nothing_back(settings):
    """Off a CPU every row sorts, and nothing is read back to decide it: on ``meta`` tensors, where any read of
    a value (``bool``, ``item``, ``tolist``) raises, ``probs`` under top-p still gives its (m, V) shape. The
    CPU's candidates read a flag per K, so taking them off a CPU fails this."""
    sampler = Sampler(GenerationConfig(**settings), 1000, "cpu")
    q = sampler.probs(torch.empty(6, 1000, device="meta"))
    assert q.shape == (6, 1000) and q.device.type == "meta" and q.dtype == torch.float32
    with pytest.raises(Exception):  # noqa: B017 -- what a value read on meta does (the error type varies)
        bool(torch.empty(3, device="meta").all())
