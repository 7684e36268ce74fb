"""Banned words through the decoder (issue 13): rollback and mask on the text, any tokenization.

Two kinds of tiny model are used:

* a *steered* llama whose vocabulary is text pieces joined without spaces (" ham",
  "burger", "h", "amb", ...). Hooks add a bigram "script" to its logits (a ranked list
  of next pieces for each last piece), so greedy decoding spells "hamburger" as one
  token, then, once that is forbidden, as " ham" + "burger", then "h" + "amb" + "urger".
  A token-id ban (transformers' ``bad_words_ids``) lets another tokenization through;
  specdecode's text ban must not, with every method, greedy or sampling, streamed or not.
* the plain random tiny models of all five architectures with the word-level tokenizer:
  greedy output with banned words must equal an independent cache-free greedy loop that
  masks the same (position, token) pairs (``GenerationStream.forbidden_tokens``), also
  when a rollback crosses the sliding window of Mistral/Gemma and empties the cache.
"""

from __future__ import annotations

import dataclasses
import re
from contextlib import contextmanager

import pytest
import torch
from tokenizers import Tokenizer, decoders, models
from transformers import PreTrainedTokenizerFast

from conftest import VOCAB, make_tiny_model, make_tiny_tokenizer
from specdecode import (
    DraftModelDrafter,
    EarlyExitDrafter,
    GenerationConfig,
    InvalidArgumentError,
    LayerSkipDrafter,
    PromptLookupDrafter,
    SkipSet,
    SpeculativeDecoder,
)
from specdecode.engine.banned_words import read_banned_words

EOS = 2
METHODS = ("autoregressive", "draft-model", "layer-skip", "early-exit", "prompt-lookup")

# ------------------------------------------------------------------ the steered model

PIECES = (
    "<pad>", "<s>", "</s>", " ", "x", " ham", "burger", "h", "amb", "urger", " hamburger", "hamburger",
    "Ham", "BURGER", "I", " like", ".", " fries", "b", " and", "s", " bad", "ger", " badger",
)
V = len(PIECES)
ID = {p: i for i, p in enumerate(PIECES)}


def ids(*pieces: str) -> list[int]:
    return [ID[p] for p in pieces]


def piece_tokenizer() -> PreTrainedTokenizerFast:
    """Id i is PIECES[i]; decoding concatenates the pieces (no spaces added)."""
    tok = Tokenizer(models.WordLevel(vocab=ID, unk_token="<pad>"))
    tok.decoder = decoders.Fuse()
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<s>", eos_token="</s>", pad_token="<pad>", unk_token="<pad>",
        clean_up_tokenization_spaces=False,
    )


TOK = piece_tokenizer()

# For each last piece, the next pieces in order of preference (unlisted: ".").
HAM = {
    "<s>": ["I"],
    "I": [" like"],
    " like": [" hamburger", " ham", " ", " fries"],
    " hamburger": ["."],
    " ham": ["burger", "b", " and"],
    "b": ["urger"],
    " ": ["hamburger", "h", "Ham", "x"],
    "h": ["amb", "x"],
    "amb": ["urger"],
    "Ham": ["BURGER", "burger"],
    " and": [" fries"],
    **{p: [".", " and"] for p in ("burger", "urger", "hamburger", "BURGER", " fries")},
    ".": ["</s>"],
}
HAM_PLURAL = {**HAM, " hamburger": ["s", "."]}  # " hamburgers."
HAM_AT_EOS = {**HAM, " hamburger": ["</s>"]}  # the word ends the text
BADGER = {
    "<s>": ["I"],
    "I": [" like"],
    " like": [" bad", " badger", " fries"],
    " bad": ["ger", "."],
    "ger": ["s", "."],
    ".": ["</s>"],
}
# The prompt "I like hamburger.I like" holds the word (matching covers the generated text
# only) and gives prompt lookup an n-gram to draft " ham" "burger" from.
HAM_PROMPT = ids("<s>", "I", " like", " ham", "burger", ".", "I", " like")
BADGER_PROMPT = ids("<s>", "I", " like")


def script_bias(script: dict[str, list[str]], top: float = 30.0, gap: float = 2.0) -> torch.Tensor:
    """(V, V): row = last piece, column = next piece; the k-th choice gets top - k * gap."""
    bias = torch.zeros(V, V)
    for prev in PIECES:
        for rank, nxt in enumerate(script.get(prev, ["."])):
            bias[ID[prev], ID[nxt]] = top - gap * rank
    return bias


@contextmanager
def steered(models_: list[torch.nn.Module], script: dict[str, list[str]], damp: float = 0.05):
    """Within the block, each model's logits are ``damp * own logits + script bias[last token]``.

    A pre-hook on the model remembers its ``input_ids``; a hook on the LM head adds the
    bias of each position's input token. The head may see only the last positions
    (``logits_to_keep``), so positions are aligned from the right.
    """
    bias = script_bias(script)
    handles = []
    try:
        for model in models_:
            seen: dict[str, torch.Tensor] = {}

            def remember(module, args, kwargs, seen=seen):
                seen["ids"] = args[0] if args else kwargs["input_ids"]

            def push(module, args, logits, seen=seen):
                last = seen["ids"]
                last = last[:, last.shape[1] - logits.shape[1] :]
                return logits * damp + bias[last].to(logits.dtype)

            handles.append(model.register_forward_pre_hook(remember, with_kwargs=True))
            handles.append(model.get_output_embeddings().register_forward_hook(push))
        yield
    finally:
        for h in handles:
            h.remove()


@pytest.fixture(scope="module")
def ham_models():
    """(target, draft): tiny llamas over the piece vocabulary (steered only inside ``steered``)."""
    return make_tiny_model("llama", vocab_size=V), make_tiny_model("llama", num_layers=1, seed=7, vocab_size=V)


def make_drafter(method: str, target, draft):
    if method == "autoregressive":
        return None
    if method == "draft-model":
        return DraftModelDrafter(draft)
    if method == "layer-skip":
        return LayerSkipDrafter(target, SkipSet.parse("attn=1;mlp=2"))
    if method == "early-exit":
        return EarlyExitDrafter(target, 2)
    if method == "prompt-lookup":
        return PromptLookupDrafter()
    raise ValueError(method)


def ham_decoder(method: str, ham_models, tokenizer=TOK) -> SpeculativeDecoder:
    target, draft = ham_models
    return SpeculativeDecoder(target, make_drafter(method, target, draft), eos_token_ids=[EOS], tokenizer=tokenizer)


def run_stream(dec: SpeculativeDecoder, prompt, config: GenerationConfig, tokenizer=TOK):
    """Iterate a stream; returns (stream, text, every prefix text the caller was shown)."""
    stream = dec.stream(prompt, config)
    shown: list[int] = []
    prefixes = []
    for chunk in stream:
        assert chunk, "a stream must not yield empty lists"
        shown += chunk
        prefixes.append(tokenizer.decode(shown, skip_special_tokens=True))
    assert shown == stream.token_ids, "tokens once streamed were taken back (or lost)"
    return stream, tokenizer.decode(stream.token_ids, skip_special_tokens=True), prefixes


def assert_masks_respected(stream) -> None:
    """No forbidden token sits at its position in the output, and none was produced twice there."""
    for pos, tokens in stream.forbidden_tokens.items():
        assert pos >= 0
        assert len(tokens) == len(set(tokens)), f"position {pos}: a masked token came back: {tokens}"
        if pos < len(stream.token_ids):
            assert stream.token_ids[pos] not in tokens, (pos, tokens, stream.token_ids)


GREEDY = GenerationConfig(max_new_tokens=12, num_speculative_tokens=4)


# ------------------------------------------------------------------ 1. every tokenization is blocked


def test_the_steered_model_spells_the_word_in_many_tokenizations(ham_models):
    """The steering itself: without a ban, each way of writing the word is the favourite in turn."""
    target, _ = ham_models
    with steered([target], HAM), torch.inference_mode():
        for prefix, best in [
            (HAM_PROMPT, " hamburger"),
            (HAM_PROMPT + ids(" ham"), "burger"),
            (HAM_PROMPT + ids(" "), "hamburger"),
            (HAM_PROMPT + ids(" ", "h"), "amb"),
            (HAM_PROMPT + ids(" ", "h", "amb"), "urger"),
        ]:
            logits = target(torch.tensor([prefix])).logits[0, -1]
            assert PIECES[int(logits.argmax())] == best
    with torch.inference_mode():  # hooks removed: the random model again
        assert PIECES[int(target(torch.tensor([HAM_PROMPT])).logits[0, -1].argmax())] != " hamburger"


@pytest.mark.parametrize("method", METHODS)
def test_every_tokenization_of_a_banned_word_is_blocked(ham_models, method):
    target, draft = ham_models
    dec = ham_decoder(method, ham_models)
    with steered([target, draft], HAM):
        free = dec.generate(HAM_PROMPT, GREEDY)
        assert free.text == " hamburger." and free.finish_reason == "eos"

        stream, text, _ = run_stream(dec, HAM_PROMPT, dataclasses.replace(GREEDY, banned_words=("hamburger",)))
        # " hamburger", " ham"+"burger", " "+"hamburger", " "+"h"+"amb"+"urger" were each tried and
        # rolled back; "Ham"+"BURGER" is another word under case-sensitive matching.
        assert text == " HamBURGER."
        assert stream.finish_reason == "eos"
        assert stream.stats.num_banned_word_rollbacks == 4
        assert stream.forbidden_tokens == {0: ids(" hamburger", " ham"), 1: ids("hamburger", "h")}
        assert stream.stats.num_banned_word_discarded_tokens >= 1 + 2 + 1 + 3
        assert stream.stats.num_new_tokens == len(stream.token_ids)
        assert_masks_respected(stream)

        rollbacks = 0
        for seed in range(4):
            config = dataclasses.replace(GREEDY, temperature=1.0, seed=seed, banned_words=("hamburger",))
            stream, text, _ = run_stream(dec, HAM_PROMPT, config)
            assert "hamburger" not in text, (seed, text)
            assert stream.finish_reason == "eos"
            assert_masks_respected(stream)
            rollbacks += stream.stats.num_banned_word_rollbacks
        assert rollbacks >= 2  # the favourite spelling is sampled most of the time


# ------------------------------------------------------------------ 2. transformers' bad_words_ids


def test_token_id_ban_lets_another_tokenization_through(ham_models):
    target, _ = ham_models
    word_ids = [TOK(" hamburger").input_ids, TOK("hamburger").input_ids]
    assert word_ids == [ids(" hamburger"), ids("hamburger")]  # the word's own single-token spellings
    prompt = torch.tensor([HAM_PROMPT])

    def hf_generate(bad_words_ids):
        out = target.generate(
            prompt, attention_mask=torch.ones_like(prompt), do_sample=False, max_new_tokens=12,
            bad_words_ids=bad_words_ids, eos_token_id=EOS, pad_token_id=0,
        )
        return TOK.decode(out[0, prompt.shape[1] :], skip_special_tokens=True)

    with steered([target], HAM):
        assert hf_generate(None) == " hamburger."
        assert hf_generate(word_ids) == " hamburger."  # now " ham" + "burger"
        # Banning that pair too only moves it on: " ham" + "b" + "urger".
        assert hf_generate(word_ids + [ids(" ham", "burger")]) == " hamburger."

        ours = SpeculativeDecoder(target, eos_token_ids=[EOS], tokenizer=TOK).generate(
            HAM_PROMPT, dataclasses.replace(GREEDY, banned_words=("hamburger",))
        )
    assert "hamburger" not in ours.text and ours.text == " HamBURGER."


# ------------------------------------------------------------------ 3. options, nested and overlapping words


OPTION_CASES = [
    # (script, prompt, banned words, ignore_case, whole_word, expected text, rollbacks, forbidden or None)
    (HAM, HAM_PROMPT, ("ham",), False, True, " hamburger.", 0, {}),  # whole-word "ham" does not block "hamburger"
    (HAM, HAM_PROMPT, ("ham",), False, False, " HamBURGER.", 4,
     {0: ids(" hamburger", " ham"), 1: ids("hamburger", "h")}),  # "h"+"amb" is cut before "urger"
    (HAM, HAM_PROMPT, ("HAMBURGER",), False, False, " hamburger.", 0, {}),  # case-sensitive by default
    (HAM, HAM_PROMPT, ("HAMBURGER",), True, False, " x.", 5,
     {0: ids(" hamburger", " ham"), 1: ids("hamburger", "h", "Ham")}),  # ignore-case also blocks "HamBURGER"
    (HAM, HAM_PROMPT, ("hamburger",), True, True, " x.", 5, None),
    (HAM_PLURAL, HAM_PROMPT, ("hamburger",), False, True, " hamburgers.", 0, {}),  # inside "hamburgers": allowed
    (HAM_PLURAL, HAM_PROMPT, ("hamburger",), False, False, " HamBURGER.", 4, None),
    (HAM_PLURAL, HAM_PROMPT, ("hamburgers",), False, True, " hamburger.", 1, {0: ids(" hamburger")}),
    (HAM_AT_EOS, HAM_PROMPT, ("hamburger",), False, True, " HamBURGER.", 4, None),  # end of text is a boundary
    # nested: "burger" inside "hamburger"; the cut is at the earlier start ("hamburger"'s)
    (HAM, HAM_PROMPT, ("burger", "hamburger"), False, False, " HamBURGER.", 4,
     {0: ids(" hamburger", " ham"), 1: ids("hamburger", "h")}),
    # "burger" alone: the cut is at the token where the word begins, not before it
    (HAM, HAM_PROMPT, ("burger",), False, False, " ham and fries.", 3,
     {0: ids(" hamburger"), 1: ids("burger", "b")}),
    # "amb" and "burger" overlap in "hamburger"; "amb" straddles " ham"+"burger" and starts first
    (HAM, HAM_PROMPT, ("amb", "burger"), False, False, " hx.", 4,
     {0: ids(" hamburger", " ham"), 1: ids("hamburger"), 2: ids("amb")}),
    (BADGER, BADGER_PROMPT, (), False, False, " badgers.", 0, {}),
    (BADGER, BADGER_PROMPT, ("badger",), False, False, " fries.", 2, {0: ids(" bad", " badger")}),
    (BADGER, BADGER_PROMPT, ("bad",), False, False, " fries.", 2, {0: ids(" bad", " badger")}),
    (BADGER, BADGER_PROMPT, ("bad", "badger"), False, False, " fries.", 2, {0: ids(" bad", " badger")}),
    (BADGER, BADGER_PROMPT, ("bad",), False, True, " badgers.", 0, {}),
    (BADGER, BADGER_PROMPT, ("badger",), False, True, " badgers.", 0, {}),
    (BADGER, BADGER_PROMPT, ("bad", "badgers"), False, True, " badger.", 1, {0: ids(" bad")}),
]


@pytest.mark.parametrize("method", ["autoregressive", "draft-model"])
@pytest.mark.parametrize(
    "script, prompt, words, ignore_case, whole_word, expected, rollbacks, forbidden",
    OPTION_CASES,
    ids=[f"{'+'.join(c[2]) or 'none'}{'-ic' if c[3] else ''}{'-ww' if c[4] else ''}-{i}" for i, c in
         enumerate(OPTION_CASES)],
)
def test_options_and_overlapping_words(ham_models, method, script, prompt, words, ignore_case, whole_word,
                                       expected, rollbacks, forbidden):
    target, draft = ham_models
    config = dataclasses.replace(
        GREEDY, banned_words=words, banned_words_ignore_case=ignore_case, banned_words_whole_word=whole_word
    )
    with steered([target, draft], script):
        stream, text, prefixes = run_stream(ham_decoder(method, ham_models), prompt, config)
    assert text == expected
    assert stream.stats.num_banned_word_rollbacks == rollbacks
    if forbidden is not None:
        assert stream.forbidden_tokens == forbidden
    assert_masks_respected(stream)
    flags = re.IGNORECASE if ignore_case else 0
    for w in words:
        pattern = rf"(?<!\w){re.escape(w)}(?!\w)" if whole_word else re.escape(w)
        for shown in prefixes:
            assert not re.search(pattern, shown, flags), (w, shown)


def test_whole_word_at_the_length_limit_counts(ham_models):
    """Generation ending on the budget ends the text: a whole word there is banned too."""
    target, _ = ham_models
    config = GenerationConfig(max_new_tokens=1, banned_words=("hamburger",), banned_words_whole_word=True)
    with steered([target], HAM):
        stream, text, _ = run_stream(ham_decoder("autoregressive", ham_models), HAM_PROMPT, config)
    assert text == " ham" and stream.finish_reason == "length"
    assert stream.forbidden_tokens == {0: ids(" hamburger")}


# ------------------------------------------------------------------ 4. streaming


@pytest.mark.parametrize("method", METHODS)
def test_stream_never_shows_a_banned_word(ham_models, method):
    target, draft = ham_models
    dec = ham_decoder(method, ham_models)
    cases = [
        (HAM, HAM_PROMPT, ("hamburger",), False, "hamburger"),
        (BADGER, BADGER_PROMPT, ("bad",), True, r"(?<!\w)bad(?!\w)"),  # " bad" must wait for "ger"
    ]
    for script, prompt, words, whole_word, pattern in cases:
        for temperature, seed in [(0.0, None), (1.0, 1), (1.0, 2)]:
            config = dataclasses.replace(
                GREEDY, banned_words=words, banned_words_whole_word=whole_word, temperature=temperature, seed=seed
            )
            with steered([target, draft], script):
                stream, text, prefixes = run_stream(dec, prompt, config)
            assert len(prefixes) >= 1 and prefixes[-1] == text
            for shown in prefixes:
                assert not re.search(pattern, shown), (method, words, temperature, seed, prefixes)
            assert_masks_respected(stream)
            if script is HAM and temperature == 0.0:
                assert stream.stats.num_banned_word_rollbacks == 4
            if script is BADGER and temperature == 0.0:
                assert text == " badgers."


def test_stream_holds_back_the_start_of_a_banned_word(ham_models):
    """Autoregressive greedy under whole-word "bad": " bad" alone is never released, " badger" is."""
    target, _ = ham_models
    config = dataclasses.replace(GREEDY, banned_words=("bad",), banned_words_whole_word=True)
    with steered([target], BADGER):
        stream = ham_decoder("autoregressive", ham_models).stream(BADGER_PROMPT, config)
        chunks = [TOK.decode(c, skip_special_tokens=True) for c in stream]
    assert "".join(chunks) == " badgers."
    assert chunks[0] == " badger"  # " bad" waited for the next token


class RecordingDrafter(DraftModelDrafter):
    """A draft-model drafter that remembers what it proposed."""

    def __init__(self, model) -> None:
        super().__init__(model)
        self.proposed: list[list[int]] = []

    def propose(self, sequences, max_tokens, exits=None, exit_rule="row"):
        draft = super().propose(sequences, max_tokens, exits, exit_rule)
        self.proposed.append(draft.tokens[0, : draft.num_tokens[0]].tolist())
        return draft


def test_draft_blocks_are_verified_whole_and_the_word_rolled_back(ham_models):
    """The draft spells the word too. Its blocks are verified whole (no cut before the word), and the word is
    rolled back as target-only decoding rolls it back, one token at a time: the same text and rollbacks, and the
    tokens verified after the word discarded with it."""
    target, draft = ham_models
    words = ("hamburger",)
    with steered([target], HAM):
        alone = SpeculativeDecoder(target, eos_token_ids=[EOS], tokenizer=TOK).generate(
            HAM_PROMPT, dataclasses.replace(GREEDY, banned_words=words))
    drafter = RecordingDrafter(draft)
    dec = SpeculativeDecoder(target, drafter, eos_token_ids=[EOS], tokenizer=TOK)
    with steered([target, draft], HAM):
        result = dec.generate(HAM_PROMPT, dataclasses.replace(GREEDY, banned_words=words))
    assert result.text == alone.text == " HamBURGER."
    assert result.stats.num_drafted_tokens == sum(map(len, drafter.proposed)) > 0  # every proposed token verified
    assert ids("burger") in [p[:1] for p in drafter.proposed]  # "burger" after " ham" was proposed, and verified
    assert result.stats.num_banned_word_rollbacks == alone.stats.num_banned_word_rollbacks > 0
    assert result.stats.num_banned_word_discarded_tokens > alone.stats.num_banned_word_discarded_tokens


# ------------------------------------------------------------------ 5. exactness on the random tiny models


def masked_greedy_reference(model, prompt: list[int], n: int, forbidden: dict[int, list[int]]) -> list[int]:
    """Greedy decoding with a full forward per token (no cache), masking forbidden[i] at new position i."""
    seq = list(prompt)
    with torch.inference_mode():
        for i in range(n):
            logits = model(torch.tensor([seq])).logits[0, -1].clone()
            if forbidden.get(i):
                logits[forbidden[i]] = float("-inf")
            seq.append(int(logits.argmax()))
    return seq[len(prompt) :]


def test_greedy_with_banned_words_equals_masked_reference(arch):
    """Rollbacks past the sliding window (6) too: the target's and the draft's batch caches keep every
    position, so nothing is re-encoded."""
    target = make_tiny_model(arch)
    draft = make_tiny_model(arch, num_layers=1, seed=7)
    tok = make_tiny_tokenizer()
    prompt = torch.randint(3, VOCAB, (5,), generator=torch.Generator().manual_seed(11)).tolist()
    n = 40
    base = GenerationConfig(max_new_tokens=n, num_speculative_tokens=4, stop_on_eos=False)
    plain = SpeculativeDecoder(target).generate(prompt, base).token_ids
    assert plain == masked_greedy_reference(target, prompt, n, {})  # the reference itself is right
    # Two-word phrases of the unbanned output: they must be rolled back, beyond the window of 6.
    words = (tok.decode(plain[7:9]), tok.decode(plain[20:22]))
    config = dataclasses.replace(base, banned_words=words)

    outputs = {}
    for method in METHODS:
        dec = SpeculativeDecoder(target, make_drafter(method, target, draft), eos_token_ids=[EOS], tokenizer=tok)
        stream, text, prefixes = run_stream(dec, prompt, config, tokenizer=tok)
        assert stream.stats.num_banned_word_rollbacks > 0, method
        assert stream.forbidden_tokens, method
        assert len(stream.token_ids) == n and stream.finish_reason == "length", (method, stream.finish_reason)
        for w in words:
            assert all(w not in shown for shown in prefixes), (method, w)
        assert_masks_respected(stream)
        expected = masked_greedy_reference(target, prompt, n, stream.forbidden_tokens)
        assert stream.token_ids == expected, (arch, method, words, stream.forbidden_tokens)
        outputs[method] = stream.token_ids
    assert len({tuple(v) for v in outputs.values()}) == 1, outputs


# ------------------------------------------------------------------ 6. bad input


@pytest.mark.parametrize(
    "words, message",
    [
        (("",), "a banned word must be a non-empty string with a non-space character, got ''"),
        (("   ",), "a banned word must be a non-empty string with a non-space character, got '   '"),
        (("ok", "\t\n"), r"got '\t\n'"),
        (("ok", None), "got None"),
        (None, "banned_words must be a list of strings, got None"),
    ],
)
def test_bad_banned_words_are_refused(words, message):
    with pytest.raises(InvalidArgumentError) as e:
        GenerationConfig(banned_words=words)
    assert message in str(e.value)


def test_a_single_string_is_one_word_and_duplicates_merge():
    assert GenerationConfig(banned_words="hamburger").banned_words == ("hamburger",)
    assert GenerationConfig(banned_words=["a b", "x", "a b"]).banned_words == ("a b", "x")


def test_banned_words_need_a_tokenizer(ham_models):
    target, _ = ham_models
    with pytest.raises(InvalidArgumentError, match="banned_words need a tokenizer; pass tokenizer= to the decoder"):
        SpeculativeDecoder(target).generate(HAM_PROMPT, GenerationConfig(banned_words=("x",)))


def test_read_banned_words(tmp_path):
    good = tmp_path / "words.txt"
    good.write_text("  hamburger \n\n bad word\n\t\nhamburger\n", encoding="utf-8")
    assert read_banned_words(good) == ["hamburger", "bad word", "hamburger"]
    assert GenerationConfig(banned_words=tuple(read_banned_words(str(good)))).banned_words == ("hamburger", "bad word")

    missing = tmp_path / "nope" / "words.txt"
    with pytest.raises(InvalidArgumentError) as e:
        read_banned_words(missing)
    assert str(e.value) == f"banned-words file {str(missing)!r} does not exist"

    blank = tmp_path / "blank.txt"
    blank.write_text(" \n\n\t\n", encoding="utf-8")
    with pytest.raises(InvalidArgumentError, match=r"holds no word \(one per line\)"):
        read_banned_words(blank)

    latin1 = tmp_path / "latin1.txt"
    latin1.write_bytes("caf\xe9\n".encode("latin-1"))
    with pytest.raises(InvalidArgumentError, match=r"cannot read banned-words file '.*latin1\.txt'"):
        read_banned_words(latin1)

    with pytest.raises(InvalidArgumentError, match="cannot read banned-words file"):
        read_banned_words(tmp_path)  # a folder


@pytest.mark.parametrize(
    "args, message",
    [
        (["--banned-words-file", "/nonexistent/banned.txt"],
         "banned-words file '/nonexistent/banned.txt' does not exist"),
        (["--banned-word", ""], "a banned word must be a non-empty string with a non-space character, got ''"),
        (["--banned-word", "ok", "--banned-word", "  "], "got '  '"),
    ],
)
def test_cli_refuses_bad_banned_words_before_loading_models(capsys, monkeypatch, args, message):
    from specdecode import cli, pipeline

    def no_loading(*a, **k):
        raise AssertionError("models were loaded before the banned words were checked")

    monkeypatch.setattr(pipeline.SpeculativeGenerator, "from_pretrained", no_loading)
    code = cli.main(["generate", "--prompt", "x", *args])
    out, err = capsys.readouterr()
    assert code == 2
    assert message in err and err.startswith("specdecode: error: ")
    assert out == ""


# ------------------------------------------------------------------ 7. sampling


@pytest.mark.parametrize("method", ["autoregressive", "draft-model", "layer-skip"])
def test_sampling_never_produces_a_banned_word(ham_models, method):
    target, draft = ham_models
    dec = ham_decoder(method, ham_models)
    n = 30
    with steered([target, draft], HAM):
        free = [dec.generate(HAM_PROMPT, dataclasses.replace(GREEDY, temperature=1.0, seed=s)).text for s in range(n)]
        assert sum("hamburger" in t for t in free) >= 0.8 * n  # the word is the model's strong favourite
        for warp in [{}, {"top_k": 3}, {"top_p": 0.9}]:
            texts = []
            for seed in range(n):
                config = dataclasses.replace(
                    GREEDY, temperature=1.0, seed=seed, banned_words=("hamburger",), **warp
                )
                stream, text, prefixes = run_stream(dec, HAM_PROMPT, config)
                assert all("hamburger" not in shown for shown in prefixes), (warp, seed, text)
                assert stream.finish_reason == "eos"
                assert_masks_respected(stream)
                texts.append(text)
            assert len(set(texts)) >= 2, (warp, texts)  # still sampling, not one forced path
            # The same seed gives the same output.
            again = dec.generate(HAM_PROMPT, dataclasses.replace(config, seed=0)).text
            assert again == texts[0]


# ------------------------------------------------------------------ when nothing is left


def test_every_token_forbidden_ends_with_banned_word():
    """A vocabulary of four text tokens, all banned: nothing can be generated at position 0."""
    vocab = {"a": 0, "b": 1, "c": 2, "d": 3}
    inner = Tokenizer(models.WordLevel(vocab=vocab, unk_token="a"))
    inner.decoder = decoders.Fuse()
    tok = PreTrainedTokenizerFast(tokenizer_object=inner, clean_up_tokenization_spaces=False)
    target = make_tiny_model("llama", vocab_size=4, pad_token_id=None, bos_token_id=None, eos_token_id=None)
    for method in ("autoregressive", "prompt-lookup"):
        drafter = None if method == "autoregressive" else PromptLookupDrafter()
        dec = SpeculativeDecoder(target, drafter, tokenizer=tok)
        config = GenerationConfig(max_new_tokens=6, banned_words=("a", "b", "c", "d"), stop_on_eos=False)
        stream, text, prefixes = run_stream(dec, [0, 1, 2, 3, 0, 1], config, tokenizer=tok)
        assert stream.token_ids == [] and text == "" and prefixes == []
        assert stream.finish_reason == "banned_word"
        assert sorted(stream.forbidden_tokens[0]) == [0, 1, 2, 3] and list(stream.forbidden_tokens) == [0]
        assert stream.stats.num_banned_word_rollbacks == 4
        # One banned word less: the remaining token fills the budget.
        stream, text, _ = run_stream(dec, [0, 1, 2, 3, 0, 1], dataclasses.replace(config, banned_words=("a", "b", "c")),
                                     tokenizer=tok)
        assert text == "dddddd" and stream.finish_reason == "length"


# ------------------------------------------------------------------ rollback into released tokens
#
# A token is released ("safe") when the text after it shows that no banned word can start in
# it. A later rollback can remove that text, and the released token is then open again: the
# next token can complete a banned word that starts in it. The decoder then gives up
# (finish_reason "banned_word") although the word could be avoided at the next position,
# and, with whole-word matching, the released text it returns can itself end in a banned word.

# " ham" " and" " fries" is spelled first, then " ham" "burger".
GIVE_UP = {
    "<s>": ["I"],
    "I": [" like"],
    " like": [" ham"],
    " ham": [" and", "burger", "."],
    " and": [" fries"],
    ".": ["</s>"],
}
# " ham" "." "x" " and" first; once "x" is forbidden after ".", EOS.
WHOLE_AT_END = {
    "<s>": ["I"],
    "I": [" like"],
    " like": [" ham"],
    " ham": ["."],
    ".": ["x", "</s>"],
    "x": [" and"],
    " and": [" fries"],
}


@pytest.mark.parametrize("method", ["autoregressive", "draft-model"])
def test_no_give_up_while_the_word_can_still_be_avoided(ham_models, method):
    """(" ham" is released once " and" follows it; " and" is rolled back for "and fries"; then
    " ham"+"burger" spells "hamburger", which starts in the released " ham".) Masking "burger"
    at position 1 avoids it without taking anything back: the greedy output is then " ham.".
    """
    target, draft = ham_models
    config = dataclasses.replace(GREEDY, banned_words=("hamburger", "and fries"))
    with steered([target, draft], GIVE_UP):
        stream, text, _ = run_stream(ham_decoder(method, ham_models), BADGER_PROMPT, config)
    assert "hamburger" not in text and "and fries" not in text
    assert stream.finish_reason != "banned_word", (text, stream.forbidden_tokens)
    assert text == " ham."


@pytest.mark.parametrize("method", ["autoregressive", "draft-model"])
def test_whole_word_output_never_ends_in_a_banned_word(ham_models, method):
    """Whole-word "ham." is not a match in " ham.x", so " ham" "." are released; "x" is then
    rolled back (whole-word "x" in "x and") and EOS follows ".": the text ends with "ham.".
    """
    target, draft = ham_models
    config = dataclasses.replace(GREEDY, banned_words=("ham.", "x"), banned_words_whole_word=True)
    with steered([target, draft], WHOLE_AT_END):
        stream, text, prefixes = run_stream(ham_decoder(method, ham_models), BADGER_PROMPT, config)
    whole = r"(?<!\w)ham\.(?!\w)"
    assert not re.search(whole, text), (text, stream.finish_reason, stream.forbidden_tokens)
