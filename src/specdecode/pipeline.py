"""The high-level API: load a target (and draft) once, then generate from text prompts.

Example::

    from specdecode import SpeculativeGenerator, GenerationConfig

    gen = SpeculativeGenerator.from_pretrained()          # offline Qwen2.5-Coder 1.5B + 0.5B
    result = gen.generate("Write a Python function that checks whether a number is prime.",
                          GenerationConfig(max_new_tokens=128))
    print(result.text, result.stats.acceptance_rate)

    for token_ids in gen.stream("Explain KV caches.", method="draft"):
        ...

    # Self-speculative methods need no draft model:
    gen = SpeculativeGenerator.from_pretrained(draft=None)
    gen.generate("...", method="layer-skip", skip_layers="attn=2,15,18;mlp=2,15,18")
    gen.generate("...", method="early-exit", exit_layer=8,
                 draft_control=DraftControl(adaptive_exit=True))
    gen.generate("...", method="prompt-lookup", prompt_lookup_max_ngram=3)
"""

from __future__ import annotations

import logging
from pathlib import Path

import torch

from specdecode import method_registry
from specdecode.config import DEFAULT_NUM_SPECULATIVE_TOKENS, GenerationConfig, check_unicode
from specdecode.defaults import (  # noqa: F401 (re-exported: the commands and tools import them from here)
    DEFAULT_TARGET,
    DEFAULT_DRAFT,
    METHODS,
    BATCH_METHODS,
    DRAFT_BACKENDS,
    BATCH_VERIFY_TOKENS_CPU,
    COMMAND_METHOD,
    ADAPTIVE_BY_DEFAULT,
    MAX_MODEL_PROMPT_TOKENS,
    adaptive_exit_by_default,
    length_schedule_by_default,
    target_float32_on_cpu,
    why_no_int4_draft,
    draft_quantize_by_default,
    prompt_limit_by_default,
    auto_verify_tokens,
    eos_token_ids,
)
from specdecode.drafters import Drafter
from specdecode.drafters.control import DraftControl
from specdecode.drafters.draft_head import DraftHead
from specdecode.drafters.layer_skip import SkipSet
from specdecode.engine.batched import BatchedSpeculativeDecoder
from specdecode.engine.decoder import GenerationResult, GenerationStream, SpeculativeDecoder
from specdecode.engine.fast_path import ModelRunner, check_drafter_compilable, resolve_compile
from specdecode.engine.runner_target import measured_cost_policy
from specdecode.engine.speculation_cost import SpeculationCostPolicy
from specdecode.errors import InvalidArgumentError
from specdecode.method_registry import DrafterOptions
from specdecode.models import LoadedModel, check_vocabularies, load_model
from specdecode.models.dense_cache import dense_cache_valid
from specdecode.models.llama_cpp import (
    LlamaCppModel,
    check_cpu_target,
    gguf_path,
    load_llama_cpp_model,
    load_with_llama_cpp_draft,
)
from specdecode.models.llama_cpp_target import LlamaCppTargetRunner, load_llama_cpp_target
from specdecode.models.quantize import resolve_pair_quantization
from specdecode.models.registry import OFFLINE_MODELS
from specdecode.models.token_frequencies import TokenFrequencies, load_or_count, special_token_ids

logger = logging.getLogger(__name__)

#: Rounds between two probes of "token-recycling"'s tree-size policy (as its measured-size policy had).
TOKEN_RECYCLING_PROBE_EVERY = 8


class SpeculativeGenerator:
    """A target model, an optional draft model, and the decoders built on them.

    Args:
        target: The loaded target model and tokenizer; for ``backend`` "llama-cpp" (``from_pretrained``)
            its ``model`` is a ``LlamaCppTargetRunner``.
        draft: The loaded draft model, needed only for ``method="draft"`` and "cascade"; the
            self-speculative methods ("layer-skip", "early-exit") draft with the
            target, "prompt-lookup" with no model.
        cache_dir: The cache folder the models were loaded with (None: the default), for what
            is derived from the model files later (the bench's llama.cpp method assembles an
            offline GGUF file there). The draft's token frequencies (``draft_vocab_size``) go
            to its ``LoadedModel.dense_folder``.
        llama_cpp_draft: A draft model run by llama.cpp (``models.llama_cpp.load_llama_cpp_model``),
            for "draft" and "cascade" with ``draft_backend="llama-cpp"``, or its spec (an offline
            model or a ``.gguf`` path: loaded, its vocabulary checked, when first asked for); with a
            torch ``draft`` and none given, it is loaded from the draft's GGUF file when first asked for.

    Raises:
        VocabularyMismatchError: If the draft's tokenizer maps tokens differently.
    """

    def __init__(self, target: LoadedModel, draft: LoadedModel | None = None, *, cache_dir=None,
                 llama_cpp_draft: LlamaCppModel | str | None = None) -> None:
        self.target = target
        self.backend = "llama-cpp" if isinstance(target.model, LlamaCppTargetRunner) else "torch"  # what runs it
        self.draft = draft
        self.cache_dir = Path(cache_dir) if cache_dir is not None else None
        self._llama_cpp_draft = llama_cpp_draft
        self._llama_cpp_runner: LlamaCppTargetRunner | None = None
        #: The "token-recycling" drafter and its tree-size policy, one per generator (its adjacency matrix
        #: and the measured costs of its sizes learn across requests).
        self.token_recycler = None
        self.size_policy: SpeculationCostPolicy | None = None
        self._token_frequencies: TokenFrequencies | None = None
        # The target's fast-path settings and one-row engine, kept for the generator's life so
        # later decoders share its cache and compiled buckets: compile -> runner.
        self._runners: dict[bool, ModelRunner] = {}
        if draft is not None:
            check_vocabularies(target, draft)
        self._eos = eos_token_ids(target)

    @classmethod
    def from_pretrained(
        cls,
        target: str = DEFAULT_TARGET,
        draft: str | None = DEFAULT_DRAFT,
        *,
        dtype: str | torch.dtype = "auto",
        device: str = "auto",
        cache_dir=None,
        quantize: str = "none",
        draft_quantize: str | None = None,
        draft_quantize_head: str | None = None,
        quantize_group_size: int | None = None,
        draft_backend: str | None = None,
        backend: str = "torch",
        prepack_linears: bool | None = None,
    ) -> SpeculativeGenerator:
        """Load target and draft (see ``specdecode.models.load_model`` for specs and errors).

        ``backend``: "torch" (a transformers target) or "llama-cpp": the target's GGUF file in llama.cpp,
        its tokenizer only from transformers (``models.llama_cpp_target``); one sequence at a time,
        "autoregressive", "prompt-lookup", "draft" and "cascade" (draft lengths: ``decoder``). The
        draft runs in llama.cpp too (``draft_backend`` None or "llama-cpp"; "torch" is refused):
        its GGUF file is loaded, and its vocabulary checked against the target's tokenizer
        (VocabularyMismatchError), when a decoder first needs it; a ``.gguf`` path is checked to
        exist here.

        ``draft_backend``: "torch" (None: the default) loads the draft as a transformers model; "llama-cpp" runs its
        GGUF file (an offline model or a ``.gguf`` path) in llama.cpp (the ``llamacpp`` extra)
        and loads no torch draft, so the draft quantization options do not apply (README, "A
        llama.cpp draft": 21.5 ms a draft step there against 27.6 ms for the int4 torch draft).

        ``quantize`` ("none", "int8", "int4"): weight-only quantized linear layers on CPU
        (``specdecode.models.quantize``) for the target; ``draft_quantize`` for the draft
        (None: the same as ``quantize``). A quantized draft with an unquantized target keeps
        the output exactly the target's while making each draft step cheaper.

        ``draft_quantize_head``: the draft's LM head storage ("int8", "int4"). None gives an
        int4 draft an int4 head, any other draft the int8 default; "int8" keeps an int4
        draft's head at int8 (the behaviour before the int4 head). The target's head stays
        int8 under every scheme (its precision is the output's). A draft head's precision
        changes acceptance only; the int4 head made the cascade 4-8% faster (README,
        "Quantized weights on CPU").

        ``quantize_group_size``: inputs per scale and zero of the int4 weights, 32, 64, 128 or
        256 (None: 32), for every int4 model of the pair: the target under ``quantize="int4"``,
        the draft when it is int4 (also with a target that is not). Groups of 64 store 4.5
        bits a weight instead of 5 (bf16 scale and zero per group) and fit the weights less
        closely; a layer whose input width is not a multiple of the group size stays int8.

        ``prepack_linears``: float32 linear layers on oneDNN's CPU kernel, for the target and a torch draft
        (``specdecode.models.prepacked_linear``; see ``load_model``): None (the default) where a model is
        float32 on an x86 CPU with AVX2 and unquantized; True on any CPU; False keeps ``nn.Linear``. The
        fast path (``compile=True``) cannot compile them: a CPU user who compiles passes False.

        ``draft=None`` loads no draft model: enough for every method but "draft" and "cascade"
        ("autoregressive", "layer-skip", "early-exit", "prompt-lookup").

        Raises:
            InvalidArgumentError: Besides ``load_model``'s: ``draft_quantize_head`` unknown, or
                "int4" with a draft that is not int4; ``quantize_group_size`` not one of 32,
                64, 128, 256, or other than 32 when neither model is int4 (checked before
                anything is loaded); an unknown ``draft_backend``; for "llama-cpp", those of
                ``models.llama_cpp.load_with_llama_cpp_draft`` (VocabularyMismatchError too).
        """
        if draft_backend is not None and draft_backend not in DRAFT_BACKENDS:
            raise InvalidArgumentError(f"unknown draft_backend {draft_backend!r}; allowed: {', '.join(DRAFT_BACKENDS)}")
        if backend != "torch":  # "llama-cpp" (else refused); the draft in llama.cpp too, loaded on first use
            if draft and draft not in OFFLINE_MODELS and draft_backend != "torch":  # cheap; an offline model
                gguf_path(draft, cache_dir, user=" (the llama.cpp draft model)")  # assembles on first use
            loaded = load_llama_cpp_target(
                target, cache_dir=cache_dir, backend=backend, dtype=dtype, device=device, quantize=quantize,
                draft_quantize=draft_quantize, draft_quantize_head=draft_quantize_head,
                quantize_group_size=quantize_group_size, draft_backend=draft_backend, prepack_linears=prepack_linears)
            return cls(loaded, None, cache_dir=cache_dir, llama_cpp_draft=draft or None)
        if draft_backend == "llama-cpp":
            t, d = load_with_llama_cpp_draft(target, draft, dtype=dtype, device=device, cache_dir=cache_dir,
                                             quantize=quantize, draft_quantize=draft_quantize,
                                             draft_quantize_head=draft_quantize_head,
                                             quantize_group_size=quantize_group_size,
                                             prepack_linears=prepack_linears)
            return cls(t, None, cache_dir=cache_dir, llama_cpp_draft=d)
        draft_scheme, draft_head, group = resolve_pair_quantization(
            quantize, draft_quantize, draft_quantize_head, quantize_group_size, has_draft=bool(draft))
        t = load_model(target, dtype=dtype, device=device, cache_dir=cache_dir, quantize=quantize,
                       quantize_group_size=group if quantize == "int4" else None, prepack_linears=prepack_linears)
        draft_prepack = prepack_linears if draft_scheme == "none" else None  # a quantized draft has no float32 linears
        d = load_model(draft, dtype=t.model.dtype, device=str(t.model.device), cache_dir=cache_dir,
                       quantize=draft_scheme, quantize_head=draft_head,
                       quantize_group_size=group if draft_scheme == "int4" else None,
                       prepack_linears=draft_prepack) if draft else None
        return cls(t, d, cache_dir=cache_dir)

    def llama_cpp_draft(self) -> LlamaCppModel:
        """The draft model run by llama.cpp: the one given, or the torch draft's GGUF file, loaded once.

        Raises:
            InvalidArgumentError: No draft model; a torch draft that is not an offline model or
                a ``.gguf`` file; llama-cpp-python not installed.
            VocabularyMismatchError: The file's tokens differ from the target's.
        """
        check_cpu_target(self.target.model.device)
        if self._llama_cpp_draft is None:
            if self.draft is None:
                raise InvalidArgumentError(
                    "draft_backend='llama-cpp' needs a draft model; pass draft=... (an offline model or a .gguf file)"
                    if self.backend == "torch" else "methods 'draft' and 'cascade' need a draft model; with "
                    "backend='llama-cpp' pass draft=... (an offline model or a .gguf file, run in llama.cpp)"
                )
            self._llama_cpp_draft = self.draft.name
        if isinstance(self._llama_cpp_draft, str):  # a spec: loaded once, its vocabulary checked
            self._llama_cpp_draft = load_llama_cpp_model(self._llama_cpp_draft, self.target.tokenizer,
                                                         self.cache_dir, name=self._llama_cpp_draft)
        return self._llama_cpp_draft

    @property
    def tokenizer(self):
        return self.target.tokenizer

    def encode(self, prompt: str, chat: bool | None = None, *, device: torch.device | str | None = None) -> torch.Tensor:
        """Prompt text -> (1, n) ids on the target's device.

        Args:
            prompt: Non-empty text.
            chat: Wrap it as a user turn with the tokenizer's chat template (and the
                assistant generation prompt). ``None`` uses the template when there is one.
            device: Where to put the ids (default: the target's device; the server asks for
                "cpu" so that reading them never waits on the device's stream).

        Raises:
            InvalidArgumentError: Empty prompt, text that is not valid Unicode (a lone surrogate),
                or ``chat=True`` without a chat template.
        """
        if not isinstance(prompt, str) or not prompt.strip():
            raise InvalidArgumentError("the prompt is empty: pass some text to generate from")
        check_unicode(prompt, "the prompt")
        tok = self.tokenizer
        has_template = bool(getattr(tok, "chat_template", None))
        if chat and not has_template:
            raise InvalidArgumentError(f"chat=True but {self.target.name!r} has no chat template; use chat=False")
        if chat or (chat is None and has_template):
            return self.encode_messages([{"role": "user", "content": prompt}], device=device)
        ids = tok(prompt, add_special_tokens=True)["input_ids"]
        if len(ids) == 0:
            raise InvalidArgumentError(f"the prompt {prompt[:80]!r} encodes to no tokens with {self.target.name!r}'s tokenizer")
        return torch.tensor([list(ids)], dtype=torch.long, device=device or self.target.model.device)

    def encode_messages(self, messages: list[dict], *, device: torch.device | str | None = None) -> torch.Tensor:
        """A conversation -> (1, n) ids on the target's device, through the tokenizer's chat
        template with the assistant generation prompt (as ``encode(prompt, chat=True)`` for one
        user turn).

        Args:
            messages: ``[{"role": "system" | "user" | "assistant", "content": str}, ...]``, at
                least one.
            device: Where to put the ids (default: the target's device).

        Raises:
            InvalidArgumentError: No messages, a message's text that is not valid Unicode (a lone
                surrogate), or a model without a chat template.
        """
        if not messages:
            raise InvalidArgumentError("messages is empty: pass at least one message")
        for i, message in enumerate(messages):
            for key, value in message.items():
                if isinstance(value, str):
                    check_unicode(value, f"messages[{i}].{key}")
        tok = self.tokenizer
        if not getattr(tok, "chat_template", None):
            raise InvalidArgumentError(f"{self.target.name!r} has no chat template; send plain text instead")
        ids = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=False)
        if isinstance(ids, dict) or hasattr(ids, "input_ids"):
            ids = ids["input_ids"]
        if len(ids) == 0:
            raise InvalidArgumentError(f"the messages encode to no tokens with {self.target.name!r}'s chat template")
        return torch.tensor([list(ids)], dtype=torch.long, device=device or self.target.model.device)

    def make_drafter(
        self,
        method: str,
        *,
        skip_set: SkipSet | None = None,
        skip_layers: str | None = None,
        skip_config: str | Path | None = None,
        exit_layer: int | None = None,
        prompt_lookup_max_ngram: int = 3,
        prompt_lookup_min_ngram: int = 1,
        prompt_lookup_branches: int = 1,
        draft_vocab_size: int | None = None,
        ngram_check: bool = True,
        draft_context_window: int | None = None,
        max_model_prompt_tokens: int | None = None,
        compile: bool | None = None,
        draft_backend: str | None = None,
        draft_tree_depth: int | None = None,
        draft_tree_expand: int | None = None,
    ) -> Drafter | None:
        """The drafter for ``method`` (None for autoregressive), built by its factory in the method
        registry (``specdecode.method_registry``).

        Args:
            method: One of ``METHODS``.
            skip_set, skip_layers, skip_config: The skip set of "layer-skip", given as a
                ``SkipSet``, as text (``"attn=2,15;mlp=3"``) or as a JSON file (at most one).
            exit_layer: N for "early-exit": the draft runs decoder layers 0..N-1 (1 <= N <= L-1).
            prompt_lookup_max_ngram, prompt_lookup_min_ngram: n-gram sizes of "prompt-lookup"
                and of the n-gram part of "cascade" (1 <= min <= max).
            prompt_lookup_branches: "prompt-lookup" drafts up to this many matches' continuations
                as a token tree (1: the linear draft of the most recent match).
            draft_vocab_size: K for "draft" and "cascade": the draft model proposes only among
                K frequent tokens and computes those LM-head rows alone (FR-Spec; see
                ``draft_head``). 0 or None: the full head.
            ngram_check: "cascade": keep only the n-gram tokens the draft model agrees with
                (``drafters.cascade``); False proposes the whole n-gram match.
            draft_context_window: W for "draft" and "cascade": the draft model is prefilled
                with the prompt's last W tokens only (``DraftModelDrafter``); None: the whole
                prompt. The output is unchanged; acceptance can drop.
            max_model_prompt_tokens: N for "cascade": a prompt of more than N tokens gets
                n-gram matches alone, with no draft model and no draft prefill
                (``drafters.cascade``); None: no limit.
            compile: Taken by every method; the drafter follows the round's (``decoder``'s) setting.
            draft_backend: "torch" or "llama-cpp" for "draft" and "cascade": what runs the draft
                model (``from_pretrained``); None: "llama-cpp" when the generator has a llama.cpp
                draft and no torch draft, else "torch". llama.cpp's forwards are never compiled.
            draft_tree_depth: D for "draft" and "cascade": each row drafts a chain of D tokens (greedy, or drawn
                from q when sampling) and a token tree of the round's budget (γ) of nodes: the chain and its steps' runners-up of
                highest joint draft probability (``drafters.draft_tree``, EAGLE-2's reranking), checked
                in one target forward; None: linear drafts. 1 .. ``draft_tree.MAX_TREE_DEPTH``.
            draft_tree_expand: M for "draft", with ``draft_tree_depth``: EAGLE-2's expansion instead of the
                chain, the M best nodes of each depth expanded by one draft tree forward (D - 1 of them).

        Options a method does not use are ignored, so one set of options can serve
        several methods (as in ``specdecode bench``); ``draft_vocab_size``,
        ``draft_context_window``, ``max_model_prompt_tokens`` and ``draft_backend`` are the
        exceptions, refused by methods that do not use them (``method_registry.METHOD_ONLY_OPTIONS``).

        Raises:
            InvalidArgumentError: Unknown method; "draft" or "cascade" without a draft model;
                "layer-skip" without a skip set, or with more than one; "early-exit"
                without ``exit_layer``; ``draft_vocab_size``, ``draft_context_window`` or
                ``max_model_prompt_tokens`` with a method that does not use it, or out of
                range; an unknown ``draft_backend``, one given to another method, or
                "llama-cpp" with ``draft_vocab_size`` (llama.cpp computes every logit) or
                without a GGUF draft; or an option out of range.
            VocabularyMismatchError: A llama.cpp draft's tokens differ from the target's.
        """
        if draft_backend is not None and draft_backend not in DRAFT_BACKENDS:
            raise InvalidArgumentError(f"unknown draft_backend {draft_backend!r}; allowed: {', '.join(DRAFT_BACKENDS)}")
        options = DrafterOptions(
            skip_set=skip_set, skip_layers=skip_layers, skip_config=skip_config, exit_layer=exit_layer,
            prompt_lookup_max_ngram=prompt_lookup_max_ngram, prompt_lookup_min_ngram=prompt_lookup_min_ngram,
            prompt_lookup_branches=prompt_lookup_branches,
            draft_vocab_size=draft_vocab_size, ngram_check=ngram_check, draft_context_window=draft_context_window,
            max_model_prompt_tokens=max_model_prompt_tokens, compile=compile, draft_backend=draft_backend,
            draft_tree_depth=draft_tree_depth, draft_tree_expand=draft_tree_expand,
        )
        return method_registry.make_drafter(self, method, options)

    def default_draft_backend(self) -> str:
        """The draft backend when none is named: "llama-cpp" for a llama.cpp target (its draft runs
        in llama.cpp too) or a generator with a llama.cpp draft and no torch draft, else "torch"."""
        llama = self.backend == "llama-cpp" or (self.draft is None and self._llama_cpp_draft is not None)
        return "llama-cpp" if llama else "torch"

    def llama_cpp_draft_runner(self) -> LlamaCppTargetRunner:
        """The llama.cpp draft's one-sequence runner, one per generator (its context is the draft's KV cache)."""
        if self._llama_cpp_runner is None:
            self._llama_cpp_runner = LlamaCppTargetRunner(self.llama_cpp_draft(), name="llama.cpp draft model")
        return self._llama_cpp_runner

    def runner(self, compile: bool | None) -> ModelRunner:
        """The target's ``fast_path.ModelRunner`` for ``compile``, made on first use and kept: decoders
        made with it share one one-row engine (its cache and compiled buckets).

        Raises:
            InvalidArgumentError: A bad ``compile``.
        """
        model = self.target.model
        compile = resolve_compile(compile, model.device)
        if compile not in self._runners:
            self._runners[compile] = ModelRunner(model, compile=compile, name="target model")
        return self._runners[compile]

    def draft_head(self, draft_vocab_size: int | None) -> DraftHead:
        """The draft model's LM head for ``draft_vocab_size`` K: full for 0/None, else FR-Spec's K tokens.

        The K tokens are every special and end-of-sequence token, then the best-ranked
        others of ``token_frequencies()`` (``TokenFrequencies.top_ids``).

        Raises:
            InvalidArgumentError: No draft model, or K not an integer in S..V (S special tokens,
                V the draft tokenizer's vocabulary), naming the value and the range.
            VocabularyMismatchError: A stored frequency file was counted with another tokenizer.
        """
        if draft_vocab_size is None or (draft_vocab_size == 0 and not isinstance(draft_vocab_size, bool)):
            return DraftHead.full()
        if self.draft is None:
            raise InvalidArgumentError("draft_vocab_size needs a draft model; pass draft=...")
        tokenizer = self.draft.tokenizer
        always = special_token_ids(tokenizer) | self._eos | eos_token_ids(self.draft)
        vocab, low = len(tokenizer), max(1, len(always))
        k = draft_vocab_size
        if isinstance(k, bool) or not isinstance(k, int) or not low <= k <= vocab:
            raise InvalidArgumentError(
                f"draft_vocab_size {k!r} is out of range: allowed {low}..{vocab} (the draft tokenizer has {vocab} "
                f"tokens, {len(always)} of them special or end-of-sequence tokens that are always kept), "
                "or 0 / None for the full head"
            )
        freqs = self.token_frequencies()
        ids = freqs.top_ids(k, always)
        logger.info("truncated draft head: K = %d of %d tokens (%.4f of the frequency corpus's tokens)",
                    k, vocab, freqs.coverage(ids))
        return DraftHead.truncated(ids)

    def token_frequencies(self) -> TokenFrequencies:
        """The draft tokenizer's token frequencies: read from the draft's dense cache, else counted.

        Counted once per generator on ``specdecode.models.token_frequencies.default_corpus`` and
        stored next to the draft model's dense copy when it has one (GGUF and offline models),
        so the next start reads them; other models count in memory each start.

        Raises:
            InvalidArgumentError: No draft model, or a stored file that cannot be read.
            VocabularyMismatchError: A stored file was counted with another tokenizer.
        """
        if self.draft is None:
            raise InvalidArgumentError("token frequencies are the draft model's; this generator has no draft model")
        if self._token_frequencies is None:
            self._token_frequencies = load_or_count(self.draft.tokenizer, self._draft_dense_folder())
        return self._token_frequencies

    def _draft_dense_folder(self) -> Path | None:
        """The dense-cache folder of the draft model, or None (a folder or hub model has none)."""
        folder = self.draft.dense_folder
        return folder if folder is not None and dense_cache_valid(folder) else None

    def decoder(
        self,
        method: str = "draft",
        *,
        draft_control: DraftControl | None = None,
        skip_set: SkipSet | None = None,
        skip_layers: str | None = None,
        skip_config: str | Path | None = None,
        exit_layer: int | None = None,
        prompt_lookup_max_ngram: int = 3,
        prompt_lookup_min_ngram: int = 1,
        prompt_lookup_branches: int = 1,
        draft_vocab_size: int | None = None,
        ngram_check: bool = True,
        draft_context_window: int | None = None,
        max_model_prompt_tokens: int | None = None,
        compile: bool | None = None,
        draft_backend: str | None = None,
        draft_tree_depth: int | None = None,
        draft_tree_expand: int | None = None,
    ) -> SpeculativeDecoder:
        """A ``SpeculativeDecoder`` over the target with the drafter of ``method``.

        Args:
            method: One of ``METHODS``.
            compile: The fast path (static KV cache, compiled forwards; ``specdecode.engine.fast_path``)
                on or off; None: the device's default (``fast_path.default_compile``). Compiled
                forwards are kept per model in this generator and reused by later decoders.
            draft_control: Adaptive draft exit, length schedule and confidence gating
                (``specdecode.drafters.control.DraftControl``); ignored by "autoregressive".
            skip_set .. max_model_prompt_tokens, draft_backend, draft_tree_depth, draft_tree_expand: See
                ``make_drafter``.

        A llama.cpp target with no ``draft_control``: draft lengths from its measured costs and, for
        "draft" and "cascade", the llama.cpp draft's one-token forward (``measured_cost_policy``).

        Raises:
            InvalidArgumentError: See ``make_drafter``; also adaptive draft exit with
                "prompt-lookup", whose drafts carry no probabilities; ``compile=True`` with a llama.cpp target.
        """
        drafter = self.make_drafter(
            method,
            skip_set=skip_set,
            skip_layers=skip_layers,
            skip_config=skip_config,
            exit_layer=exit_layer,
            prompt_lookup_max_ngram=prompt_lookup_max_ngram,
            prompt_lookup_min_ngram=prompt_lookup_min_ngram,
            prompt_lookup_branches=prompt_lookup_branches,
            draft_vocab_size=draft_vocab_size,
            ngram_check=ngram_check,
            draft_context_window=draft_context_window,
            max_model_prompt_tokens=max_model_prompt_tokens,
            compile=compile,
            draft_backend=draft_backend,
            draft_tree_depth=draft_tree_depth,
            draft_tree_expand=draft_tree_expand,
        )
        llama = self.backend == "llama-cpp"  # the target in llama.cpp: one row, nothing compiled (runner_target)
        draft_control = self._measured_policy(method, draft_control, drafter)
        runner = None if llama else self.runner(compile)
        check_drafter_compilable(drafter, runner is not None and runner.compile)
        return SpeculativeDecoder(self.target.model, drafter, eos_token_ids=self._eos, tokenizer=self.tokenizer,
                                  draft_control=draft_control, runner=runner, compile=compile)

    def _measured_policy(self, method: str, draft_control, drafter):
        """``draft_control``, or where none is given (and a drafter): for "token-recycling" the tree size
        from the cost model (``engine.speculation_cost.SpeculationCostPolicy``: target forwards calibrated
        by the engine, trees priced by their measured accepted tokens per size; one per generator, so what
        it learned carries over); for a llama.cpp target the draft length from
        measured costs: the target's and, for methods with a draft model, the llama.cpp draft's
        one-token forward (``measured_cost_policy``)."""
        if draft_control is not None or drafter is None:
            return draft_control
        if method == "token-recycling":
            if self.size_policy is None:
                self.size_policy = SpeculationCostPolicy(probe_every=TOKEN_RECYCLING_PROBE_EVERY)
            return self.size_policy
        if self.backend != "llama-cpp":
            return draft_control
        with_model = method_registry.REGISTRY[method].needs_draft_model
        return measured_cost_policy(self.target.model, draft_runner=self.llama_cpp_draft_runner() if with_model else None)

    def batch_decoder(
        self,
        method: str = "draft",
        *,
        max_batch_size: int = 8,
        max_length: int = 2048,
        num_speculative_tokens: int = DEFAULT_NUM_SPECULATIVE_TOKENS,
        draft_control: DraftControl | None = None,
        exit_rule: str = "row",
        max_verify_tokens: int | None | str = "auto",
        skip_set: SkipSet | None = None,
        skip_layers: str | None = None,
        skip_config: str | Path | None = None,
        exit_layer: int | None = None,
        prompt_lookup_max_ngram: int = 3,
        prompt_lookup_min_ngram: int = 1,
        prompt_lookup_branches: int = 1,
        ngram_check: bool = True,
        max_model_prompt_tokens: int | None = None,
        draft_context_window: int | None = None,
        draft_vocab_size: int | None = None,
        compile: bool | None = None,
        draft_backend: str | None = None,
        draft_tree_depth: int | None = None,
        draft_tree_expand: int | None = None,
    ) -> BatchedSpeculativeDecoder:
        """A ``BatchedSpeculativeDecoder`` (many rows at once, continuous batching) for ``method``.

        Args:
            method: One of ``BATCH_METHODS``.
            max_batch_size, max_length, num_speculative_tokens, exit_rule: See
                ``BatchedSpeculativeDecoder``.
            draft_control: Per-row adaptive draft exit and gating; ignored by "autoregressive". None
                with a llama.cpp target: draft lengths from measured costs, as ``decoder``.
            max_verify_tokens: See ``BatchedSpeculativeDecoder``; "auto": ``auto_verify_tokens``
                (on a CPU ``BATCH_VERIFY_TOKENS_CPU``, or the longest block + 1 where that is more,
                so a lone row drafts what ``decoder``'s one-row engine drafts; no limit on other
                devices, not measured).
            skip_set .. draft_vocab_size, draft_tree_depth, draft_tree_expand: See ``make_drafter`` (a tree's
                nodes count against ``num_speculative_tokens`` and ``max_verify_tokens``).
            compile: The batched fast path (compiled (rows, width) buckets, CUDA graphs on CUDA):
                True, False, or None for the device's default (``BatchedSpeculativeDecoder``).
            draft_backend: As in ``make_drafter``; "llama-cpp" ("draft", "cascade") runs one
                sequence, so ``max_batch_size`` must be 1 (the drafter refuses more).

        Raises:
            InvalidArgumentError: Unknown method; the errors of
                ``make_drafter`` for a missing draft model, skip set or exit layer; a value
                out of range; the llama.cpp draft with ``max_batch_size`` > 1.
        """
        target = self.target.model
        drafter = method_registry.make_drafter(self, method, DrafterOptions(
            skip_set=skip_set, skip_layers=skip_layers, skip_config=skip_config, exit_layer=exit_layer,
            prompt_lookup_max_ngram=prompt_lookup_max_ngram, prompt_lookup_min_ngram=prompt_lookup_min_ngram,
            prompt_lookup_branches=prompt_lookup_branches,
            ngram_check=ngram_check, max_model_prompt_tokens=max_model_prompt_tokens,
            draft_context_window=draft_context_window, draft_vocab_size=draft_vocab_size,
            draft_backend=draft_backend, draft_tree_depth=draft_tree_depth, draft_tree_expand=draft_tree_expand,
        ))
        control = self._measured_policy(method, draft_control, drafter) if drafter is not None else None
        check_drafter_compilable(drafter, resolve_compile(compile, target.device))
        if max_verify_tokens == "auto":
            max_verify_tokens = auto_verify_tokens(target.device, num_speculative_tokens, control)
        return BatchedSpeculativeDecoder(
            target,
            drafter,
            max_batch_size=max_batch_size,
            max_length=max_length,
            num_speculative_tokens=num_speculative_tokens,
            eos_token_ids=self._eos,
            tokenizer=self.tokenizer,
            draft_control=control,
            exit_rule=exit_rule,
            max_verify_tokens=max_verify_tokens,
            compile=compile,
        )

    def stream(
        self,
        prompt: str,
        config: GenerationConfig | None = None,
        *,
        method: str = "draft",
        chat: bool | None = None,
        **options,
    ) -> GenerationStream:
        """Tokens as they are verified: iterate to get lists of ids; ``.stats`` after the end.

        ``options`` are the keywords of ``decoder`` (draft_control, skip_layers, exit_layer, ...).
        """
        return self.decoder(method, **options).stream(self.encode(prompt, chat), config)

    def generate(
        self,
        prompt: str,
        config: GenerationConfig | None = None,
        *,
        method: str = "draft",
        chat: bool | None = None,
        **options,
    ) -> GenerationResult:
        """Generate to the end; see ``SpeculativeDecoder.generate``; ``options`` as in ``stream``."""
        return self.decoder(method, **options).generate(self.encode(prompt, chat), config)
