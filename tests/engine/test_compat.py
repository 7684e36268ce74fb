"""The fast path on the oldest supported torch (2.11): its ``torch.compile`` signature, emulated.

The GPU machines run torch 2.11, whose ``torch.compile`` has neither ``isolate_recompiles``
nor ``recompile_limit``; CI runs torch 2.13 on CPU, and the registry offers torch 2.11 only
as its 530 MB CUDA wheel (with several GB of CUDA libraries), so no second venv. Instead
``torch.compile`` is replaced by a function with exactly torch 2.11.0's signature, copied from
``torch/__init__.py`` of the torch-2.11.0 wheel (``torch-2.11.0-cp311-cp311-manylinux_2_28_x86_64.whl``,
git version 70d99e998b4955e0049d13a98d77ae1b14db1f45)::

    def compile(model=None, *, fullgraph=False, dynamic=None, backend="inductor",
                mode=None, options=None, disable=False)

Python raises ``TypeError`` on any other keyword, as torch 2.11 does; the accepted ones are
passed to the real ``torch.compile``, whose dynamo then applies its global recompile limit
per code object, as 2.11's does (``torch/_dynamo/cache_size.py``).
"""

from __future__ import annotations

import inspect
import logging

import pytest
import torch

from conftest import VOCAB, make_tiny_model
from helpers import perturbed_copy
from specdecode import DraftModelDrafter, GenerationConfig, InvalidArgumentError, SpeculativeDecoder
from specdecode.engine import compat
from specdecode.engine.fast_path import ModelRunner

REAL_COMPILE = torch.compile


def _torch_2_11_compile(calls: list):
    """A ``torch.compile`` with torch 2.11.0's signature that records its keyword arguments."""

    def compile(model=None, *, fullgraph=False, dynamic=None, backend="inductor", mode=None, options=None,
                disable=False):
        kwargs = dict(fullgraph=fullgraph, dynamic=dynamic, backend=backend, mode=mode, options=options,
                      disable=disable)
        calls.append({**kwargs, "options": dict(options) if options is not None else None})  # torch pops from it
        return REAL_COMPILE(model, **kwargs)

    return compile


@pytest.fixture
def torch_2_11(monkeypatch):
    """``torch.compile`` as torch 2.11 offers it, and a fresh dynamo; yields the list of its calls."""
    calls: list = []
    monkeypatch.setattr(torch, "compile", _torch_2_11_compile(calls))
    torch._dynamo.reset()
    yield calls
    torch._dynamo.reset()


def test_the_emulated_signature_is_torch_2_11s(torch_2_11):
    assert list(inspect.signature(torch.compile).parameters) == [
        "model", "fullgraph", "dynamic", "backend", "mode", "options", "disable"]
    with pytest.raises(TypeError, match="unexpected keyword argument 'isolate_recompiles'"):
        torch.compile(lambda x: x, isolate_recompiles=True)
    assert torch_2_11 == []


def test_options_detection_drops_exactly_the_unsupported_options(monkeypatch, caplog):
    caplog.set_level(logging.INFO, logger="specdecode.engine.compat")
    compat._log_dropped.cache_clear()  # logged once per process: this test reads the log
    compat._log_module_guards_kept.cache_clear()
    newest = dict(dynamic=False, fullgraph=True, isolate_recompiles=True, recompile_limit=compat.RECOMPILE_LIMIT)
    unguarded = {"guard_filter_fn": torch.compiler.skip_guard_on_all_nn_modules_unsafe}  # torch >= 2.9
    cuda_graphs = {"triton.cudagraphs": True, **unguarded}  # what mode="reduce-overhead" sets, and the filter
    if set(compat.NEWER_COMPILE_OPTIONS) <= set(inspect.signature(REAL_COMPILE).parameters):  # torch 2.13
        assert compat.compile_kwargs("cpu") == {**newest, "options": unguarded}
        assert compat.compile_kwargs("cuda", recompile_limit=5) == {**newest, "options": cuda_graphs,
                                                                   "recompile_limit": 5}
        assert compat.compile_kwargs("cuda", module_guards=True) == {**newest, "mode": "reduce-overhead"}
        assert "no isolate_recompiles" not in caplog.text

    monkeypatch.setattr(torch, "compile", _torch_2_11_compile([]))
    assert compat.compile_kwargs("cpu") == dict(dynamic=False, fullgraph=True, options=unguarded)
    assert compat.compile_kwargs("cuda") == dict(dynamic=False, fullgraph=True, options=cuda_graphs)
    assert compat.compile_kwargs("cuda", cuda_graphs=False) == dict(dynamic=False, fullgraph=True, options=unguarded)
    assert "torch.compile has no isolate_recompiles or recompile_limit option" in caplog.text
    assert "no skip_guard_on_all_nn_modules_unsafe" not in caplog.text
    monkeypatch.delattr(torch.compiler, "skip_guard_on_all_nn_modules_unsafe")  # a torch before 2.9
    assert compat.compile_kwargs("cpu") == dict(dynamic=False, fullgraph=True)
    assert compat.compile_kwargs("cuda") == dict(dynamic=False, fullgraph=True, mode="reduce-overhead")
    assert "torch.compiler has no skip_guard_on_all_nn_modules_unsafe; compiled calls keep dynamo's guards on " \
           "the models' modules" in caplog.text

    def only_limit(model=None, *, fullgraph=False, dynamic=None, backend="inductor", mode=None, options=None,
                   disable=False, recompile_limit=None):
        raise AssertionError("not called")

    monkeypatch.setattr(torch, "compile", only_limit)
    assert compat.compile_kwargs("cpu", recompile_limit=7, module_guards=True) == dict(dynamic=False, fullgraph=True,
                                                                                       recompile_limit=7)
    assert "torch.compile has no isolate_recompiles option" in caplog.text
    with pytest.raises(InvalidArgumentError, match="recompile_limit must be an integer >= 1, got 0"):
        compat.compile_kwargs("cpu", recompile_limit=0)
    assert compat.compile_kwargs("cpu", dynamic=None)["dynamic"] is None  # [dynamic rows] marked dims symbolic
    with pytest.raises(InvalidArgumentError, match="dynamic must be False or None, got True"):
        compat.compile_kwargs("cpu", dynamic=True)
    with pytest.raises(InvalidArgumentError, match="needs a Python function, got Linear"):
        compat.compile_function(torch.nn.Linear(2, 2), "cpu")


def test_fast_path_greedy_equals_autoregressive_on_torch_2_11(torch_2_11):
    """Target and draft runners compile (several widths each) through 2.11's signature and give
    the eager autoregressive tokens. Before the compat layer, the first compiled call raised
    ``TypeError: compile() got an unexpected keyword argument 'isolate_recompiles'``."""
    target = make_tiny_model("llama", num_layers=1)
    draft = perturbed_copy(target, noise=0.3, seed=1)
    prompt = torch.randint(3, VOCAB, (1, 5), generator=torch.Generator().manual_seed(0))
    config = GenerationConfig(max_new_tokens=6, num_speculative_tokens=1, stop_on_eos=False)
    expected = SpeculativeDecoder(target, compile=False).generate(prompt, config).token_ids
    runner = ModelRunner(target, compile=True, name="target")
    drafter = DraftModelDrafter(draft)
    dec = SpeculativeDecoder(target, drafter, runner=runner)
    result = dec.generate(prompt, config)
    assert result.token_ids == expected
    assert result.stats.num_accepted_tokens > 0
    # The target compiles in the one-row engine's BatchRunner (its buckets), the draft in its own.
    assert drafter.compile_time_s > 0 and dec.compile_time_s() > drafter.compile_time_s
    assert len(torch_2_11) >= 2
    unguarded = {"guard_filter_fn": torch.compiler.skip_guard_on_all_nn_modules_unsafe}  # torch 2.11 has it
    assert all(kwargs == dict(fullgraph=True, dynamic=False, backend="inductor", mode=None, options=unguarded,
                              disable=False) for kwargs in torch_2_11)


def _closure(k: int):
    def add(x: torch.Tensor) -> torch.Tensor:
        return x + k

    return add


def test_each_function_keeps_its_own_recompile_budget_on_torch_2_11(torch_2_11):
    """Without ``isolate_recompiles``, two closures of one code object would share dynamo's entries and
    budget (4 variants against a global limit of 2 here); each gets its own, and its own limit."""
    with torch._dynamo.config.patch(recompile_limit=2):
        first = compat.compile_function(_closure(1), "cpu", recompile_limit=2)
        second = compat.compile_function(_closure(2), "cpu", recompile_limit=3)
        for n in (1, 2):
            for fn, k in ((first, 1), (second, 2)):
                assert torch.equal(fn(torch.zeros(n)), torch.full((n,), float(k)))
        # A third variant: past the first's limit of 2, within the second's 3 (above the global 2).
        with pytest.raises(torch._dynamo.exc.FailOnRecompileLimitHit):
            first(torch.zeros(3))
        assert torch.equal(second(torch.zeros(3)), torch.full((3,), 2.0))
        with pytest.raises(torch._dynamo.exc.FailOnRecompileLimitHit):
            second(torch.zeros(4))
        assert torch.equal(first(torch.zeros(2)), torch.ones(2))  # compiled variants still run


class _Scale(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.k = 2.0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.k


def _scaled(module: torch.nn.Module):
    def scaled(x: torch.Tensor) -> torch.Tensor:
        return module(x)

    return scaled


def test_compiled_functions_do_not_guard_the_modules_they_trace(torch_2_11):
    """What ``compile_function`` assumes (``compat``'s docstring): a module's attribute changed after the first
    call is not seen, as dynamo's guards on modules are dropped; with ``module_guards`` they are kept, and the
    change compiles a new graph. A new input shape still compiles anew either way. (Under torch 2.11's
    signature: the filter goes through ``options``, which 2.11 has.)"""
    unguarded, guarded = _Scale(), _Scale()
    fast = compat.compile_function(_scaled(unguarded), "cpu")
    safe = compat.compile_function(_scaled(guarded), "cpu", module_guards=True)
    x = torch.ones(3)
    assert torch.equal(fast(x), 2 * x) and torch.equal(safe(x), 2 * x)
    unguarded.k = guarded.k = 5.0
    assert torch.equal(fast(x), 2 * x)  # the graph traced with k = 2, unchecked
    assert torch.equal(safe(x), 5 * x)
    assert torch.equal(fast(torch.ones(4)), 5 * torch.ones(4))  # a new shape: traced again, with k = 5
