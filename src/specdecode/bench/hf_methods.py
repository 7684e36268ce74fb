"""transformers' ``generate`` variants benchmarked next to specdecode's methods.

``HFMethod`` describes one (``HF_METHODS``: plain, static cache with a compiled forward,
assisted, prompt lookup); ``_HFRunner`` times one generation of it on the target. Built by
``specdecode.bench.methods.resolve_methods``.
"""

from __future__ import annotations

import contextlib
import copy
import logging
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import TYPE_CHECKING, Any

import torch

from specdecode import pipeline
from specdecode.bench.settings import BenchSettings
from specdecode.errors import InvalidArgumentError

if TYPE_CHECKING:
    from specdecode.bench.methods import PromptPrefix

logger = logging.getLogger(__name__)

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
        static_cache: Decode with transformers' ``StaticCache`` and a compiled forward, as
            transformers documents it (``cache_implementation="static"`` with a
            ``CompileConfig``; see ``_HFRunner``). Compilation happens in the warm-up.
    """

    name: str
    description: str
    needs_draft: bool = False
    generate_options: Mapping[str, Any] = field(default_factory=dict)
    supports_prompt_cache: bool = False
    static_cache: bool = False

    def __post_init__(self) -> None:
        object.__setattr__(self, "generate_options", MappingProxyType(dict(self.generate_options)))


HF_METHODS = MappingProxyType(
    {
        m.name: m
        for m in (
            HFMethod("hf-generate", "transformers generate, target only", supports_prompt_cache=True),
            HFMethod("hf-generate-static", "transformers generate with a static cache and a compiled forward "
                     "(cache_implementation='static', CompileConfig), target only",
                     supports_prompt_cache=True, static_cache=True),
            HFMethod("hf-assisted", "transformers assisted generation (assistant_model=draft)", needs_draft=True),
            HFMethod("hf-prompt-lookup", "transformers prompt lookup decoding",
                     generate_options={"prompt_lookup_num_tokens": 10}),
        )
    }
)


class _HFRunner:
    """Runs ``transformers`` ``generate`` on the target; counts target forwards with a pre-forward hook.

    Drafted tokens are read off the target's forward input lengths (a verification
    forward over the pending token and k candidates has k + 1 inputs; the first
    forward also holds the prompt), accepted tokens as new tokens - forwards
    (each forward adds its accepted tokens plus one).

    A static-cache method (``HFMethod.static_cache``) passes transformers a
    ``CompileConfig`` (its defaults, which ``generate`` uses when it compiles on its own)
    flagged to compile on every device: ``generate`` compiles the decode forward by itself
    on CUDA (and XPU, TPU, Neuron) only, and elsewhere only when
    ``CompileConfig._compile_all_devices`` is set. The prefill stays eager, as in
    transformers. Its static cache holds ``max_positions`` positions, the same for every
    prompt of a run, so the graph compiled in the warm-up serves every generation
    (transformers' sliding-window static layers still recompile once when the window first
    fills). From a cached prompt prefix, the prefix is encoded into a ``StaticCache`` of
    that size once per prompt (untimed) and every generation starts from a copy of it.

    Args:
        spec: The transformers variant.
        generator: The loaded target (and draft, for assisted generation).
        settings: How every method generates.
        max_positions: Static-cache length in positions (the run's longest prompt plus
            ``max_new_tokens``); None: each generation's own prompt plus ``max_new_tokens``,
            grown by transformers as later calls need (a larger cache recompiles).
    """

    kind = "transformers"

    def __init__(
        self,
        spec: HFMethod,
        generator: pipeline.SpeculativeGenerator,
        settings: BenchSettings,
        max_positions: int | None = None,
    ) -> None:
        self.name = spec.name
        self.spec = spec
        self.settings = settings
        self.max_positions = max_positions
        self._static_prefix: tuple[PromptPrefix, int, Any] | None = None  # (prefix, length, StaticCache): one prompt
        self._warned = False  # logged that transformers ran a static-cache method eagerly
        self.model = generator.target.model
        self.assistant = generator.draft.model if spec.needs_draft else None
        self.eos = sorted(pipeline.eos_token_ids(generator.target))
        pad = self.model.generation_config.pad_token_id
        if pad is None:
            pad = generator.tokenizer.pad_token_id
        self.pad = pad if pad is not None else (self.eos[0] if self.eos else None)
        self.assistant_settings = _hf_assistant_defaults() if self.assistant is not None else None
        self.supports_prompt_cache = spec.supports_prompt_cache

    def generation_config(self, max_new_tokens: int, *, own_cache: bool = False):
        """The transformers ``GenerationConfig``: our settings, and neutral values for every
        logits processor a model's own generation config could switch on (e.g. Qwen's
        repetition_penalty 1.05, top_k 20, top_p 0.8).

        Args:
            max_new_tokens: Tokens to generate at most.
            own_cache: ``generate`` gets a cache of ours (``past_key_values``), so a static-cache
                method leaves ``cache_implementation`` unset (transformers refuses both).
        """
        from transformers import GenerationConfig as HFGenerationConfig

        options: dict[str, Any] = {
            "max_new_tokens": max_new_tokens,
            "do_sample": not self.settings.greedy,
            "eos_token_id": self.eos or None,
            "pad_token_id": self.pad,
            "repetition_penalty": self.settings.repetition_penalty,  # [processors] transformers' own
            "no_repeat_ngram_size": 0,
            **self.spec.generate_options,
        }
        if self.spec.static_cache:
            options["compile_config"] = _compile_config()
            if not own_cache:
                options["cache_implementation"] = "static"
                if self.max_positions is not None:
                    options["max_cache_len"] = self.max_positions
        if not self.settings.greedy:
            options.update(temperature=self.settings.temperature, top_k=0, top_p=1.0, typical_p=1.0,
                           epsilon_cutoff=0.0, eta_cutoff=0.0)
            if self.settings.min_p or getattr(self.model.generation_config, "min_p", None) is not None:
                options["min_p"] = self.settings.min_p  # [processors]
        return HFGenerationConfig(**options)

    def describe(self) -> dict:
        config = self.generation_config(self.settings.max_new_tokens).to_diff_dict()
        config.pop("transformers_version", None)
        out = {"kind": self.kind, "description": self.spec.description, "generation_config": config}
        if self.spec.static_cache:
            compiled = config.get("compile_config")
            compiled = compiled.to_dict() if hasattr(compiled, "to_dict") else dict(compiled or {})
            config["compile_config"] = {**compiled, "compile_all_devices": True}
            config["max_cache_len"] = self.max_positions
            # Whether transformers compiled the target's forward (in this process): it keeps the
            # compiled call on the model. False means generate ran eagerly.
            out["forward_compiled"] = getattr(self.model, "_compiled_call", None) is not None
        if self.assistant_settings is not None:
            out["assistant_generation_config"] = dict(self.assistant_settings)
        return out

    def _static_prefix_cache(self, input_ids: torch.Tensor, prefix: PromptPrefix, max_new_tokens: int):
        """A fresh copy of ``prefix`` encoded into a ``StaticCache`` (the encoding is kept for the prompt).

        Its length in positions is ``max_positions``, or more where this prompt plus the run's
        ``max_new_tokens`` (or this call's ``max_new_tokens``) needs more: the length of
        transformers' own static cache in the uncached case. The encoding is an eager forward
        over the prefix tokens, untimed, like ``PromptPrefix.encode``.
        """
        from transformers import StaticCache

        n = int(input_ids.shape[1])
        needed = n + max_new_tokens
        kept = self._static_prefix
        if kept is None or kept[0] is not prefix or kept[1] < needed:
            length = max(self.max_positions or 0, n + self.settings.max_new_tokens, needed)
            cache = StaticCache(config=self.model.config.get_text_config(decoder=True), max_cache_len=length)
            with torch.inference_mode():
                self.model(input_ids[:, : prefix.num_tokens], past_key_values=cache, use_cache=True, logits_to_keep=1)
            kept = self._static_prefix = (prefix, length, cache)
        return copy.deepcopy(kept[2])

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
        config = self.generation_config(max_new_tokens, own_cache=prefix is not None)
        lengths: list[int] = []
        if prefix is not None and not self.supports_prompt_cache:
            raise InvalidArgumentError(f"method {self.name!r} cannot start from a cached prompt")
        if prefix is not None:  # transformers encodes only the tokens its cache lacks
            if self.spec.static_cache:
                extra_cache = {"past_key_values": self._static_prefix_cache(input_ids, prefix, max_new_tokens)}
            else:
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
        if self.spec.static_cache and getattr(self.model, "_compiled_call", None) is None and not self._warned:
            self._warned = True
            logger.warning("%s: transformers did not compile the target's forward (its compile criteria were not "
                           "met), so this method runs eagerly", self.name)
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
            "banned_word_rollbacks": None,
            "banned_word_discarded_tokens": None,
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


def _compile_config():
    """transformers' default ``CompileConfig`` (inductor, mode "reduce-overhead": CUDA graphs on CUDA),
    flagged to compile on every device.

    ``generate`` compiles the forward of a static-cache decode by itself only on CUDA, XPU,
    TPU and Neuron (``GenerationMixin._valid_auto_compile_criteria``); ``_compile_all_devices``
    is the flag transformers provides to compile elsewhere too (on CPU, inductor's C++ kernels).
    """
    from transformers import CompileConfig

    config = CompileConfig()
    config._compile_all_devices = True
    return config


def _hf_assistant_defaults() -> dict:
    from transformers import GenerationConfig as HFGenerationConfig

    try:
        defaults = HFGenerationConfig._get_default_generation_params()
    except AttributeError:
        defaults = {}
    return {k: defaults.get(k, v) for k, v in _HF_ASSISTANT_DEFAULTS.items()}
