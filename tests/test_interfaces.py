"""The runner and cache interfaces (specdecode.engine.protocol): both runners implement them, and
whether a cache is static is decided by the runner that makes it."""

from __future__ import annotations

import inspect

import pytest

from specdecode.errors import InvalidArgumentError
from transformers import DynamicCache

from conftest import make_tiny_model
from specdecode.engine import kv_cache
from specdecode.engine.fast_path import ModelRunner
from specdecode.engine.protocol import KVCache, ModelRunnerProtocol, StaticCache, TargetRunnerProtocol
from specdecode.models.llama_cpp import LlamaCppCache, LlamaCppModelRunner
from specdecode.models.llama_cpp_target import LlamaCppTargetRunner


class _FakeLlamaModel:
    """What LlamaCppModelRunner.new_cache touches of a LlamaCppModel (no llama.cpp needed)."""

    name = "fake"
    generation = 0
    vocab_size = 7

    def remove_from(self, position: int) -> None:
        pass

    def ensure_context(self, num_positions: int, cached: list[int]) -> None:
        pass


def _protocol_methods(protocol) -> list[str]:
    return [n for n, v in vars(protocol).items() if callable(v) and not n.startswith("_") or n == "__call__"]


@pytest.mark.parametrize("runner_class", [ModelRunner, LlamaCppModelRunner])
def test_both_runners_have_the_declared_signatures(runner_class):
    assert set(_protocol_methods(ModelRunnerProtocol)) == {"with_buckets", "new_cache", "check_owner", "__call__"}
    for name in _protocol_methods(ModelRunnerProtocol):
        declared = list(inspect.signature(getattr(ModelRunnerProtocol, name)).parameters)
        assert list(inspect.signature(getattr(runner_class, name)).parameters) == declared, name
    for name in ("static_cache", "max_bucket"):
        assert hasattr(runner_class, name), name


@pytest.mark.parametrize("compile", [False, True])
def test_the_torch_runner_decides_whether_its_cache_is_static(compile):
    runner = ModelRunner(make_tiny_model("llama", num_layers=2), compile=compile, graphs=False)
    assert isinstance(runner, ModelRunnerProtocol)
    cache = runner.new_cache(16)
    assert runner.static_cache is compile
    assert kv_cache.is_static(cache) is compile
    assert isinstance(cache, StaticCache if compile else KVCache)
    if not compile:
        assert isinstance(cache, DynamicCache) and not isinstance(cache, StaticCache)


def test_the_llama_cpp_runner_implements_the_protocol_with_a_cropped_cache():
    runner = LlamaCppModelRunner(_FakeLlamaModel())
    assert isinstance(runner, ModelRunnerProtocol)
    assert runner.static_cache is False and runner.max_bucket == 0 and not runner.compile
    cache = runner.new_cache(16)
    assert isinstance(cache, LlamaCppCache) and isinstance(cache, KVCache) and not isinstance(cache, StaticCache)
    assert kv_cache.is_static(cache) is False
    runner.check_owner(cache, cache.generation)


def test_the_llama_cpp_target_runner_implements_the_target_protocol():
    methods = _protocol_methods(TargetRunnerProtocol)
    assert set(methods) == {"prefill", "forward", "rollback", "measure_forward_costs", "__call__"}
    for name in methods:
        declared = list(inspect.signature(getattr(TargetRunnerProtocol, name)).parameters)
        assert list(inspect.signature(getattr(LlamaCppTargetRunner, name)).parameters) == declared, name
    runner = LlamaCppTargetRunner(_FakeLlamaModel())
    assert isinstance(runner, TargetRunnerProtocol) and not isinstance(runner, ModelRunnerProtocol)
    assert runner.num_cached == 0 and dict(runner.forward_costs) == {} and runner.vocab_size == 7


def test_a_cache_that_does_not_say_whether_it_is_static_is_refused():
    """Never guessed from missing attributes (the negative control of is_static)."""

    class Unstated:
        layers = ()

    assert kv_cache.is_static(None) is False
    with pytest.raises(InvalidArgumentError, match=r"a Unstated cannot be used here"):
        kv_cache.is_static(Unstated())
