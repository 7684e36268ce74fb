"""Speculative sampling must be distributed exactly as target sampling (statistical tests).

Tolerances come from the sample size: each cell's frequency must lie within
Z standard errors sqrt(p (1 - p) / N) of its exact probability, with Z = 4.5
(a per-cell false alarm rate of about 7e-6). Every test also runs a negative
control that the same tolerance rejects, so the test can fail.
"""

from __future__ import annotations

import itertools

import pytest
import torch

from conftest import make_tiny_model
from helpers import perturbed_copy, transformers_probs
from specdecode import DraftModelDrafter, GenerationConfig, SpeculativeDecoder
from specdecode.drafters import base as drafters_base
from specdecode.engine import sampling
from specdecode.engine.sampling import Sampler, draw_tokens, safe_logits, warped_probs
from specdecode.engine.verification import (VerificationResult as R, greedy_verify, rejection_sample,
                                            rejection_sample_rows)
from specdecode.errors import InvalidArgumentError

Z = 4.5


def _within(freq: torch.Tensor, exact: torch.Tensor, n: int) -> bool:
    se = torch.sqrt(exact * (1 - exact) / n).clamp_min(1.0 / n)
    return bool(((freq - exact).abs() <= Z * se).all())


def test_greedy_verify_prefix_and_bonus():
    assert greedy_verify([5, 6, 7], [5, 6, 7, 9]) == R(3, 9)
    assert greedy_verify([5, 6, 7], [5, 8, 7, 9]) == R(1, 8)
    assert greedy_verify([5], [4, 1]) == R(0, 4)


@pytest.mark.parametrize("deterministic", [False, True])
def test_rejection_sample_first_token_law(deterministic):
    """Token emitted at the first draft position ~ p, whatever q is."""
    V, N = 6, 30000
    p = torch.tensor([[0.05, 0.40, 0.05, 0.30, 0.10, 0.10], [0.2, 0.2, 0.2, 0.2, 0.1, 0.1]])
    q = torch.tensor([[0.30, 0.10, 0.30, 0.10, 0.10, 0.10]])
    sampler = Sampler(GenerationConfig(temperature=1.0, seed=0), V, "cpu")
    counts = torch.zeros(V)
    drafted = torch.zeros(V)
    fixed = torch.tensor([2])  # a deterministic drafter always proposes token 2
    for _ in range(N):
        d = fixed if deterministic else sampler.sample(q)
        drafted[d] += 1
        res = rejection_sample(d, None if deterministic else q, p, sampler)
        counts[d[0] if res.num_accepted == 1 else res.next_token] += 1
    assert _within(counts / N, p[0], N)
    # Negative control: the drafted tokens alone follow q (or a point mass), not p.
    assert not _within(drafted / N, p[0], N)


def test_bonus_token_law_when_all_accepted():
    """With q == p every draft is accepted and the bonus token follows p_gamma."""
    V, N = 5, 20000
    p = torch.tensor([[0.2, 0.2, 0.2, 0.2, 0.2], [0.5, 0.1, 0.1, 0.1, 0.2]])
    sampler = Sampler(GenerationConfig(temperature=1.0, seed=1), V, "cpu")
    counts = torch.zeros(V)
    for _ in range(N):
        d = sampler.sample(p[:1])
        res = rejection_sample(d, p[:1], p, sampler)
        assert res.num_accepted == 1
        counts[res.next_token] += 1
    assert _within(counts / N, p[1], N)
    assert not _within(counts / N, p[0], N)


def _exact_joint(target, prompt: torch.Tensor, config: GenerationConfig, steps: int) -> dict:
    """Exact probability of every token sequence of length ``steps`` under target sampling."""
    sampler = Sampler(config, target.config.vocab_size, "cpu")
    V = target.config.vocab_size
    joint = {}
    with torch.inference_mode():
        for seq in itertools.product(range(V), repeat=steps - 1):
            ids = torch.cat([prompt, torch.tensor([seq], dtype=torch.long)], dim=1)
            probs = sampler.probs(target(ids).logits[0, prompt.shape[1] - 1 :])
            prefix = 1.0
            for i, t in enumerate(seq):
                prefix *= float(probs[i, t])
            if prefix == 0.0:
                continue
            for t in range(V):
                joint[(*seq, t)] = prefix * float(probs[-1, t])
    return joint


def _verified_cells(exact: dict) -> tuple[list, torch.Tensor]:
    """The marginal laws of the 2nd and 3rd tokens (which come out of verification) and of their pair,
    from ``_exact_joint``: the cells, in a fixed order, and their probabilities."""
    cells = {}
    for seq, pr in exact.items():
        for pos in (1, 2):
            cells[(pos, seq[pos])] = cells.get((pos, seq[pos]), 0.0) + pr
        cells[("pair", seq[1], seq[2])] = cells.get(("pair", seq[1], seq[2]), 0.0) + pr
    keys = sorted(cells, key=str)
    return keys, torch.tensor([cells[k] for k in keys])


@pytest.mark.parametrize(
    "temperature,top_k,top_p,nucleus", [(1.0, 0, 1.0, False), (0.7, 5, 1.0, False), (1.3, 0, 0.85, False),
                                        (1.3, 0, 0.85, True)],
    ids=["t1", "t0.7-topk5", "t1.3-topp", "t1.3-topp-nucleus"]
)
def test_speculative_sampling_matches_target_distribution(temperature, top_k, top_p, nucleus, monkeypatch):
    """Tokens 2 and 3 (verified) follow the target's exact law; "nucleus": the decoder's p and q under top-p come
    from ``Sampler.nucleus_probs`` over each row's 6, then 7, most likely tokens (a spy checks that the first count
    placed some rows and left others), while the exact law is computed with transformers' ``TopPLogitsWarper``
    over all 8 (float32 logits: no ties, so the two rules agree); "t1.3-topp": every row sorts all 8, as on a
    GPU."""
    found = []
    monkeypatch.setattr(sampling, "NUCLEUS_CANDIDATES", (6, 7) if nucleus else ())
    if nucleus:
        topk = torch.Tensor.topk

        def spied(self, k, *args, **kwargs):  # the nucleus' candidates: how many rows each count looked at
            found.append((k, self.shape[0]))
            return topk(self, k, *args, **kwargs)

        monkeypatch.setattr(torch.Tensor, "topk", spied)
    V, N, steps = 8, 2000, 3
    target = make_tiny_model("llama", num_layers=1, vocab_size=V, hidden_size=16, intermediate_size=32)
    with torch.no_grad():
        target.get_output_embeddings().weight.mul_(0.25)  # keep distributions spread out
    draft = perturbed_copy(target, noise=2.0, seed=3)
    prompt = torch.tensor([[3, 5, 4]])
    base = dict(temperature=temperature, top_k=top_k, top_p=top_p, max_new_tokens=steps, stop_on_eos=False)
    with monkeypatch.context() as whole:  # transformers' warpers over all V
        whole.setattr(Sampler, "probs", lambda self, logits: transformers_probs(base, logits))
        exact = _exact_joint(target, prompt, GenerationConfig(**base), steps)
    found.clear()
    keys, want = _verified_cells(exact)

    dec = SpeculativeDecoder(target, DraftModelDrafter(draft))
    counts = torch.zeros(len(keys))
    index = {k: i for i, k in enumerate(keys)}
    rates = []
    for seed in range(N):
        res = dec.generate(prompt, GenerationConfig(**base, seed=seed, num_speculative_tokens=2))
        s = res.token_ids
        counts[index[(1, s[1])]] += 1
        counts[index[(2, s[2])]] += 1
        counts[index[("pair", s[1], s[2])]] += 1
        rates.append(res.stats.acceptance_rate)
    # Negative control: the draft's own law, which speculative sampling must not follow.
    draft_law = torch.zeros(len(keys))
    for seq, pr in _exact_joint(draft, prompt, GenerationConfig(**base), steps).items():
        draft_law[index[(1, seq[1])]] += pr
        draft_law[index[(2, seq[2])]] += pr
        draft_law[index[("pair", seq[1], seq[2])]] += pr
    mean_rate = sum(r for r in rates if r is not None) / len(rates)
    assert 0.05 < mean_rate < 0.95, "the draft must be rejected often for this test to mean anything"
    assert _within(counts / N, want, N)
    assert not _within(draft_law, want, N)
    if nucleus:  # rows whose nucleus the first count held, and rows that needed the second
        rows = {k: sum(r for kk, r in found if kk == k) for k in (6, 7)}
        assert rows[6] > rows[7] > 0, rows


def test_warped_probs_gives_each_row_its_own_distribution():
    """Rows warped together (``warped_probs``, grouped by their settings) get exactly what each gets alone:
    (m, V) and (m, T, V) logits, two groups and one, and a truncated head's K columns."""
    V = 40
    configs = [GenerationConfig(temperature=0.7, top_p=0.8), GenerationConfig(temperature=1.3, top_k=5),
               GenerationConfig(temperature=0.7, top_p=0.8), GenerationConfig(temperature=1.0, min_p=0.1)]
    samplers = [Sampler(c, V, "cpu") for c in configs]
    gen = torch.Generator().manual_seed(0)
    for shape in ((4, V), (4, 3, V)):
        logits = torch.randn(shape, generator=gen) * 3
        for rows in (samplers, [samplers[0], samplers[2]]):
            got = warped_probs(rows, logits[: len(rows)])
            for i, sampler in enumerate(rows):
                alone = sampler.probs(logits[i].reshape(-1, V)).view(got[i].shape)
                assert torch.equal(got[i], alone), (shape, i)
    ids = torch.tensor([3, 7, 11, 20, 39])
    head = torch.randn((4, 5), generator=gen)
    got = warped_probs(samplers, head, ids)
    assert got.shape == (4, V)
    for i, sampler in enumerate(samplers):
        assert torch.equal(got[i], sampler.probs_over(head[i : i + 1], ids)[0])


def test_safe_logits_zeroes_only_positions_that_were_not_finite():
    """A position whose raw logits had a NaN becomes zeros (a safe, uniform draw; the round's flag drops it);
    a finite one stays as it is after its processors, their -inf mask included."""
    raw = torch.tensor([[[0.5, 1.5, 2.0], [float("nan"), 1.0, 1.0]]])
    finite = torch.isfinite(raw).all(-1)  # (1, 2): before the processors
    processed = raw.clone()
    processed[0, 0, 1] = float("-inf")  # a processor masks a token
    out = safe_logits(processed, finite)
    assert torch.equal(out[0, 0], processed[0, 0])
    assert torch.equal(out[0, 1], torch.zeros(3))
    assert torch.equal(safe_logits(processed[0], finite[0]), out[0])  # (T, V) with (T,) flags


def _algorithm_1_law(uniforms: torch.Tensor | None, p: torch.Tensor, drafted: torch.Tensor,
                     q: torch.Tensor | None) -> tuple[int, torch.Tensor]:
    """Leviathan et al. 2022, Algorithm 1, for one row, written plainly as the reference, up to the last draw:
    given its k uniforms, the first n with u_n q_n(d_n) >= p_n(d_n) is rejected, and the next token's law is
    norm(max(0, p_n - q_n)) (a one-hot q for None; p_n itself when that has no mass) or, all accepted, p_k.
    Returns n and that (V,) law."""
    k, n = drafted.shape[0], 0
    while n < k and uniforms[n] * (1.0 if q is None else q[n, drafted[n]]) < p[n, drafted[n]]:
        n += 1
    law = p[n]
    if n < k:
        residual = (p[n] - (torch.nn.functional.one_hot(drafted[n], p.shape[-1]) if q is None else q[n])).clamp_min(0)
        law = residual / residual.sum() if residual.sum() > 0 else p[n] / p[n].sum()
    return n, law


def _algorithm_1(sampler: Sampler, p: torch.Tensor, drafted: torch.Tensor, q: torch.Tensor | None) -> list[int]:
    """``_algorithm_1_law`` with k uniforms from the sampler's generator, then the token drawn from the law.
    Returns [accepted draft tokens, next token]."""
    k = drafted.shape[0]
    n, law = _algorithm_1_law(sampler.uniform(k, torch.device("cpu")) if k else None, p, drafted, q)
    return [n, int(sampler.sample(law.view(1, -1))[0])]


def _row_case(generator: torch.Generator, m: int, gamma: int, vocab: int, full: bool = False):
    """Random target distributions (m, γ + 1, V), drafted tokens, block lengths 0..γ, and per row a q (k_j, V),
    None (one-hot; half of these rows draft p's most likely tokens, so that some are all accepted), q equal to p
    (every token accepted), or q equal to p with p(d) = q(d) = 0 at the last drafted token d: rejected there with
    a residual max(0, p - q) of no mass, so the token is drawn from p itself (the residual's p == q fallback
    decides it). ``full``: every block length is γ."""
    probs = torch.softmax(torch.randn(m, gamma + 1, vocab, generator=generator) * 2.0, -1)
    ks = torch.randint(0, gamma + 1, (m,), generator=generator).tolist()
    ks = [gamma] * m if full else ks
    drafted = torch.randint(0, vocab, (m, gamma), generator=generator)
    qs = []
    for j, k in enumerate(ks):
        kind = int(torch.randint(0, 4, (1,), generator=generator))
        q = torch.softmax(torch.randn(k, vocab, generator=generator) * 2.0, -1)
        if kind == 0 and int(torch.randint(0, 2, (1,), generator=generator)):  # a lookup that found p's mode
            drafted[j, :k] = probs[j, :k].argmax(-1)
        if kind == 3 and k:
            probs[j, k - 1, drafted[j, k - 1]] = 0.0
            probs[j, k - 1] /= probs[j, k - 1].sum()
        qs.append(None if kind == 0 else q if kind == 1 else probs[j, :k].clone())
    return probs, ks, drafted, qs


@pytest.mark.parametrize("layout", ["rows", "block"])
def test_rejection_sample_rows_draws_what_each_row_draws_alone(layout):
    """The batched rejection sampler gives every row, bit for bit, the verdict a plain Algorithm 1 gives it alone
    with the same seed (``_algorithm_1``), and leaves each generator where that leaves it (the same draws, in the
    same order): a seed's tokens do not depend on the batch, and the vectorized acceptance, residual and bonus
    law are Algorithm 1's. Rows of every kind: block lengths 0..γ (every third batch all γ, the path without a
    mask), a draft's q, a one-hot q (prompt lookup; "rows" only), q = p, and q = p rejected with a residual of no
    mass (p itself is drawn from); the q's given per row or as one block (``Draft.probs_block``) whose positions
    past k_j hold other distributions (never read)."""
    generator = torch.Generator().manual_seed(5)
    vocab, outcomes, no_mass = 12, set(), 0
    for trial in range(150):
        m = int(torch.randint(1, 6, (1,), generator=generator))
        gamma = int(torch.randint(0, 5, (1,), generator=generator))
        probs, ks, drafted, qs = _row_case(generator, m, gamma, vocab, full=trial % 3 == 0)
        config = [GenerationConfig(temperature=1.0, seed=1000 * trial + j) for j in range(m)]
        batched = [Sampler(c, vocab, "cpu") for c in config]
        alone = [Sampler(c, vocab, "cpu") for c in config]
        given = qs
        if layout == "block":
            given = torch.softmax(torch.randn(m, gamma + 1, vocab, generator=generator), -1)  # one more: unread
            qs = [given[j, : ks[j]] if q is None else q for j, q in enumerate(qs)]
            for j, q in enumerate(qs):
                given[j, : ks[j]] = q
        verdicts, failed = rejection_sample_rows(batched, probs, drafted, ks, given)
        assert not failed and verdicts.shape == (m, 2)
        for j in range(m):
            expected = _algorithm_1(alone[j], probs[j, : ks[j] + 1], drafted[j, : ks[j]], qs[j])
            assert verdicts[j].tolist() == expected, (trial, j, ks[j])
            assert torch.equal(batched[j].generator.get_state(), alone[j].generator.get_state()), (trial, j)
            n = expected[0]
            outcomes.add((qs[j] is None, min(n, 1), n == ks[j]))
            no_mass += qs[j] is not None and n < ks[j] and not float((probs[j, n] - qs[j][n]).clamp_min(0).sum())
    # one-hot ("rows" only) and q rows; rejected at once, later, and fully accepted; residuals of no mass
    kinds = (False, True) if layout == "rows" else (False,)
    assert outcomes == set(itertools.product(kinds, (0, 1), (False, True))), outcomes
    assert no_mass >= 10, no_mass


@pytest.mark.parametrize("layout", ["rows", "block"])
def test_rows_sharing_one_generator_draw_what_one_draw_over_them_gives(layout):
    """Rows whose samplers share one generator (requests without a seed) and which all drafted γ draw their m·γ
    uniforms in one call and their m tokens in one call, the uniforms laid out row by row as drawn (the path
    with no mask and no placing of the draws): every row's verdict equals a plain Algorithm 1 over the same
    uniforms and the same noise, and the generator ends where one such pair of draws leaves it."""
    generator = torch.Generator().manual_seed(6)
    vocab, outcomes = 12, set()
    for trial in range(60):
        m = int(torch.randint(2, 6, (1,), generator=generator))
        gamma = int(torch.randint(1, 5, (1,), generator=generator))
        probs, ks, drafted, qs = _row_case(generator, m, gamma, vocab, full=True)
        given = qs
        if layout == "block":
            qs = [torch.softmax(torch.randn(gamma, vocab, generator=generator), -1) if q is None else q for q in qs]
            given = torch.stack(qs)
        shared, alone = (torch.Generator().manual_seed(100 + trial) for _ in range(2))
        samplers = [Sampler(GenerationConfig(temperature=1.0), vocab, "cpu", generator=shared) for _ in range(m)]
        verdicts, failed = rejection_sample_rows(samplers, probs, drafted, ks, given)
        reference = Sampler(GenerationConfig(temperature=1.0), vocab, "cpu", generator=alone)
        uniforms = reference.uniform(m * gamma, torch.device("cpu")).view(m, gamma)
        decided = [_algorithm_1_law(uniforms[j], probs[j], drafted[j], qs[j]) for j in range(m)]
        tokens = reference.sample(torch.stack([law for _, law in decided]))
        assert not failed
        assert verdicts.tolist() == [[n, int(t)] for (n, _), t in zip(decided, tokens)], trial
        assert torch.equal(shared.get_state(), alone.get_state()), trial
        outcomes.update(min(n, 1) + (n == gamma) for n, _ in decided)
    assert outcomes == {0, 1, 2}, outcomes  # rejected at once, later, and all accepted


def test_rejection_sample_rows_first_token_law_and_refusals():
    """Statistical: in one batch, a row with a draft's q and a one-hot row each emit first tokens distributed as
    their own p (negative control: the drafted tokens follow q). Bad block lengths, row counts and q shapes are
    refused by name."""
    V, N = 6, 20000
    p = torch.tensor([[[0.05, 0.40, 0.05, 0.30, 0.10, 0.10], [0.2, 0.2, 0.2, 0.2, 0.1, 0.1]],
                      [[0.30, 0.05, 0.25, 0.10, 0.20, 0.10], [0.1, 0.1, 0.1, 0.1, 0.3, 0.3]]])
    q = torch.tensor([[0.30, 0.10, 0.30, 0.10, 0.10, 0.10]])
    samplers = [Sampler(GenerationConfig(temperature=1.0, seed=s), V, "cpu") for s in (3, 4)]
    counts, drafted_counts = torch.zeros(2, V), torch.zeros(V)
    for _ in range(N):
        d = samplers[0].sample(q)
        drafted_counts[d] += 1
        drafted = torch.stack([d, torch.tensor([2])])  # row 1: a deterministic drafter proposing token 2
        verdicts, _ = rejection_sample_rows(samplers, p, drafted, [1, 1], [q, None])
        for j, (accepted, token) in enumerate(verdicts.tolist()):
            counts[j, drafted[j, 0] if accepted else token] += 1
    assert _within(counts[0] / N, p[0, 0], N) and _within(counts[1] / N, p[1, 0], N)
    assert not _within(drafted_counts / N, p[0, 0], N)
    with pytest.raises(InvalidArgumentError, match=r"block lengths \[1, 2\] must lie in 0..1"):
        rejection_sample_rows(samplers, p, torch.zeros((2, 1), dtype=torch.long), [1, 2], None)
    with pytest.raises(InvalidArgumentError, match=r"cut \(1,\) for 2 rows: must be \(2,\)"):
        rejection_sample_rows(samplers, p, torch.zeros((2, 1), dtype=torch.long), [1, 1], None, cut=torch.ones(1))
    with pytest.raises(InvalidArgumentError, match=r"1 samplers, 2 block lengths and drafted \(2, 1\)"):
        rejection_sample_rows(samplers[:1], p, torch.zeros((2, 1), dtype=torch.long), [1, 1], None)
    with pytest.raises(InvalidArgumentError, match=r"draft_probs \[\(0, 6\), None\] for block lengths \[1, 1\]"):
        rejection_sample_rows(samplers, p, torch.zeros((2, 1), dtype=torch.long), [1, 1], [q[:0], None])
    with pytest.raises(InvalidArgumentError, match=r"draft_probs \[None\] for block lengths \[1, 1\] over 6"):
        rejection_sample_rows(samplers, p, torch.zeros((2, 1), dtype=torch.long), [1, 1], [None])
    with pytest.raises(InvalidArgumentError, match=r"draft_probs \(2, 1, 5\) for 2 rows of up to 1 drafted tokens"):
        rejection_sample_rows(samplers, p, torch.zeros((2, 1), dtype=torch.long), [1, 1], torch.ones(2, 1, 5))
    with pytest.raises(InvalidArgumentError, match=r"draft_tokens \(1, 1\) must be \(γ,\)"):
        rejection_sample(torch.zeros((1, 1), dtype=torch.long), None, p[0], samplers[0])


@pytest.mark.parametrize("method, broken_row, seed, ks", [("exponential", 1, 9, [2, 1, 2]),
                                                         ("uniform", 0, 11, [2, 2, 1])])
def test_rejection_sample_rows_fails_only_the_row_whose_draws_raise(method, broken_row, seed, ks):
    """A row whose draw of its token (``exponential``) or of its uniforms (``uniform``) raises is left out and reported
    (``contain_errors``); the others get what they get alone. Without ``contain_errors`` the error propagates."""
    generator = torch.Generator().manual_seed(seed)
    probs, _, drafted, _ = _row_case(generator, 3, 2, 8)
    samplers = [Sampler(GenerationConfig(temperature=1.0, seed=s), 8, "cpu") for s in range(3)]
    alone = [Sampler(GenerationConfig(temperature=1.0, seed=s), 8, "cpu") for s in range(3)]

    def broken(*args):
        raise RuntimeError(f"{method} failed")

    setattr(samplers[broken_row], method, broken)
    verdicts, failed = rejection_sample_rows(samplers, probs, drafted, ks, None, contain_errors=True)
    assert list(failed) == [broken_row] and str(failed[broken_row]) == f"{method} failed"
    others = [j for j in range(3) if j != broken_row]
    expected = [_algorithm_1(alone[j], probs[j, : ks[j] + 1], drafted[j, : ks[j]], None) for j in others]
    assert verdicts.tolist() == expected
    with pytest.raises(RuntimeError, match=f"{method} failed"):
        rejection_sample_rows(samplers, probs, drafted, ks, None)


def test_rows_sharing_a_generator_are_drawn_together_and_keep_their_laws():
    """Statistical: rows whose samplers share a generator (requests without a seed) draw their uniforms in one
    call and their tokens in one call, and each still emits first tokens distributed as its own p, with a seeded
    row between them (so the shared draws are placed back row by row). Negative control: a row's counts against
    another row's p."""
    V, N = 6, 20000
    p = torch.tensor([[[0.05, 0.40, 0.05, 0.30, 0.10, 0.10], [0.2, 0.2, 0.2, 0.2, 0.1, 0.1]],
                      [[0.30, 0.05, 0.25, 0.10, 0.20, 0.10], [0.1, 0.1, 0.1, 0.1, 0.3, 0.3]],
                      [[0.10, 0.10, 0.10, 0.50, 0.10, 0.10], [0.3, 0.1, 0.1, 0.1, 0.1, 0.3]]])
    q = torch.tensor([[0.30, 0.10, 0.30, 0.10, 0.10, 0.10]])
    shared = torch.Generator().manual_seed(8)
    samplers = [Sampler(GenerationConfig(temperature=1.0, seed=s), V, "cpu", generator=shared) for s in (None, 4, None)]
    assert samplers[0].generator is samplers[2].generator is shared and samplers[1].generator is not shared
    calls = []
    for s in samplers:
        for name in ("exponential", "uniform"):  # the rows of a noise draw; the count of uniforms
            method = getattr(s, name)
            setattr(s, name, lambda *a, _m=method, _n=name: calls.append(
                (_n, (1 if a[0].dim() == 1 else a[0].shape[0]) if _n == "exponential" else a[0])) or _m(*a))
    counts = torch.zeros(3, V)
    for i in range(N):
        d = torch.multinomial(q, 1, generator=shared)[0]
        drafted = torch.stack([d, torch.tensor([2]), torch.tensor([3])])  # rows 1 and 2: one-hot q's
        calls.clear()
        verdicts, _ = rejection_sample_rows(samplers, p, drafted, [1, 1, 1], [q, None, None])
        if i == 0:  # shared: 2 uniforms, 2 tokens; seeded: 1 uniform, 1 token
            assert sorted(calls) == [("exponential", 1), ("exponential", 2), ("uniform", 1), ("uniform", 2)], calls
        for j, (accepted, token) in enumerate(verdicts.tolist()):
            counts[j, drafted[j, 0] if accepted else token] += 1
    for j in range(3):
        assert _within(counts[j] / N, p[j, 0], N), j
    assert not _within(counts[0] / N, p[2, 0], N) and not _within(counts[2] / N, p[0, 0], N)


def test_draw_tokens_places_each_rows_token_and_fails_only_a_row_whose_draw_raises():
    """``draw_tokens`` over rows in any order, a shared generator's rows in one call: each row gets the token of
    its own distribution (one-hot here, so the token is known), and a row that is not a distribution (NaN, or no
    mass) gets -1. A shared draw that raises is retried row by row, and only the row whose own draw raises is
    reported; without ``failed`` the error propagates."""
    V = 7
    shared = torch.Generator().manual_seed(0)
    samplers = [Sampler(GenerationConfig(temperature=1.0, seed=s), V, "cpu", generator=shared)
                for s in (None, 3, None, None)]
    probs = torch.eye(V)[[4, 1, 6, 2, 5]]  # row r is one-hot at probs[r].argmax()
    rows = [3, 0, 4, 1]
    assert draw_tokens(samplers, probs, rows).tolist() == [2, 4, 5, 1]
    assert draw_tokens(samplers[:1], probs[3:4]).tolist() == [2]
    invalid = probs.clone()
    invalid[4], invalid[0] = float("nan"), 0.0
    assert draw_tokens(samplers, invalid, rows).tolist() == [2, -1, -1, 1]
    shared_draw = samplers[0].exponential

    def breaks(out):  # every call: the shared one (rows 0, 2, 3), then row 0's own retry
        raise RuntimeError("exponential failed")

    samplers[0].exponential = breaks
    failed: dict[int, Exception] = {}
    tokens = draw_tokens(samplers, probs, rows, failed)
    assert list(failed) == [0] and str(failed[0]) == "exponential failed"
    assert [t for i, t in enumerate(tokens.tolist()) if i != 0] == [4, 5, 1]
    with pytest.raises(RuntimeError, match="exponential failed"):
        draw_tokens(samplers, probs, rows)
    samplers[0].exponential = shared_draw


@pytest.mark.parametrize("broken", [[0], [0, 1, 2, 3]])
@pytest.mark.parametrize("ks, seeds", [([2, 1, 2, 1], (None, 5, None, None)), ([2, 2, 2, 2], (None,) * 4)],
                         ids=["mixed", "one-generator"])
def test_a_shared_uniform_draw_that_raises_is_retried_row_by_row(broken, ks, seeds):
    """"mixed": rows 0, 2 and 3 share a generator, row 1 is seeded; "one-generator": all four share it and drafted
    γ (their draws fill the layout in order). The shared uniforms are drawn by row 0's sampler. When
    that draw raises it is retried row by row: only the rows whose own draw raises are reported, and the others'
    verdicts stay on their rows (one-hot p's: every drafted token accepted, a known bonus token). When every row
    fails, no verdict is left (``contain_errors``)."""
    V = 6
    drafted = torch.tensor([[1, 4], [2, 0], [5, 3], [0, 0]])
    bonus = [3, 1, 0, 4]
    probs = torch.zeros(4, 3, V)
    for j, k in enumerate(ks):
        probs[j, torch.arange(k), drafted[j, :k]] = 1.0
        probs[j, k:, bonus[j]] = 1.0
    shared = torch.Generator().manual_seed(2)
    samplers = [Sampler(GenerationConfig(temperature=1.0, seed=s), V, "cpu", generator=shared) for s in seeds]

    def raising(*args):
        raise RuntimeError("uniform failed")

    for j in broken:
        samplers[j].uniform = raising
    verdicts, failed = rejection_sample_rows(samplers, probs, drafted, ks, None, contain_errors=True)
    assert sorted(failed) == broken and all(str(e) == "uniform failed" for e in failed.values())
    assert verdicts.tolist() == [[ks[j], bonus[j]] for j in range(4) if j not in broken]


def test_draw_tokens_draws_what_torch_multinomial_draws():
    """A seeded row draws the token ``torch.multinomial`` draws with its generator, and rows sharing a generator
    the tokens one ``torch.multinomial`` call over them draws, generator states included (on CPU): the
    exponential race is multinomial's own method, so seeds keep their tokens."""
    for trial in range(40):
        V = (7, 256, 151_936)[trial % 3]
        probs = torch.softmax(torch.randn(5, V, generator=torch.Generator().manual_seed(trial)) * 3, -1)
        shared, alone_shared = (torch.Generator().manual_seed(1000 + trial) for _ in range(2))
        seeds = (None, 3 + trial, None, 7 + trial, None)
        samplers = [Sampler(GenerationConfig(temperature=1.0, seed=s), V, "cpu", generator=shared) for s in seeds]
        rows = [4, 0, 2, 1, 3]
        tokens = draw_tokens(samplers, probs, rows).tolist()
        seeded = [i for i, s in enumerate(seeds) if s is not None]
        for i in seeded:
            g = torch.Generator().manual_seed(seeds[i])
            assert tokens[i] == int(torch.multinomial(probs[rows[i] : rows[i] + 1], 1, generator=g)), (trial, i)
            assert torch.equal(g.get_state(), samplers[i].generator.get_state())
        together = [i for i, s in enumerate(seeds) if s is None]
        want = torch.multinomial(probs[[rows[i] for i in together]], 1, generator=alone_shared).squeeze(-1)
        assert [tokens[i] for i in together] == want.tolist(), trial
        assert torch.equal(alone_shared.get_state(), shared.get_state())


def test_a_draft_q_that_is_not_a_distribution_only_loses_its_tokens(monkeypatch):
    """A draft q that is NaN on some tokens and 0 on the rest (a q whose warping overflowed) draws a
    token where it is NaN (unchecked ``race``), and verification rejects it (u * NaN < p is false), then draws
    from the target: every drafted token is rejected, no error, every requested token comes out."""
    V = 8
    target = make_tiny_model("llama", num_layers=1, vocab_size=V, hidden_size=16, intermediate_size=32)
    draft = perturbed_copy(target, noise=0.3, seed=3)

    def nan_q(samplers, logits, ids=None):  # the draft steps' ``warped_probs``; the target's p is untouched
        q = torch.zeros(logits.shape[0], V)
        q[:, 5:] = float("nan")
        return q

    monkeypatch.setattr(drafters_base, "warped_probs", nan_q)
    dec = SpeculativeDecoder(target, DraftModelDrafter(draft))
    for seed in range(5):
        res = dec.generate(torch.tensor([[3, 5, 4]]), GenerationConfig(temperature=1.3, seed=seed, max_new_tokens=8,
                                                                         stop_on_eos=False, num_speculative_tokens=3))
        assert len(res.token_ids) == 8 and res.finish_reason == "length"
        assert res.stats.num_drafted_tokens > 0 and res.stats.num_accepted_tokens == 0
