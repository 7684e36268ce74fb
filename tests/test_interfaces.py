"""The runner interfaces (specdecode.engine.protocol): the round's torch runner and the llama.cpp runner
have the declared call, and every cache of the round says it is static."""

from __future__ import annotations

import inspect

import pytest
from transformers import DynamicCache

from conftest import make_tiny_model
from specdecode.engine import kv_cache
from specdecode.engine.batch_cache import BatchKVCache
from specdecode.engine.batch_runner import BatchRunner
from specdecode.engine.protocol import BatchRunnerProtocol, RoundRunnerProtocol, TargetRunnerProtocol
from specdecode.engine.runner_target import RunnerTargetForwards
from specdecode.errors import InvalidArgumentError
from specdecode.models.llama_cpp_target import LlamaCppTargetRunner


class _FakeLlamaModel:
    """What LlamaCppTargetRunner's constructor touches of a LlamaCppModel (no llama.cpp needed)."""

    name = "fake"
    generation = 0
    vocab_size = 7


def _protocol_methods(protocol) -> list[str]:
    return [n for n, v in vars(protocol).items() if callable(v) and not n.startswith("_") or n == "__call__"]


@pytest.mark.parametrize("runner_class", [BatchRunner, LlamaCppTargetRunner])
def test_both_runners_have_the_declared_call(runner_class):
    assert _protocol_methods(BatchRunnerProtocol) == ["__call__"]
    declared = list(inspect.signature(BatchRunnerProtocol.__call__).parameters)
    assert list(inspect.signature(runner_class.__call__).parameters) == declared


@pytest.mark.parametrize("runner_class", [BatchRunner, RunnerTargetForwards])
def test_both_round_runners_have_the_declared_verification_forward(runner_class):
    assert _protocol_methods(RoundRunnerProtocol) == ["forward_greedy"]
    declared = list(inspect.signature(RoundRunnerProtocol.forward_greedy).parameters)
    assert list(inspect.signature(runner_class.forward_greedy).parameters) == declared


def test_the_torch_runner_implements_the_protocol_on_a_static_cache():
    model = make_tiny_model("llama", num_layers=2)
    cache = BatchKVCache(model, 2, 32)
    runner = BatchRunner(model, cache, (1,), "target model")
    assert isinstance(runner, RoundRunnerProtocol) and not isinstance(runner, TargetRunnerProtocol)
    assert kv_cache.is_static(cache) is True
    assert kv_cache.is_static(DynamicCache()) is False


def test_the_llama_cpp_runner_implements_both_protocols():
    methods = _protocol_methods(TargetRunnerProtocol)
    assert set(methods) == {"prefill", "forward", "rollback", "measure_forward_costs", "__call__"}
    for name in methods:
        declared = list(inspect.signature(getattr(TargetRunnerProtocol, name)).parameters)
        assert list(inspect.signature(getattr(LlamaCppTargetRunner, name)).parameters) == declared, name
    runner = LlamaCppTargetRunner(_FakeLlamaModel())
    assert isinstance(runner, TargetRunnerProtocol) and isinstance(runner, BatchRunnerProtocol)
    assert runner.num_cached == 0 and dict(runner.forward_costs) == {} and runner.vocab_size == 7


def test_a_cache_that_does_not_say_whether_it_is_static_is_refused():
    """Never guessed from missing attributes (the negative control of is_static)."""

    class Unstated:
        layers = ()

    assert kv_cache.is_static(None) is False
    with pytest.raises(InvalidArgumentError, match=r"a Unstated cannot be used here"):
        kv_cache.is_static(Unstated())
