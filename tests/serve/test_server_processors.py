"""The server's processor fields (issue 31) through the official openai client on real HTTP:
penalties, min_p, logit_bias, stop_token_ids, logprobs / top_logprobs; each equals autoregressive
decoding with the same settings, and one test each shows the field changes the output."""

from __future__ import annotations

import openai
import pytest

from serve_helpers import folders, generator, server  # noqa: F401 -- fixtures
from serve_helpers import decoded as text, openai_client as client, target_only as alone

PROMPT = "w5 w9 w11 w7"
CHAT = [{"role": "user", "content": "w9 w11"}]


def added(generator, ids: list[int]) -> list[str]:
    """What each token adds to the text of ``ids`` (decoded without special tokens)."""
    return [text(generator, ids[: i + 1])[len(text(generator, ids[:i])):] for i in range(len(ids))]


def test_the_greedy_reference_repeats_and_a_penalty_changes_it(server, generator):
    url, _, _ = server
    plain = alone(generator, PROMPT, False, max_new_tokens=20)
    assert len(set(plain.token_ids)) < len(plain.token_ids), "the greedy output must repeat for this test"
    got = client(url).completions.create(model="tiny", prompt=PROMPT, max_tokens=20, temperature=0,
                                         frequency_penalty=2.0)
    want = alone(generator, PROMPT, False, frequency_penalty=2.0)
    assert got.choices[0].text == text(generator, want.token_ids) != text(generator, plain.token_ids)


@pytest.mark.parametrize(
    ("kwargs", "options"),
    [
        (dict(presence_penalty=2.0), dict(presence_penalty=2.0)),
        (dict(frequency_penalty=1.5), dict(frequency_penalty=1.5)),
        (dict(extra_body={"repetition_penalty": 1.8}), dict(repetition_penalty=1.8)),
        (dict(logit_bias={"9": 8.0, "11": -100}), dict(logit_bias={9: 8.0, 11: -100.0})),
    ],
    ids=["presence", "frequency", "repetition", "logit_bias"],
)
def test_each_greedy_processor_equals_autoregressive_and_changes_the_output(server, generator, kwargs, options):
    url, _, _ = server
    c = client(url)
    want = alone(generator, PROMPT, False, **options)
    assert want.token_ids != alone(generator, PROMPT, False).token_ids
    got = c.completions.create(model="tiny", prompt=PROMPT, max_tokens=20, temperature=0, **kwargs)
    assert got.choices[0].text == text(generator, want.token_ids)
    chat_want = alone(generator, CHAT[0]["content"], True, **options)
    chat = c.chat.completions.create(model="tiny", messages=CHAT, max_tokens=20, temperature=0, **kwargs)
    assert chat.choices[0].message.content == text(generator, chat_want.token_ids)


def test_min_p_one_keeps_only_the_top_token(server, generator):
    """min_p = 1 keeps only the most likely token: sampling then gives the greedy output, which
    sampling without it (same seed) does not."""
    url, _, _ = server
    c = client(url)
    greedy = text(generator, alone(generator, PROMPT, False).token_ids)
    sampled = [c.completions.create(model="tiny", prompt=PROMPT, max_tokens=20, temperature=1.0, seed=s,
                                    extra_body={"min_p": 1.0}).choices[0].text for s in range(3)]
    assert sampled == [greedy] * 3
    free = [c.completions.create(model="tiny", prompt=PROMPT, max_tokens=20, temperature=1.0,
                                 seed=s).choices[0].text for s in range(3)]
    assert any(f != greedy for f in free)


def test_stop_token_ids_end_the_output(server, generator):
    url, _, _ = server
    plain = alone(generator, PROMPT, False).token_ids
    stop = plain[4]
    r = client(url).completions.create(model="tiny", prompt=PROMPT, max_tokens=20, temperature=0,
                                       extra_body={"stop_token_ids": [stop]})
    assert r.choices[0].finish_reason == "stop"
    assert r.usage.completion_tokens == plain.index(stop) + 1


def test_chat_logprobs_equal_autoregressive_streamed_or_not(server, generator):
    url, _, _ = server
    c = client(url)
    want = alone(generator, CHAT[0]["content"], True, logprobs=True, top_logprobs=3, presence_penalty=1.0)
    r = c.chat.completions.create(model="tiny", messages=CHAT, max_tokens=20, temperature=0, logprobs=True,
                                  top_logprobs=3, presence_penalty=1.0)
    content = r.choices[0].logprobs.content
    assert len(content) == len(want.logprobs) == r.usage.completion_tokens
    ids = [lp.token_id for lp in want.logprobs]
    # A token is what it adds to the text (" w23" after "w9", where its own decode is "w23"), so the tokens
    # join to the message; its bytes are its own.
    assert [entry.token for entry in content] == added(generator, ids)
    assert "".join(entry.token for entry in content) == r.choices[0].message.content
    for i, (entry, lp) in enumerate(zip(content, want.logprobs)):
        assert entry.logprob == pytest.approx(lp.logprob, abs=1e-4) and entry.logprob <= 0
        assert [t.token for t in entry.top_logprobs] == [added(generator, ids[:i] + [t])[-1] for t, _ in lp.top]
        assert entry.bytes == list(generator.tokenizer.decode([lp.token_id]).encode("utf-8"))
        assert entry.top_logprobs[0].token == entry.token  # greedy: the top token is the chosen one
    stream = c.chat.completions.create(model="tiny", messages=CHAT, max_tokens=20, temperature=0, logprobs=True,
                                       top_logprobs=3, presence_penalty=1.0, stream=True)
    streamed = [e for chunk in stream if chunk.choices and chunk.choices[0].logprobs
                for e in chunk.choices[0].logprobs.content]
    assert [(e.token, e.logprob) for e in streamed] == [(e.token, e.logprob) for e in content]
    plain = c.chat.completions.create(model="tiny", messages=CHAT, max_tokens=5, temperature=0)
    assert plain.choices[0].logprobs is None


def test_completion_logprobs(server, generator):
    url, _, _ = server
    want = alone(generator, PROMPT, False, logprobs=True, top_logprobs=2)
    r = client(url).completions.create(model="tiny", prompt=PROMPT, max_tokens=20, temperature=0, logprobs=2)
    lp = r.choices[0].logprobs
    assert lp.tokens == added(generator, [e.token_id for e in want.logprobs])
    assert "".join(lp.tokens) == r.choices[0].text
    assert lp.token_logprobs == pytest.approx([e.logprob for e in want.logprobs], abs=1e-4)
    assert [len(t) for t in lp.top_logprobs] == [2] * len(lp.tokens)
    assert all(token in top for token, top in zip(lp.tokens, lp.top_logprobs))  # greedy: the chosen token leads
    assert lp.text_offset[0] == 0 and lp.text_offset == sorted(lp.text_offset)


def test_completion_text_offsets_point_into_the_returned_text_past_special_tokens(server, generator):
    """text_offset[i] is where token i starts in the returned text, as vLLM's: the text is decoded without
    special tokens, so a special token (here <pad> and <s>, which the bias makes the tiny model emit between
    words) adds no characters. The offsets once added each token's own decode, "<s>" included, so every
    offset after a special token pointed past where its token starts (and past the end of the text)."""
    url, _, _ = server
    tok = generator.tokenizer
    want = alone(generator, PROMPT, False, logit_bias={1: 1.0}, max_new_tokens=12)
    ids = want.token_ids
    special = set(tok.all_special_ids)
    assert any(t in special for t in ids[:-1]) and any(t not in special for t in ids), ids  # the case at hand
    expected = [len(tok.decode(ids[:i], skip_special_tokens=True)) for i in range(len(ids))]
    c = client(url)
    kwargs = dict(model="tiny", prompt=PROMPT, max_tokens=12, temperature=0, logprobs=0, logit_bias={"1": 1.0})
    r = c.completions.create(**kwargs)
    text, lp = r.choices[0].text, r.choices[0].logprobs
    assert text == tok.decode(ids, skip_special_tokens=True)
    assert lp.text_offset == expected
    # Each token's characters: from its offset to the next one's; together they are the text, and each is
    # the token's text in logprobs.tokens (it was the token's own decode: "<s>", and "w23" for " w23").
    pieces = [text[a:b] for a, b in zip(lp.text_offset, [*lp.text_offset[1:], len(text)])]
    assert "".join(pieces) == text == "".join(lp.tokens)
    assert lp.tokens == pieces
    assert all(p == "" for p, t in zip(pieces, ids) if t in special)
    assert all(p.strip() == tok.decode([t]) for p, t in zip(pieces, ids) if t not in special)
    streamed = [o for chunk in c.completions.create(**kwargs, stream=True)
                if chunk.choices and chunk.choices[0].logprobs for o in chunk.choices[0].logprobs.text_offset]
    assert streamed == expected


@pytest.mark.parametrize(
    ("create", "param", "needle"),
    [
        (dict(extra_body={"repetition_penalty": 0}), "repetition_penalty", "repetition_penalty"),
        # the logits overflowed to inf and the request failed with a 500 generation_failed
        (dict(extra_body={"repetition_penalty": 1e-300}), "repetition_penalty",
         "1e-300 (Input should be greater than or equal to 0.01)"),
        (dict(extra_body={"min_p": 1.5}), "min_p", "1.5"),
        (dict(logit_bias={"9": 150}), "logit_bias.9", "150 (Input should be less than or equal to 100)"),
        (dict(logit_bias={"9": -101}), "logit_bias.9", "-101 (Input should be greater than or equal to -100)"),
        (dict(logit_bias={"w9": 1}), "logit_bias", "token ids"),
        (dict(logit_bias={"4000": 1}), "logit_bias", "logit_bias names token id 4000, outside the target model's "
                                                     "vocabulary 0..47"),  # param was "prompt"
        (dict(extra_body={"stop_token_ids": [-1]}), "stop_token_ids.0", "-1"),
        (dict(extra_body={"stop_token_ids": [3, 4000]}), "stop_token_ids", "stop_token_ids names token id 4000"),
    ],
)
def test_bad_processor_values_get_400s_that_name_them(server, create, param, needle):
    url, engine, _ = server
    with pytest.raises(openai.BadRequestError) as e:
        client(url).completions.create(model="tiny", prompt=PROMPT, max_tokens=4, **create)
    assert needle in e.value.body["message"]
    assert e.value.body["param"] == param
    assert engine.outstanding == 0


def test_chat_top_logprobs_without_logprobs_is_refused(server):
    url, _, _ = server
    with pytest.raises(openai.BadRequestError) as e:
        client(url).chat.completions.create(model="tiny", messages=CHAT, max_tokens=4, top_logprobs=2)
    assert e.value.body["param"] == "top_logprobs" and "needs logprobs=true" in e.value.body["message"]


def test_temperature_top_p_and_seed_change_the_output(server, generator):
    """Sampling happens: temperature and seed change the text, a tiny top_p brings back the greedy
    text (only the top token is left), and the same seed gives the same text."""
    url, _, _ = server
    c = client(url)
    greedy = text(generator, alone(generator, PROMPT, False).token_ids)

    def sample(**kw) -> str:
        return c.completions.create(model="tiny", prompt=PROMPT, max_tokens=20, **kw).choices[0].text

    assert sample(temperature=0) == greedy
    by_seed = [sample(temperature=1.2, seed=s) for s in range(4)]
    assert any(t != greedy for t in by_seed) and len(set(by_seed)) > 1
    assert sample(temperature=1.2, seed=2) == by_seed[2]
    assert [sample(temperature=1.2, seed=s, top_p=1e-6) for s in range(4)] == [greedy] * 4


def test_a_masked_tokens_logprob_is_floored_in_json():
    from specdecode.engine.processors import TokenLogprob
    from specdecode.serve.openai_format import LOGPROB_FLOOR, logprobs_json

    entry = TokenLogprob(5, -0.1, ((5, -0.1), (7, float("-inf"))))
    chat = logprobs_json(True, [entry], None)
    assert chat["content"][0]["top_logprobs"][1]["logprob"] == LOGPROB_FLOOR
    completion = logprobs_json(False, [entry], None)
    assert completion["top_logprobs"] == [{"5": -0.1, "7": LOGPROB_FLOOR}] and completion["text_offset"] == [0]


def test_logprobs_json_offsets_without_given_ones_are_those_of_the_text_without_special_tokens():
    """A whole completion's offsets computed from its tokens: <pad> and <s> add no characters to the text."""
    from conftest import make_tiny_tokenizer
    from specdecode.engine.processors import TokenLogprob
    from specdecode.serve.openai_format import logprobs_json

    tok = make_tiny_tokenizer()
    ids = [0, 23, 1, 40, 23]  # text "w23 w40 w23"
    entries = [TokenLogprob(t, -1.0, ()) for t in ids]
    got = logprobs_json(False, entries, tok)
    assert got["tokens"] == ["", "w23", "", " w40", " w23"]  # was each token's own decode: "<pad>", "w40", ...
    assert got["text_offset"] == [0, 0, 3, 3, 7]  # it was [0, 5, 8, 11, 14]: each token's own decode added up
