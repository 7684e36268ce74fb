"""The request schemas alone (no server): what they refuse, and the field each refusal names."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from specdecode.serve.schemas import CompletionRequest

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
