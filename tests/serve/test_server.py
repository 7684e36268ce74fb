"""The OpenAI-compatible server, run by real uvicorn on loopback, driven by the official openai client."""

from __future__ import annotations

import asyncio
import json
import re
import time

import httpx
import openai
import pytest

from helpers import run_generate
from serve_helpers import folders, generator, running_server, server  # noqa: F401 -- fixtures
from specdecode.config import GenerationConfig
from specdecode.errors import InvalidArgumentError

PROMPT = "w5 w9 w11 w7"


def client(url: str, key: str = "unused") -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{url}/v1", api_key=key, max_retries=0, timeout=60)


def cli_json(capsys, folders, *args) -> dict:
    target, draft = folders
    code, out, err = run_generate(capsys, "--target", target, "--draft", draft, "--dtype", "float32", "--device",
                                  "cpu", "--json", *args)
    assert code == 0, err
    return json.loads(out)


def alone(generator, text: str, max_tokens: int, chat: bool) -> list[int]:
    """Greedy target-only decoding of one prompt, alone (the reference)."""
    return generator.generate(text, GenerationConfig(max_new_tokens=max_tokens), method="autoregressive",
                              chat=chat).token_ids


def metric(url: str, name: str, labels: str = "") -> float:
    text = httpx.get(f"{url}/metrics").text
    m = re.search(rf"^{re.escape(name)}{re.escape(labels)} (\S+)$", text, re.M)
    return float(m.group(1)) if m else 0.0


def wait_until(predicate, timeout_s: float = 20.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.05)
    return False


# -- greedy output equals `specdecode generate` ----------------------------------------------------


def test_completion_equals_specdecode_generate(server, folders, capsys, generator):
    url, _, _ = server
    ref = cli_json(capsys, folders, "--prompt", PROMPT, "--no-chat", "--max-new-tokens", 24)
    r = client(url).completions.create(model="tiny", prompt=PROMPT, max_tokens=24, temperature=0)
    assert r.choices[0].text == ref["text"]
    assert r.usage.completion_tokens == len(ref["token_ids"])
    assert r.usage.prompt_tokens == len(generator.encode(PROMPT, chat=False)[0])
    assert r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens
    assert r.choices[0].finish_reason == {"length": "length", "eos": "stop"}[ref["finish_reason"]]
    spec = r.model_extra["speculative"]
    assert ref["token_ids"] == alone(generator, PROMPT, 24, chat=False)
    assert spec["method"] == "draft" and spec["num_drafted_tokens"] > 0
    assert 0 <= spec["acceptance_rate"] <= 1 and spec["mean_accepted_tokens"] >= 1


def test_chat_equals_specdecode_generate_with_the_template(server, folders, capsys, generator):
    url, _, _ = server
    ref = cli_json(capsys, folders, "--prompt", PROMPT, "--chat", "--max-new-tokens", 24)
    r = client(url).chat.completions.create(model="tiny", messages=[{"role": "user", "content": PROMPT}],
                                            max_tokens=24, temperature=0)
    assert r.choices[0].message.role == "assistant"
    assert r.choices[0].message.content == ref["text"]
    assert r.usage.completion_tokens == len(ref["token_ids"])
    assert r.usage.prompt_tokens == len(generator.encode(PROMPT, chat=True)[0])
    assert ref["token_ids"] == alone(generator, PROMPT, 24, chat=True)


def test_streams_carry_the_same_text_usage_and_statistics(server):
    url, _, _ = server
    c = client(url)
    full = c.completions.create(model="tiny", prompt=PROMPT, max_tokens=30, temperature=0)
    chunks = list(c.completions.create(model="tiny", prompt=PROMPT, max_tokens=30, temperature=0, stream=True,
                                       stream_options={"include_usage": True}))
    assert "".join(ch.choices[0].text for ch in chunks if ch.choices) == full.choices[0].text
    assert [ch.choices[0].finish_reason for ch in chunks if ch.choices][-1] == full.choices[0].finish_reason
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == full.usage.completion_tokens
    assert all(ch.usage is None for ch in chunks[:-1])
    assert chunks[-1].model_extra["speculative"]["num_target_forwards"] >= 1

    chat_full = c.chat.completions.create(model="tiny", messages=[{"role": "user", "content": PROMPT}],
                                          max_tokens=30, temperature=0)
    chat_chunks = list(c.chat.completions.create(model="tiny", messages=[{"role": "user", "content": PROMPT}],
                                                 max_tokens=30, temperature=0, stream=True))
    assert chat_chunks[0].choices[0].delta.role == "assistant"
    assert "".join(ch.choices[0].delta.content or "" for ch in chat_chunks) == chat_full.choices[0].message.content
    assert chat_chunks[-1].choices[0].finish_reason == chat_full.choices[0].finish_reason
    assert all(ch.usage is None for ch in chat_chunks)  # no include_usage: no usage chunk
    assert "speculative" in chat_chunks[-1].model_extra


def test_raw_stream_ends_with_done(server):
    url, _, _ = server
    with httpx.stream("POST", f"{url}/v1/completions", json={"prompt": PROMPT, "max_tokens": 8, "stream": True,
                                                             "temperature": 0}) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        data = [line[len("data: "):] for line in r.iter_lines() if line.startswith("data: ")]
    assert data[-1] == "[DONE]"
    assert json.loads(data[-2])["choices"][0]["finish_reason"] in ("stop", "length")


def test_stop_strings_are_cut_from_the_text(server):
    url, _, _ = server
    c = client(url)
    text = c.completions.create(model="tiny", prompt=PROMPT, max_tokens=30, temperature=0).choices[0].text
    words = text.split()
    stop = f"{words[3]} {words[4]}"  # two words in the middle (may also occur earlier: cut at the first)
    expected = text[: text.index(stop)]
    r = c.completions.create(model="tiny", prompt=PROMPT, max_tokens=30, temperature=0, stop=[stop, "zzz"])
    assert r.choices[0].text == expected and r.choices[0].finish_reason == "stop"
    streamed = list(c.completions.create(model="tiny", prompt=PROMPT, max_tokens=30, temperature=0, stop=stop,
                                         stream=True))
    assert "".join(ch.choices[0].text for ch in streamed) == expected
    assert streamed[-1].choices[0].finish_reason == "stop"
    assert stop not in "".join(ch.choices[0].text for ch in streamed)


def test_finish_reason_length_and_usage(server):
    url, _, _ = server
    r = client(url).completions.create(model="tiny", prompt=PROMPT, max_tokens=3, temperature=0)
    assert r.choices[0].finish_reason == "length" and r.usage.completion_tokens == 3


def test_sampling_with_a_seed_is_reproducible(server):
    url, _, _ = server
    c = client(url)
    a, b = (c.completions.create(model="tiny", prompt=PROMPT, max_tokens=20, temperature=0.9, top_p=0.95, seed=7)
            for _ in range(2))
    assert a.choices[0].text == b.choices[0].text


def test_a_tiny_temperature_is_greedy_not_an_error(server, generator):
    url, _, _ = server
    r = client(url).completions.create(model="tiny", prompt=PROMPT, max_tokens=12, temperature=1e-38, seed=3)
    expected = generator.tokenizer.decode(alone(generator, PROMPT, 12, chat=False), skip_special_tokens=True)
    assert r.choices[0].text == expected


def test_null_fields_take_their_defaults(server):
    url, _, _ = server
    body = {"prompt": PROMPT, "max_tokens": 4, "temperature": None, "top_p": None, "n": None, "stream": None,
            "presence_penalty": None, "logprobs": None, "stop": None, "seed": None}
    r = httpx.post(f"{url}/v1/completions", json=body)
    assert r.status_code == 200, r.text
    # temperature null is OpenAI's default 1 with no seed: a random sample, which may end at EOS early.
    done = (r.json()["choices"][0]["finish_reason"], r.json()["usage"]["completion_tokens"])
    assert done == ("length", 4) or (done[0] == "stop" and 1 <= done[1] <= 4), done
    r = httpx.post(f"{url}/v1/completions", json={**body, "max_tokens": None})
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] <= 16  # OpenAI's default, 16


# -- errors ------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("kwargs", "param", "needle"),
    [
        (dict(n=5), "n", "at most 4 choices"),
        (dict(temperature=3.5), "temperature", "3.5"),
        (dict(top_p=0), "top_p", "top_p"),
        (dict(max_tokens=0), "max_tokens", "max_tokens"),
        (dict(max_tokens=10_000), "max_tokens", "at most"),
        (dict(extra_body={"foo": 1}), "foo", "Unrecognized request argument supplied: foo"),
        (dict(stop=["a", "b", "c", "d", "e"]), "stop", "at most 4"),
        (dict(logprobs=6), "logprobs", "logprobs"),
        (dict(presence_penalty=2.5), "presence_penalty", "2.5"),
        (dict(stream_options={"include_usage": True}), "stream_options", "stream=true"),
    ],
)
def test_bad_completion_requests_get_openai_shaped_400s(server, kwargs, param, needle):
    url, _, _ = server
    with pytest.raises(openai.BadRequestError) as e:
        client(url).completions.create(model="tiny", prompt=PROMPT, **{"max_tokens": 4, **kwargs})
    error = e.value.body
    assert set(error) == {"message", "type", "param", "code"} and error["code"]
    assert error["type"] == "invalid_request_error" and error["param"] == param and needle in error["message"]


def test_context_length_and_chat_errors(server):
    url, engine, _ = server
    c = client(url)
    long_prompt = " ".join(["w9"] * 300)  # the test server's rows hold 256 positions
    with pytest.raises(openai.BadRequestError) as e:
        c.completions.create(model="tiny", prompt=long_prompt, max_tokens=4)
    assert e.value.body["code"] == "context_length_exceeded" and "--max-length 256" in e.value.body["message"]
    with pytest.raises(openai.BadRequestError) as e:
        c.completions.create(model="tiny", prompt=PROMPT, max_tokens=250)
    assert e.value.body["code"] == "context_length_exceeded"
    with pytest.raises(openai.BadRequestError) as e:
        c.chat.completions.create(model="tiny", messages=[], max_tokens=4)
    assert e.value.body["param"] == "messages"
    with pytest.raises(openai.BadRequestError) as e:
        c.chat.completions.create(model="tiny", messages=[{"role": "wizard", "content": "w5"}], max_tokens=4)
    assert e.value.body["param"] == "messages.0.role"
    with pytest.raises(openai.BadRequestError) as e:
        c.chat.completions.create(model="tiny", messages=[{"role": "assistant", "content": "w5"}], max_tokens=4)
    assert "chat template refused" in e.value.body["message"] and "must not be the assistant" in e.value.body["message"]
    with pytest.raises(openai.BadRequestError) as e:
        c.completions.create(model="tiny", prompt=[5, 9, 4000], max_tokens=4)
    assert "4000" in e.value.body["message"] and "vocabulary" in e.value.body["message"]
    with pytest.raises(openai.BadRequestError) as e:
        c.completions.create(model="tiny", prompt=[5, -1], max_tokens=4)
    assert e.value.body["param"].startswith("prompt")
    with pytest.raises(openai.NotFoundError) as e:
        c.completions.create(model="gpt-4o", prompt=PROMPT, max_tokens=4)
    assert e.value.body["code"] == "model_not_found"
    assert engine.outstanding == 0  # nothing refused stayed in the engine


def test_raw_http_errors_are_openai_shaped(server):
    url, _, _ = server
    r = httpx.post(f"{url}/v1/completions", content=b"{not json", headers={"content-type": "application/json"})
    assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_json"
    r = httpx.post(f"{url}/v1/completions", json={"max_tokens": 4})
    assert r.status_code == 400 and r.json()["error"]["param"] == "prompt"
    r = httpx.post(f"{url}/v1/completions", content=b"x" * (2 << 20))
    assert r.status_code == 413 and "bytes" in r.json()["error"]["message"]
    r = httpx.get(f"{url}/v1/nothing")
    assert r.status_code == 404 and set(r.json()["error"]) == {"message", "type", "param", "code"}
    assert metric(url, "specdecode_request_errors_total", '{endpoint="other",type="not_found_error"}') >= 1
    assert metric(url, "specdecode_request_errors_total",
                  '{endpoint="/v1/completions",type="invalid_request_error"}') >= 3


@pytest.mark.parametrize(("content", "headers", "needle"), [
    # curl -d sends application/x-www-form-urlencoded: once "invalid value for 'the body': bytes (...)"
    (b'{"prompt": "w5"}', {"content-type": "application/x-www-form-urlencoded"},
     "must be JSON, sent with Content-Type: application/json; got Content-Type 'application/x-www-form-urlencoded'"),
    (b'{"prompt": "w5"}', {"content-type": "text/plain"}, "got Content-Type 'text/plain'"),
    (b"", {"content-type": "application/json"}, "the request body is empty"),  # once "None is a required property"
    ('{"prompt": "\xe9"}'.encode("latin-1"), {"content-type": "application/json"},
     "could not be read as JSON: send a JSON object in UTF-8"),  # once code "http_400"
])
def test_bodies_that_are_not_json_say_so(server, content, headers, needle):
    url, _, _ = server
    r = httpx.post(f"{url}/v1/completions", content=content, headers=headers)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["code"] == "invalid_json" and needle in r.json()["error"]["message"], r.text


@pytest.mark.parametrize(("path", "body", "param", "needle"), [
    # once param "prompt.str" and "Input should be a valid string" for a bad token id
    ("/v1/completions", {"prompt": [5, -1]}, "prompt.1", "-1 (Input should be greater than or equal to 0)"),
    ("/v1/completions", {"prompt": [[5, 9]]}, "prompt",
     "invalid value for 'prompt': list (it must be a string or a list of strings or a list of token ids"),
    ("/v1/completions", {"prompt": 5}, "prompt", "5 (it must be a string or"),
    ("/v1/completions", {"prompt": "w5", "stop": [1]}, "stop", "(it must be a string or a list of strings)"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]},
     "messages.0.content.0.type", "\"image_url\" (Input should be 'text')"),  # once "messages.0.content.str"
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": 5}]}, "messages.0.content",
     "it must be a string or a list of text parts"),
    # unknown fields that look like pydantic's names of a union's members are still unknown fields
    ("/v1/completions", {"prompt": "w5", "str": 1}, "str", "Unrecognized request argument supplied: str"),
    ("/v1/completions", {"prompt": "w5", "stream": True, "stream_options": {"TextPart": 1}},
     "stream_options.TextPart", "Unrecognized request argument supplied: stream_options.TextPart"),
    # keys the client chose are never a union's members: once "messages.0" and "(it must be A or B)"
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "w5", "Foo": 1, "Bar": 2}]},
     "messages.0.Foo", "Unrecognized request argument supplied: messages.0.Foo"),
    ("/v1/completions", {"prompt": "w5", "logit_bias": {"A": "x", "B": "y"}}, "logit_bias.A",
     "invalid value for 'logit_bias.A': \"x\""),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "w5"}], "tool_choice": 5}, "tool_choice",
     "(it must be a string or an object)"),
])
def test_a_value_of_none_of_a_fields_types_names_the_field(server, path, body, param, needle):
    url, _, _ = server
    r = httpx.post(f"{url}{path}", json={"max_tokens": 4, **body})
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == param and needle in error["message"], error


def test_rows_too_short_for_any_request_are_refused_at_start(generator):
    """--max-length 1 once started a server that answered every request with a 400."""
    from specdecode.serve.app import ServeSettings
    from specdecode.serve.command import build

    decoder = generator.batch_decoder("draft", max_batch_size=1, max_length=4)  # gamma 5: a block takes 6
    with pytest.raises(InvalidArgumentError, match=r"--max-length 4 leaves no room for a request: a row keeps 6 "
                                                   r"positions for a draft block.*use --max-length >= 8"):
        build(generator, decoder, max_queue=1, settings=ServeSettings(model_name="tiny", method="draft"))


def test_api_key_is_required_everywhere_but_health(generator):
    with running_server(generator, api_key="s3cret") as (url, _, _):
        with pytest.raises(openai.AuthenticationError) as e:
            client(url, "wrong").completions.create(model="tiny", prompt=PROMPT, max_tokens=2)
        assert e.value.status_code == 401 and e.value.body["code"] == "invalid_api_key"
        for path in ("/v1/models", "/metrics"):
            assert httpx.get(f"{url}{path}").status_code == 401
            assert httpx.get(f"{url}{path}", headers={"Authorization": "Bearer s3cret"}).status_code == 200
        assert httpx.get(f"{url}/health").status_code == 200
        r = client(url, "s3cret").completions.create(model="tiny", prompt=PROMPT, max_tokens=2, temperature=0)
        assert r.usage.completion_tokens == 2


# -- scheduling ----------------------------------------------------------------------------------------


def test_a_full_queue_answers_429_with_retry_after(generator):
    with running_server(generator, max_batch_size=1, max_queue=1) as (url, engine, gate):
        gate.close()  # no round runs: the first two requests stay running / queued
        c = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0, timeout=60)

        async def scenario():
            first = asyncio.create_task(c.completions.create(model="tiny", prompt=PROMPT, max_tokens=5,
                                                             temperature=0))
            second = asyncio.create_task(c.completions.create(model="tiny", prompt="w6 w7", max_tokens=5,
                                                              temperature=0))
            while engine.outstanding < 2:
                await asyncio.sleep(0.02)
            r = httpx.post(f"{url}/v1/completions", json={"prompt": PROMPT, "max_tokens": 5})
            gate.open()
            return r, await first, await second

        r, first, second = asyncio.run(scenario())
        assert r.status_code == 429 and r.headers["retry-after"] == "1"
        assert r.json()["error"]["type"] == "rate_limit_error" and r.json()["error"]["code"] == "queue_full"
        assert first.usage.completion_tokens == 5 and second.usage.completion_tokens == 5
        assert metric(url, "specdecode_requests_total", '{endpoint="/v1/completions",status="429"}') == 1


def test_a_disconnected_client_is_cancelled_and_its_row_freed(generator):
    with running_server(generator, max_length=512, delay_s=0.02) as (url, engine, gate):
        body = {"prompt": PROMPT, "max_tokens": 400, "stream": True, "temperature": 0}
        with httpx.stream("POST", f"{url}/v1/completions", json=body) as r:
            lines = r.iter_lines()
            assert next(line for line in lines if line.startswith("data: "))
            assert engine.running == 1
        # the connection is closed after one chunk; ~400 tokens would take many seconds
        assert wait_until(lambda: engine.running == 0 and engine.outstanding == 0)
        assert httpx.get(f"{url}/health").json() == {"status": "ok", "running": 0, "waiting": 0}
        assert metric(url, "specdecode_request_cancelled_total") == 1

        # the same for a non-streamed request whose client gives up while rounds keep delivering
        # tokens (every 0.02 s, more often than the 0.25 s idle check): ~400 tokens take seconds
        with pytest.raises(httpx.ReadTimeout):
            r = httpx.post(f"{url}/v1/completions", json={"prompt": PROMPT, "max_tokens": 400, "temperature": 0},
                           timeout=0.5)
            pytest.fail(f"the request ended before the client gave up: {r.status_code} {r.text[:300]}")
        assert wait_until(lambda: engine.outstanding == 0, timeout_s=3.0)
        assert metric(url, "specdecode_request_cancelled_total") == 2
        # never counted as successes, under any label
        assert metric(url, "specdecode_request_success_total", '{finish_reason="length"}') == 0
        assert metric(url, "specdecode_request_success_total", '{finish_reason="stop"}') == 0
        labels = re.findall(r'^specdecode_request_success_total\{finish_reason="([^"]*)"\}', httpx.get(f"{url}/metrics").text,
                            re.M)
        assert sorted(labels) == ["content_filter", "length", "stop"]


def test_sixteen_concurrent_streams_each_get_their_own_tokens(generator):
    prompts = [" ".join(f"w{3 + (7 * i + 3 * j) % 44}" for j in range(2 + i % 5)) for i in range(16)]
    lengths = [4 + 3 * i for i in range(16)]
    expected_ids = [alone(generator, p, n, chat=False) for p, n in zip(prompts, lengths)]
    expected = [generator.tokenizer.decode(ids, skip_special_tokens=True) for ids in expected_ids]
    with running_server(generator, max_batch_size=4, max_queue=16) as (url, engine, _):
        c = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0, timeout=120)

        async def one(prompt, n):
            stream = await c.completions.create(model="tiny", prompt=prompt, max_tokens=n, temperature=0,
                                                stream=True, stream_options={"include_usage": True})
            parts, usage = [], None
            async for ch in stream:
                parts += [ch.choices[0].text] if ch.choices else []
                usage = ch.usage or usage
            return "".join(parts), usage

        async def all_():
            return await asyncio.gather(*(one(p, n) for p, n in zip(prompts, lengths)))

        got = asyncio.run(all_())
        assert [text for text, _ in got] == expected
        assert [u.completion_tokens for _, u in got] == [len(ids) for ids in expected_ids]
        assert engine.outstanding == 0
        assert metric(url, "specdecode_num_requests_running") == 0
        assert metric(url, "specdecode_time_to_first_token_seconds_count") == 16
        assert metric(url, "specdecode_inter_token_latency_seconds_count") > 0
        assert 0 <= metric(url, "specdecode_spec_decode_acceptance_rate") <= 1


def test_models_and_health(server):
    url, _, _ = server
    models = client(url).models.list()
    assert [m.id for m in models.data] == ["tiny"]
    assert client(url).models.retrieve("tiny") == models.data[0]  # once a 404 "Not Found"
    with pytest.raises(openai.NotFoundError) as e:
        client(url).models.retrieve("gpt-4o")
    assert e.value.body["code"] == "model_not_found" and e.value.body["param"] == "model"
    assert httpx.get(f"{url}/health").json()["status"] == "ok"
    head = httpx.head(f"{url}/health")  # a load balancer's check: once 405
    assert head.status_code == 200 and head.content == b""
    # counted under its route, not "other" (nor one label per model id)
    assert metric(url, "specdecode_requests_total", '{endpoint="/v1/models/{id}",status="200"}') >= 1
    assert metric(url, "specdecode_request_errors_total", '{endpoint="/v1/models/{id}",type="invalid_request_error"}') >= 1


def test_shutdown_cancels_running_requests_with_a_clear_error(generator):
    with running_server(generator, max_length=512, delay_s=0.05) as (url, engine, _):
        c = client(url)
        stream = c.completions.create(model="tiny", prompt=PROMPT, max_tokens=400, stream=True, temperature=0)
        first = next(iter(stream))
        assert first.choices[0].text
        engine.begin_shutdown(0.0)  # what SIGTERM does, with no time left for running requests
        with pytest.raises(openai.APIError) as e:
            for _ in stream:
                pass
        assert "shutting down" in str(e.value)
        assert wait_until(lambda: engine.outstanding == 0)
        with pytest.raises(openai.InternalServerError) as e:
            c.completions.create(model="tiny", prompt=PROMPT, max_tokens=4)
        assert e.value.status_code == 503 and e.value.body["code"] == "unavailable"
        assert httpx.get(f"{url}/health").status_code == 503
