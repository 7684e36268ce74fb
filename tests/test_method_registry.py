"""The method registry (specdecode.method_registry): one table of methods, read by the pipeline,
generate, bench and serve; and γ's one default."""

from __future__ import annotations

import inspect

import pytest

from conftest import make_tiny_model, make_tiny_tokenizer
from specdecode import method_registry, pipeline
from specdecode.bench.settings import BenchSettings
from specdecode.config import DEFAULT_NUM_SPECULATIVE_TOKENS, GenerationConfig
from specdecode.engine.batched import BatchedSpeculativeDecoder
from specdecode.errors import InvalidArgumentError
from specdecode.method_registry import REGISTRY, DrafterOptions
from specdecode.models import LoadedModel
from specdecode.pipeline import SpeculativeGenerator
from specdecode.serve import command as serve_command


def test_the_method_tables_are_the_registrys():
    assert pipeline.METHODS == tuple(REGISTRY) == (
        "autoregressive", "draft", "cascade", "layer-skip", "early-exit", "prompt-lookup",
        "token-recycling")
    assert pipeline.BATCH_METHODS == pipeline.METHODS  # every method has a batch mode (issue 28)
    assert serve_command.SERVE_METHODS == pipeline.BATCH_METHODS
    assert [m for m in REGISTRY.values() if m.needs_draft_model] == [REGISTRY["draft"], REGISTRY["cascade"]]
    assert method_registry.methods_taking("max_model_prompt_tokens") == ("cascade",)
    assert method_registry.methods_taking("draft_quantize_head") == ("draft", "cascade")
    assert method_registry.who_takes("draft_backend") == "the methods with a draft model, 'draft' and 'cascade'"
    assert method_registry.who_takes("max_model_prompt_tokens") == "the method 'cascade'"


def test_every_option_a_method_takes_is_a_make_drafter_keyword():
    keywords = set(inspect.signature(SpeculativeGenerator.make_drafter).parameters) - {"self", "method"}
    fields = set(DrafterOptions.__dataclass_fields__)
    assert keywords == fields  # make_drafter forwards every option to the factories
    for method in REGISTRY.values():
        assert method.options <= fields, method.name


def test_refused_option_follows_the_options_order_and_counts_draft_vocab_size_0_as_not_given():
    assert method_registry.refused_option("prompt-lookup", {"draft_vocab_size": 0, "exit_layer": 3}) is None
    assert method_registry.refused_option(
        "layer-skip", {"draft_context_window": 4, "draft_backend": "torch"}) == ("draft_context_window", 4)
    assert method_registry.refused_option("draft", {"max_model_prompt_tokens": 9}) == ("max_model_prompt_tokens", 9)
    assert method_registry.refused_option("cascade", {"max_model_prompt_tokens": 9}) is None


@pytest.fixture(scope="module")
def generator():
    target = LoadedModel(make_tiny_model("qwen2", num_layers=4), make_tiny_tokenizer(), "tiny-qwen2")
    return SpeculativeGenerator(target)  # no draft model


@pytest.mark.parametrize("name", ["autoregressive", "layer-skip", "early-exit", "prompt-lookup"])
def test_adaptive_exit_matches_the_drafters(generator, name):
    options = dict(skip_layers="attn=1", exit_layer=2)
    drafter = generator.make_drafter(name, **options)
    assert REGISTRY[name].adaptive_exit == (drafter is not None and drafter.supports_exit_policy)
    batch = generator.batch_decoder(name, **options).drafter
    assert REGISTRY[name].adaptive_exit == (batch is not None and batch.supports_exit_policy)


def test_adaptive_exit_of_the_draft_model_methods():
    from specdecode.drafters import CascadeDrafter, DraftModelDrafter

    assert REGISTRY["draft"].adaptive_exit == DraftModelDrafter.supports_exit_policy == True  # noqa: E712
    assert REGISTRY["cascade"].adaptive_exit == CascadeDrafter.supports_exit_policy == True  # noqa: E712
    assert DraftModelDrafter.supports_exit_policy and CascadeDrafter.supports_exit_policy


def test_the_batched_cascade_is_built_with_its_options():
    target = LoadedModel(make_tiny_model("qwen2", num_layers=4), make_tiny_tokenizer(), "tiny-qwen2")
    draft = LoadedModel(make_tiny_model("qwen2", num_layers=2, seed=1), make_tiny_tokenizer(), "tiny-draft")
    gen = SpeculativeGenerator(target, draft)
    drafter = gen.batch_decoder("cascade", prompt_lookup_max_ngram=4, prompt_lookup_min_ngram=2, ngram_check=False,
                                max_model_prompt_tokens=7, draft_context_window=5).drafter
    assert type(drafter).__name__ == "CascadeDrafter"
    assert (drafter.max_ngram, drafter.min_ngram, drafter.ngram_check, drafter.max_model_prompt_tokens,
            drafter.context_window) == (4, 2, False, 7, 5)
    assert gen.batch_decoder("draft", draft_context_window=6).drafter.context_window == 6
    with pytest.raises(InvalidArgumentError, match=r"draft_context_window=6 \(--draft-context-window\) applies to "
                                                   "the methods with a draft model, 'draft' and 'cascade', not to "
                                                   "'layer-skip'"):
        gen.batch_decoder("layer-skip", skip_layers="attn=1", draft_context_window=6)
    with pytest.raises(InvalidArgumentError, match=r"max_model_prompt_tokens=7 \(--max-model-prompt-tokens\) "
                                                   "applies to the method 'cascade', not to 'draft'"):
        gen.batch_decoder("draft", max_model_prompt_tokens=7)
    with pytest.raises(InvalidArgumentError, match="max_model_prompt_tokens=0 is out of range"):
        gen.batch_decoder("cascade", max_model_prompt_tokens=0)


def test_unknown_methods_and_every_method_has_a_batch_mode(generator):
    assert pipeline.BATCH_METHODS == pipeline.METHODS  # one drafter per method, for one row or many
    with pytest.raises(InvalidArgumentError, match="unknown method 'medusa'; allowed: autoregressive, "
                                                   "draft, cascade, layer-skip, early-exit, prompt-lookup"):
        generator.batch_decoder("medusa")
    with pytest.raises(InvalidArgumentError, match="method 'cascade' needs a draft model"):
        generator.batch_decoder("cascade")
    with pytest.raises(InvalidArgumentError, match="unknown method 'medusa'; allowed: autoregressive, draft"):
        generator.make_drafter("medusa")
    with pytest.raises(InvalidArgumentError, match=r"draft_vocab_size=8 \(--draft-vocab-size\) applies to the "
                                                   "methods with a draft model, 'draft' and 'cascade', not to 'medusa'"):
        generator.make_drafter("medusa", draft_vocab_size=8)  # option checks come first, as before


def test_gamma_has_one_default():
    assert DEFAULT_NUM_SPECULATIVE_TOKENS == 5
    assert GenerationConfig().num_speculative_tokens == DEFAULT_NUM_SPECULATIVE_TOKENS
    assert BenchSettings().num_speculative_tokens == DEFAULT_NUM_SPECULATIVE_TOKENS
    for fn in (BatchedSpeculativeDecoder.__init__, SpeculativeGenerator.batch_decoder):
        assert inspect.signature(fn).parameters["num_speculative_tokens"].default == DEFAULT_NUM_SPECULATIVE_TOKENS
    import argparse

    from specdecode.cli import build_parser

    parser = build_parser()
    assert parser.parse_args(["bench"]).num_speculative_tokens == DEFAULT_NUM_SPECULATIVE_TOKENS
    serve = argparse.ArgumentParser()
    serve_command.add_arguments(serve, default_target="t", default_draft="d")
    args = serve.parse_args([])
    assert args.num_speculative_tokens is None  # as generate's: unset, so that adaptive exit can be the default
    import torch

    from specdecode.defaults import plan_command

    assert plan_command(args, torch.device("cpu")).num_speculative_tokens == (
        DEFAULT_NUM_SPECULATIVE_TOKENS)


def test_the_tree_drafters_are_built_with_their_options(generator):
    """"prompt-lookup" takes its branches (a token tree); "token-recycling" is one drafter per generator,
    with one measured size policy (both learn across requests)."""
    from specdecode.drafters.token_recycling import TokenRecyclingDrafter
    from specdecode.engine.speculation_cost import SpeculationCostPolicy

    assert generator.make_drafter("prompt-lookup", prompt_lookup_branches=3).branches == 3
    assert generator.make_drafter("prompt-lookup").branches == 1
    first, second = generator.decoder("token-recycling"), generator.decoder("token-recycling")
    assert isinstance(first.drafter, TokenRecyclingDrafter) and first.drafter is second.drafter
    assert isinstance(first.draft_control, SpeculationCostPolicy) and first.draft_control is second.draft_control
    assert method_registry.refused_option("prompt-lookup", {"prompt_lookup_branches": 2}) is None
