"""The server's ``bad_words`` (vLLM's name) through the official openai client on real HTTP: the output is
target-only decoding with the same banned words (matched on the text, rolled back), for completions and chat;
a stream never shows a word, not even in part; a request whose words leave no token ends with
"content_filter"; bad values are refused with OpenAI's error body."""

from __future__ import annotations

import openai
import pytest
from tokenizers import Tokenizer, decoders, models
from transformers import PreTrainedTokenizerFast

from conftest import make_tiny_model
from helpers import perturbed_copy, save_tiny_folders
from serve_helpers import folders, generator, running_server, server  # noqa: F401 -- fixtures
from serve_helpers import decoded as text, openai_client as client, target_only as alone

PROMPT = "w5 w9 w11 w7"
CHAT = [{"role": "user", "content": "w9 w11"}]


@pytest.mark.parametrize("chat", [False, True], ids=["completions", "chat"])
def test_bad_words_give_target_only_decoding_with_the_same_words(server, generator, chat):
    """Greedy: a phrase of the output's own (two words) is banned; the server's text is target-only decoding with
    that word list, has no phrase, and differs from the output without it."""
    url, _, _ = server
    prompt = CHAT[0]["content"] if chat else PROMPT
    plain = text(generator, alone(generator, prompt, chat).token_ids)
    phrase = " ".join(plain.split()[2:4])
    assert len(phrase.split()) == 2, plain
    want = text(generator, alone(generator, prompt, chat, banned_words=(phrase,)).token_ids)
    assert phrase not in want and want != plain
    c = client(url)
    if chat:
        got = c.chat.completions.create(model="tiny", messages=CHAT, max_tokens=20, temperature=0,
                                        extra_body={"bad_words": [phrase]})
        assert got.choices[0].message.content == want
    else:
        got = c.completions.create(model="tiny", prompt=PROMPT, max_tokens=20, temperature=0,
                                   extra_body={"bad_words": [phrase]})
        assert got.choices[0].text == want
    assert got.choices[0].finish_reason == "length"


def test_a_stream_never_shows_a_bad_word_and_ends_as_the_whole_answer(server, generator):
    """Sampling, several seeds, a word drawn often: no prefix of the streamed text holds it, and the streamed text
    is the non-streamed answer with the same seed."""
    url, _, _ = server
    c = client(url)
    words = [w for w in text(generator, alone(generator, PROMPT, False).token_ids).split()][:2]
    rolled = 0
    for seed in range(4):
        options = dict(model="tiny", prompt=PROMPT, max_tokens=20, temperature=1.0, seed=seed,
                       extra_body={"bad_words": words})
        whole = c.completions.create(**options).choices[0].text
        shown = ""
        for chunk in c.completions.create(stream=True, **options):
            shown += chunk.choices[0].text if chunk.choices else ""
            assert not any(w in shown for w in words), (seed, shown)
        assert shown == whole
        free = c.completions.create(model="tiny", prompt=PROMPT, max_tokens=20, temperature=1.0, seed=seed)
        rolled += any(w in free.choices[0].text for w in words)
    assert rolled, "without bad_words some answer must hold a word for this test to mean anything"


@pytest.mark.parametrize(("bad_words", "message"), [
    ([""], "bad_words must be non-empty strings with a non-space character, got ''"),
    (["w5", "  "], "bad_words must be non-empty strings with a non-space character, got '  '"),
    (["w"] * 1001, "at most 1000 bad_words are allowed, got 1001"),
    (["w5", "x" * 101], "a bad word may have at most 100 characters, got 101: 'xxxxxxxxxxxxxxxxxxxx'..."),
    ("w5", "valid list"),
    ([5], "valid string"),
    ([["w5"]], "valid string"),
])
def test_bad_values_are_refused_with_openai_errors(server, bad_words, message):
    url, _, _ = server
    with pytest.raises(openai.BadRequestError) as info:
        client(url).completions.create(model="tiny", prompt=PROMPT, max_tokens=4,
                                       extra_body={"bad_words": bad_words})
    error = info.value.body
    assert info.value.status_code == 400 and error["param"].startswith("bad_words"), error
    assert message in error["message"] and error["code"] == "invalid_value", error


def test_null_and_an_empty_list_mean_no_words_and_each_choice_keeps_its_own(server, generator):
    """``null`` and ``[]`` change nothing; with n = 3 sampled choices, none holds a word."""
    url, _, _ = server
    c = client(url)
    plain = c.completions.create(model="tiny", prompt=PROMPT, max_tokens=12, temperature=0).choices[0].text
    for empty in (None, []):
        got = c.completions.create(model="tiny", prompt=PROMPT, max_tokens=12, temperature=0,
                                   extra_body={"bad_words": empty})
        assert got.choices[0].text == plain
    words = plain.split()[:2]
    assert len(words) == 2, plain
    got = c.completions.create(model="tiny", prompt=PROMPT, max_tokens=12, temperature=1.0, seed=5, n=3,
                               extra_body={"bad_words": words})
    assert len(got.choices) == 3 and not any(w in ch.text for ch in got.choices for w in words), got.choices


def _four_token_folders(root):
    """A tiny llama of four text tokens, "a" to "d" (no special token), its draft and tokenizer."""
    inner = Tokenizer(models.WordLevel(vocab={"a": 0, "b": 1, "c": 2, "d": 3}, unk_token="a"))
    inner.decoder = decoders.Fuse()
    tok = PreTrainedTokenizerFast(tokenizer_object=inner, clean_up_tokenization_spaces=False)
    target = make_tiny_model("llama", vocab_size=4, pad_token_id=None, bos_token_id=None, eos_token_id=None)
    return save_tiny_folders(root, tok, target, perturbed_copy(target, noise=0.1, seed=1))


def test_words_that_leave_no_token_end_with_content_filter(tmp_path):
    """Every token of the vocabulary banned: the answer is empty, its finish_reason "content_filter"; three of
    four banned: the fourth fills it."""
    from specdecode.pipeline import SpeculativeGenerator

    target, draft = _four_token_folders(tmp_path)
    gen = SpeculativeGenerator.from_pretrained(str(target), str(draft), dtype="float32", device="cpu")
    with running_server(gen) as (url, _, _):
        c = client(url)
        none = c.completions.create(model="tiny", prompt=[0, 1, 2, 3, 0, 1], max_tokens=6, temperature=0,
                                    extra_body={"bad_words": ["a", "b", "c", "d"]})
        assert (none.choices[0].text, none.choices[0].finish_reason) == ("", "content_filter")
        one = c.completions.create(model="tiny", prompt=[0, 1, 2, 3, 0, 1], max_tokens=6, temperature=0,
                                   extra_body={"bad_words": ["a", "b", "c"]})
        assert (one.choices[0].text, one.choices[0].finish_reason) == ("dddddd", "length")


def test_the_servers_words_apply_to_every_request_with_its_own(generator):
    """``serve --banned-word`` / ``--banned-words-file`` (``ServeSettings.banned_words``): a request without
    ``bad_words`` gets target-only decoding with the server's words; one with its own gets both lists;
    ``--banned-words-ignore-case`` applies to both."""
    plain = text(generator, alone(generator, PROMPT, False).token_ids).split()
    assert len(set(plain)) >= 4, plain
    server_word, request_word = " ".join(plain[2:4]), plain[0]
    with running_server(generator, banned_words=(server_word,), banned_words_ignore_case=True) as (url, _, _):
        c = client(url)
        for words, sent in (((server_word,), None), ((server_word, request_word.upper()), [request_word.upper()])):
            want = alone(generator, PROMPT, False, banned_words=words, banned_words_ignore_case=True).token_ids
            got = c.completions.create(model="tiny", prompt=PROMPT, max_tokens=20, temperature=0,
                                       extra_body={"bad_words": sent})
            assert got.choices[0].text == text(generator, want), words
            assert not any(w.lower() in got.choices[0].text.lower() for w in words)
        assert text(generator, want) != text(generator, alone(generator, PROMPT, False, banned_words=(
            server_word,)).token_ids), "the request's word must change the answer for this test to mean anything"


def test_serve_reads_its_banned_word_flags_before_loading(tmp_path):
    """The flags become ``ServeSettings``' words (the file's after --banned-word's); a file that cannot be read is
    refused with its name, as generate refuses it."""
    from specdecode.cli import build_parser
    from specdecode.errors import InvalidArgumentError
    from specdecode.serve.command import serve_settings

    words = tmp_path / "words.txt"
    words.write_text("w9\n\n  w11 w7  \n", encoding="utf-8")
    args = build_parser().parse_args(["serve", "--banned-word", "w5", "--banned-words-file", str(words),
                                      "--banned-words-whole-word"])
    settings = serve_settings(args, 256, 5)
    assert settings.banned_words == ("w5", "w9", "w11 w7") and settings.banned_words_whole_word
    assert not settings.banned_words_ignore_case
    args = build_parser().parse_args(["serve", "--banned-words-file", str(tmp_path / "missing.txt")])
    with pytest.raises(InvalidArgumentError, match="missing.txt"):
        serve_settings(args, 256, 5)


@pytest.mark.parametrize(("flags", "message"), [
    (["--banned-words-file", "/nonexistent/banned.txt"], "banned-words file '/nonexistent/banned.txt' does not exist"),
    (["--banned-word", "ok", "--banned-word", "  "], "got '  '"),
])
def test_serve_refuses_bad_banned_word_flags_before_loading_models(tmp_path, monkeypatch, flags, message):
    from serve_helpers import tiny_chat_folders
    from specdecode.cli import build_parser
    from specdecode.errors import InvalidArgumentError
    from specdecode.pipeline import SpeculativeGenerator
    from specdecode.serve.command import load_server

    def no_loading(*a, **k):
        raise AssertionError("models were loaded before the banned words were checked")

    monkeypatch.setattr(SpeculativeGenerator, "from_pretrained", no_loading)
    target, draft = tiny_chat_folders(tmp_path)
    args = build_parser().parse_args(["serve", "--target", str(target), "--draft", str(draft), "--dtype", "float32",
                                      "--device", "cpu", "--port", "0", "--no-warmup", *flags])
    with pytest.raises(InvalidArgumentError, match=message):
        load_server(args)
