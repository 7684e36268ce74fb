"""``specdecode bench``: time every decoding method on the same prompts, in one process.

The target (and draft) are loaded once; every method runs with the same weights,
dtype, prompts (encoded once) and generation settings. After a warm-up (one
short generation per method), each method runs on every prompt, ``repeats``
times, interleaved prompt by prompt so that slow drifts of the machine (heat,
other load) hit every method alike.

Methods:

* ``hf-generate``: transformers ``model.generate`` on the target alone (greedy, or
  sampling at the same temperature with top-k/top-p off), EOS from the target's
  generation config, ``min_new_tokens`` unset.
* ``hf-assisted``: ``generate(assistant_model=draft)``; the draft's
  ``num_assistant_tokens``/``num_assistant_tokens_schedule``/
  ``assistant_confidence_threshold`` are set to transformers' defaults (recorded
  in results.json).
* ``hf-prompt-lookup``: ``generate(prompt_lookup_num_tokens=10)``.
* every method in ``specdecode.pipeline.METHODS`` (read at run time, so new
  methods appear here without code), run through ``SpeculativeGenerator.decoder``.

Speedups are relative to the *faster* of ``hf-generate`` and ``autoregressive``
in the same category (``speedups``), with tokens/s aggregated as total new
tokens / total seconds (``tokens_per_second``), so neither a slow baseline nor a
few short outputs can flatter a method.

Every finished (method, prompt, repeat) is appended to ``OUT/records.jsonl`` at
once (flushed and fsynced). Running the same command again skips finished
records; the reports are recomputed from all records of the run's plan. The
run's settings live in ``OUT/settings.json``; resuming with different ones is refused.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import dataclasses
import hashlib
import inspect
import json
import logging
import math
import os
import platform
import re
import shlex
import statistics
import sys
import time
import zlib
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from types import MappingProxyType
from typing import Any

import torch

from specdecode import pipeline
from specdecode.config import GenerationConfig, check_num_speculative_tokens
from specdecode.datasets import Prompt
from specdecode import kv_cache
from specdecode.decoding import SpeculativeDecoder
from specdecode.draft_control import DraftControl
from specdecode.errors import InvalidArgumentError
from specdecode.files import write_png_atomic, write_text_atomic

logger = logging.getLogger(__name__)

BASELINES = ("hf-generate", "autoregressive")
REFERENCE_METHOD = "autoregressive"  # token agreement is measured against its output
OVERALL = "overall"
RECORDS_FILE = "records.jsonl"
SETTINGS_FILE = "settings.json"
RESULTS_JSON = "results.json"
RESULTS_MD = "results.md"
SPEEDUP_PNG = "speedup_by_category.png"
ACCEPTANCE_PNG = "acceptance_by_position.png"
CPU_FLAGS_OF_INTEREST = ("avx2", "fma", "avx512f", "avx512_vnni", "avx512_bf16", "amx_tile", "amx_bf16", "amx_int8")
# transformers' defaults for assisted generation (GenerationConfig._get_default_generation_params in 5.x),
# used only if that private helper is gone.
_HF_ASSISTANT_DEFAULTS = MappingProxyType(
    {"num_assistant_tokens": 20, "num_assistant_tokens_schedule": "constant", "assistant_confidence_threshold": 0.4}
)


@dataclass(frozen=True)
class HFMethod:
    """A transformers ``generate`` variant benchmarked next to specdecode's methods.

    Attributes:
        name: Method name on the command line.
        description: One line for the report.
        needs_draft: Passes the draft model as ``assistant_model``.
        generate_options: Extra ``transformers.GenerationConfig`` fields.
        supports_prompt_cache: ``generate(past_key_values=...)`` continues from a cached
            prompt prefix. False for transformers' assisted and prompt-lookup decoding
            (5.x): their first step feeds the whole prompt again whatever the cache holds.
    """

    name: str
    description: str
    needs_draft: bool = False
    generate_options: Mapping[str, Any] = field(default_factory=dict)
    supports_prompt_cache: bool = False

    def __post_init__(self) -> None:
        object.__setattr__(self, "generate_options", MappingProxyType(dict(self.generate_options)))


HF_METHODS = MappingProxyType(
    {
        m.name: m
        for m in (
            HFMethod("hf-generate", "transformers generate, target only", supports_prompt_cache=True),
            HFMethod("hf-assisted", "transformers assisted generation (assistant_model=draft)", needs_draft=True),
            HFMethod("hf-prompt-lookup", "transformers prompt lookup decoding",
                     generate_options={"prompt_lookup_num_tokens": 10}),
        )
    }
)


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


DRAFTER_OPTIONS = (
    DrafterOption("--skip-layers", "skip_layers", str, "layer-skip: sublayers the draft pass skips, "
                  "e.g. 'attn=2,15,18;mlp=2,15,18'"),
    DrafterOption("--skip-config", "skip_config", str, "layer-skip: JSON file with the skip set"),
    DrafterOption("--exit-layer", "exit_layer", int, "early-exit: the draft runs the target's first N decoder layers"),
    DrafterOption("--prompt-lookup-max-ngram", "prompt_lookup_max_ngram", int, "prompt-lookup: longest n-gram matched"),
    DrafterOption("--prompt-lookup-min-ngram", "prompt_lookup_min_ngram", int, "prompt-lookup: shortest n-gram matched"),
)


# Modifiers a method name may carry after "+": the DraftControl they switch on.
METHOD_MODIFIERS = MappingProxyType({
    "adaptive": "Draft & Verify adaptive draft exit (adaptive=T: initial threshold T, default 0.6)",
    "heuristic": "transformers' heuristic draft-length schedule (+2 after a fully accepted block, -1 otherwise)",
    "gated": "target-confidence gating (gated=T: threshold T, default 0.5)",
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
    ``num_speculative_tokens=N``, which sets this method's γ.

    Attributes:
        name: The full string.
        base: A method of ``available_methods()``.
        options: Keywords for the pipeline's ``decoder``/``make_drafter`` (values parsed as JSON
            where they parse, else kept as strings).
        draft_control: The ``DraftControl`` the modifiers build, or None.
        num_speculative_tokens: This method's γ, or None for the run's.
    """

    name: str
    base: str
    options: Mapping[str, Any] = field(default_factory=dict)
    draft_control: DraftControl | None = None
    num_speculative_tokens: int | None = None

    @classmethod
    def parse(cls, name: str) -> MethodSpec:
        """Parse a method name.

        Raises:
            InvalidArgumentError: An unknown base method or modifier, a malformed option,
                options or modifiers on a method that takes none (the transformers
                methods, autoregressive), or a modifier value out of range.
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
                if key == "heuristic":
                    raise InvalidArgumentError(f"modifier 'heuristic' in method {name!r} takes no value")
            if key == "adaptive":
                control["adaptive_exit"] = True
                if number is not None:
                    control["exit_threshold"] = number
            elif key == "heuristic":
                control["length_schedule"] = "heuristic"
            else:
                control["confidence_gate"] = DEFAULT_GATE_THRESHOLD if number is None else number
        if (options or control) and (base in HF_METHODS or base == "autoregressive"):
            raise InvalidArgumentError(
                f"method {name!r}: {base!r} takes no options or modifiers (only specdecode's speculative methods do)"
            )
        gamma = options.pop("num_speculative_tokens", None)
        if gamma is not None:
            check_num_speculative_tokens(gamma)
        return cls(name, base, MappingProxyType(options), DraftControl(**control) if control else None, gamma)


def available_methods() -> list[str]:
    """Every method the bench knows now: the two baselines, the transformers variants, then ``pipeline.METHODS``."""
    names = ["hf-generate", "autoregressive", "hf-assisted", "hf-prompt-lookup", *pipeline.METHODS]
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


# ---------------------------------------------------------------------------------------------
# settings


@dataclass(frozen=True)
class BenchSettings:
    """How every method generates.

    Attributes:
        max_new_tokens: Tokens generated per prompt at most (>= 1).
        temperature: 0 = greedy; > 0 samples (top-k and top-p off) for every method.
        num_speculative_tokens: γ for specdecode's speculative methods (transformers'
            methods use their own defaults, recorded in the results).
        repeats: Runs of every (method, prompt); tokens/s is reported as the median
            over repeats, with min and max.
        seed: Base seed; each (prompt, repeat) derives its own, shared by all methods.
        warmup_tokens: Length of the warm-up generation of each method.
        drafter_options: Keywords forwarded to the pipeline's ``decoder``/``make_drafter``
            (e.g. ``{"exit_layer": 8}``).
        prompt_cache: Encode each prompt but its last token once, outside the timing, and
            give every method a copy of that target cache (``PromptPrefix``), as a server
            with prefix caching would; each timed generation then encodes the last prompt
            token and decodes. False: every method encodes the whole prompt inside its
            timing. None (default): on when every method of the run supports it (not
            ``hf-assisted``/``hf-prompt-lookup``, see ``HFMethod``), else off.

    Raises:
        InvalidArgumentError: A value outside its range.
    """

    max_new_tokens: int = 128
    temperature: float = 0.0
    num_speculative_tokens: int = GenerationConfig.num_speculative_tokens
    repeats: int = 1
    seed: int = 0
    warmup_tokens: int = 8
    drafter_options: Mapping[str, Any] = field(default_factory=dict)
    prompt_cache: bool | None = None

    def __post_init__(self) -> None:
        GenerationConfig(  # validates max_new_tokens, temperature, gamma
            max_new_tokens=self.max_new_tokens,
            temperature=self.temperature,
            num_speculative_tokens=self.num_speculative_tokens,
        )
        for name in ("repeats", "warmup_tokens"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise InvalidArgumentError(f"{name} must be an integer >= 1, got {value!r}")
        if self.prompt_cache not in (None, True, False):
            raise InvalidArgumentError(f"prompt_cache must be True, False or None (auto), got {self.prompt_cache!r}")
        if not isinstance(self.seed, int) or isinstance(self.seed, bool) or self.seed < 0:
            raise InvalidArgumentError(f"seed must be an integer >= 0, got {self.seed!r}")
        options = dict(self.drafter_options or {})
        for key, value in options.items():
            if not isinstance(key, str) or not key.isidentifier():
                raise InvalidArgumentError(f"drafter option names must be Python identifiers, got {key!r}")
            try:
                json.dumps(value)
            except TypeError as e:
                raise InvalidArgumentError(f"drafter option {key}={value!r} is not a JSON value") from e
        object.__setattr__(self, "drafter_options", MappingProxyType(options))

    @property
    def greedy(self) -> bool:
        """True when decoding takes the argmax (temperature 0)."""
        return self.temperature == 0.0

    def generation_config(self, max_new_tokens: int | None = None, seed: int | None = None) -> GenerationConfig:
        """specdecode's ``GenerationConfig`` for one generation."""
        return GenerationConfig(
            max_new_tokens=max_new_tokens or self.max_new_tokens,
            temperature=self.temperature,
            num_speculative_tokens=self.num_speculative_tokens,
            seed=None if self.greedy else seed,
        )

    def to_dict(self) -> dict:
        """JSON-ready copy."""
        return {
            "max_new_tokens": self.max_new_tokens,
            "temperature": self.temperature,
            "num_speculative_tokens": self.num_speculative_tokens,
            "repeats": self.repeats,
            "seed": self.seed,
            "warmup_tokens": self.warmup_tokens,
            "drafter_options": dict(self.drafter_options),
            "prompt_cache": self.prompt_cache,
        }


def run_identity(generator: pipeline.SpeculativeGenerator, settings: BenchSettings) -> dict:
    """The settings a results folder is tied to: records made under other values are not comparable.

    Repeats, prompts and methods are not part of it: a later run may add them.
    """
    model = generator.target.model
    return {
        "target": generator.target.name,
        "draft": generator.draft.name if generator.draft is not None else None,
        "dtype": str(model.dtype).removeprefix("torch."),
        "device": str(model.device),
        "max_new_tokens": settings.max_new_tokens,
        "temperature": settings.temperature,
        "num_speculative_tokens": settings.num_speculative_tokens,
        "seed": settings.seed,
        "drafter_options": dict(settings.drafter_options),
        "prompt_cache": settings.prompt_cache,
    }


@dataclass(frozen=True)
class PromptPrefix:
    """A prompt without its last token, encoded once by the target and shared by every method.

    Each runner deep-copies a cache before its timed generation (the copy is not timed).

    Attributes:
        num_tokens: m, the prefix length (prompt length - 1).
        cache: specdecode's target cache (``kv_cache.new_cache`` layout) of the m tokens.
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


def _ids_digest(ids: torch.Tensor) -> str:
    """Short fingerprint of encoded prompt ids (detects a changed chat setting or dataset on resume)."""
    return hashlib.sha256(json.dumps(ids[0].tolist()).encode()).hexdigest()[:16]


def prompt_seed(base_seed: int, prompt_id: str, repeat: int) -> int:
    """The sampling seed of one (prompt, repeat), the same for every method and every run."""
    return (base_seed * 1_000_003 + zlib.crc32(f"{prompt_id}\0{repeat}".encode())) % (2**31)


# ---------------------------------------------------------------------------------------------
# pure arithmetic (unit-tested with hand numbers)


def tokens_per_second(new_tokens: Sequence[int], seconds: Sequence[float]) -> float | None:
    """Aggregate throughput: total new tokens / total seconds (not the mean of per-prompt rates).

    Returns None when no time was spent.
    """
    total_s = math.fsum(seconds)
    return sum(new_tokens) / total_s if total_s > 0 else None


def speedups(
    tokens_per_s: Mapping[str, float | None], baselines: Sequence[str] = BASELINES
) -> tuple[dict[str, float | None], str | None]:
    """Speedup of each method over the fastest baseline present.

    Args:
        tokens_per_s: Method name -> aggregated tokens/s (None: not measured).
        baselines: The methods that may serve as baseline.

    Returns:
        (method -> tokens/s ÷ the fastest baseline's tokens/s, or None; the baseline's name,
        or None when no baseline was measured).
    """
    measured = {b: tokens_per_s[b] for b in baselines if tokens_per_s.get(b)}
    if not measured:
        return {m: None for m in tokens_per_s}, None
    ref = max(measured, key=measured.__getitem__)
    return {m: (v / measured[ref] if v is not None else None) for m, v in tokens_per_s.items()}, ref


def first_divergence(tokens: Sequence[int], reference: Sequence[int]) -> int | None:
    """Index of the first position where ``tokens`` and ``reference`` differ (None: identical).

    When one is a prefix of the other, the shorter length.
    """
    for i, (a, b) in enumerate(zip(tokens, reference)):
        if a != b:
            return i
    return None if len(tokens) == len(reference) else min(len(tokens), len(reference))


def _ratio(num: float, den: float) -> float | None:
    return num / den if den else None


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


class _SpecdecodeRunner:
    """Runs one specdecode method through its ``SpeculativeDecoder`` (built once, reused)."""

    kind = "specdecode"
    supports_prompt_cache = True

    def __init__(
        self, name: str, decoder: SpeculativeDecoder, settings: BenchSettings, spec: MethodSpec | None = None
    ) -> None:
        self.name = name
        self.decoder = decoder
        self.settings = settings
        self.spec = spec or MethodSpec(name, name)

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
            "draft_control": dataclasses.asdict(control) if control is not None and drafter is not None else None,
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
        seconds = time.perf_counter() - t0
        s = stream.stats
        return {
            "token_ids": list(stream.token_ids),
            "seconds": seconds,
            "finish_reason": stream.finish_reason,
            "target_forwards": s.num_target_forwards + 1,  # + the prefill
            # τ counts the tokens of the decode-phase forwards (the prefill's token excluded), bonus included.
            "verify_tokens": s.num_tokens_from_forwards,
            "verify_forwards": s.num_target_forwards,
            "drafted": s.num_drafted_tokens,
            "accepted": s.num_accepted_tokens,
            "draft_forwards": s.num_draft_forwards,
            "drafted_by_position": list(s.drafted_by_position),
            "accepted_by_position": list(s.accepted_by_position),
            "prefill_s": s.prefill_time_s,
            "final_draft_threshold": s.final_draft_threshold,
            "gated_steps": s.num_gated_steps,
        }


class _HFRunner:
    """Runs ``transformers`` ``generate`` on the target; counts target forwards with a pre-forward hook.

    Drafted tokens are read off the target's forward input lengths (a verification
    forward over the pending token and k candidates has k + 1 inputs; the first
    forward also holds the prompt), accepted tokens as new tokens - forwards
    (each forward adds its accepted tokens plus one).
    """

    kind = "transformers"

    def __init__(self, spec: HFMethod, generator: pipeline.SpeculativeGenerator, settings: BenchSettings) -> None:
        self.name = spec.name
        self.spec = spec
        self.settings = settings
        self.model = generator.target.model
        self.assistant = generator.draft.model if spec.needs_draft else None
        self.eos = sorted(pipeline.eos_token_ids(generator.target))
        pad = self.model.generation_config.pad_token_id
        if pad is None:
            pad = generator.tokenizer.pad_token_id
        self.pad = pad if pad is not None else (self.eos[0] if self.eos else None)
        self.assistant_settings = _hf_assistant_defaults() if self.assistant is not None else None
        self.supports_prompt_cache = spec.supports_prompt_cache

    def generation_config(self, max_new_tokens: int):
        """The transformers ``GenerationConfig``: our settings, and neutral values for every
        logits processor a model's own generation config could switch on (e.g. Qwen's
        repetition_penalty 1.05, top_k 20, top_p 0.8)."""
        from transformers import GenerationConfig as HFGenerationConfig

        options: dict[str, Any] = {
            "max_new_tokens": max_new_tokens,
            "do_sample": not self.settings.greedy,
            "eos_token_id": self.eos or None,
            "pad_token_id": self.pad,
            "repetition_penalty": 1.0,
            "no_repeat_ngram_size": 0,
            **self.spec.generate_options,
        }
        if not self.settings.greedy:
            options.update(temperature=self.settings.temperature, top_k=0, top_p=1.0, typical_p=1.0,
                           epsilon_cutoff=0.0, eta_cutoff=0.0)
            if getattr(self.model.generation_config, "min_p", None) is not None:
                options["min_p"] = 0.0
        return HFGenerationConfig(**options)

    def describe(self) -> dict:
        config = self.generation_config(self.settings.max_new_tokens).to_diff_dict()
        config.pop("transformers_version", None)
        out = {"kind": self.kind, "description": self.spec.description, "generation_config": config}
        if self.assistant_settings is not None:
            out["assistant_generation_config"] = dict(self.assistant_settings)
        return out

    @contextlib.contextmanager
    def _assistant_configured(self):
        """Set the draft's assisted-generation fields to transformers' defaults, restoring them after."""
        if self.assistant is None:
            yield
            return
        gc = self.assistant.generation_config
        saved = {k: getattr(gc, k, None) for k in self.assistant_settings}
        for k, v in self.assistant_settings.items():
            setattr(gc, k, v)
        try:
            yield
        finally:
            for k, v in saved.items():
                setattr(gc, k, v)

    def __call__(
        self, input_ids: torch.Tensor, max_new_tokens: int, seed: int, prefix: PromptPrefix | None = None
    ) -> dict:
        config = self.generation_config(max_new_tokens)
        lengths: list[int] = []
        if prefix is not None and not self.supports_prompt_cache:
            raise InvalidArgumentError(f"method {self.name!r} cannot start from a cached prompt")
        if prefix is not None:  # transformers encodes only the tokens its cache lacks
            extra_cache = {"past_key_values": copy.deepcopy(prefix.hf_cache)}
            num_prefix = prefix.num_tokens
        else:
            extra_cache, num_prefix = {}, 0

        def count(_module, args, kwargs):
            ids = kwargs.get("input_ids", args[0] if args else None)
            if ids is None and kwargs.get("inputs_embeds") is not None:
                ids = kwargs["inputs_embeds"]
            lengths.append(int(ids.shape[1]) if ids is not None else 1)

        extra = {"assistant_model": self.assistant} if self.assistant is not None else {}
        extra.update(extra_cache)
        n = int(input_ids.shape[1])
        handle = self.model.register_forward_pre_hook(count, with_kwargs=True)
        try:
            with self._assistant_configured(), _seeded(None if self.settings.greedy else seed, input_ids.device):
                t0 = time.perf_counter()
                out = self.model.generate(
                    input_ids, attention_mask=torch.ones_like(input_ids), generation_config=config, **extra
                )
                seconds = time.perf_counter() - t0
        finally:
            handle.remove()
        tokens = out[0, n:].tolist()
        eos = set(self.eos)
        cut = next((i + 1 for i, t in enumerate(tokens) if t in eos), None)
        if cut is not None:
            tokens = tokens[:cut]
        finish = "eos" if cut is not None else ("length" if len(tokens) >= max_new_tokens else "other")
        forwards = len(lengths)
        drafted = (lengths[0] - (n - num_prefix) if lengths else 0) + sum(k - 1 for k in lengths[1:])
        return {
            "token_ids": tokens,
            "seconds": seconds,
            "finish_reason": finish,
            "target_forwards": forwards,
            # Every transformers forward, the first included, verifies a block and adds its tokens.
            "verify_tokens": len(tokens),
            "verify_forwards": forwards,
            "drafted": drafted,
            "accepted": max(len(tokens) - forwards, 0) if drafted else 0,
            "draft_forwards": None,
            "drafted_by_position": None,
            "accepted_by_position": None,
            "prefill_s": None,
            "final_draft_threshold": None,
            "gated_steps": None,
        }


@contextlib.contextmanager
def _seeded(seed: int | None, device: torch.device):
    """Seed torch's global generator for one sampling generation and restore its state afterwards."""
    if seed is None:
        yield
        return
    devices = [device] if device.type == "cuda" else []
    with torch.random.fork_rng(devices=devices):
        torch.manual_seed(seed)
        yield


def _hf_assistant_defaults() -> dict:
    from transformers import GenerationConfig as HFGenerationConfig

    try:
        defaults = HFGenerationConfig._get_default_generation_params()
    except AttributeError:
        defaults = {}
    return {k: defaults.get(k, v) for k, v in _HF_ASSISTANT_DEFAULTS.items()}


def resolve_methods(
    generator: pipeline.SpeculativeGenerator,
    methods: Sequence[str] | None,
    settings: BenchSettings,
) -> tuple[dict[str, Callable], dict[str, str]]:
    """Build a runner for every method.

    Args:
        methods: The methods to run; ``None``: every available method whose requirements
            (such as a draft model) are met; the others are skipped and reported.

    Returns:
        (method -> runner, skipped method -> reason).

    Raises:
        InvalidArgumentError: An unknown method, or a requested method whose requirements
            are not met (e.g. it needs a draft model and none is loaded).
    """
    explicit = methods is not None
    names = check_method_names(methods) if explicit else available_methods()
    runners: dict[str, Callable] = {}
    skipped: dict[str, str] = {}
    for name in names:
        try:
            if name in HF_METHODS:
                spec = HF_METHODS[name]
                if spec.needs_draft and generator.draft is None:
                    raise InvalidArgumentError(
                        f"method {name!r} needs a draft model; pass --draft (draft=...) or leave {name!r} out"
                    )
                runners[name] = _HFRunner(spec, generator, settings)
            else:
                spec = MethodSpec.parse(name)
                options = {} if spec.base == "autoregressive" else {**settings.drafter_options, **spec.options}
                if spec.draft_control is not None:
                    options["draft_control"] = spec.draft_control
                runners[name] = _SpecdecodeRunner(
                    name, build_decoder(generator, spec.base, options), settings, spec
                )
        except InvalidArgumentError as e:
            if explicit:
                raise
            skipped[name] = str(e)
            logger.info("skipping method %s: %s", name, e)
    if not any(b in runners for b in BASELINES):
        logger.warning("no baseline method (%s) in the run: speedups will be None", " or ".join(BASELINES))
    return runners, skipped


# ---------------------------------------------------------------------------------------------
# memory and environment


def _reset_peak_rss() -> bool:
    """Reset the kernel's peak-RSS mark of this process (Linux); False where that is not possible."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def _peak_rss_mb() -> float | None:
    """Peak resident set size of this process in MB (VmHWM on Linux, else ru_maxrss)."""
    try:
        with open("/proc/self/status", encoding="ascii") as f:
            m = re.search(r"^VmHWM:\s+(\d+)\s+kB", f.read(), re.MULTILINE)
        if m:
            return int(m.group(1)) / 1024
    except OSError:
        pass
    try:
        import resource
    except ImportError:
        return None
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak / (1024 * 1024) if sys.platform == "darwin" else peak / 1024


def environment(generator: pipeline.SpeculativeGenerator) -> dict:
    """Versions, CPU and threads: what a tokens/s number depends on."""
    import transformers

    import specdecode

    cpu_model, flags = None, set()
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                key, _, value = line.partition(":")
                key = key.strip()
                if key == "model name" and cpu_model is None:
                    cpu_model = value.strip()
                elif key == "flags" and not flags:
                    flags = set(value.split())
    except OSError:
        pass
    try:
        affinity = len(os.sched_getaffinity(0))
    except AttributeError:
        affinity = None
    model = generator.target.model
    return {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "specdecode": specdecode.__version__,
        "platform": platform.platform(),
        "cpu_model": cpu_model or platform.processor() or None,
        "cpu_flags": {f: f in flags for f in CPU_FLAGS_OF_INTEREST} if flags else None,
        "torch_cpu_capability": torch.backends.cpu.get_cpu_capability(),
        "cpu_count": os.cpu_count(),
        "cpus_usable": affinity,
        "torch_threads": torch.get_num_threads(),
        "dtype": str(model.dtype).removeprefix("torch."),
        "device": str(model.device),
        "cuda_device": torch.cuda.get_device_name(model.device) if model.device.type == "cuda" else None,
    }


# ---------------------------------------------------------------------------------------------
# the results folder


def record_key(record: Mapping[str, Any]) -> tuple[str, str, int]:
    """(method, prompt id, repeat): what makes a record unique."""
    return record["method"], record["prompt_id"], int(record["repeat"])


class RecordStore:
    """``settings.json`` and the append-only ``records.jsonl`` of one results folder.

    Args:
        out_dir: The folder (created on the first write).
    """

    def __init__(self, out_dir: str | Path) -> None:
        self.dir = Path(out_dir)
        self.records_path = self.dir / RECORDS_FILE
        self.settings_path = self.dir / SETTINGS_FILE

    def check_settings(self, identity: Mapping[str, Any]) -> bool:
        """Compare with the folder's stored settings; store them when there are none.

        Returns:
            True when the folder already had (matching) settings, i.e. this run resumes.

        Raises:
            InvalidArgumentError: The folder was made with different settings (listed).
        """
        if self.settings_path.is_file():
            try:
                stored = json.loads(self.settings_path.read_text(encoding="utf-8"))
            except (OSError, ValueError) as e:
                raise InvalidArgumentError(f"cannot read {self.settings_path}: {e}; use another --out folder") from e
            old = stored.get("identity", {})
            diff = [k for k in sorted(set(old) | set(identity)) if old.get(k) != identity.get(k)]
            if diff:
                changes = "; ".join(f"{k}: {old.get(k)!r} there, {identity.get(k)!r} now" for k in diff)
                raise InvalidArgumentError(
                    f"results folder {str(self.dir)!r} was made with different settings ({changes}); "
                    "resume with the same settings or use another --out folder"
                )
            return True
        if self.records_path.exists():
            raise InvalidArgumentError(
                f"{self.records_path} exists but {SETTINGS_FILE} does not, so its settings are unknown; "
                "use another --out folder"
            )
        self.dir.mkdir(parents=True, exist_ok=True)
        payload = {"identity": dict(identity), "created": datetime.now(timezone.utc).isoformat(timespec="seconds")}
        write_text_atomic(self.settings_path, json.dumps(payload, indent=2) + "\n")
        return False

    def load(self) -> list[dict]:
        """Every stored record, first copy of each key. A torn last line (a kill mid-write) is cut off.

        Raises:
            InvalidArgumentError: A line before the last is not a JSON record.
        """
        if not self.records_path.is_file():
            return []
        data = self.records_path.read_bytes()
        if data and not data.endswith(b"\n"):
            keep = data.rfind(b"\n") + 1
            logger.warning("%s ends in a torn line (interrupted write); dropping it", self.records_path)
            with open(self.records_path, "r+b") as f:
                f.truncate(keep)
                f.flush()
                os.fsync(f.fileno())
            data = data[:keep]
        records, seen = [], set()
        for lineno, line in enumerate(data.decode("utf-8").splitlines(), start=1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
                key = record_key(record)
            except (ValueError, KeyError, TypeError) as e:
                raise InvalidArgumentError(
                    f"{self.records_path}:{lineno} is not a bench record ({e}); use another --out folder"
                ) from e
            if key not in seen:
                seen.add(key)
                records.append(record)
        return records

    def append(self, record: Mapping[str, Any]) -> None:
        """Append one record durably (flush + fsync) before returning."""
        line = json.dumps(record, separators=(",", ":")) + "\n"
        with open(self.records_path, "a", encoding="utf-8") as f:
            f.write(line)
            f.flush()
            os.fsync(f.fileno())


# ---------------------------------------------------------------------------------------------
# the run


ProgressCallback = Callable[[int, int, str], None]


def run_bench(
    generator: pipeline.SpeculativeGenerator,
    prompts: Sequence[Prompt],
    methods: Sequence[str] | None = None,
    settings: BenchSettings | None = None,
    out_dir: str | Path = "bench-out",
    *,
    progress: ProgressCallback | None = None,
    run_info: Mapping[str, Any] | None = None,
) -> dict:
    """Benchmark ``methods`` on ``prompts`` and write the reports to ``out_dir``.

    Finished (method, prompt, repeat) records already in ``out_dir`` are kept and
    not run again (see the module docstring). The reports cover exactly this
    call's methods × prompts × repeats.

    Args:
        generator: The loaded target (and draft).
        prompts: Prompts with unique ids.
        methods: Methods to run (``available_methods()``); None: all whose requirements are met.
        settings: Generation settings (default ``BenchSettings()``).
        out_dir: Results folder: records.jsonl, settings.json, results.json, results.md, two PNGs.
        progress: Called as ``progress(done, total, description)`` before the first and after
            every generation; ``total`` counts the generations still to run.
        run_info: Extra JSON-ready facts stored in results.json (e.g. dataset, command line).

    Returns:
        The content of results.json.

    Raises:
        InvalidArgumentError: Unknown or unusable methods, no prompts, duplicate prompt ids,
            or an ``out_dir`` made with different settings.
        KeyboardInterrupt: Passed on; the records finished so far stay in records.jsonl.
    """
    settings = settings or BenchSettings()
    prompts = list(prompts)
    if not prompts:
        raise InvalidArgumentError("no prompts to benchmark (check the dataset, categories and limits)")
    ids = [p.id for p in prompts]
    if len(set(ids)) != len(ids):
        dup = next(i for i in ids if ids.count(i) > 1)
        raise InvalidArgumentError(f"prompt ids must be unique; {dup!r} appears {ids.count(dup)} times")
    runners, skipped = resolve_methods(generator, methods, settings)
    unsupported = [name for name, runner in runners.items() if not getattr(runner, "supports_prompt_cache", False)]
    if settings.prompt_cache and unsupported:
        raise InvalidArgumentError(
            f"prompt_cache=True, but {', '.join(unsupported)} cannot start from a cached prompt (transformers "
            "re-encodes the whole prompt on the first assisted step); leave prompt_cache unset (auto) or False"
        )
    if settings.prompt_cache is None:  # auto
        settings = dataclasses.replace(settings, prompt_cache=not unsupported)
    encoded = {p.id: generator.encode(p.text, p.chat) for p in prompts}
    store = RecordStore(out_dir)
    resumed = store.check_settings(run_identity(generator, settings))
    stored = store.load()
    prompt_sha = {pid: _ids_digest(prompt_ids) for pid, prompt_ids in encoded.items()}
    for rec in stored:
        if rec["prompt_id"] in prompt_sha and rec.get("prompt_sha") not in (None, prompt_sha[rec["prompt_id"]]):
            raise InvalidArgumentError(
                f"prompt {rec['prompt_id']!r} now encodes to different tokens than in {store.records_path} "
                "(another --chat setting, dataset text or tokenizer); use the same ones or another --out folder"
            )
    done = {record_key(rec) for rec in stored}
    plan = [(p, r, m) for p in prompts for r in range(settings.repeats) for m in runners]
    pending = [(p, r, m) for p, r, m in plan if (m, p.id, r) not in done]
    logger.info("%d generations planned, %d already done%s", len(plan), len(plan) - len(pending),
                " (resuming)" if resumed else "")
    if progress:
        progress(0, len(pending), "warm-up")
    todo_methods = list(dict.fromkeys(m for _, _, m in pending))
    model = generator.target.model
    prefixes: dict[str, PromptPrefix | None] = {}  # only the current prompt's is kept

    def prefix_of(prompt_id: str) -> PromptPrefix | None:
        if not settings.prompt_cache:
            return None
        if prompt_id not in prefixes:
            prefixes.clear()
            prefixes[prompt_id] = PromptPrefix.encode(model, encoded[prompt_id])
        return prefixes[prompt_id]

    warm_id = pending[0][0].id if pending else prompts[0].id
    for name in todo_methods:  # one short generation each: first-call allocations, lazy inits
        logger.info("warm-up: %s", name)
        runners[name](encoded[warm_id], min(settings.warmup_tokens, settings.max_new_tokens), settings.seed,
                      prefix_of(warm_id))
    for i, (prompt, repeat, name) in enumerate(pending, start=1):
        prefix = prefix_of(prompt.id)
        reset = _reset_peak_rss()
        seed = prompt_seed(settings.seed, prompt.id, repeat)
        out = runners[name](encoded[prompt.id], settings.max_new_tokens, seed, prefix)
        new_tokens = len(out["token_ids"])
        record = {
            "method": name,
            "prompt_id": prompt.id,
            "category": prompt.category,
            "repeat": repeat,
            "prompt_tokens": int(encoded[prompt.id].shape[1]),
            "prompt_cache_tokens": prefix.num_tokens if prefix is not None else 0,
            "prompt_cache_s": prefix.seconds if prefix is not None else None,
            "prompt_sha": prompt_sha[prompt.id],
            "new_tokens": new_tokens,
            "tokens_per_s": new_tokens / out["seconds"] if out["seconds"] > 0 else None,
            **out,
            "seed": None if settings.greedy else seed,
            "peak_rss_mb": _peak_rss_mb(),
            "peak_rss_scope": "generation" if reset else "process lifetime",
            "finished_at": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        }
        store.append(record)
        logger.debug("%s %s #%d: %d tokens in %.2f s", name, prompt.id, repeat, new_tokens, out["seconds"])
        if progress:
            progress(i, len(pending), f"{name} {prompt.id}")
    keys = {(m, p.id, r) for p, r, m in plan}
    records = [rec for rec in store.load() if record_key(rec) in keys]
    info = {
        "environment": environment(generator),
        "identity": run_identity(generator, settings),
        "settings": settings.to_dict(),
        "methods": {name: runner.describe() for name, runner in runners.items()},
        "skipped_methods": skipped,
        "categories": list(dict.fromkeys(p.category for p in prompts)),
        "num_prompts": len(prompts),
        "run_info": dict(run_info or {}),
    }
    return write_reports(out_dir, records, info)


# ---------------------------------------------------------------------------------------------
# reports


NOTES = MappingProxyType({
    "tokens_per_s": "new tokens / wall seconds (time.perf_counter around one whole generation), aggregated as total new tokens / total seconds over the category's prompts for each repeat; "
    "'tokens_per_s' is the median over repeats, 'tokens_per_s_min'/'_max' the spread. With the prompt cache "
    "(settings.prompt_cache, the default) every prompt but its last token is encoded once, untimed, and each "
    "method starts from a copy of that target cache, so the time covers the last prompt token, the draft "
    "model's own prompt encoding (method 'draft') and decoding; without it (and always when hf-assisted or "
    "hf-prompt-lookup is in the run, which cannot start from a cache) the whole prompt is timed",
    "speedup": "tokens_per_s / tokens_per_s of the faster of hf-generate and autoregressive in the same category",
    "acceptance_rate": "accepted draft tokens / drafted tokens; transformers methods: estimated from the target's "
    "forward input lengths (drafted) and new tokens - target forwards (accepted)",
    "mean_accepted_tokens": "tau: tokens per verifying target forward, the bonus/replacement token COUNTED "
    "(target-only decoding gives 1.0); specdecode excludes the prefill and its token, transformers methods "
    "count every forward (their first forward verifies candidates together with the prompt)",
    "target_forwards_per_token": "target forward passes (prefill included) / new tokens",
    "agreement": "exact_match_rate: share of generations whose whole token sequence equals autoregressive's on "
    "the same prompt and repeat; mean_first_divergence: mean index of the first differing token among the "
    "others. In bfloat16 a k-token verification forward may round differently from a 1-token step, so greedy "
    "outputs can diverge late; in float32 they must match. Under sampling (temperature > 0) outputs differ by "
    "design and agreement says nothing about correctness",
    "peak_rss_mb": "peak resident set size of the whole process in MB (both models included), max over the "
    "category's generations; scope 'generation' when the kernel's peak mark was reset before each generation "
    "(Linux), else the process-lifetime peak",
})


def _agreement(records: list[dict]) -> None:
    """Annotate each record with ``exact_match`` and ``first_divergence`` vs. autoregressive's output."""
    reference = {(r["prompt_id"], r["repeat"]): r["token_ids"] for r in records if r["method"] == REFERENCE_METHOD}
    for r in records:
        ref = reference.get((r["prompt_id"], r["repeat"]))
        if ref is None or r["method"] == REFERENCE_METHOD:
            r["exact_match"] = r["first_divergence"] = None
        else:
            r["first_divergence"] = first_divergence(r["token_ids"], ref)
            r["exact_match"] = r["first_divergence"] is None


def _sum_positions(records: Iterable[dict], key: str) -> list[int]:
    total: list[int] = []
    for r in records:
        values = r.get(key) or []
        if len(values) > len(total):
            total.extend([0] * (len(values) - len(total)))
        for i, v in enumerate(values):
            total[i] += v
    return total


def summarize(records: Sequence[dict]) -> dict:
    """Metrics per method, per category and overall (see ``NOTES``), speedups included.

    Args:
        records: Bench records (with ``exact_match``/``first_divergence`` set by the agreement pass).

    Returns:
        ``{"methods": {method: {category or "overall": metrics}}, "baselines": {category: baseline
        method used for its speedups, or None}}``.
    """
    methods = list(dict.fromkeys(r["method"] for r in records))
    categories = list(dict.fromkeys(r["category"] for r in records))
    summary: dict[str, dict[str, dict]] = {m: {} for m in methods}
    baselines: dict[str, str | None] = {}
    for cat in [*categories, OVERALL]:
        for m in methods:
            rs = [r for r in records if r["method"] == m and (cat == OVERALL or r["category"] == cat)]
            if rs:
                summary[m][cat] = _metrics(rs)
        tps = {m: summary[m][cat]["tokens_per_s"] for m in methods if cat in summary[m]}
        sp, baselines[cat] = speedups(tps)
        for m, v in sp.items():
            summary[m][cat]["speedup"] = v
    return {"methods": summary, "baselines": baselines}


def _metrics(rs: list[dict]) -> dict:
    by_repeat: dict[int, list[dict]] = {}
    for r in rs:
        by_repeat.setdefault(r["repeat"], []).append(r)
    rates = [
        v for v in (tokens_per_second([r["new_tokens"] for r in g], [r["seconds"] for r in g])
                    for g in by_repeat.values()) if v is not None
    ]
    drafted = sum(r["drafted"] or 0 for r in rs)
    compared = [r for r in rs if r.get("exact_match") is not None]
    diverged = [r["first_divergence"] for r in compared if not r["exact_match"]]
    new_tokens = sum(r["new_tokens"] for r in rs)
    peaks = [r["peak_rss_mb"] for r in rs if r.get("peak_rss_mb") is not None]
    drafted_pos = _sum_positions(rs, "drafted_by_position")
    accepted_pos = _sum_positions(rs, "accepted_by_position")
    return {
        "prompts": len({r["prompt_id"] for r in rs}),
        "generations": len(rs),
        "new_tokens": new_tokens,
        "seconds": math.fsum(r["seconds"] for r in rs),
        "tokens_per_s": statistics.median(rates) if rates else None,
        "tokens_per_s_min": min(rates) if rates else None,
        "tokens_per_s_max": max(rates) if rates else None,
        "speedup": None,
        "acceptance_rate": _ratio(sum(r["accepted"] or 0 for r in rs), drafted) if drafted else None,
        "mean_accepted_tokens": _ratio(sum(r["verify_tokens"] for r in rs), sum(r["verify_forwards"] for r in rs)),
        "target_forwards_per_token": _ratio(sum(r["target_forwards"] for r in rs), new_tokens),
        "exact_match_rate": len([r for r in compared if r["exact_match"]]) / len(compared) if compared else None,
        "mean_first_divergence": statistics.fmean(diverged) if diverged else None,
        "compared": len(compared),
        "peak_rss_mb": max(peaks) if peaks else None,
        "drafted_by_position": drafted_pos,
        "accepted_by_position": accepted_pos,
        "acceptance_by_position": [a / d if d else None for a, d in zip(accepted_pos, drafted_pos)],
    }


def write_reports(out_dir: str | Path, records: list[dict], info: Mapping[str, Any]) -> dict:
    """Write results.json, results.md and the two PNGs from ``records``; returns results.json's content."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    records = [dict(r) for r in records]
    _agreement(records)
    summary = summarize(records)
    results = {
        **info,
        "baseline": "per category, the faster (higher median tokens/s) of " + " and ".join(BASELINES),
        "baselines_used": summary["baselines"],
        "summary": summary["methods"],
        "notes": dict(NOTES),
        "generated_at": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "records": records,
    }
    write_text_atomic(out / RESULTS_JSON, json.dumps(results, indent=1) + "\n")
    write_text_atomic(out / RESULTS_MD, markdown_report(results))
    categories = [c for c in info.get("categories", []) if any(c in s for s in summary["methods"].values())]
    plot_speedups(summary["methods"], categories, out / SPEEDUP_PNG)
    plot_acceptance(summary["methods"], out / ACCEPTANCE_PNG)
    return results


def _f(v, fmt: str = "{:.2f}", none: str = "–") -> str:
    return none if v is None else fmt.format(v)


def markdown_report(results: Mapping[str, Any]) -> str:
    """A Spec-Bench-style leaderboard: methods × (category speedups, overall tokens/s, speedup, α, τ, agreement)."""
    summary = results["summary"]
    cats = [c for c in results.get("categories", []) if any(c in s for s in summary.values())]
    ident, env = results.get("identity", {}), results.get("environment", {})
    head = ["Method", *[f"{c} speedup" for c in cats], "Overall tok/s (min–max)", "Overall speedup",
            "Acceptance α", "τ (incl. bonus)", "Fwd/token", "Exact match vs AR", "Peak RSS MB"]
    lines = [
        "# specdecode bench",
        "",
        f"Target `{ident.get('target')}`, draft `{ident.get('draft')}`, {ident.get('dtype')} on "
        f"{ident.get('device')} ({env.get('cpu_model') or env.get('cuda_device') or '?'}, "
        f"{env.get('torch_threads')} torch threads); max_new_tokens {ident.get('max_new_tokens')}, "
        f"temperature {ident.get('temperature')}, γ {ident.get('num_speculative_tokens')}; "
        f"{results.get('num_prompts')} prompts × {results.get('settings', {}).get('repeats')} repeat(s).",
        "",
        "Speedup: against the faster of hf-generate and autoregressive in each category "
        f"(baseline used: {', '.join(f'{c}: {b}' for c, b in results.get('baselines_used', {}).items())}). "
        "Tokens/s = total new tokens / total seconds, median over repeats.",
        "",
        "| " + " | ".join(head) + " |",
        "|" + "|".join(["---"] + ["---:"] * (len(head) - 1)) + "|",
    ]
    for method, by_cat in summary.items():
        o = by_cat.get(OVERALL, {})
        agree = "ref" if method == REFERENCE_METHOD else _f(o.get("exact_match_rate"), "{:.0%}")
        if o.get("mean_first_divergence") is not None:
            agree += f" (1st diff @{o['mean_first_divergence']:.0f})"
        row = [
            f"`{method}`",
            *[_f(by_cat.get(c, {}).get("speedup"), "{:.2f}×") for c in cats],
            f"{_f(o.get('tokens_per_s'))} ({_f(o.get('tokens_per_s_min'))}–{_f(o.get('tokens_per_s_max'))})",
            _f(o.get("speedup"), "{:.2f}×"),
            _f(o.get("acceptance_rate"), "{:.1%}"),
            _f(o.get("mean_accepted_tokens")),
            _f(o.get("target_forwards_per_token")),
            agree,
            _f(o.get("peak_rss_mb"), "{:.0f}"),
        ]
        lines.append("| " + " | ".join(row) + " |")
    skipped = results.get("skipped_methods") or {}
    if skipped:
        lines += ["", "Skipped: " + "; ".join(f"`{m}` ({why})" for m, why in skipped.items())]
    hf = {m: d for m, d in results.get("methods", {}).items() if d.get("assistant_generation_config")}
    for m, d in hf.items():
        lines += ["", f"`{m}` assistant settings (transformers defaults): "
                  + ", ".join(f"{k}={v}" for k, v in d["assistant_generation_config"].items())]
    lines += ["", "Definitions:", ""] + [f"- **{k}**: {v}" for k, v in results.get("notes", {}).items()]
    return "\n".join(lines) + "\n"


def plot_speedups(summary: Mapping[str, Mapping[str, dict]], categories: Sequence[str], path: Path) -> None:
    """Grouped bars: speedup of every method per category and overall (1.0 = baseline)."""
    from matplotlib.figure import Figure

    groups = [*categories, OVERALL]
    methods = list(summary)
    fig = Figure(figsize=(min(24.0, max(6.0, 0.25 * len(groups) * len(methods) + 2.0)), 4.5))
    ax = fig.subplots()
    width = 0.8 / max(1, len(methods))
    for j, m in enumerate(methods):
        xs = [i + (j - (len(methods) - 1) / 2) * width for i in range(len(groups))]
        ys = [(summary[m].get(c) or {}).get("speedup") or 0.0 for c in groups]
        ax.bar(xs, ys, width, label=m)
    ax.axhline(1.0, color="black", linewidth=0.8, linestyle="--")
    ax.set_xticks(range(len(groups)), groups, rotation=30, ha="right")
    ax.set_ylabel("speedup vs faster baseline (×)")
    ax.set_title("Speedup by category")
    ax.legend(fontsize="small", loc="upper left", bbox_to_anchor=(1.01, 1.0))
    write_png_atomic(fig, path)


def plot_acceptance(summary: Mapping[str, Mapping[str, dict]], path: Path) -> None:
    """Acceptance rate by draft position (accepted ÷ drafted at position i) of every drafting method."""
    from matplotlib.figure import Figure

    fig = Figure(figsize=(6.0, 4.0))
    ax = fig.subplots()
    plotted = False
    for m, by_cat in summary.items():
        rates = (by_cat.get(OVERALL) or {}).get("acceptance_by_position") or []
        if any(r is not None for r in rates):
            xs = [i + 1 for i, r in enumerate(rates) if r is not None]
            ax.plot(xs, [r for r in rates if r is not None], marker="o", label=m)
            plotted = True
    if plotted:
        ax.legend(fontsize="small")
        ax.xaxis.get_major_locator().set_params(integer=True)
    else:
        ax.text(0.5, 0.5, "no method recorded drafted tokens by position", ha="center", va="center",
                transform=ax.transAxes)
    ax.set_xlabel("draft position")
    ax.set_ylabel("acceptance rate")
    ax.set_ylim(0, 1.05)
    ax.set_title("Acceptance by draft position")
    write_png_atomic(fig, path)


# ---------------------------------------------------------------------------------------------
# command line (the only part of this module that writes to the terminal)


def _split_list(values: Sequence[str] | None, separator: str = ",") -> list[str] | None:
    if not values:
        return None
    return [v for item in values for v in re.split(separator, item) if v]


def _method_separator() -> str:
    """Commas followed by a method name: "layer-skip:skip_layers=mlp=5,7,num_speculative_tokens=1" stays whole."""
    names = "|".join(re.escape(m) for m in sorted(available_methods(), key=len, reverse=True))
    return rf",(?=(?:{names})(?:[:+,]|$))"


def _parse_option(text: str) -> tuple[str, Any]:
    key, sep, value = text.partition("=")
    if not sep or not key:
        raise argparse.ArgumentTypeError(f"expected KEY=VALUE, got {text!r}")
    try:
        return key, json.loads(value)
    except ValueError:
        return key, value


def add_parser(sub) -> argparse.ArgumentParser:
    """Register ``specdecode bench`` on the CLI's subparsers."""
    p = sub.add_parser(
        "bench",
        help="time every decoding method on Spec-Bench, HumanEval or a JSONL file",
        description="Benchmark decoding methods in one process on the same models, dtype and prompts. "
        "Results go to --out; rerunning the same command resumes an interrupted run.",
    )
    p.add_argument("--target", default=pipeline.DEFAULT_TARGET, help="offline model name, .gguf file, folder or hub id")
    p.add_argument("--draft", default=None,
                   help=f"draft model; default {pipeline.DEFAULT_DRAFT} when --target is the default, "
                   "else none; 'none' for no draft")
    p.add_argument("--dataset", default="spec-bench",
                   help="spec-bench, humaneval, or a .jsonl file with a 'prompt' or 'turns' field per line")
    p.add_argument("--categories", nargs="+", default=None, help="categories to keep (space or comma separated)")
    p.add_argument("--limit-per-category", type=int, default=None, help="first N prompts of each category")
    p.add_argument("--limit", type=int, default=None, help="first N prompts overall (after the category limit)")
    p.add_argument("--methods", nargs="+", default=None,
                   help="methods to run (default: all whose requirements are met): "
                   + ", ".join(available_methods())
                   + ". A specdecode method may carry options and draft-control modifiers: "
                   "NAME[:KEY=VALUE,...][+MODIFIER[=VALUE]...], e.g. early-exit:exit_layer=8+adaptive; "
                   "modifiers: " + "; ".join(f"{k}: {v}" for k, v in METHOD_MODIFIERS.items()))
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    p.add_argument("--num-speculative-tokens", "-g", type=int, default=GenerationConfig.num_speculative_tokens,
                   help="gamma of specdecode's speculative methods")
    p.add_argument("--seed", type=int, default=0, help="base seed of sampling (temperature > 0)")
    p.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"])
    p.add_argument("--device", default="auto")
    p.add_argument("--repeats", type=int, default=1, help="runs per (method, prompt); tok/s is their median")
    p.add_argument("--warmup-tokens", type=int, default=8, help="length of each method's warm-up generation")
    p.add_argument("--prompt-cache", action=argparse.BooleanOptionalAction, default=None,
                   help="encode each prompt (but its last token) once, untimed, and start every method from a "
                   "copy of that cache; default: on unless hf-assisted or hf-prompt-lookup is in the run "
                   "(they cannot start from a cache); --no-prompt-cache times whole prompts")
    p.add_argument("--out", default="bench-out", help="results folder (resumable)")
    p.add_argument("--chat", action=argparse.BooleanOptionalAction, default=None,
                   help="chat template on/off (default: on for spec-bench and JSONL when the tokenizer has one, "
                   "off for humaneval, whose stubs are completed raw)")
    for opt in DRAFTER_OPTIONS:
        p.add_argument(opt.flag, dest=f"drafter_{opt.keyword}", type=opt.type, default=None, help=opt.help,
                       metavar=opt.keyword.upper())
    p.add_argument("--drafter-option", action="append", type=_parse_option, default=[], metavar="KEY=VALUE",
                   help="any other keyword for the pipeline's decoder/make_drafter (VALUE parsed as JSON if it can be)")
    return p


def _drafter_options(args) -> dict:
    options = dict(args.drafter_option)
    for opt in DRAFTER_OPTIONS:
        value = getattr(args, f"drafter_{opt.keyword}")
        if value is not None:
            options[opt.keyword] = value
    return options


def _draft_spec(args) -> str | None:
    if args.draft is None:
        return pipeline.DEFAULT_DRAFT if args.target == pipeline.DEFAULT_TARGET else None
    return None if args.draft.lower() in ("none", "") else args.draft


def run(args) -> int:
    """``specdecode bench``: load the models once, run ``run_bench``, print a summary. Returns the exit code."""
    from rich.console import Console
    from rich.progress import (BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn,
                               TimeRemainingColumn)
    from rich.table import Table

    from specdecode.datasets import load_prompts

    settings = BenchSettings(
        max_new_tokens=args.max_new_tokens,
        temperature=args.temperature,
        num_speculative_tokens=args.num_speculative_tokens,
        repeats=args.repeats,
        seed=args.seed,
        warmup_tokens=args.warmup_tokens,
        drafter_options=_drafter_options(args),
        prompt_cache=args.prompt_cache,
    )
    methods = _split_list(args.methods, _method_separator())
    if methods is not None:
        methods = check_method_names(methods)
    prompts = load_prompts(
        args.dataset,
        categories=_split_list(args.categories),
        limit_per_category=args.limit_per_category,
        limit=args.limit,
        chat=args.chat,
    )
    err = Console(stderr=True)
    with err.status(f"loading {args.target}" + (f" and {_draft_spec(args)}" if _draft_spec(args) else "")):
        generator = pipeline.SpeculativeGenerator.from_pretrained(
            args.target, _draft_spec(args), dtype=args.dtype, device=args.device
        )
    columns = (TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
               TextColumn("ETA"), TimeRemainingColumn())
    # A whole-run average for the ETA (rich's default averages the last 30 s only).
    bar = Progress(*columns, console=err, speed_estimate_period=7 * 24 * 3600.0)
    task = bar.add_task("bench", total=None)

    def on_progress(done: int, total: int, description: str) -> None:
        bar.update(task, completed=done, total=total, description=description)

    info = {"dataset": args.dataset, "command_line": shlex.join(sys.argv), "chat": args.chat}
    try:
        with bar:
            results = run_bench(generator, prompts, methods, settings, args.out, progress=on_progress,
                                run_info=info)
    except KeyboardInterrupt:
        kept = len(RecordStore(args.out).load()) if Path(args.out, SETTINGS_FILE).is_file() else 0
        err.print(f"interrupted: {kept} finished record(s) kept in {Path(args.out) / RECORDS_FILE}; "
                  "run the same command again to resume")
        return 130
    table = Table(title=f"specdecode bench: {len(prompts)} prompts, {args.dataset}")
    for col in ("method", "tok/s", "speedup", "acceptance", "τ", "exact match vs AR"):
        table.add_column(col, justify="left" if col == "method" else "right")
    for method, by_cat in results["summary"].items():
        o = by_cat[OVERALL]
        table.add_row(method, _f(o["tokens_per_s"]), _f(o["speedup"], "{:.2f}×"), _f(o["acceptance_rate"], "{:.1%}"),
                      _f(o["mean_accepted_tokens"]),
                      "ref" if method == REFERENCE_METHOD else _f(o["exact_match_rate"], "{:.0%}"))
    out = Console()
    out.print(table)
    out.print(f"results in {Path(args.out).resolve()}: {RESULTS_MD}, {RESULTS_JSON}, {SPEEDUP_PNG}, {ACCEPTANCE_PNG}")
    return 0


__all__ = [
    "BASELINES",
    "DRAFTER_OPTIONS",
    "HF_METHODS",
    "BenchSettings",
    "DrafterOption",
    "HFMethod",
    "METHOD_MODIFIERS",
    "MethodSpec",
    "PromptPrefix",
    "RecordStore",
    "available_methods",
    "build_decoder",
    "check_method_names",
    "first_divergence",
    "resolve_methods",
    "run",
    "run_bench",
    "speedups",
    "summarize",
    "tokens_per_second",
    "write_reports",
]
