"""The method registry: each decoding method's name, drafter factories and options, stated once.

``SpeculativeGenerator.make_drafter`` and ``batch_decoder`` build drafters through it, and
``generate``, ``bench`` and ``serve`` read from it which methods exist, which options each
takes, which need a draft model and which have a batch mode. Adding a method is one
``Method`` entry in ``REGISTRY``.

A layer of its own beside ``pipeline`` (tests/test_layout.py): it imports the engine, the
drafters and the models, never the pipeline; a factory gets the generator (a
``pipeline.SpeculativeGenerator``) as its first argument and asks it for what is kept per
generator (runners, the draft head, the llama.cpp draft).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from types import MappingProxyType
from typing import Any

from specdecode.drafters import CascadeDrafter, DraftModelDrafter, Drafter
from specdecode.drafters.datastore import corpus_files
from specdecode.drafters.early_exit import EarlyExitDrafter, check_exit_layer_given
from specdecode.drafters.layer_skip import LayerSkipDrafter, SkipSet, resolve_skip_set
from specdecode.drafters.prompt_lookup import PromptLookupDrafter
from specdecode.drafters.token_recycling import TokenRecyclingDrafter
from specdecode.errors import InvalidArgumentError

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class DrafterOptions:
    """The drafter options of every method (``SpeculativeGenerator.make_drafter``'s keywords);
    each method's factory reads those in its ``Method.options`` and ignores the rest.

    Attributes:
        skip_set, skip_layers, skip_config: "layer-skip"'s skip set, given once.
        exit_layer: "early-exit"'s N (layers 0..N-1 draft).
        prompt_lookup_branches: "prompt-lookup"'s matches per round, as a token tree (1: linear).
        prompt_lookup_datastore: "prompt-lookup"'s datastore corpus (``drafters.datastore.corpus_files``); None or
            "none": none; "auto": ``LLAMA_CPP_PROMPT_LOOKUP_DATASTORE`` with a llama.cpp target, else none.
        prompt_lookup_max_ngram, prompt_lookup_min_ngram: n-gram sizes of "prompt-lookup" and of
            the cascade's n-gram part.
        draft_vocab_size: FR-Spec's K for the draft model's head (0 or None: the full head).
        ngram_check: The cascade's check of n-gram tokens by the draft model.
        draft_context_window: W, the draft model's prompt window (None: the whole prompt).
        draft_tree_depth: D for "draft" and "cascade": the draft model's chain steps per round of a token
            tree of the round's budget of nodes (``drafters.draft_tree``); None: linear drafts.
        draft_tree_expand: M for "draft" (with ``draft_tree_depth``): EAGLE-2's expansion, the M best nodes
            of each depth expanded by one draft tree forward; None: the chain's tree.
        draft_tree_shape: How a draft-model tree's shape is chosen ("per-round", "previous-round",
            ``drafters.draft_tree.TREE_SHAPES``); None: the device's default.
        max_model_prompt_tokens: The cascade's prompt limit for the draft model (None: none).
        compile: The fast path for the drafter's forwards (None: the device default).
        draft_backend: "torch" or "llama-cpp" (None: ``SpeculativeGenerator.default_draft_backend``).
    """

    skip_set: SkipSet | None = None
    skip_layers: str | None = None
    skip_config: str | Path | None = None
    exit_layer: int | None = None
    prompt_lookup_max_ngram: int = 3
    prompt_lookup_min_ngram: int = 1
    prompt_lookup_branches: int = 1
    prompt_lookup_datastore: str | Path | None = "auto"
    draft_vocab_size: int | None = None
    ngram_check: bool = True
    draft_context_window: int | None = None
    draft_tree_depth: int | None = None
    draft_tree_expand: int | None = None
    draft_tree_shape: str | None = None
    max_model_prompt_tokens: int | None = None
    compile: bool | None = None
    draft_backend: str | None = None


#: Prompt lookup's datastore (``drafters.datastore``) when ``prompt_lookup_datastore`` is "auto" (the default of the
#: API and the commands): this Python's standard library with a llama.cpp target, where a verification of 2-4
#: tokens costs 1.5-1.8 plain steps on 2 cores, so drafts must be sure to pay (measured in one run: 1.10x -> 1.19x
#: llama.cpp on 10 HumanEval prompts, 1.06x -> 1.05x on 26 Spec-Bench prompts, docs/benchmarks/2026-11-27-datastore.md);
#: none with a torch target (not measured). A Python without its standard library's sources gets none, with a warning.
LLAMA_CPP_PROMPT_LOOKUP_DATASTORE = "python-stdlib"


#: A factory: (generator, options) -> the drafter, or None for target-only decoding.
Factory = Callable[[Any, DrafterOptions], "Drafter | None"]


@dataclass(frozen=True)
class Method:
    """One decoding method.

    Attributes:
        name: As users write it ("draft", "layer-skip", ...).
        factory: Builds its drafter, for one row (``SpeculativeDecoder``) and for many
            (``BatchedSpeculativeDecoder``); None: target-only decoding. Raises
            ``InvalidArgumentError`` when a required option or model is missing.
        options: The ``DrafterOptions`` fields it uses (``compile`` for every method that runs
            a model; "autoregressive" takes ``compile`` alone, for the target).
        needs_draft_model: Whether it drafts with a separate draft model (so it loads one and
            takes the draft's loading options, ``draft_quantize`` and ``draft_quantize_head``).
        adaptive_exit: Whether its drafter gives draft probabilities, so adaptive draft exit
            applies (``Drafter.supports_exit_policy``).
    """

    name: str
    factory: Factory
    options: frozenset[str] = field(default_factory=frozenset)
    needs_draft_model: bool = False
    adaptive_exit: bool = False


# --- the factories ---------------------------------------------------------------------------


def _no_drafter(generator, options: DrafterOptions) -> None:
    return None


#: Why the llama.cpp draft runs with one row only (``DraftModelDrafter``'s refusal at ``bind``).
LLAMA_CPP_ONE_SEQUENCE = "llama.cpp's draft runs one sequence (one llama.cpp context)"


def _draft_model_kwargs(generator, method: str, o: DrafterOptions) -> dict:
    """The draft model of "draft" and "cascade", on the chosen backend, as ``DraftModelDrafter`` keywords."""
    backend = o.draft_backend if o.draft_backend is not None else generator.default_draft_backend()
    if backend == "llama-cpp":
        if o.draft_vocab_size:
            raise InvalidArgumentError(
                f"draft_vocab_size={o.draft_vocab_size!r} truncates a torch draft's LM head; the llama.cpp draft "
                "computes every logit: leave it out, or use draft_backend='torch'"
            )
        return {"runner": generator.llama_cpp_draft_runner(), "one_sequence_reason": LLAMA_CPP_ONE_SEQUENCE}
    if generator.draft is None:
        raise InvalidArgumentError(
            f"method {method!r} needs a draft model; pass draft=... (or use 'layer-skip', 'early-exit' "
            "or 'prompt-lookup', which need none)"
        )
    return {"model": generator.draft.model, "head": generator.draft_head(o.draft_vocab_size)}


def _draft(generator, o: DrafterOptions) -> DraftModelDrafter:
    return DraftModelDrafter(context_window=o.draft_context_window, tree_depth=o.draft_tree_depth,
                             tree_expand=o.draft_tree_expand, tree_shape=o.draft_tree_shape,
                             **_draft_model_kwargs(generator, "draft", o))


def _cascade(generator, o: DrafterOptions) -> CascadeDrafter:
    return CascadeDrafter(max_ngram=o.prompt_lookup_max_ngram, min_ngram=o.prompt_lookup_min_ngram,
                          ngram_check=o.ngram_check, max_model_prompt_tokens=o.max_model_prompt_tokens,
                          context_window=o.draft_context_window, tree_depth=o.draft_tree_depth,
                          tree_shape=o.draft_tree_shape, **_draft_model_kwargs(generator, "cascade", o))


def _layer_skip(generator, o: DrafterOptions) -> LayerSkipDrafter:
    skip_set = resolve_skip_set(o.skip_set, o.skip_layers, o.skip_config)
    logger.info("layer-skip drafting with skip set %s", skip_set)
    return LayerSkipDrafter(generator.target.model, skip_set)


def _early_exit(generator, o: DrafterOptions) -> EarlyExitDrafter:
    check_exit_layer_given(o.exit_layer)
    return EarlyExitDrafter(generator.target.model, o.exit_layer)


def _prompt_lookup(generator, o: DrafterOptions) -> PromptLookupDrafter:
    return PromptLookupDrafter(o.prompt_lookup_max_ngram, o.prompt_lookup_min_ngram, o.prompt_lookup_branches,
                               datastore=_datastore(generator, o))


def _datastore(generator, o: DrafterOptions):
    """Prompt lookup's ``NgramDatastore`` for ``prompt_lookup_datastore``, or None ("none", None; "auto" where it
    resolves to none, or where its default corpus cannot be read, with a warning: it was not asked for)."""
    corpus = o.prompt_lookup_datastore
    if corpus is None or str(corpus) == "none":
        return None
    if corpus != "auto":
        return generator.datastore(corpus)
    if generator.backend != "llama-cpp" or o.prompt_lookup_branches != 1:  # a tree drafts the sequence's matches
        return None
    try:
        return generator.datastore(LLAMA_CPP_PROMPT_LOOKUP_DATASTORE)
    except InvalidArgumentError as exc:
        logger.warning("prompt lookup without its default datastore %r: %s", LLAMA_CPP_PROMPT_LOOKUP_DATASTORE, exc)
        return None


def _token_recycling(generator, o: DrafterOptions) -> TokenRecyclingDrafter:
    """One drafter per generator: its adjacency matrix keeps learning across decoders and requests."""
    if generator.token_recycler is None:
        generator.token_recycler = TokenRecyclingDrafter()
    return generator.token_recycler


# --- the registry ----------------------------------------------------------------------------

_NGRAMS = frozenset({"prompt_lookup_max_ngram", "prompt_lookup_min_ngram"})
_DRAFT_MODEL = frozenset({"draft_vocab_size", "draft_context_window", "draft_backend", "draft_tree_depth",
                          "draft_tree_shape", "compile"})

#: Every method, in the order users see them (``METHODS``).
REGISTRY: Mapping[str, Method] = MappingProxyType({m.name: m for m in (
    Method("autoregressive", _no_drafter, frozenset({"compile"})),
    Method("draft", _draft, _DRAFT_MODEL | {"draft_tree_expand"}, needs_draft_model=True, adaptive_exit=True),
    Method("cascade", _cascade, _DRAFT_MODEL | _NGRAMS | {"ngram_check", "max_model_prompt_tokens"},
           needs_draft_model=True, adaptive_exit=True),
    Method("layer-skip", _layer_skip, frozenset({"skip_set", "skip_layers", "skip_config", "compile"}),
           adaptive_exit=True),
    Method("early-exit", _early_exit, frozenset({"exit_layer", "compile"}), adaptive_exit=True),
    Method("prompt-lookup", _prompt_lookup, _NGRAMS | {"prompt_lookup_branches", "prompt_lookup_datastore"}),
    Method("token-recycling", _token_recycling),
)})

#: The method names, in order.
METHODS: tuple[str, ...] = tuple(REGISTRY)
#: The methods with a batch mode (``SpeculativeGenerator.batch_decoder``): every one, as every
#: drafter is batch-native.
BATCH_METHODS: tuple[str, ...] = METHODS
#: The methods that load a draft model.
DRAFT_MODEL_METHODS: tuple[str, ...] = tuple(name for name, m in REGISTRY.items() if m.needs_draft_model)


@dataclass(frozen=True)
class MethodOnlyOption:
    """An option that methods which do not use it refuse, rather than ignore.

    Attributes:
        keyword: The ``make_drafter`` keyword, or a loading option of the draft model.
        acts_on: What it acts on, in ``generate``'s message ("the draft model").
        hint: Appended to ``generate``'s message.
    """

    keyword: str
    acts_on: str
    hint: str = ""


#: Options that only some methods take (``methods_taking``), in the order ``generate`` checks its
#: flags. ``draft_quantize`` and ``draft_quantize_head`` load the draft model (``from_pretrained``);
#: the others are ``make_drafter`` keywords. ``draft_vocab_size`` 0 means the full head, so it counts
#: as given only when truthy (``given``).
METHOD_ONLY_OPTIONS: tuple[MethodOnlyOption, ...] = (
    MethodOnlyOption("draft_quantize", "the draft model", "; use --quantize for the target"),
    MethodOnlyOption("draft_quantize_head", "the draft model", "; use --quantize for the target"),
    MethodOnlyOption("draft_vocab_size", "a draft model's head"),
    MethodOnlyOption("max_model_prompt_tokens", "its draft model"),
    MethodOnlyOption("draft_context_window", "a draft model"),
    MethodOnlyOption("draft_backend", "the draft model"),
    MethodOnlyOption("draft_tree_depth", "the draft model's token tree"),
    MethodOnlyOption("draft_tree_expand", "the draft model's token tree"),
    MethodOnlyOption("draft_tree_shape", "the draft model's token tree"),
    MethodOnlyOption("prompt_lookup_datastore", "prompt lookup's datastore"),
)
_DRAFT_LOADING_OPTIONS = ("draft_quantize", "draft_quantize_head")


def get(method: str) -> Method | None:
    """The entry of ``method``, or None for a name no method has."""
    return REGISTRY.get(method)


def methods_taking(keyword: str) -> tuple[str, ...]:
    """The methods that take option ``keyword``, in ``METHODS`` order (the draft's loading options:
    the methods with a draft model)."""
    if keyword in _DRAFT_LOADING_OPTIONS:
        return DRAFT_MODEL_METHODS
    return tuple(name for name, m in REGISTRY.items() if keyword in m.options)


def who_takes(keyword: str) -> str:
    """The methods taking ``keyword``, in words: "the method 'cascade'", or "the methods with a draft
    model, 'draft' and 'cascade'"."""
    users = methods_taking(keyword)
    if len(users) == 1:
        return f"the method {users[0]!r}"
    kind = "with a draft model, " if all(REGISTRY[m].needs_draft_model for m in users) else ""
    return f"the methods {kind}{' and '.join(map(repr, users))}"


def given(keyword: str, value: object) -> bool:
    """Whether a method-only option counts as given: not None (``draft_vocab_size``: truthy, 0 being
    the full head; ``prompt_lookup_datastore``: not "auto", its default)."""
    if keyword == "draft_vocab_size":
        return bool(value)
    return value is not None and not (keyword == "prompt_lookup_datastore" and value == "auto")


def check_datastore_option(corpus: object, branches: int) -> None:
    """Refuse, before any model loads, a ``prompt_lookup_datastore`` that cannot be used: a corpus
    (``drafters.datastore.corpus_files``) that does not exist or holds no text files, or one given with
    ``prompt_lookup_branches`` > 1 (a tree drafts the sequence's own matches only). "auto", "none" and None pass.

    Raises:
        InvalidArgumentError: Naming the value and what is allowed.
    """
    if corpus is None or str(corpus) in ("auto", "none"):
        return
    if branches > 1:
        raise InvalidArgumentError(f"a prompt lookup datastore ({str(corpus)!r}) drafts a linear block; with "
                                   f"--prompt-lookup-branches {branches} use 'auto' or 'none'")
    corpus_files(corpus)


def refused_option(method: str, options: Mapping[str, object]) -> tuple[str, object] | None:
    """The first of ``options`` (keyword -> value, in their order) that is a method-only option,
    is given, and that ``method`` does not take; None when there is none. An unknown ``method``
    takes none of them."""
    known = {o.keyword for o in METHOD_ONLY_OPTIONS}
    for keyword, value in options.items():
        if keyword in known and given(keyword, value) and method not in methods_taking(keyword):
            return keyword, value
    return None


#: Why a method does not run on a target run by llama.cpp (``SpeculativeGenerator.backend == "llama-cpp"``).
LLAMA_CPP_TARGET_REFUSALS: Mapping[str, str] = MappingProxyType({
    **dict.fromkeys(("layer-skip", "early-exit"), (
        "it drafts with the target's own torch layers, and a target run by llama.cpp has none (no torch weights "
        "are loaded)")),
})


def refuse_on_llama_cpp_target(generator, method: str, options: DrafterOptions) -> None:
    """Refuse what cannot run on ``generator``'s target when llama.cpp runs it (``LLAMA_CPP_TARGET_REFUSALS``);
    nothing for a torch target.

    "draft" and "cascade" run there with the draft model in llama.cpp too.

    Raises:
        InvalidArgumentError: ``draft_vocab_size`` (FR-Spec's head needs torch layers), ``draft_backend``
            "torch" (a torch draft beside a llama.cpp target is not built), or a method of
            ``LLAMA_CPP_TARGET_REFUSALS``, naming why and what runs instead.
    """
    if getattr(generator, "backend", "torch") != "llama-cpp":
        return
    if given("draft_vocab_size", options.draft_vocab_size):
        raise InvalidArgumentError(
            f"draft_vocab_size={options.draft_vocab_size!r} (FR-Spec's truncated head) needs torch layers, and with "
            "backend='llama-cpp' the target runs in llama.cpp with no torch layers: leave it out, or use "
            "backend='torch'"
        )
    if options.draft_backend not in (None, "llama-cpp"):
        raise InvalidArgumentError(
            f"draft_backend={options.draft_backend!r} with backend='llama-cpp': a torch draft beside a llama.cpp "
            "target is not built; the draft model runs in llama.cpp too: leave draft_backend out, or use 'llama-cpp'"
        )
    why = LLAMA_CPP_TARGET_REFUSALS.get(method)
    if why is not None:
        raise InvalidArgumentError(
            f"method {method!r} does not run with backend='llama-cpp': {why}; use 'prompt-lookup', 'draft', "
            "'cascade' or 'autoregressive', or backend='torch'"
        )


def check_method(method: str) -> Method:
    """The entry of ``method``.

    Raises:
        InvalidArgumentError: Unknown method; the message lists ``METHODS``.
    """
    entry = REGISTRY.get(method)
    if entry is None:
        raise InvalidArgumentError(f"unknown method {method!r}; allowed: {', '.join(METHODS)}")
    return entry


def make_drafter(generator, method: str, options: DrafterOptions) -> Drafter | None:
    """The drafter of ``method`` for ``generator`` (None for "autoregressive"), for one row or many.

    Method-only options that ``method`` does not take are refused first
    (``METHOD_ONLY_OPTIONS``), then the method's factory runs.

    Raises:
        InvalidArgumentError: A method-only option ``method`` does not take (named with its flag and
            the methods that take it); an unknown method; the factory's own errors (a missing draft
            model, skip set or exit layer, an option out of range); what a llama.cpp target refuses
            (``refuse_on_llama_cpp_target``).
        VocabularyMismatchError: A llama.cpp draft's tokens differ from the target's.

    A llama.cpp draft runs one sequence: its drafter refuses an engine of more than one row.
    """
    refuse_on_llama_cpp_target(generator, method, options)
    refused = refused_option(method, {k: getattr(options, k) for k in (
        "draft_backend", "draft_vocab_size", "max_model_prompt_tokens", "draft_context_window", "draft_tree_depth",
        "draft_tree_expand", "draft_tree_shape", "prompt_lookup_datastore")})
    if refused is not None:
        keyword, value = refused
        raise InvalidArgumentError(
            f"{keyword}={value!r} (--{keyword.replace('_', '-')}) applies to {who_takes(keyword)}, not to {method!r}"
        )
    return check_method(method).factory(generator, options)
