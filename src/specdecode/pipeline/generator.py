"""``SpeculativeGenerator``: the decoders built on a ``ModelPair`` (``pipeline.model_pair``): the
drafter of each method (``make_drafter``, through ``specdecode.method_registry``), the one-sequence
``decoder`` and the ``batch_decoder``, and ``generate`` / ``stream`` from text prompts (``encode``).
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import torch

from specdecode import method_registry
from specdecode.config import DEFAULT_NUM_SPECULATIVE_TOKENS, GenerationConfig, check_unicode
from specdecode.defaults import DRAFT_BACKENDS, auto_verify_tokens
from specdecode.drafters import Drafter
from specdecode.drafters.control import DraftControl
from specdecode.drafters.layer_skip import SkipSet
from specdecode.engine.batched import BatchedSpeculativeDecoder
from specdecode.engine.decoder import GenerationResult, GenerationStream, SpeculativeDecoder
from specdecode.engine.fast_path import ModelRunner, check_drafter_compilable, resolve_compile
from specdecode.engine.runner_target import measured_cost_policy
from specdecode.engine.speculation_cost import SpeculationCostPolicy
from specdecode.errors import InvalidArgumentError
from specdecode.method_registry import DrafterOptions
from specdecode.models import LoadedModel
from specdecode.models.llama_cpp import LlamaCppModel
from specdecode.pipeline.model_pair import ModelPair

#: Rounds between two probes of "token-recycling"'s tree-size policy (as its measured-size policy had).
TOKEN_RECYCLING_PROBE_EVERY = 8


class SpeculativeGenerator(ModelPair):
    """A target model, an optional draft model, and the decoders built on them.

    The arguments, ``from_pretrained`` and the draft model's resources (the llama.cpp draft, the
    truncated draft head, token frequencies) are ``ModelPair``'s.

    Raises:
        VocabularyMismatchError: If the draft's tokenizer maps tokens differently.
    """

    def __init__(self, target: LoadedModel, draft: LoadedModel | None = None, *, cache_dir=None,
                 llama_cpp_draft: LlamaCppModel | str | None = None) -> None:
        super().__init__(target, draft, cache_dir=cache_dir, llama_cpp_draft=llama_cpp_draft)
        #: The "token-recycling" drafter and its tree-size policy, one per generator (its adjacency matrix
        #: and the measured costs of its sizes learn across requests).
        self.token_recycler = None
        self.size_policy: SpeculationCostPolicy | None = None
        # The target's fast-path settings and one-row engine, kept for the generator's life so
        # later decoders share its cache and compiled buckets: compile -> runner.
        self._runners: dict[bool, ModelRunner] = {}

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
        prompt_lookup_datastore: str | Path | None = "auto",
        draft_vocab_size: int | None = None,
        ngram_check: bool = True,
        draft_context_window: int | None = None,
        max_model_prompt_tokens: int | None = None,
        compile: bool | None = None,
        draft_backend: str | None = None,
        draft_tree_depth: int | None = None,
        draft_tree_expand: int | None = None,
        draft_tree_shape: str | None = None,
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
            prompt_lookup_datastore: "prompt-lookup" also matches in this corpus ("python-stdlib": this
                Python's standard library sources; or a folder or file of text), REST's datastore
                (``drafters.datastore``), tokenized once and cached in the cache folder; None or "none":
                not; "auto" (the default): "python-stdlib" with a llama.cpp target, else none
                (``method_registry.LLAMA_CPP_PROMPT_LOOKUP_DATASTORE``).
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
            draft_tree_shape: With ``draft_tree_depth``, how each round's tree is shaped: "per-round" (from the
                round's own draft values, one host sync in the drafter) or "previous-round" (from the row's
                earlier rounds, nothing read before the verification); None: the device's default
                (``drafters.draft_tree.default_tree_shape``: previous-round on CUDA, per-round elsewhere).

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
            prompt_lookup_datastore=prompt_lookup_datastore,
            draft_vocab_size=draft_vocab_size, ngram_check=ngram_check, draft_context_window=draft_context_window,
            max_model_prompt_tokens=max_model_prompt_tokens, compile=compile, draft_backend=draft_backend,
            draft_tree_depth=draft_tree_depth, draft_tree_expand=draft_tree_expand, draft_tree_shape=draft_tree_shape,
        )
        return method_registry.make_drafter(self, method, options)

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
        prompt_lookup_datastore: str | Path | None = "auto",
        draft_vocab_size: int | None = None,
        ngram_check: bool = True,
        draft_context_window: int | None = None,
        max_model_prompt_tokens: int | None = None,
        compile: bool | None = None,
        draft_backend: str | None = None,
        draft_tree_depth: int | None = None,
        draft_tree_expand: int | None = None,
        draft_tree_shape: str | None = None,
    ) -> SpeculativeDecoder:
        """A ``SpeculativeDecoder`` over the target with the drafter of ``method``.

        Args:
            method: One of ``METHODS``.
            compile: The fast path (static KV cache, compiled forwards; ``specdecode.engine.fast_path``)
                on or off; None: the device's default (``fast_path.default_compile``). Compiled
                forwards are kept per model in this generator and reused by later decoders.
            draft_control: Adaptive draft exit, length schedule and confidence gating
                (``specdecode.drafters.control.DraftControl``); ignored by "autoregressive".
            skip_set .. max_model_prompt_tokens, draft_backend, draft_tree_depth .. draft_tree_shape: See
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
            prompt_lookup_datastore=prompt_lookup_datastore,
            draft_vocab_size=draft_vocab_size,
            ngram_check=ngram_check,
            draft_context_window=draft_context_window,
            max_model_prompt_tokens=max_model_prompt_tokens,
            compile=compile,
            draft_backend=draft_backend,
            draft_tree_depth=draft_tree_depth,
            draft_tree_expand=draft_tree_expand,
            draft_tree_shape=draft_tree_shape,
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
        prompt_lookup_datastore: str | Path | None = "auto",
        ngram_check: bool = True,
        max_model_prompt_tokens: int | None = None,
        draft_context_window: int | None = None,
        draft_vocab_size: int | None = None,
        compile: bool | None = None,
        draft_backend: str | None = None,
        draft_tree_depth: int | None = None,
        draft_tree_expand: int | None = None,
        draft_tree_shape: str | None = None,
        row_buckets: Sequence[int] | None = None,
        shared_prefill: bool | None = None,
        overlap_rounds: bool | None = None,
        dynamic_shapes: bool = False,
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
            skip_set .. draft_vocab_size, draft_tree_depth .. draft_tree_shape: See ``make_drafter`` (a tree's
                nodes count against ``num_speculative_tokens`` and ``max_verify_tokens``).
            compile: The batched fast path (compiled (rows, width) buckets, CUDA graphs on CUDA):
                True, False, or None for the device's default (``BatchedSpeculativeDecoder``).
            draft_backend: As in ``make_drafter``; "llama-cpp" ("draft", "cascade") runs one
                sequence, so ``max_batch_size`` must be 1 (the drafter refuses more).
            row_buckets: With ``compile``, the rows buckets compiled; None: 1, 2, 4, .. and
                ``max_batch_size`` (``BatchedSpeculativeDecoder``). ``(max_batch_size,)`` compiles one
                rows bucket per width, fewer rows running padded.
            dynamic_shapes: With ``compile``, the buckets with rows or widths above 1 share compiled functions
                (``BatchedSpeculativeDecoder``): fewer compilations, CUDA graphs still one per bucket.
            shared_prefill: Requests admitted together share their prefill forwards (``engine.shared_prefill``):
                True, False, or None for the device's default (CUDA only).
            overlap_rounds: "autoregressive": each round's successor forward runs while the host reads and
                emits the round (``engine.overlap``): True, False, or None for the device's default (CUDA only).

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
            prompt_lookup_datastore=prompt_lookup_datastore,
            ngram_check=ngram_check, max_model_prompt_tokens=max_model_prompt_tokens,
            draft_context_window=draft_context_window, draft_vocab_size=draft_vocab_size,
            draft_backend=draft_backend, draft_tree_depth=draft_tree_depth, draft_tree_expand=draft_tree_expand,
            draft_tree_shape=draft_tree_shape,
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
            row_buckets=row_buckets,
            dynamic_shapes=dynamic_shapes,
            shared_prefill=shared_prefill,
            overlap_rounds=overlap_rounds,
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


__all__ = ["SpeculativeGenerator", "TOKEN_RECYCLING_PROBE_EVERY"]
