"""What a benchmarked method is and how it runs.

The methods (``available_methods``): transformers' ``generate`` variants (``HFMethod``,
``HF_METHODS``, run by ``_HFRunner``; all three in ``specdecode.bench.hf_methods``) and
every method of ``specdecode.pipeline.METHODS``, each optionally with drafter options and
draft-control modifiers (``MethodSpec``, ``METHOD_MODIFIERS``, ``DRAFTER_OPTIONS``); the
runners that time one generation of a method (``_SpecdecodeRunner``, ``_HFRunner``), built
by ``resolve_methods``; and the prompt prefix a run shares between them (``PromptPrefix``).
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import inspect
import json
import logging
import re
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any

import torch

from specdecode import method_registry, pipeline
from specdecode.bench.hf_methods import HF_METHODS, HFMethod, _HFRunner  # HFMethod: re-exported, as before
from specdecode.bench.llamacpp import LlamaCppLookupRunner, LlamaCppRunner
from specdecode.bench.report import BASELINES, LLAMA_CPP, LLAMA_CPP_LOOKUP, LLAMA_CPP_REFERENCES, is_baseline
from specdecode.bench.settings import BenchSettings
from specdecode.config import check_num_speculative_tokens
from specdecode.drafters.control import DraftControl
from specdecode.drafters.draft_tree import TREE_SHAPES
from specdecode.engine.decoder import SpeculativeDecoder
from specdecode.engine.runner_target import is_runner_target
from specdecode.errors import InvalidArgumentError

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class DrafterOption:
    """A method-specific option forwarded to ``SpeculativeGenerator.decoder`` (or ``make_drafter``).

    Adding an option is one line in ``DRAFTER_OPTIONS``; any other keyword can be
    passed without code as ``--drafter-option KEY=VALUE``.

    Attributes:
        flag: Command-line flag.
        keyword: Keyword argument of the pipeline's ``decoder``/``make_drafter``.
        type: Parses the flag's value.
        help: Help text.
    """

    flag: str
    keyword: str
    type: Callable[[str], Any]
    help: str


def _choice(value: str, allowed: Sequence[str]) -> str:
    """``value`` if it is one of ``allowed``, for a flag's ``type``.

    Raises:
        argparse.ArgumentTypeError: Anything else, naming the value and the allowed ones.
    """
    if value not in allowed:
        raise argparse.ArgumentTypeError(f"{value!r} is not one of {', '.join(allowed)}")
    return value


DRAFTER_OPTIONS = (
    DrafterOption("--skip-layers", "skip_layers", str, "layer-skip: sublayers the draft pass skips, "
                  "e.g. 'attn=2,15,18;mlp=2,15,18'"),
    DrafterOption("--skip-config", "skip_config", str, "layer-skip: JSON file with the skip set"),
    DrafterOption("--exit-layer", "exit_layer", int, "early-exit: the draft runs the target's first N decoder layers"),
    DrafterOption("--prompt-lookup-max-ngram", "prompt_lookup_max_ngram", int, "prompt-lookup: longest n-gram matched"),
    DrafterOption("--prompt-lookup-min-ngram", "prompt_lookup_min_ngram", int, "prompt-lookup: shortest n-gram matched"),
    DrafterOption("--prompt-lookup-branches", "prompt_lookup_branches", int,
                  "prompt-lookup: matches per round as a token tree (1: linear)"),
    DrafterOption("--prompt-lookup-datastore", "prompt_lookup_datastore", str,
                  "prompt-lookup: corpus of its n-gram datastore ('python-stdlib', a folder, 'none'; default 'auto': "
                  "python-stdlib with --backend llama-cpp)"),
    DrafterOption("--draft-tree-depth", "draft_tree_depth", int,
                  "draft and cascade: the draft's chain steps of a token tree of γ nodes (unset: linear)"),
    DrafterOption("--draft-tree-expand", "draft_tree_expand", int,
                  "draft, with --draft-tree-depth: EAGLE-2's expansion of the M best nodes a depth"),
    DrafterOption("--draft-tree-shape", "draft_tree_shape", lambda value: _choice(value, TREE_SHAPES),
                  "draft and cascade, with --draft-tree-depth: per-round or previous-round tree shapes (default: "
                  "previous-round on CUDA, else per-round)"),
)


# Modifiers a method name may carry after "+": the DraftControl they switch on.
METHOD_MODIFIERS = MappingProxyType({
    "adaptive": "Draft & Verify adaptive draft exit (adaptive=T: initial threshold T, default 0.6)",
    "heuristic": "transformers' heuristic draft-length schedule (+2 after a fully accepted block, -1 otherwise)",
    "gated": "target-confidence gating (gated=T: threshold T, default 0.5)",
    "cost-model": "each round's draft size from measured forward costs and acceptance by depth "
                  "(engine.speculation_cost; 0 = a plain step); with +adaptive, drafting or a plain step "
                  "by their measured tokens per second",
})
DEFAULT_GATE_THRESHOLD = 0.5
_OPTION_SPLIT = re.compile(r",(?=[A-Za-z_]\w*=)")


@dataclass(frozen=True)
class MethodSpec:
    """One benchmarked method: a base method, drafter options and draft-control modifiers.

    Written on the command line as ``BASE[:KEY=VALUE[,KEY=VALUE...]][+MODIFIER[=VALUE]...]``,
    e.g. ``early-exit:exit_layer=8+adaptive`` or ``layer-skip:skip_config=best.json+gated=0.4``.
    The whole string is the method's name in the records and tables; its options
    override the run's ``BenchSettings.drafter_options``, except
    ``num_speculative_tokens=N``, which sets this method's γ, ``draft_exit_mode=MODE`` (with
    ``+adaptive``: ``DraftControl.exit_mode``), and ``compile=0|1``
    (also ``false|true``), which turns the fast path (static KV cache, compiled forwards)
    off or on for this method, overriding ``BenchSettings.compile``. ``compile`` is the
    only option ``autoregressive`` takes, so one run can hold ``autoregressive:compile=0``
    and ``autoregressive:compile=1``.

    Attributes:
        name: The full string.
        base: A method of ``available_methods()``.
        options: Keywords for the pipeline's ``decoder``/``make_drafter`` (values parsed as JSON
            where they parse, else kept as strings).
        draft_control: The ``DraftControl`` the modifiers build, or None.
        num_speculative_tokens: This method's γ, or None for the run's.
        compile: The fast path on (True) or off (False) for this method, or None for the run's
            setting.
    """

    name: str
    base: str
    options: Mapping[str, Any] = field(default_factory=dict)
    draft_control: DraftControl | None = None
    num_speculative_tokens: int | None = None
    compile: bool | None = None

    @classmethod
    def parse(cls, name: str) -> MethodSpec:
        """Parse a method name.

        Raises:
            InvalidArgumentError: An unknown base method or modifier, a malformed option,
                options or modifiers on a method that takes none (the transformers
                methods; autoregressive takes ``compile`` alone), a ``compile`` value other
                than 0, 1, false or true, or a modifier value out of range.
        """
        head, *modifiers = name.split("+")
        base, sep, option_text = head.partition(":")
        allowed = available_methods()
        if base not in allowed:
            raise InvalidArgumentError(f"unknown method {base!r} in {name!r}; allowed: {', '.join(allowed)}")
        options: dict[str, Any] = {}
        if sep:
            for item in _OPTION_SPLIT.split(option_text):
                key, eq, value = item.partition("=")
                if not eq or not key.isidentifier():
                    raise InvalidArgumentError(
                        f"method {name!r}: expected KEY=VALUE options after ':', got {item!r}"
                    )
                try:
                    options[key] = json.loads(value)
                except ValueError:
                    options[key] = value
        control: dict[str, Any] = {}
        for modifier in modifiers:
            key, eq, value = modifier.partition("=")
            if key not in METHOD_MODIFIERS:
                raise InvalidArgumentError(
                    f"unknown modifier {key!r} in method {name!r}; allowed: {', '.join(METHOD_MODIFIERS)}"
                )
            number = None
            if eq:
                try:
                    number = float(value)
                except ValueError:
                    raise InvalidArgumentError(
                        f"modifier {key}={value!r} in method {name!r} needs a number in (0, 1)"
                    ) from None
                if key in ("heuristic", "cost-model"):
                    raise InvalidArgumentError(f"modifier {key!r} in method {name!r} takes no value")
            if key == "adaptive":
                control["adaptive_exit"] = True
                if number is not None:
                    control["exit_threshold"] = number
            elif key in ("heuristic", "cost-model"):
                control["length_schedule"] = key
            else:
                control["confidence_gate"] = DEFAULT_GATE_THRESHOLD if number is None else number
        compile_ = _parse_compile(name, options.pop("compile")) if "compile" in options else None
        if (options or control or compile_ is not None) and (base in HF_METHODS or base in LLAMA_CPP_REFERENCES):
            raise InvalidArgumentError(
                f"method {name!r}: {base!r} takes no options or modifiers (only specdecode's methods do; "
                "for transformers' compiled static-cache decoding use 'hf-generate-static')"
            )
        if (options or control) and base == "autoregressive":
            raise InvalidArgumentError(
                f"method {name!r}: 'autoregressive' takes no options or modifiers but compile=0|1 "
                "(only specdecode's speculative methods do)"
            )
        gamma = options.pop("num_speculative_tokens", None)
        if gamma is not None:
            check_num_speculative_tokens(gamma)
        if "draft_exit_mode" in options:  # the adaptive exit's (``DraftControl.exit_mode``)
            if not control.get("adaptive_exit"):
                raise InvalidArgumentError(f"method {name!r}: draft_exit_mode applies to the adaptive draft exit; "
                                           "add +adaptive")
            control["exit_mode"] = options.pop("draft_exit_mode")
        return cls(name, base, MappingProxyType(options), DraftControl(**control) if control else None, gamma,
                   compile_)


def _parse_compile(name: str, value: Any) -> bool:
    """The ``compile`` option of method ``name``: 0/1/false/true (any case) -> bool.

    Raises:
        InvalidArgumentError: Any other value (named, with the allowed ones).
    """
    if isinstance(value, bool) or (isinstance(value, int) and value in (0, 1)):
        return bool(value)
    if isinstance(value, str) and value.strip().lower() in ("true", "false"):
        return value.strip().lower() == "true"
    raise InvalidArgumentError(
        f"method {name!r}: compile={value!r} is not allowed; use compile=0 or compile=1 (or false/true)"
    )


def available_methods() -> list[str]:
    """Every method the bench knows now: the target-only baselines (``BASELINES``), the transformers
    variants, the llama.cpp reference (``specdecode.bench.llamacpp``), then ``pipeline.METHODS``."""
    names = ["hf-generate", "autoregressive", "hf-generate-static", "hf-assisted", "hf-prompt-lookup", LLAMA_CPP,
             LLAMA_CPP_LOOKUP, *pipeline.METHODS]
    return list(dict.fromkeys(names))


def check_method_names(methods: Iterable[str]) -> list[str]:
    """``methods`` without duplicates, in order; each may carry options and modifiers (``MethodSpec``).

    Raises:
        InvalidArgumentError: An unknown name (the allowed ones are listed), a bad option or
            modifier, or no method at all.
    """
    methods = list(dict.fromkeys(methods))
    allowed = available_methods()
    unknown = [m for m in methods if m.partition("+")[0].partition(":")[0] not in allowed]
    if unknown:
        raise InvalidArgumentError(
            f"unknown method{'s' if len(unknown) > 1 else ''} {', '.join(map(repr, unknown))}; "
            f"allowed: {', '.join(allowed)} (each optionally as NAME:KEY=VALUE,...+MODIFIER, "
            f"modifiers: {', '.join(METHOD_MODIFIERS)})"
        )
    if not methods:
        raise InvalidArgumentError(f"no methods to benchmark; allowed: {', '.join(allowed)}")
    for m in methods:
        MethodSpec.parse(m)
    return methods


@dataclass(frozen=True)
class PromptPrefix:
    """A prompt without its last token, encoded once by the target and shared by every method.

    Each runner deep-copies a cache before its timed generation (the copy is not timed).

    Attributes:
        num_tokens: m, the prefix length (prompt length - 1).
        cache: specdecode's target cache (``specdecode.engine.kv_cache.new_cache`` layout) of the m tokens.
        hf_cache: The cache handed to transformers' ``generate`` (the same object unless
            the model has sliding-window layers, whose specdecode layout differs).
        seconds: Wall time of encoding the prefix.
    """

    num_tokens: int
    cache: Any
    hf_cache: Any
    seconds: float

    @classmethod
    @torch.inference_mode()
    def encode(cls, model, input_ids: torch.Tensor) -> PromptPrefix | None:
        """Encode ``input_ids`` (1, n) but the last token; None when n == 1 (nothing to share)."""
        from transformers import DynamicCache

        m = int(input_ids.shape[1]) - 1
        if m < 1:
            return None
        prefix = input_ids[:, :m]
        t0 = time.perf_counter()
        cache = SpeculativeDecoder(model).prompt_cache(prefix)
        hf_cache = cache
        if getattr(cache, "layers", None) and any(getattr(layer, "is_sliding", False) for layer in cache.layers):
            hf_cache = DynamicCache(config=model.config)
            model(prefix, past_key_values=hf_cache, use_cache=True, logits_to_keep=1)
        return cls(m, cache, hf_cache, time.perf_counter() - t0)


# ---------------------------------------------------------------------------------------------
# method runners


def _accepted_keywords(fn: Callable) -> set[str] | None:
    """Keyword names ``fn`` takes besides ``method`` (None: it takes any, via ``**kwargs``)."""
    params = inspect.signature(fn).parameters.values()
    if any(p.kind is p.VAR_KEYWORD for p in params):
        return None
    return {p.name for p in params if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)} - {"method"}


def build_decoder(
    generator: pipeline.SpeculativeGenerator, method: str, options: Mapping[str, Any]
) -> SpeculativeDecoder:
    """The pipeline's decoder for ``method``, with the drafter options forwarded.

    Options go to ``generator.decoder`` when it takes them, else to
    ``generator.make_drafter``.

    Raises:
        InvalidArgumentError: The pipeline takes none of these options, or rejects the method
            (unknown, or its requirements, such as a draft model, are not met).
    """
    if not options:
        return generator.decoder(method)
    wanted = set(options)
    takes = _accepted_keywords(generator.decoder)
    if takes is None or wanted <= takes:
        return generator.decoder(method, **options)
    takes = _accepted_keywords(generator.make_drafter)
    if takes is not None and not wanted <= takes:
        raise InvalidArgumentError(
            f"drafter option(s) {', '.join(sorted(wanted - takes))} are not supported by this specdecode "
            f"pipeline; SpeculativeGenerator.make_drafter takes: {', '.join(sorted(takes)) or 'no options'}"
        )
    return SpeculativeDecoder(
        generator.target.model,
        generator.make_drafter(method, **options),
        eos_token_ids=pipeline.eos_token_ids(generator.target),
        tokenizer=generator.tokenizer,
    )


def _describe_control(control) -> dict:
    """A decoder's draft control, JSON-ready: a ``DraftControl``'s fields, or a policy's name and numbers (the
    measured-cost policy of a target run by llama.cpp: its forward costs in seconds by width)."""
    if isinstance(control, DraftControl):
        return dataclasses.asdict(control)
    out: dict[str, Any] = {"policy": type(control).__name__}
    costs = getattr(getattr(control, "target_costs", None), "seconds", None)
    if costs:  # a SpeculationCostPolicy's (calibrated by the engine unless a llama.cpp target's, given)
        out["forward_costs_s"] = {str(w): float(v) for w, v in costs.items()}
        out["draft_step_s"] = getattr(control, "draft_node_s", None)
        out["max_tokens"] = getattr(control, "max_size", None)
    for name in ("prior", "prior_weight", "decay", "probe_every"):
        if isinstance(getattr(control, name, None), (int, float)):
            out[name] = getattr(control, name)
    return out


class _SpecdecodeRunner:
    """Runs one specdecode method through its ``SpeculativeDecoder`` (built once, reused).

    With a target run by llama.cpp (backend "llama-cpp") it cannot start from a prompt cache
    (``supports_prompt_cache`` False: there are no torch keys and values to copy)."""

    kind = "specdecode"

    def __init__(
        self, name: str, decoder: SpeculativeDecoder, settings: BenchSettings, spec: MethodSpec | None = None
    ) -> None:
        self.name = name
        self.decoder = decoder
        self.settings = settings
        self.spec = spec or MethodSpec(name, name)
        self.backend = "llama-cpp" if is_runner_target(decoder.target) else "torch"
        self.supports_prompt_cache = self.backend == "torch"

    def _gamma(self) -> int:
        return self.spec.num_speculative_tokens or self.settings.num_speculative_tokens

    def describe(self) -> dict:
        drafter = self.decoder.drafter
        control = self.decoder.draft_control
        options = {} if drafter is None else {**self.settings.drafter_options, **self.spec.options}
        return {
            "kind": self.kind,
            "base_method": self.spec.base,
            "drafter": type(drafter).__name__ if drafter is not None else None,
            "num_speculative_tokens": self._gamma() if drafter is not None else None,
            "drafter_options": options,
            "draft_control": _describe_control(control) if control is not None and drafter is not None else None,
            # The fast path as requested (None: the pipeline's device default).
            "compile": self.spec.compile if self.spec.compile is not None else self.settings.compile,
            "backend": self.backend,
        }

    def __call__(
        self, input_ids: torch.Tensor, max_new_tokens: int, seed: int, prefix: PromptPrefix | None = None
    ) -> dict:
        config = dataclasses.replace(
            self.settings.generation_config(max_new_tokens, seed), num_speculative_tokens=self._gamma()
        )
        cache = copy.deepcopy(prefix.cache) if prefix is not None else None  # outside the timing
        t0 = time.perf_counter()
        stream = self.decoder.stream(input_ids, config, prompt_cache=cache)
        for _ in stream:
            pass
        s = stream.stats
        # Compilation of the fast path (a width first met in a timed run) is warm-up, not decoding.
        seconds = time.perf_counter() - t0 - s.warmup_s
        return {
            "token_ids": list(stream.token_ids),
            "seconds": seconds,
            "warmup_s": s.warmup_s,
            "finish_reason": stream.finish_reason,
            "target_forwards": s.num_target_forwards + 1,  # + the prefill
            # τ (SpecDecodingStats.mean_accepted_tokens): accepted + one bonus token per verification.
            "verify_tokens": s.num_accepted_tokens + s.num_target_forwards,
            "verify_forwards": s.num_target_forwards,
            "drafted": s.num_drafted_tokens,
            "accepted": s.num_accepted_tokens,
            "draft_forwards": s.num_draft_forwards,
            "drafted_by_position": list(s.drafted_by_position),
            "accepted_by_position": list(s.accepted_by_position),
            "rounds_by_draft_size": list(s.rounds_by_draft_size),
            "rounds_by_draft_cap": list(s.rounds_by_draft_cap),
            "prefill_s": s.prefill_time_s,
            "final_draft_threshold": s.final_draft_threshold,
            "gated_steps": s.num_gated_steps,
            "banned_word_rollbacks": s.num_banned_word_rollbacks,
            "banned_word_discarded_tokens": s.num_banned_word_discarded_tokens,
        }


def resolve_methods(
    generator: pipeline.SpeculativeGenerator,
    methods: Sequence[str] | None,
    settings: BenchSettings,
    *,
    max_positions: int | None = None,
) -> tuple[dict[str, Callable], dict[str, str]]:
    """Build a runner for every method.

    Args:
        methods: The methods to run; ``None``: every available method whose requirements
            (such as a draft model) are met, but ``llama-cpp`` and ``llama-cpp-lookup`` (references, run only when
            named, except with the target in llama.cpp, ``generator.backend`` "llama-cpp", where they are what
            our methods are compared with); the others are skipped and reported.
        settings: How every method generates; its ``compile`` applies to the specdecode
            methods whose name sets no ``compile`` option (``MethodSpec``).
        max_positions: The most positions one generation of the run needs (longest prompt
            plus ``max_new_tokens``): the static-cache length of ``hf-generate-static``, fixed
            so that no prompt recompiles it; None: sized per generation.

    Returns:
        (method -> runner, skipped method -> reason).

    Raises:
        InvalidArgumentError: An unknown method, or a requested method whose requirements
            are not met (no draft model loaded; llama-cpp-python missing or a non-GGUF target;
            with a target run by llama.cpp, ``generator.backend`` "llama-cpp": transformers'
            methods and those the pipeline refuses there, such as layer-skip; unnamed, they are
            skipped with the reason).
        ModelNotFoundError, ChecksumMismatchError, UnsupportedModelError: the llama.cpp references' GGUF file.
    """
    explicit = methods is not None
    names = check_method_names(methods) if explicit else available_methods()
    runners: dict[str, Callable] = {}
    skipped: dict[str, str] = {}
    for name in names:
        try:
            if name in LLAMA_CPP_REFERENCES:  # a second engine and model in memory: with a torch target, when asked for
                if not explicit and getattr(generator, "backend", "torch") != "llama-cpp":
                    raise InvalidArgumentError(f"{name!r} is a reference and runs only when named in the methods")
                if settings.processor_settings():  # [processors]
                    raise InvalidArgumentError(f"method {name!r} does not take specdecode's processors "
                                               f"({', '.join(settings.processor_settings())}); leave it out")
                runner_class = LlamaCppRunner if name == LLAMA_CPP else LlamaCppLookupRunner
                runners[name] = runner_class(generator, settings)
            elif name in HF_METHODS:
                spec = HF_METHODS[name]
                if getattr(generator, "backend", "torch") != "torch":
                    raise InvalidArgumentError(
                        f"method {name!r} runs transformers' generate on the target's torch model, but with backend "
                        f"{generator.backend!r} the target runs in llama.cpp and has none; leave {name!r} out (the "
                        f"references there are {' and '.join(LLAMA_CPP_REFERENCES)}) or use backend 'torch'"
                    )
                if settings.banned_words:
                    raise InvalidArgumentError(
                        f"method {name!r} cannot ban words (transformers masks token ids, not text); "
                        "leave it out of a run with banned words"
                    )
                unmatched = set(settings.processor_settings()) - {"repetition_penalty", "min_p"}  # [processors]
                if unmatched:
                    raise InvalidArgumentError(
                        f"method {name!r} has no {', '.join(sorted(unmatched))} (transformers' generate has no "
                        "OpenAI penalties or logit_bias here); leave it out of a run with them"
                    )
                if spec.needs_draft and generator.draft is None:
                    raise InvalidArgumentError(
                        f"method {name!r} needs a draft model; pass --draft (draft=...) or leave {name!r} out"
                    )
                if spec.static_cache and getattr(generator.target, "prepacked", False):
                    raise InvalidArgumentError(
                        f"method {name!r} compiles the target's forward, but its float32 linear layers run on "
                        "oneDNN's kernel (models.prepacked_linear, the CPU default), which torch.compile cannot "
                        "compile whole; run the bench with --no-prepack-linears (prepack_linears=False) to include it"
                    )
                runners[name] = _HFRunner(spec, generator, settings, max_positions)
            else:
                spec = MethodSpec.parse(name)
                run_wide = dict(settings.drafter_options)
                entry = method_registry.get(spec.base)  # None: a name the pipeline refuses when asked
                takes = entry.options if entry is not None else frozenset()
                # Run-wide draft-model options go to the methods that take them (the registry's) alone.
                for keyword in ("draft_vocab_size", "draft_context_window", "max_model_prompt_tokens",
                                "draft_tree_depth", "draft_tree_expand", "draft_tree_shape",
                                "prompt_lookup_datastore"):
                    if keyword not in takes:
                        run_wide.pop(keyword, None)
                options = {} if spec.base == "autoregressive" else {**run_wide, **spec.options}
                if spec.draft_control is not None:
                    options["draft_control"] = spec.draft_control
                compile_ = spec.compile if spec.compile is not None else settings.compile
                if compile_ is not None:  # unset: the pipeline's device default
                    options["compile"] = compile_
                runners[name] = _SpecdecodeRunner(
                    name, build_decoder(generator, spec.base, options), settings, spec
                )
        except InvalidArgumentError as e:
            if explicit:
                raise
            skipped[name] = str(e)
            logger.info("skipping method %s: %s", name, e)
    if not any(is_baseline(name) for name in runners):
        logger.warning("no baseline method (%s) in the run: speedups will be None", " or ".join(BASELINES))
    return runners, skipped
