"""Banned words in the batched engine: per row, exactly the single-sequence decoder's output.

Both decoders run the same ``engine.banned_rows.BannedRow`` (masks, rollback). On
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
def test_a_drafted_banned_word_is_verified_and_rolled_back_as_one_token_at_a_time():
    """The draft model spells the banned phrase too. Its whole block is verified, and the check rolls the word back
    as target-only decoding does: the same output and rollbacks, with more tokens discarded (those of the block
    after the word, which a cut before the word never verified). B = 3 with joins equals B = 1, stats included."""
    target = make_tiny_model("llama")
    draft = perturbed_copy(target, noise=0.05, seed=1)  # a close draft: it proposes the phrase
    plain = [SpeculativeDecoder(target).generate(p, BASE).token_ids for p in PROMPTS[:3]]
    configs = _configs(plain)
    reference = [_single(target, None, p, c)[0] for p, c in zip(PROMPTS[:3], configs)]
    expected = [_single(target, DraftModelDrafter(draft), p, c)[0] for p, c in zip(PROMPTS[:3], configs)]
    dec = BatchedSpeculativeDecoder(
        target, DraftModelDrafter(draft), max_batch_size=3, max_length=64, num_speculative_tokens=4,
        tokenizer=TOK,
    )
    results, _ = _batched(dec, PROMPTS[:3], configs)
    more = 0
    for b, (ref, stream, result) in enumerate(zip(reference, expected, results)):
        assert stream.token_ids == ref.token_ids, b
        assert stream.stats.num_banned_word_rollbacks == ref.stats.num_banned_word_rollbacks, b
        more += stream.stats.num_banned_word_discarded_tokens > ref.stats.num_banned_word_discarded_tokens
        assert result.token_ids == stream.token_ids, b
        got = (result.stats.num_drafted_tokens, result.stats.num_accepted_tokens)
        assert got == (stream.stats.num_drafted_tokens, stream.stats.num_accepted_tokens), b
        assert result.stats.num_banned_word_discarded_tokens == stream.stats.num_banned_word_discarded_tokens, b
    assert reference[0].stats.num_banned_word_rollbacks > 0
    assert more, "no block verified tokens past a banned word"


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
    """Sampling rows (speculative sampling on the whole block, a drawn word rolled back) with banned words next
    to greedy rows."""
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


def _peaked_pair(noise: float):
    """A tiny llama target whose token 3 is 0.56 of the first token's law and token 5 0.27 after a 3 (each
    token's law depends much on the one before), a draft ``noise`` away, and two prompts."""
    model = make_tiny_model("llama", num_layers=1, vocab_size=8, hidden_size=16, intermediate_size=32)
    with torch.no_grad():
        model.get_output_embeddings().weight.mul_(2.0)
    return model, perturbed_copy(model, noise=noise, seed=1), [[5, 3, 6, 5, 3, 4, 6, 5, 7], [4, 4, 6, 1]]


@pytest.mark.usefixtures("one_thread")
def test_sampling_rows_with_banned_words_follow_the_rollback_law():
    """A sampling row with banned words samples its whole block before the round's read and keeps all it drew;
    a word it drew is matched after the read and rolled back (cut to where it begins, that token masked there),
    as when the tokens come one at a time. The first three tokens of the sampling row follow the exact law of
    that process (enumerated with the engine's matcher; the word of two tokens begins at a token that the next
    one completes), and not the target's law without banned words; the greedy row beside it is the target-only
    decoder's output with the same words."""
    from selfspec_helpers import exact_marginals, violations
    from specdecode.engine.banned_words import BannedWords

    vocab, n, steps = 8, 600, 3
    model, draft, prompts = _peaked_pair(noise=0.3)
    tok, words = make_tiny_tokenizer(vocab), ("w3 w5",)
    sampling = GenerationConfig(max_new_tokens=steps, stop_on_eos=False, temperature=1.0, banned_words=words)
    greedy = dataclasses.replace(sampling, temperature=0.0)
    expected = SpeculativeDecoder(model, tokenizer=tok).generate(torch.tensor([prompts[0]]), greedy).token_ids
    dec = BatchedSpeculativeDecoder(model, DraftModelDrafter(draft), max_batch_size=2, max_length=32,
                                    num_speculative_tokens=4, tokenizer=tok)
    firsts, rollbacks = torch.zeros((n, steps), dtype=torch.long), 0
    for i in range(n):
        rows = dec.generate(prompts, [greedy, dataclasses.replace(sampling, seed=i)])
        assert rows[0].token_ids == expected
        firsts[i] = torch.tensor(rows[1].token_ids)
        rollbacks += rows[1].stats.num_banned_word_rollbacks
    assert rollbacks > n // 10, f"{rollbacks} rollbacks: the word must be drawn often for this test to mean anything"
    freq = {f"x{j + 1}": torch.bincount(firsts[:, j], minlength=vocab).double() / n for j in range(steps)}
    freq["x1x2"] = torch.bincount(firsts[:, 0] * vocab + firsts[:, 1], minlength=vocab**2).double().view(
        vocab, vocab) / n

    banned, probs, memo = BannedWords(words), {}, {}

    def safe(tokens: tuple) -> int:
        matcher = banned.matcher(tok)
        matcher.extend(tokens)
        return matcher.num_safe()

    def law_from(prefix: tuple, masks: frozenset, released: int) -> dict:
        """The law of the output from ``prefix`` with ``masks`` ((position, token) pairs) and ``released`` tokens
        (no longer part of any word when they came): one token at a time; a completed word cuts back to where it
        begins, or to the first token not released, and masks that token there."""
        if (prefix, masks, released) in memo:
            return memo[prefix, masks, released]
        if prefix not in probs:
            with torch.no_grad():
                probs[prefix] = model(torch.tensor([prompts[1] + list(prefix)])).logits[0, -1]
        logits = probs[prefix].clone()
        logits[[t for at, t in masks if at == len(prefix)]] = float("-inf")
        out = {}
        for token, p in enumerate(logits.softmax(-1).tolist()):
            if p == 0.0:  # masked
                continue
            new = (*prefix, token)
            matcher = banned.matcher(tok)
            matcher.extend(new)
            start = matcher.violation(final=len(new) == steps)
            if start is None:
                rest = {new: 1.0} if len(new) == steps else law_from(new, masks, max(released, safe(new)))
            else:
                cut = max(start, released)
                kept = frozenset({(at, t) for at, t in masks if at <= cut} | {(cut, new[cut])})
                rest = law_from(new[:cut], kept, max(released, safe(new[:cut])))
            for seq, q in rest.items():
                out[seq] = out.get(seq, 0.0) + p * q
        memo[prefix, masks, released] = out
        return out

    joint = torch.zeros((vocab,) * steps, dtype=torch.float64)
    for seq, p in law_from((), frozenset(), 0).items():
        joint[seq] += p
    exact = {"x1": joint.sum((1, 2)), "x2": joint.sum((0, 2)), "x3": joint.sum((0, 1)), "x1x2": joint.sum(2)}
    assert abs(float(joint.sum()) - 1.0) < 1e-6  # float32 softmaxes
    assert violations(exact, freq, n) == []
    plain = exact_marginals(model, prompts[1], dataclasses.replace(sampling, banned_words=()), vocab)
    assert violations(plain, freq, n) != [], "the words must change the law for this test to mean anything"


@pytest.mark.usefixtures("one_thread")
def test_a_banned_word_drawn_inside_a_block_is_rolled_back_not_cut(monkeypatch):
    """Inside a block, a sampling row's word is rolled back after the read, not cut before it: a cut chosen by
    the draft's next token would keep the word's first token where the target drew the word (here 3.99 3s in 16
    tokens against 3.17, z = 6.8). Sixteen tokens with a close draft: the number of
    3s (the word's first token) matches the target-only decoder's, which checks each token as it comes. Then a
    seeded row draws the same blocks with and without its words up to the round whose check rolls a word back."""
    from specdecode.engine.batch_rows import BatchRow

    n = 600
    model, draft, prompts = _peaked_pair(noise=0.1)
    tok, words = make_tiny_tokenizer(8), ("w3 w5",)
    sampling = GenerationConfig(max_new_tokens=16, stop_on_eos=False, temperature=1.0, banned_words=words,
                                num_speculative_tokens=4)
    counts = []
    for dec, offset in ((SpeculativeDecoder(model, tokenizer=tok), 0),
                        (SpeculativeDecoder(model, DraftModelDrafter(draft), tokenizer=tok), 10**6)):
        counts.append(torch.tensor([float(dec.generate(torch.tensor([prompts[1]]), dataclasses.replace(
            sampling, seed=offset + i)).token_ids.count(3)) for i in range(n)]))
    plain, spec = counts
    z = float((spec.mean() - plain.mean()) / torch.sqrt(plain.var() / n + spec.var() / n))
    assert abs(z) < 4.5, f"3s a sequence: {float(spec.mean()):.3f} against {float(plain.mean()):.3f} (z = {z:.1f})"

    # The same blocks with and without the words, up to the round whose emit rolls the word back.
    emitted, emit = [], BatchRow.emit

    def spied(self, new, *stats):  # each round's new tokens, and the row's rollbacks after its check
        out = emit(self, new, *stats)
        emitted.append((list(new), self.stats.num_banned_word_rollbacks))
        return out

    monkeypatch.setattr(BatchRow, "emit", spied)
    one = SpeculativeDecoder(model, DraftModelDrafter(draft), tokenizer=tok)
    inside = 0  # rollbacks in rounds that drew more than the word's two tokens
    for seed in range(60):
        config = dataclasses.replace(sampling, seed=seed, max_new_tokens=8)
        runs = []
        for ban in ((), words):
            emitted.clear()
            one.generate(torch.tensor([prompts[1]]), dataclasses.replace(config, banned_words=ban))
            runs.append(list(emitted))
        plain_run, banned_run = runs
        first = next((r for r, (_, count) in enumerate(banned_run) if count), None)
        if first is None:
            continue
        assert [new for new, _ in banned_run[: first + 1]] == [new for new, _ in plain_run[: first + 1]], seed
        inside += len(banned_run[first][0]) > 2
    assert inside >= 5, f"{inside} rollbacks inside a block"
