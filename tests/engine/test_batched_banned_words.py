"""Banned words in the batched engine: per row, exactly the single-sequence decoder's output.

Both decoders run the same ``engine.banned_rows.BannedRow`` (masks, draft cut, rollback). On
the random tiny models with the word-level tokenizer (float32, greedy), each row's banned
words are two-word phrases of its own unbanned output, so they do trigger rollbacks; rows
without banned words, and a row with the same prompt as a rolled-back one, must come out as
if no other row had banned words. Rows join mid-flight (more requests than slots), at B = 1
and B = 3, for autoregressive, draft-model and prompt-lookup decoding.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from tokenizers import Tokenizer, decoders, models
from transformers import PreTrainedTokenizerFast

from conftest import make_tiny_model, make_tiny_tokenizer
from helpers import perturbed_copy
from selfspec_helpers import REPETITIVE, one_thread  # noqa: F401 (a fixture)
from specdecode import DraftModelDrafter, GenerationConfig, PromptLookupDrafter, SpeculativeDecoder
from specdecode.drafters import CascadeDrafter
from specdecode.drafters.prompt_lookup import HostSequences
from specdecode.engine.batched import BatchedSpeculativeDecoder

TOK = make_tiny_tokenizer()
PROMPTS = [[5, 9, 12], REPETITIVE, [7, 3, 30, 41, 8, 11, 19], [44], [5, 9, 12], [13, 14, 15, 16, 17, 18]]
# Rows 0, 2 and 3 ban phrases of their own unbanned output (row 3 its first word too); rows 1, 4
# (row 0's prompt) and 5 ban nothing.
BANNED_ROWS = (0, 2, 3)
N = 30
BASE = GenerationConfig(max_new_tokens=N, num_speculative_tokens=4, stop_on_eos=False)


def _methods(target, draft):
    """name -> (single-sequence drafter factory, batch drafter factory)."""
    return {
        "autoregressive": (lambda: None, lambda: None),
        "draft": (lambda: DraftModelDrafter(draft), lambda: DraftModelDrafter(draft)),
        "prompt-lookup": (PromptLookupDrafter, PromptLookupDrafter),
        "cascade": (lambda: CascadeDrafter(draft), lambda: CascadeDrafter(draft)),
    }


def _single(target, drafter, prompt, config, tokenizer=TOK):
    """(stream, the chunks it yielded) from the single-sequence decoder."""
    stream = SpeculativeDecoder(target, drafter, tokenizer=tokenizer).stream(prompt, config)
    chunks = list(stream)
    return stream, chunks


def _batched(dec: BatchedSpeculativeDecoder, prompts, configs, join_after: int = 2):
    """Add the first half, step ``join_after`` times, add the rest (rows join mid-flight), run to the end.

    Returns (results, streamed tokens) per request, in the prompts' order. Fails (rather than
    hangs) when the rows do not end: an unmasked word would be rolled back forever.
    """
    half = (len(prompts) + 1) // 2
    ids = [dec.add(p, c) for p, c in zip(prompts[:half], configs[:half])]
    streamed: dict[int, list[list[int]]] = {i: [] for i in range(len(prompts))}
    results = {}
    steps = 0

    def step():
        nonlocal steps
        steps += 1
        assert steps <= 20 * N, "the rows do not end (a banned word rolled back over and over?)"
        for ev in dec.step():
            assert ev.result is None or ev.finish_reason == ev.result.finish_reason
            if ev.token_ids:
                streamed[ev.request_id].append(ev.token_ids)
            if ev.result is not None:
                results[ev.request_id] = ev.result

    for _ in range(join_after):
        step()
    ids += [dec.add(p, c) for p, c in zip(prompts[half:], configs[half:])]
    while dec.has_work:
        step()
    return [results[i] for i in ids], [streamed[i] for i in ids]


def _configs(plain: list[list[int]]) -> list[GenerationConfig]:
    configs = []
    for b, out in enumerate(plain):
        if b in BANNED_ROWS:  # two phrases, the second past the sliding window (6) of Mistral
            words = (TOK.decode(out[4:6]), TOK.decode(out[15:17]))
            if b == 3:  # its first token: rolled back as the row joins, before any round
                words = (TOK.decode(out[:1]), words[1])
            configs.append(dataclasses.replace(BASE, banned_words=words))
        else:
            configs.append(BASE)
    return configs


@pytest.mark.usefixtures("one_thread")
@pytest.mark.parametrize("arch", ["llama", "mistral"])
@pytest.mark.parametrize("method", ["autoregressive", "draft", "prompt-lookup"])
@pytest.mark.parametrize("max_batch_size", [1, 3])
def test_rows_equal_the_single_decoder_with_banned_words(arch, method, max_batch_size):
    _check_rows_equal_the_single_decoder(arch, method, max_batch_size)


@pytest.mark.usefixtures("one_thread")
def test_rows_equal_the_single_decoder_on_the_fast_path():
    """The fast path's static-shape forwards (``compile=True, graphs=False``): the masks go on its logits."""
    _check_rows_equal_the_single_decoder("mistral", "draft", 3, compile=True, graphs=False)


def _check_rows_equal_the_single_decoder(arch, method, max_batch_size, **engine):
    target = make_tiny_model(arch)
    draft = perturbed_copy(target, noise=0.3, seed=1)
    single, batch = _methods(target, draft)[method]
    plain = [SpeculativeDecoder(target).generate(p, BASE).token_ids for p in PROMPTS]
    configs = _configs(plain)
    expected = [_single(target, single(), p, c) for p, c in zip(PROMPTS, configs)]
    for b in BANNED_ROWS:  # the setup does trigger rollbacks, which change the output
        stream = expected[b][0]
        assert stream.stats.num_banned_word_rollbacks > 0 and stream.token_ids != plain[b], b

    dec = BatchedSpeculativeDecoder(
        target, batch(), max_batch_size=max_batch_size, max_length=64, num_speculative_tokens=4, tokenizer=TOK,
        **engine,
    )
    results, streamed = _batched(dec, PROMPTS, configs)
    for b, ((stream, chunks), result, shown) in enumerate(zip(expected, results, streamed)):
        want = (stream.token_ids, stream.finish_reason)
        assert (result.token_ids, result.finish_reason) == want, (arch, method, max_batch_size, b)
        assert result.stats.num_banned_word_rollbacks == stream.stats.num_banned_word_rollbacks, b
        assert result.stats.num_banned_word_discarded_tokens == stream.stats.num_banned_word_discarded_tokens, b
        assert result.stats.num_new_tokens == len(result.token_ids) == N
        assert result.text == TOK.decode(stream.token_ids, skip_special_tokens=True)
        # What was streamed is never taken back, and no prefix of it shows a banned word.
        assert sum(shown, []) == result.token_ids, b
        for i in range(1, len(shown) + 1):
            text = TOK.decode(sum(shown[:i], []))
            assert not any(w in text for w in configs[b].banned_words), (b, text)
        if b not in BANNED_ROWS:  # other rows' rollbacks do not disturb this one
            assert result.token_ids == plain[b] and result.stats.num_banned_word_rollbacks == 0, b
    assert results[4].token_ids == plain[0] != results[0].token_ids  # same prompt, with and without words
    assert dec.stats.num_banned_word_rollbacks == sum(r.stats.num_banned_word_rollbacks for r in results)
    assert dec.stats.num_new_tokens == N * len(PROMPTS)


@pytest.mark.usefixtures("one_thread")
@pytest.mark.parametrize("method", ["prompt-lookup", "cascade"])
@pytest.mark.parametrize("max_batch_size", [1, 3])
def test_the_n_gram_match_sees_each_rows_sequence_through_rewinds_joins_and_moves(monkeypatch, method,
                                                                                  max_batch_size):
    """The drafters' host copies (``HostSequences``: each round copies only the tokens after the last
    rollback's count) equal the rows' sequences at every ``propose``, as banned words rewind rows, rows
    join mid-flight and move into freed slots; and the rows' output is the single decoder's. Between two
    proposes here a row only grows or is cut from its end, which the copies follow even without a rollback;
    a rewind that regrows past the held count with other tokens is the unit test's
    (``test_host_sequences_copy_only_what_is_new_and_follow_rollbacks_joins_and_moves``)."""
    arrays, moves = HostSequences.arrays, []

    def checked(self, sequences):
        out = arrays(self, sequences)
        assert [a.tolist() for a in out] == [list(s) for s in sequences]
        return out

    def move(self, src, dst, num_valid):
        moves.append((src, dst))
        move_(self, src, dst, num_valid)

    move_ = HostSequences.move
    monkeypatch.setattr(HostSequences, "arrays", checked)
    monkeypatch.setattr(HostSequences, "move", move)
    _check_rows_equal_the_single_decoder("llama", method, max_batch_size)
    assert (max_batch_size == 1) == (not moves)  # rows finish out of order at B = 3: some move


@pytest.mark.usefixtures("one_thread")
def test_drafts_are_cut_before_a_banned_word_as_in_the_single_decoder():
    """The draft model spells the banned phrase too: its block is cut before it, in both engines,
    so the rows verify (and discard) exactly what the single decoder does."""
    target = make_tiny_model("llama")
    draft = perturbed_copy(target, noise=0.05, seed=1)  # a close draft: it proposes the phrase
    plain = [SpeculativeDecoder(target).generate(p, BASE).token_ids for p in PROMPTS[:3]]
    configs = _configs(plain)
    expected = [_single(target, DraftModelDrafter(draft), p, c)[0] for p, c in zip(PROMPTS[:3], configs)]
    dec = BatchedSpeculativeDecoder(
        target, DraftModelDrafter(draft), max_batch_size=3, max_length=64, num_speculative_tokens=4,
        tokenizer=TOK,
    )
    results, _ = _batched(dec, PROMPTS[:3], configs)
    for b, (stream, result) in enumerate(zip(expected, results)):
        assert result.token_ids == stream.token_ids, b
        got = (result.stats.num_drafted_tokens, result.stats.num_accepted_tokens)
        assert got == (stream.stats.num_drafted_tokens, stream.stats.num_accepted_tokens), b
        assert result.stats.num_banned_word_discarded_tokens == stream.stats.num_banned_word_discarded_tokens, b
    assert expected[0].stats.num_banned_word_rollbacks > 0


def _four_token_tokenizer() -> PreTrainedTokenizerFast:
    inner = Tokenizer(models.WordLevel(vocab={"a": 0, "b": 1, "c": 2, "d": 3}, unk_token="a"))
    inner.decoder = decoders.Fuse()
    return PreTrainedTokenizerFast(tokenizer_object=inner, clean_up_tokenization_spaces=False)


@pytest.mark.usefixtures("one_thread")
@pytest.mark.parametrize("method", ["autoregressive", "prompt-lookup"])
def test_a_row_with_every_token_banned_ends_with_banned_word(method):
    """A vocabulary of four text tokens: the row banning all four ends with "banned_word" and no
    token; the row banning three fills its budget with the fourth; a row banning none is untouched."""
    tok = _four_token_tokenizer()
    target = make_tiny_model("llama", vocab_size=4, pad_token_id=None, bos_token_id=None, eos_token_id=None)
    base = GenerationConfig(max_new_tokens=6, stop_on_eos=False)
    prompt = [0, 1, 2, 3, 0, 1]
    configs = [
        dataclasses.replace(base, banned_words=("a", "b", "c", "d")),
        base,
        dataclasses.replace(base, banned_words=("a", "b", "c")),
    ]
    single = (lambda: None) if method == "autoregressive" else PromptLookupDrafter
    expected = [_single(target, single(), prompt, c, tokenizer=tok)[0] for c in configs]
    batch = None if method == "autoregressive" else PromptLookupDrafter()
    dec = BatchedSpeculativeDecoder(target, batch, max_batch_size=3, max_length=32, tokenizer=tok)
    results, streamed = _batched(dec, [prompt] * 3, configs, join_after=1)
    assert results[0].token_ids == [] and results[0].finish_reason == "banned_word" and streamed[0] == []
    assert results[0].stats.num_banned_word_rollbacks == 4
    assert results[2].text == "dddddd" and results[2].finish_reason == "length"
    for b, (stream, result) in enumerate(zip(expected, results)):
        assert (result.token_ids, result.finish_reason) == (stream.token_ids, stream.finish_reason), b
        assert result.stats.num_banned_word_rollbacks == stream.stats.num_banned_word_rollbacks, b
    assert results[1].token_ids == SpeculativeDecoder(target).generate(prompt, base).token_ids


@pytest.mark.usefixtures("one_thread")
@pytest.mark.parametrize("method", ["autoregressive", "draft"])
def test_sampling_rows_never_stream_a_banned_word(method):
    """Sampling rows (speculative sampling on the cut block) with banned words next to greedy rows."""
    target = make_tiny_model("llama")
    draft = perturbed_copy(target, noise=0.3, seed=1)
    plain = [SpeculativeDecoder(target).generate(p, BASE).token_ids for p in PROMPTS]
    configs = [
        dataclasses.replace(c, temperature=1.0, seed=b) if b % 2 else c for b, c in enumerate(_configs(plain))
    ]
    configs[1] = dataclasses.replace(configs[1], banned_words=(TOK.decode(plain[1][2:4]),))
    batch = _methods(target, draft)[method][1]
    dec = BatchedSpeculativeDecoder(target, batch(), max_batch_size=3, max_length=64, num_speculative_tokens=4,
                                    tokenizer=TOK)
    results, streamed = _batched(dec, PROMPTS, configs)
    for b, (result, shown) in enumerate(zip(results, streamed)):
        assert sum(shown, []) == result.token_ids and len(result.token_ids) == N, b
        for i in range(1, len(shown) + 1):
            text = TOK.decode(sum(shown[:i], []))
            assert not any(w in text for w in configs[b].banned_words), (b, text)
    assert sum(r.stats.num_banned_word_rollbacks for r in results) > 0


@pytest.mark.usefixtures("one_thread")
def test_sampling_rows_cut_by_a_banned_word_keep_the_law(monkeypatch):
    """A sampling row's whole block is sampled before the round's read; a banned word's cut, matched on the host
    after it, keeps the first kb + 1 tokens of what the block drew (its accepted tokens, then the token at the
    cut: the next draft token where more were accepted, else the drawn one). Single-token words make rollback
    and masking exact conditioning: each position's token follows the target's law without the banned tokens.
    The first three tokens of the sampling row are checked against that law, and the greedy row beside it is
    the target-only decoder's output with the same words. Then the cut itself: a seeded row (one sequence) draws
    the same blocks with and without its words until the first cut, which keeps the start of that round's
    unbanned tokens."""
    from selfspec_helpers import exact_marginals, violations
    from specdecode.engine.banned_rows import BannedRow
    from specdecode.engine.batch_rows import BatchRow

    vocab, n, banned = 8, 600, (3, 7)  # token 3: the target's first choice, 0.56 of its first token's law
    model = make_tiny_model("llama", num_layers=1, vocab_size=vocab, hidden_size=16, intermediate_size=32)
    with torch.no_grad():  # peaked: each token's law depends much on the one before
        model.get_output_embeddings().weight.mul_(2.0)
    draft, prompts = perturbed_copy(model, noise=0.3, seed=1), [[5, 3, 6, 5, 3, 4, 6, 5, 7], [4, 4, 6, 1]]
    tok = make_tiny_tokenizer(vocab)
    words = tuple(f"w{t}" for t in banned)
    cuts, cut_draft = [], BannedRow.cut_draft
    monkeypatch.setattr(BannedRow, "cut_draft", lambda self, tokens, first: (lambda keep: cuts.append(
        keep < len(tokens)) or keep)(cut_draft(self, tokens, first)))
    sampling = GenerationConfig(max_new_tokens=6, stop_on_eos=False, temperature=1.0, banned_words=words)
    greedy = dataclasses.replace(sampling, temperature=0.0)
    expected = SpeculativeDecoder(model, tokenizer=tok).generate(torch.tensor([prompts[0]]), greedy).token_ids
    dec = BatchedSpeculativeDecoder(model, DraftModelDrafter(draft), max_batch_size=2, max_length=32,
                                    num_speculative_tokens=4, tokenizer=tok)
    firsts = torch.zeros((n, 3), dtype=torch.long)
    for i in range(n):
        rows = dec.generate(prompts, [greedy, dataclasses.replace(sampling, seed=i)])
        assert rows[0].token_ids == expected
        firsts[i] = torch.tensor(rows[1].token_ids[:3])
    assert sum(cuts) > n // 5, f"{sum(cuts)} cuts: blocks must be cut often for this test to mean anything"
    freq = {f"x{j + 1}": torch.bincount(firsts[:, j], minlength=vocab).double() / n for j in range(3)}
    freq["x1x2"] = torch.bincount(firsts[:, 0] * vocab + firsts[:, 1], minlength=vocab**2).double().view(
        vocab, vocab) / n

    def without_banned(ids):  # the target with the banned tokens' logits at -inf
        out = model(ids)
        out.logits[..., list(banned)] = float("-inf")
        return out

    exact = exact_marginals(without_banned, prompts[1], dataclasses.replace(sampling, max_new_tokens=3), vocab)
    assert violations(exact, freq, n) == []
    # The cut keeps the start of what the block drew: a seeded row draws the same block with and without its
    # banned words, so the first round they part is a cut, its tokens the first of the unbanned row's.
    emitted, emit = [], BatchRow.emit
    monkeypatch.setattr(BatchRow, "emit", lambda self, new, *stats: emitted.append(list(new)) or emit(
        self, new, *stats))
    one = SpeculativeDecoder(model, DraftModelDrafter(draft), tokenizer=tok)
    cut_inside = 0  # cuts where the block drew more than the cut keeps
    for seed in range(120):
        config = dataclasses.replace(sampling, seed=seed, num_speculative_tokens=4)
        runs = []
        for ban in ((), words):
            emitted.clear()
            one.generate(torch.tensor([prompts[1]]), dataclasses.replace(config, banned_words=ban))
            runs.append(list(emitted))
        plain, kept = runs
        part = next((i for i, (x, y) in enumerate(zip(plain, kept)) if x != y), None)
        if part is None or any(t in banned for tokens in kept[:part] for t in tokens):
            continue  # no banned token drawn, or a rollback first (the first token or a bonus token banned)
        assert kept[part] == plain[part][: len(kept[part])], (seed, plain[part], kept[part])
        cut_inside += len(kept[part]) < len(plain[part])
    assert cut_inside >= 10, f"{cut_inside} cuts inside a drawn block"
