"""The fast path (static KV cache, compiled forwards) gives exactly the eager path's tokens.

Two levels:

* ``graphs=False`` runners keep the static cache (position rollback, padding-free) with eager
  forwards: cheap, so every method, control and architecture is covered.
* ``graphs=True`` runners compile with ``torch.compile`` (inductor on CPU, several seconds per
  graph for these tiny models), over a smaller set. In float32 the compiled kernels gave the
  eager tokens exactly on these models, so the reference is the eager autoregressive output;
  a compiled kernel that rounded differently would fail here and show it.
"""

from __future__ import annotations

import pytest
import torch
from torch._dynamo.utils import counters

from conftest import VOCAB, make_tiny_model
from helpers import CorruptingDrafter, perturbed_copy
from specdecode import (
    DraftControl,
    DraftModelDrafter,
    EarlyExitDrafter,
    GenerationConfig,
    InvalidArgumentError,
    LayerSkipDrafter,
    NonFiniteLogitsError,
    PromptLookupDrafter,
    SkipSet,
    SpeculativeDecoder,
)
from specdecode.drafters.cascade import CascadeDrafter
from specdecode.engine import kv_cache
from specdecode.engine.decoder import CACHE_STEP
from specdecode.engine.fast_path import ModelRunner, resolve_compile

PROMPTS = [(0, 1), (1, 5), (2, 13), (3, 29)]  # (seed, length): 13 and 29 cross the sliding window of 6


def _prompt(length: int, seed: int) -> torch.Tensor:
    return torch.randint(3, VOCAB, (1, length), generator=torch.Generator().manual_seed(seed))


def _runners(target, draft, graphs: bool) -> dict:
    """The target's fast-path settings (drafters follow the round's)."""
    return {"target": ModelRunner(target, compile=True, graphs=graphs, name="target")}


def _drafters(target, draft, runners) -> dict:
    return {
        "autoregressive": lambda: None,
        "draft": lambda: DraftModelDrafter(draft),
        "cascade": lambda: CascadeDrafter(draft),
        # the draft context window (prompts 13 and 29 are longer) and the cascade's prompt limit
        "draft-window": lambda: DraftModelDrafter(draft, context_window=4),
        "cascade-window": lambda: CascadeDrafter(draft, context_window=4),
        "cascade-limit": lambda: CascadeDrafter(draft, max_model_prompt_tokens=10),
        "layer-skip": lambda: LayerSkipDrafter(target, SkipSet(attn=(1,), mlp=(1, 2))),
        "early-exit": lambda: EarlyExitDrafter(target, 2),
        "prompt-lookup": lambda: PromptLookupDrafter(),
    }


@pytest.mark.parametrize("control", [None, "adaptive", "gate"])
def test_static_cache_greedy_equals_autoregressive(arch, control):
    """Every method, with adaptive exit or confidence gating, on the static cache (eager forwards)."""
    target = make_tiny_model(arch, num_layers=3)
    draft = perturbed_copy(target, noise=0.3, seed=1)
    runners = _runners(target, draft, graphs=False)
    policy = {
        None: None,
        "adaptive": DraftControl(adaptive_exit=True, exit_threshold=0.6),
        "gate": DraftControl(confidence_gate=0.15),
    }[control]
    accepted_somewhere, gated = False, 0
    for seed, length in PROMPTS:
        prompt = _prompt(length, seed)
        config = GenerationConfig(max_new_tokens=24, num_speculative_tokens=3, stop_on_eos=False)
        expected = SpeculativeDecoder(target, compile=False).generate(prompt, config).token_ids
        for name, make in _drafters(target, draft, runners).items():
            drafter = make()
            use = policy if drafter is not None and (policy is None or not policy.adaptive_exit
                                                      or drafter.supports_exit_policy) else None
            dec = SpeculativeDecoder(target, drafter, draft_control=use, runner=runners["target"])
            result = dec.generate(prompt, config)
            assert result.token_ids == expected, (arch, control, name, seed)
            assert dec._engine.compile and kv_cache.is_static(dec._engine.cache)
            accepted_somewhere |= bool(result.stats.num_accepted_tokens)
            gated += result.stats.num_gated_steps
    assert runners["target"].one_row_engine.cache.fast.graphs is False  # static shapes, eager forwards
    assert accepted_somewhere
    assert (gated > 0) == (control == "gate")


def test_static_cache_after_rollback_equals_fresh_forward(arch):
    """On the fast path's static batch cache, after rejections, every confirmed position holds what
    a fresh forward over the confirmed tokens gives (rejected ones lie past them, never read)."""
    target = make_tiny_model(arch)
    prompt = _prompt(5, 5)
    config = GenerationConfig(max_new_tokens=40, num_speculative_tokens=4, stop_on_eos=False)
    runner = ModelRunner(target, compile=True, graphs=False)
    dec = SpeculativeDecoder(target, CorruptingDrafter(perturbed_copy(target, 0.3), period=2), runner=runner)
    stream = dec.stream(prompt, config)
    rounds = iter(stream)
    next(rounds)
    rejections = 0
    for _ in range(8):
        rejections += len(next(rounds)) < 5
        confirmed = stream._row.tokens[:-1]
        n = len(confirmed)
        fresh = kv_cache.new_cache(target)
        with torch.inference_mode():
            target(torch.tensor([confirmed]), past_key_values=fresh, use_cache=True)
        fresh.crop(0)  # a sliding layer keeps its window's last positions
        for got, want in zip(dec._engine.cache.layers, fresh.layers):
            kept = want.keys.shape[-2]
            torch.testing.assert_close(got.keys[:1, :, n - kept : n], want.keys, rtol=1e-5, atol=1e-5)
            torch.testing.assert_close(got.values[:1, :, n - kept : n], want.values, rtol=1e-5, atol=1e-5)
    assert rejections > 0


def test_prompt_cache_on_the_static_cache(arch):
    target = make_tiny_model(arch)
    prompt = _prompt(12, 6)
    config = GenerationConfig(max_new_tokens=16, num_speculative_tokens=3, stop_on_eos=False)
    expected = SpeculativeDecoder(target, compile=False).generate(prompt, config).token_ids
    runner = ModelRunner(target, compile=True, graphs=False)
    dec = SpeculativeDecoder(target, DraftModelDrafter(perturbed_copy(target, 0.3)), runner=runner)
    # A plain generation first: the runner's cache then exists (allocated in inference mode).
    assert dec.generate(prompt, config).token_ids == expected
    # 4 positions fit every layer (sliding windows of 6 keep them): copied; 11 do not (re-encoded).
    for m in (11, 4):
        assert dec.generate(prompt, config, prompt_cache=dec.prompt_cache(prompt[:, :m])).token_ids == expected


def test_interleaved_fast_path_streams_are_refused():
    """Two generations on one runner share its static cache: the older one must not go on silently."""
    target = make_tiny_model("llama")
    runner = ModelRunner(target, compile=True, graphs=False)
    config = GenerationConfig(max_new_tokens=10, num_speculative_tokens=3, stop_on_eos=False)
    for drafter in (None, DraftModelDrafter(perturbed_copy(target, 0.3))):
        dec = SpeculativeDecoder(target, drafter, runner=runner)
        first = iter(dec.stream(_prompt(5, 0), config))
        next(first)
        dec.generate(_prompt(7, 1), config)  # takes the caches over and finishes
        with pytest.raises(InvalidArgumentError, match="cannot be interleaved"):
            next(first)


def test_the_one_row_engine_is_kept_and_grows_with_the_generation():
    """The engine (its static cache, its compiled buckets) is kept while generations fit, and rebuilt
    larger, with the same output, when one needs more positions."""
    target = make_tiny_model("llama", max_position_embeddings=4096)
    runner = ModelRunner(target, compile=True, graphs=False)
    dec = SpeculativeDecoder(target, runner=runner)
    prompt, config = _prompt(5, 1), GenerationConfig(max_new_tokens=8, stop_on_eos=False)
    eager = SpeculativeDecoder(target, compile=False).generate(prompt, config).token_ids
    assert dec.generate(prompt, config).token_ids == eager
    first = runner.one_row_engine
    assert first.max_length == CACHE_STEP and dec.generate(_prompt(9, 2), config) and runner.one_row_engine is first
    long = GenerationConfig(max_new_tokens=CACHE_STEP, stop_on_eos=False)
    want = SpeculativeDecoder(target, compile=False).generate(prompt, long).token_ids
    assert dec.generate(prompt, long).token_ids == want
    assert runner.one_row_engine is not first and runner.one_row_engine.max_length == 2 * CACHE_STEP


def test_compile_flag_and_defaults():
    model = make_tiny_model("llama")
    assert resolve_compile(None, "cpu") is False and resolve_compile(None, "cuda") is True
    assert resolve_compile(True, "cpu") is True
    with pytest.raises(InvalidArgumentError, match="compile must be True, False or None.*'yes'"):
        ModelRunner(model, compile="yes")
    assert SpeculativeDecoder(model).runner.compile is False  # CPU default


def test_context_length_is_checked_before_any_work():
    target = make_tiny_model("qwen2", max_position_embeddings=32)
    dec = SpeculativeDecoder(target, compile=False)
    with pytest.raises(InvalidArgumentError, match=r"prompt has 20 tokens and max_new_tokens is 13: 33 positions, "
                                                   r"past the model's context length of 32.*at most 12"):
        dec.generate(_prompt(20, 0), GenerationConfig(max_new_tokens=13))
    assert len(dec.generate(_prompt(20, 0), GenerationConfig(max_new_tokens=12, stop_on_eos=False)).token_ids) == 12


@pytest.fixture
def fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


@pytest.mark.parametrize("arch_name", ["llama", "qwen2", "mistral", "gemma2", "gemma3"])
def test_compiled_greedy_equals_autoregressive(arch_name, fresh_dynamo):
    """torch.compile'd forwards: every method gives the eager autoregressive tokens, widths are
    compiled once, and later prompts of other lengths recompile nothing."""
    target = make_tiny_model(arch_name, num_layers=3)
    draft = perturbed_copy(target, noise=0.3, seed=1)
    runners = _runners(target, draft, graphs=True)
    config = GenerationConfig(max_new_tokens=20, num_speculative_tokens=3, stop_on_eos=False)
    drafters = _drafters(target, draft, runners)
    adaptive = DraftControl(adaptive_exit=True, exit_threshold=0.6, max_draft_tokens=6)
    generations, skip_rates = 0, []
    for i, (seed, length) in enumerate(PROMPTS[1:]):
        prompt = _prompt(length, seed)
        expected = SpeculativeDecoder(target, compile=False).generate(prompt, config).token_ids
        graphs_before = counters["stats"]["unique_graphs"]
        for name in ("autoregressive", "draft", "layer-skip", "prompt-lookup"):
            control = adaptive if name in ("draft", "layer-skip") else None
            dec = SpeculativeDecoder(target, drafters[name](), draft_control=control, runner=runners["target"])
            result = dec.generate(prompt, config)
            generations += 1
            assert result.token_ids == expected, (arch_name, name, seed)
            if name == "layer-skip":
                skip_rates.append(result.stats.acceptance_rate)
            assert (result.stats.warmup_s > 0) == (i == 0 and name in ("autoregressive", "draft", "layer-skip")), \
                (name, i, result.stats.warmup_s)
        if i > 0:  # the first prompt compiled every width; a new prompt length compiles nothing
            assert counters["stats"]["unique_graphs"] == graphs_before, arch_name
    engine = runners["target"].one_row_engine  # the decoders shared its cache and runners
    skip = next(r for key, r in engine.cache.shared.items() if key[0] == "layer-skip runner")
    assert engine.runner.compile_time_s > 0 and skip.compile_time_s > 0
    # Only prefills may run eagerly (batch_prefill, outside the runner): every verification (widths
    # 1..7, adaptive blocks of up to 6 tokens) and every draft step went through a graph.
    assert engine.runner.num_eager_forwards == 0 and generations
    assert skip.num_eager_forwards == 0
    # The layer-skip graph is the skipped model's, not the full model's (which would accept all).
    assert min(skip_rates) < 1.0


def test_compiled_speculative_sampling_matches_target_distribution(fresh_dynamo):
    """The statistical test of speculative sampling, with compiled forwards on a static cache."""
    from test_verification import _exact_joint, _within

    V, N, steps = 8, 1500, 3
    target = make_tiny_model("llama", num_layers=1, vocab_size=V, hidden_size=16, intermediate_size=32)
    with torch.no_grad():
        target.get_output_embeddings().weight.mul_(0.25)
    draft = perturbed_copy(target, noise=2.0, seed=3)
    prompt = torch.tensor([[3, 5, 4]])
    base = dict(temperature=1.0, max_new_tokens=steps, stop_on_eos=False)
    exact = _exact_joint(target, prompt, GenerationConfig(**base), steps)
    cells: dict = {}
    for seq, pr in exact.items():
        cells[("pair", seq[1], seq[2])] = cells.get(("pair", seq[1], seq[2]), 0.0) + pr
    keys = sorted(cells, key=str)
    index = {k: i for i, k in enumerate(keys)}
    want = torch.tensor([cells[k] for k in keys])
    runners = _runners(target, draft, graphs=True)
    dec = SpeculativeDecoder(target, DraftModelDrafter(draft), runner=runners["target"])
    counts = torch.zeros(len(keys))
    accepted = 0
    for seed in range(N):
        res = dec.generate(prompt, GenerationConfig(**base, seed=seed, num_speculative_tokens=2))
        counts[index[("pair", res.token_ids[1], res.token_ids[2])]] += 1
        accepted += res.stats.num_accepted_tokens
    assert 0 < accepted < N * 2
    assert _within(counts / N, want, N)
    assert dec.compile_time_s() > 0


@pytest.mark.parametrize("temperature", [0.0, 0.8])
@pytest.mark.parametrize("nan_in", ["target", "draft"])
def test_non_finite_logits_found_in_the_rounds_one_sync(nan_in, temperature):
    """Rounds read the finiteness of target and draft logits with the tokens, in one host sync (sampling
    rounds too: their draws meanwhile are made from ``safe_logits``); a NaN still raises, naming the model
    that produced it."""
    target = make_tiny_model("llama")
    draft = perturbed_copy(target, noise=0.3, seed=1)
    with torch.no_grad():
        (target if nan_in == "target" else draft).get_output_embeddings().weight[7, 0] = float("nan")
    dec = SpeculativeDecoder(target, DraftModelDrafter(draft), compile=False)
    with pytest.raises(NonFiniteLogitsError, match=f"the {nan_in} model produced non-finite logits"):
        dec.generate(_prompt(4, 0), GenerationConfig(max_new_tokens=6, stop_on_eos=False, temperature=temperature,
                                                     seed=0))


def test_captured_graphs_option_is_checked_and_on_a_cpu_compiles_as_true(fresh_dynamo):
    """``graphs="captured"`` (CUDA graphs of specdecode's own, ``engine.batch_runner``): a bad value is refused
    by name; on a CPU there is nothing to capture, so its buckets are the compiled ones of ``graphs=True``, with
    the autoregressive tokens. (The capture itself needs CUDA: ``docs/benchmarks/gpu_engine.py``'s
    ``-captured`` rows.)"""
    from specdecode.engine.fast_path import FastPath
    from specdecode.engine.compat import compile_kwargs

    target = make_tiny_model("llama", num_layers=2)
    draft = perturbed_copy(target, noise=0.3, seed=1)
    with pytest.raises(InvalidArgumentError, match=r"graphs must be True, False or 'captured', got 'manual'"):
        ModelRunner(target, compile=True, graphs="manual")
    with pytest.raises(InvalidArgumentError, match=r"graphs must be True, False or 'captured', got 1"):
        FastPath((1,), 2, 1)
    assert "mode" not in compile_kwargs("cuda", cuda_graphs=False) and "mode" not in compile_kwargs("cpu")
    assert compile_kwargs("cuda")["options"]["triton.cudagraphs"] is True  # mode="reduce-overhead"'s option
    assert "options" not in compile_kwargs("cuda", cuda_graphs=False, module_guards=True)
    config = GenerationConfig(max_new_tokens=12, num_speculative_tokens=3, stop_on_eos=False)
    prompt = _prompt(9, 3)
    expected = SpeculativeDecoder(target, compile=False).generate(prompt, config).token_ids
    runner = ModelRunner(target, compile=True, graphs="captured", name="target model")
    dec = SpeculativeDecoder(target, DraftModelDrafter(draft), runner=runner)
    assert dec.generate(prompt, config).token_ids == expected
    engine = runner.one_row_engine
    assert engine.cache.fast.graphs == "captured" and engine.runner.compile_time_s > 0
    assert all(not b.capture and b.graph is None for b in engine.runner._buckets.values())


def test_dynamic_shapes_compile_one_function_per_width_class(fresh_dynamo):
    """``ModelRunner(dynamic_shapes=True)``: the one-row engine's buckets share compiled functions, widths above 1
    symbolic. The cascade's draft model runs widths 1, 2 and 4 (its n-gram check feeds several tokens, up
    to the widest bucket, γ + 1) and the target 1 and γ + 1: 4 graphs, where a graph per bucket makes 5. The tokens are the eager
    autoregressive ones; a second prompt compiles nothing; a bad value is refused by name."""
    target = make_tiny_model("qwen2", num_layers=2)
    draft = perturbed_copy(target, noise=0.3, seed=1)
    with pytest.raises(InvalidArgumentError, match=r"dynamic_shapes must be True or False, .*got 1 with compile=True"):
        ModelRunner(target, compile=True, dynamic_shapes=1)
    with pytest.raises(InvalidArgumentError, match=r"True only where forwards compile .*got True with compile=False"):
        ModelRunner(target, compile=False, dynamic_shapes=True)
    with pytest.raises(InvalidArgumentError, match=r"got True with compile=True, graphs=False"):  # nothing compiles
        ModelRunner(target, compile=True, graphs=False, dynamic_shapes=True)
    runner = ModelRunner(target, compile=True, name="target model", dynamic_shapes=True)
    config = GenerationConfig(max_new_tokens=20, num_speculative_tokens=3, stop_on_eos=False)
    dec = SpeculativeDecoder(target, CascadeDrafter(draft), runner=runner)
    graphs = counters["stats"]["unique_graphs"]
    for seed, length in PROMPTS[1:3]:
        prompt = _prompt(length, seed)
        expected = SpeculativeDecoder(target, compile=False).generate(prompt, config).token_ids
        assert dec.generate(prompt, config).token_ids == expected
        engine = runner.one_row_engine
        engine.drafter.warm_up(1, engine.max_block)  # every width of the draft runner, as a server's warm-up
        assert counters["stats"]["unique_graphs"] - graphs == 4, sorted(engine.runner._buckets)
    draft_runner = engine.drafter.runner
    assert engine.cache.fast.dynamic_shapes and draft_runner.widths == (1, 2, 4)
    assert sorted(map(str, draft_runner._forwards)) == ["(1, 'N', False)", "(1, 1, False)"]
    assert engine.runner.num_eager_forwards == 0 and draft_runner.num_eager_forwards == 0


def test_a_changed_dynamic_shapes_is_not_ignored_by_the_kept_engine():
    """The one-row engine is kept while the runner's settings hold; after ``runner.dynamic_shapes`` changes, the
    next generation makes a new engine, which checks the value (here refused: nothing compiles with graphs=False)."""
    target = make_tiny_model("llama", num_layers=2)
    runner = ModelRunner(target, compile=True, graphs=False)
    dec = SpeculativeDecoder(target, runner=runner)
    config = GenerationConfig(max_new_tokens=4, stop_on_eos=False)
    dec.generate(_prompt(5, 0), config)
    first = runner.one_row_engine
    dec.generate(_prompt(5, 1), config)
    assert runner.one_row_engine is first
    runner.dynamic_shapes = True
    with pytest.raises(InvalidArgumentError, match=r"got True with compile=True, graphs=False"):
        dec.generate(_prompt(5, 2), config)
