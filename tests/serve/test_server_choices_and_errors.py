"""The server's n choices, a message's name, its metrics' labels and every error path's code, over
real HTTP on loopback (uvicorn in a thread), with the official openai client and raw httpx."""

from __future__ import annotations

import re

import httpx
import openai
import pytest

from serve_helpers import CHAT_TEMPLATE, folders, generator, running_server, server  # noqa: F401 -- fixtures
from specdecode.config import GenerationConfig
from specdecode.pipeline import SpeculativeGenerator

PROMPT = "w5 w9 w11 w7"
#: CHAT_TEMPLATE, but a message's name is written before its content.
NAME_TEMPLATE = CHAT_TEMPLATE.replace("{{ m['content'] }}", "{% if m['name'] is defined %}w6 {{ m['name'] }} "
                                      "{% endif %}{{ m['content'] }}")


def client(url: str, key: str = "unused") -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{url}/v1", api_key=key, max_retries=0, timeout=60)


def alone(generator, text: str, max_tokens: int, chat: bool) -> list[int]:
    return generator.generate(text, GenerationConfig(max_new_tokens=max_tokens), method="autoregressive",
                              chat=chat).token_ids


# -- n choices --------------------------------------------------------------------------------------


def test_n_choices_are_rows_with_their_own_seeded_sampler(server, generator):
    """n = 3 with seed 11 gives what the batched engine gives for three rows of the prompt seeded 11, 12
    and 13 that join together (a row's draft length depends on how many rows share the verification,
    and with it how many random numbers its sampler draws: a seeded sample is reproducible for the
    same batch)."""
    url, _, _ = server
    c = client(url)
    r = c.completions.create(model="tiny", prompt=PROMPT, max_tokens=12, temperature=1.0, seed=11, n=3)
    assert [ch.index for ch in r.choices] == [0, 1, 2]
    again = c.completions.create(model="tiny", prompt=PROMPT, max_tokens=12, temperature=1.0, seed=11, n=3)
    assert [ch.text for ch in again.choices] == [ch.text for ch in r.choices]  # reproducible

    ids = generator.encode(PROMPT, chat=False)[0].tolist()
    rows = generator.batch_decoder("draft", max_batch_size=4, max_length=256).generate(
        [ids] * 3, [GenerationConfig(max_new_tokens=12, temperature=1.0, seed=11 + i) for i in range(3)])
    assert [ch.text for ch in r.choices] == [generator.tokenizer.decode(row.token_ids, skip_special_tokens=True)
                                             for row in rows]  # choice i: its own row, seed + i
    assert len({ch.text for ch in r.choices}) > 1  # each row samples on its own
    assert r.usage.completion_tokens == sum(len(row.token_ids) for row in rows)
    assert r.usage.prompt_tokens == len(ids)
    assert r.model_extra["speculative"]["num_drafted_tokens"] == sum(row.stats.num_drafted_tokens for row in rows)
    other = c.completions.create(model="tiny", prompt=PROMPT, max_tokens=12, temperature=1.0, seed=12, n=3)
    assert other.choices[0].text != r.choices[0].text or other.choices[1].text != r.choices[1].text


def test_n_greedy_choices_all_equal_target_only_decoding(server, generator):
    url, _, _ = server
    r = client(url).chat.completions.create(model="tiny", messages=[{"role": "user", "content": PROMPT}],
                                            max_tokens=16, temperature=0, n=2)
    expected = generator.tokenizer.decode(alone(generator, PROMPT, 16, chat=True), skip_special_tokens=True)
    assert [ch.message.content for ch in r.choices] == [expected, expected]
    assert [ch.index for ch in r.choices] == [0, 1]


def test_n_streamed_choices_carry_their_index(server):
    url, _, _ = server
    c = client(url)
    kwargs = dict(model="tiny", messages=[{"role": "user", "content": PROMPT}], max_tokens=14, temperature=0.8,
                  seed=5, n=3)
    full = c.chat.completions.create(**kwargs)
    chunks = list(c.chat.completions.create(**kwargs, stream=True, stream_options={"include_usage": True}))
    texts, reasons, roles = {}, {}, set()
    for ch in chunks[:-1]:
        (choice,) = ch.choices
        texts[choice.index] = texts.get(choice.index, "") + (choice.delta.content or "")
        roles |= {choice.index} if choice.delta.role == "assistant" else set()
        if choice.finish_reason is not None:
            reasons[choice.index] = choice.finish_reason
    assert roles == {0, 1, 2}
    assert texts == {ch.index: ch.message.content for ch in full.choices}
    assert reasons == {ch.index: ch.finish_reason for ch in full.choices}
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == full.usage.completion_tokens

    raw = list(c.completions.create(model="tiny", prompt=PROMPT, max_tokens=6, temperature=0, n=2, stream=True))
    by_index = {i: "".join(ch.choices[0].text for ch in raw if ch.choices[0].index == i) for i in (0, 1)}
    assert by_index[0] == by_index[1] != ""


@pytest.mark.parametrize("n", [0, 5, 129])
def test_n_out_of_range_is_a_400(server, n):
    url, engine, _ = server
    with pytest.raises(openai.BadRequestError) as e:
        client(url).completions.create(model="tiny", prompt=PROMPT, max_tokens=4, n=n)
    assert e.value.body["param"] == "n" and e.value.body["code"] == "invalid_value"
    assert engine.outstanding == 0


# -- a message's name ------------------------------------------------------------------------------


def test_a_name_the_template_ignores_is_refused_naming_the_field(server):
    url, engine, _ = server
    messages = [{"role": "system", "content": "w8"}, {"role": "user", "content": PROMPT, "name": "w7"}]
    with pytest.raises(openai.BadRequestError) as e:
        client(url).chat.completions.create(model="tiny", messages=messages, max_tokens=4)
    body = e.value.body
    assert body["param"] == "messages.1.name" and body["code"] == "unsupported_parameter"
    assert "does not use a message's name" in body["message"]
    assert engine.outstanding == 0


def test_a_name_the_template_uses_reaches_it(folders):
    target, draft = folders
    gen = SpeculativeGenerator.from_pretrained(str(target), str(draft), dtype="float32", device="cpu")
    gen.tokenizer.chat_template = NAME_TEMPLATE
    with running_server(gen) as (url, _, _):
        c = client(url)
        plain = c.chat.completions.create(model="tiny", messages=[{"role": "user", "content": PROMPT}], max_tokens=4,
                                          temperature=0)
        named = c.chat.completions.create(model="tiny", max_tokens=4, temperature=0,
                                          messages=[{"role": "user", "content": PROMPT, "name": "w7"}])
    assert named.usage.prompt_tokens == plain.usage.prompt_tokens + 2  # "w6 w7" before the content


# -- metrics --------------------------------------------------------------------------------------


def test_metrics_count_the_api_finish_reasons(server):
    url, _, _ = server
    c = client(url)

    def successes() -> dict[str, float]:
        text = httpx.get(f"{url}/metrics").text
        return {k: float(v) for k, v in
                re.findall(r'^specdecode_request_success_total\{finish_reason="([^"]*)"\} (\S+)$', text, re.M)}

    before = successes()
    text = c.completions.create(model="tiny", prompt=PROMPT, max_tokens=20, temperature=0).choices[0].text
    r = c.completions.create(model="tiny", prompt=PROMPT, max_tokens=20, temperature=0, stop=[text.split()[2]])
    assert r.choices[0].finish_reason == "stop"
    after = successes()
    assert set(after) == {"stop", "length", "content_filter"}  # never the engine's own eos / stop_string / banned_word
    assert after["stop"] == before["stop"] + 1 and after["length"] == before["length"] + 1


# -- every error carries a code -------------------------------------------------------------------


def _error_code(r: httpx.Response) -> str:
    error = r.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}, r.text
    assert isinstance(error["code"], str) and error["code"], r.text
    return error["code"]


def test_every_error_path_answers_a_code(server, generator):
    url, _, _ = server
    long_prompt = " ".join(["w9"] * 300)
    chat = "/v1/chat/completions"
    cases = [
        ("POST", "/v1/completions", {"json": {"prompt": PROMPT, "temperature": 3}}, 400, "invalid_value"),
        ("POST", "/v1/completions", {"json": {"prompt": PROMPT, "foo": 1}}, 400, "unrecognized_argument"),
        ("POST", "/v1/completions", {"json": {"max_tokens": 4}}, 400, "missing_required_parameter"),
        ("POST", "/v1/completions", {"content": b"{not json", "headers": {"content-type": "application/json"}},
         400, "invalid_json"),
        ("POST", chat, {"json": {"messages": [{"role": "user", "content": PROMPT}], "tools": [{"type": "function"}]}},
         400, "unsupported_parameter"),
        ("POST", "/v1/completions", {"json": {"prompt": PROMPT, "max_tokens": 10_000}}, 400, "invalid_value"),
        ("POST", "/v1/completions", {"json": {"prompt": long_prompt, "max_tokens": 4}}, 400,
         "context_length_exceeded"),
        ("POST", "/v1/completions", {"json": {"prompt": PROMPT, "max_tokens": 250}}, 400, "context_length_exceeded"),
        ("POST", "/v1/completions", {"json": {"prompt": PROMPT, "model": "gpt-4o"}}, 404, "model_not_found"),
        ("POST", "/v1/completions", {"json": {"prompt": [5, 4000], "max_tokens": 4}}, 400, "invalid_value"),
        ("POST", "/v1/completions", {"json": {"prompt": PROMPT, "n": 9}}, 400, "invalid_value"),
        ("POST", "/v1/completions", {"json": {"prompt": PROMPT, "logit_bias": {"\u00b2": 1}}}, 400,
         "invalid_value"),  # "²".isdigit(), but not an int(): once a 500
        ("POST", "/v1/completions", {"content": b'{"prompt": "w5 \\ud800"}', "headers": {"content-type":
         "application/json"}}, 400, "invalid_value"),  # a lone surrogate: the tokenizer's TypeError was a 500
        ("POST", chat, {"content": b'{"messages": [{"role": "user", "content": "\\udc00 w5"}]}', "headers": {
            "content-type": "application/json"}}, 400, "invalid_value"),
        ("POST", chat, {"json": {"messages": [{"role": "assistant", "content": "w5"}]}}, 400, "invalid_messages"),
        ("POST", chat, {"json": {"messages": [{"role": "user", "content": "w5", "name": "w7"}]}}, 400,
         "unsupported_parameter"),
        ("POST", "/v1/completions", {"content": b"x" * (2 << 20)}, 413, "request_too_large"),
        ("POST", "/v1/completions", {"content": iter([b'{"prompt": "w5"}'])}, 411, "length_required"),  # chunked
        ("GET", "/v1/nothing", {}, 404, "not_found"),
        ("GET", "/v1/completions", {}, 405, "method_not_allowed"),
    ]
    for method, path, kwargs, status, code in cases:
        r = httpx.request(method, f"{url}{path}", **kwargs)
        assert r.status_code == status, (path, kwargs, r.text)
        assert _error_code(r) == code, (path, kwargs, r.text)

    with running_server(generator, api_key="s3cret") as (key_url, _, _):
        r = httpx.get(f"{key_url}/v1/models")
        assert r.status_code == 401 and _error_code(r) == "invalid_api_key"


def test_failures_of_the_server_itself_answer_a_code(folders):
    target, draft = folders
    gen = SpeculativeGenerator.from_pretrained(str(target), str(draft), dtype="float32", device="cpu")
    with running_server(gen) as (url, engine, gate):
        def broken_step():
            raise RuntimeError("the device fell over")

        gate._step = broken_step  # every round fails: the engine ends its requests with an error
        r = httpx.post(f"{url}/v1/completions", json={"prompt": PROMPT, "max_tokens": 4})
        assert r.status_code == 500 and _error_code(r) == "generation_failed"
        assert "the device fell over" in r.json()["error"]["message"]
        with httpx.stream("POST", f"{url}/v1/completions",
                          json={"prompt": PROMPT, "max_tokens": 4, "stream": True}) as s:
            events = [line[len("data: "):] for line in s.iter_lines() if line.startswith("data: ")]
        assert events[-1] == "[DONE]" and '"code":"generation_failed"' in events[-2]

        def broken_encode(*args, **kwargs):
            raise RuntimeError("tokenizer exploded")

        gen.encode = broken_encode  # an unexpected exception in a handler
        r = httpx.post(f"{url}/v1/completions", json={"prompt": PROMPT, "max_tokens": 4})
        assert r.status_code == 500 and _error_code(r) == "internal_error"

        engine.begin_shutdown(0.0)
        r = httpx.post(f"{url}/v1/completions", json={"prompt": [5, 6], "max_tokens": 4})
        assert r.status_code == 503 and _error_code(r) == "unavailable"


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_logprobs_the_engine_got_wrong_answer_a_clear_internal_error_streamed_or_not(folders, path):
    """Logprobs that do not describe their tokens (an engine bug; no request field can cause it) once raised a
    ValueError from logprobs_json: a 500 naming only "ValueError", and a stream cut off after its status 200
    without an error or [DONE]. Now the response says what failed, and a stream ends with the error's body and
    [DONE]."""
    target, draft = folders
    gen = SpeculativeGenerator.from_pretrained(str(target), str(draft), dtype="float32", device="cpu")
    with running_server(gen) as (url, engine, gate):
        step = gate._step

        def lossy_step():  # each event's last logprob goes missing
            events = step()
            for event in events:
                if event.logprobs:
                    event.logprobs = event.logprobs[:-1]
            return events

        gate._step = lossy_step
        body = ({"prompt": PROMPT} if path == "/v1/completions" else
                {"messages": [{"role": "user", "content": "w9 w11"}]})
        body.update(max_tokens=6, temperature=0, logprobs=1 if path == "/v1/completions" else True)
        r = httpx.post(f"{url}{path}", json=body, timeout=60)
        assert r.status_code == 500 and _error_code(r) == "internal_error", r.text
        error = r.json()["error"]
        assert error["type"] == "server_error"
        assert "the logprobs do not match the generated tokens" in error["message"], error
        with httpx.stream("POST", f"{url}{path}", json={**body, "stream": True}, timeout=60) as s:
            assert s.status_code == 200
            events = [line[len("data: "):] for line in s.iter_lines() if line.startswith("data: ")]
        assert events[-1] == "[DONE]", events
        assert '"code":"internal_error"' in events[-2] and "the logprobs do not match" in events[-2], events
        gate._step = step
        r = httpx.post(f"{url}{path}", json=body, timeout=60)  # the server goes on
        assert r.status_code == 200, r.text
        assert engine.outstanding == 0
