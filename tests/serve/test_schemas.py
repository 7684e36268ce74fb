"""The request schemas alone (no server): what they refuse, and the field each refusal names."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from specdecode.serve.schemas import ChatCompletionRequest, CompletionRequest

PROMPT = "w5 w9"


def refused(model, body: dict) -> tuple[str, str]:
    """(param, message) of the first error validating ``body``; fails the test if it is accepted."""
    with pytest.raises(ValidationError) as e:
        model.model_validate(body)
    first = e.value.errors()[0]
    return ".".join(str(p) for p in first["loc"]), first["msg"]


@pytest.mark.parametrize("key", ["²", "٥", "1e3", "-1", "abc", ""])
def test_logit_bias_keys_must_be_ascii_decimal_token_ids(key):
    # "²".isdigit() is True but int("²") raises: this key used to reach int() in the handler (a 500)
    param, message = refused(CompletionRequest, {"prompt": PROMPT, "logit_bias": {key: 1}})
    assert param == "logit_bias" and repr(key) in message and "decimal integers >= 0" in message


def test_logit_bias_may_not_name_one_token_twice():
    # "5" and "05" are the same token: one of the two biases would be dropped without a word
    param, message = refused(CompletionRequest, {"prompt": PROMPT, "logit_bias": {"5": 1, "05": -1}})
    assert param == "logit_bias" and "token 5 twice" in message and "'05'" in message


def test_good_logit_bias_keys_are_token_ids():
    body = CompletionRequest.model_validate({"prompt": PROMPT, "logit_bias": {"5": 1, " 7 ": -100}})
    assert body.processor_options()["logit_bias"] == {5: 1.0, 7: -100.0}


@pytest.mark.parametrize(("field", "value"), [
    ("max_tokens", "4"), ("max_tokens", True), ("n", "2"), ("seed", "1"), ("temperature", "0.5"),
    ("stream", "yes"), ("stream", 1), ("logprobs", True), ("top_k", False), ("echo", "false"),
    ("max_tokens", 4.5), ("n", 1.5), ("top_k", float("inf")), ("seed", float("nan")),
])
def test_wrong_types_are_refused_not_coerced(field, value):
    # pydantic's lax mode read "4" as 4, true as 1 and "yes" as true: a wrong request was answered
    # as something it did not ask for
    param, _ = refused(CompletionRequest, {"prompt": PROMPT, field: value})
    assert param == field


def test_wrong_types_inside_nested_objects_are_refused():
    param, _ = refused(CompletionRequest, {"prompt": PROMPT, "stream": True, "stream_options": {"include_usage": "no"}})
    assert param == "stream_options.include_usage"
    param, _ = refused(ChatCompletionRequest, {"messages": [{"role": "user", "content": "w5"}], "logprobs": "true"})
    assert param == "logprobs"


def test_integers_are_numbers_and_json_values_keep_their_types():
    body = CompletionRequest.model_validate({"prompt": [5, 9], "temperature": 1, "top_p": 1, "max_tokens": 3,
                                             "stream": True, "stream_options": {"include_usage": True},
                                             "logit_bias": {"5": -1}, "stop": ["w3"]})
    assert body.temperature == 1.0 and body.include_usage and body.prompt == [5, 9]
    chat = ChatCompletionRequest.model_validate({"messages": [{"role": "user", "content": [{"type": "text",
                                                                                           "text": "w5"}]}]})
    assert chat.messages[0].as_template_message() == {"role": "user", "content": "w5"}


@pytest.mark.parametrize(("body", "param"), [
    ({"logit_bias": {"5": 100.5}}, "logit_bias.5"),
    ({"logit_bias": {"5": float("nan")}}, "logit_bias.5"),
    ({"repetition_penalty": float("inf")}, "repetition_penalty"),  # JSON's 1e400; once a 400 with param null
    ({"repetition_penalty": float("nan")}, "repetition_penalty"),
])
def test_processor_ranges_are_checked_where_the_field_is_named(body, param):
    assert refused(CompletionRequest, {"prompt": PROMPT, **body})[0] == param


@pytest.mark.parametrize("fmt", [{}, {"type": "json_object"}, {"type": "json_schema", "json_schema": {}}])
def test_response_format_other_than_text_is_unsupported(fmt):
    # {} (no type) was taken as text: it is not a valid response_format
    body = ChatCompletionRequest.model_validate({"messages": [{"role": "user", "content": "w5"}],
                                                 "response_format": fmt})
    assert body.unsupported() == ("response_format", f"only response_format {{'type': 'text'}} is supported, "
                                                     f"got {fmt!r}")


def test_response_format_text_is_the_default():
    body = ChatCompletionRequest.model_validate({"messages": [{"role": "user", "content": "w5"}],
                                                 "response_format": {"type": "text"}})
    assert body.unsupported() is None


@pytest.mark.parametrize(("model", "field", "value"), [
    (CompletionRequest, "max_tokens", 4.0), (CompletionRequest, "n", 1.0), (CompletionRequest, "top_k", 5.0),
    (CompletionRequest, "seed", 7.0), (CompletionRequest, "logprobs", 2.0), (CompletionRequest, "best_of", 1.0),
    (ChatCompletionRequest, "max_completion_tokens", 8.0), (ChatCompletionRequest, "top_logprobs", 3.0),
])
def test_a_whole_number_float_is_an_integer(model, field, value):
    """Strict types once refused "max_tokens": 4.0 (accepted before, and by vLLM)."""
    body = {"prompt": PROMPT} if model is CompletionRequest else {"messages": [{"role": "user", "content": "w5"}]}
    if field == "top_logprobs":
        body["logprobs"] = True
    parsed = getattr(model.model_validate({**body, field: value}), field)
    assert parsed == int(value) and type(parsed) is int


def test_a_whole_number_float_still_meets_the_fields_range():
    param, _ = refused(CompletionRequest, {"prompt": PROMPT, "max_tokens": 0.0})
    assert param == "max_tokens"


@pytest.mark.parametrize("n, best_of, refused", [(2, 1, True), (1, 1, False), (2, None, False), (1, None, False)])
def test_best_of_below_n_is_refused(n, best_of, refused):
    body = CompletionRequest(model="m", prompt="hi", n=n, best_of=best_of)
    if refused:
        assert body.unsupported() == ("best_of", f"best_of={best_of} is less than n={n}: best_of counts the candidates "
                                                 "the n choices are picked from, so it must be at least n; leave best_of out")
    else:
        assert body.unsupported() is None
