"""Decoding one sequence: ``SpeculativeDecoder``, ``GenerationStream``, ``GenerationResult``.

A generation runs the batched engine's round (``engine.batched.BatchedSpeculativeDecoder``: draft,
verify, accept, emit) with one row, B = 1: one implementation for one sequence and for many. An
optional draft policy (``specdecode.drafters.control.DraftControl``, seen through
``engine.protocol.DraftPolicy``) may change γ per round, end a block early when the draft is unsure,
or skip drafting after a low-confidence target token. Autoregressive decoding is the same loop with
k = 0: one target forward, one token.

Drafters are batch-native (``engine.protocol.Drafter``): the same drafter object serves one
row here and many in the serving engine. The engine is kept across generations; its cache is sized per generation (prompt + ``max_new_tokens`` + the longest
block + 1, rounded up to ``CACHE_STEP``) and rebuilt only when a generation needs more
positions or another γ.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator

import torch
from transformers import DynamicCache, PreTrainedModel

from specdecode.config import GenerationConfig
from specdecode.engine import kv_cache
from specdecode.engine.batch_rows import BatchRow, check_prompt_cache
from specdecode.engine.batched import BatchedSpeculativeDecoder
from specdecode.engine.fast_path import DRAFT_BUCKETS, ModelRunner
from specdecode.engine.overlap import engine_overlap_rounds
from specdecode.engine.protocol import Drafter, DraftPolicy
from specdecode.engine.results import GenerationResult, as_2d
from specdecode.engine.runner_target import forwards_of, is_runner_target
from specdecode.engine.sampling import logits_width
from specdecode.engine.stats import SpecDecodingStats
from specdecode.errors import InvalidArgumentError


__all__ = ["CACHE_STEP", "GenerationResult", "GenerationStream", "SpeculativeDecoder"]

#: A one-sequence engine's cache holds a multiple of this many positions per generation.
CACHE_STEP = 256


class GenerationStream:
    """Iterates over verified tokens, one list per target forward, as soon as they exist.

    After the iteration ends, ``token_ids``, ``finish_reason`` and ``stats`` hold the
    outcome. Made by ``SpeculativeDecoder.stream``.

    With ``GenerationConfig.banned_words``, a list holds only tokens that can no longer
    become part of a banned word (the tail that may still start one is held back), so
    no prefix of the stream ever contains a banned word. ``forbidden_tokens`` then maps
    each generated position (0 = the first new token) to the token ids masked there.
    The rollback and the masks are ``engine.banned_rows.BannedRow``'s,
    the batched engine's per-row state.

    Semantics: under greedy decoding the output is the target's greedy output with
    those (position, token) pairs masked, a deterministic function of the prompt and
    the list. A mask holds for the prefix it was made for: rolling back to an earlier
    position drops the masks after it. Under sampling, rolling back and masking is *not* exact conditioning of
    the target's distribution on "contains no banned word": the masked token's
    probability mass moves to the other tokens at that one position only, whereas
    exact conditioning would reweight every earlier token by how likely its
    continuations are to avoid the words (intractable without enumerating them).

    Stopping the iteration early (``break``, closing it) cancels the generation in the engine.
    """

    def __init__(
        self,
        decoder: SpeculativeDecoder,
        input_ids: torch.Tensor,
        config: GenerationConfig,
        prompt_cache: DynamicCache | None = None,
    ):
        self._decoder = decoder
        self._input_ids = input_ids
        self._prompt_cache = prompt_cache
        self.config = config
        self.token_ids: list[int] = []
        self.finish_reason: str | None = None
        self.stats = SpecDecodingStats(num_prompt_tokens=int(input_ids.shape[1]))
        self._row: BatchRow | None = None
        self._started = False

    @property
    def logprobs(self) -> list | None:
        """With ``GenerationConfig.logprobs``: one ``TokenLogprob`` per token of ``token_ids``; else None."""
        proc = self._row.sampler.processors if self._row is not None else None  # [processors]
        return list(proc.logprobs[: len(self.token_ids)]) if proc is not None and proc.wants_logprobs else None

    @property
    def forbidden_tokens(self) -> dict[int, list[int]]:
        """Banned-word masks: generated position (0 = the first new token) -> masked token ids."""
        if self._row is None or self._row.banned is None:
            return {}
        return self._row.banned.forbidden_tokens

    def __iter__(self) -> Iterator[list[int]]:
        if self._started:
            raise RuntimeError("a GenerationStream can be iterated only once")
        self._started = True
        return self._run()

    def _run(self) -> Iterator[list[int]]:
        engine = self._decoder._engine_for(self.config, int(self._input_ids.shape[1]))
        request_id = engine.add(self._input_ids, self.config, prompt_cache=self._prompt_cache)
        row = self._row = engine.request(request_id)
        self.stats.final_draft_threshold = row.stats.final_draft_threshold  # set by the row's controller
        row.stats = self.stats
        self.token_ids = row.output
        engine.cache.generation += 1
        generation = engine.cache.generation
        try:
            # The first step admits the request: its prefill gives the first token (no round).
            decode = False
            while True:
                if engine.cache.generation != generation:
                    self._taken_over(row, engine, request_id)
                released: list[int] = []
                for event in engine.step(decode=decode):
                    if event.request_id == request_id:
                        released += event.token_ids
                decode = True
                self.finish_reason = row.finish_reason
                if released:
                    yield released
                if row.finish_reason == "cancelled" or engine.cache.generation != generation:
                    self._taken_over(row, engine, request_id)
                if row.finish_reason is not None:
                    break
        finally:
            if row.finish_reason is None and engine.is_running(request_id):
                engine.cancel(request_id)  # the caller stopped early, or a step raised

    @staticmethod
    def _taken_over(row: BatchRow, engine: BatchedSpeculativeDecoder, request_id: int) -> None:
        if engine.is_running(request_id):
            engine.cancel(request_id)
        raise InvalidArgumentError(
            "this generation was taken over by a newer one on the same cache (one sequence at a time: "
            "generations of one SpeculativeDecoder, or of decoders sharing a runner, cannot be interleaved); "
            "finish or close a stream before starting the next"
        )


class SpeculativeDecoder:
    """Target-only or speculative decoding of one sequence (batch size 1).

    Args:
        target: The target model, a transformers causal LM in eval mode (eager or SDPA
            attention: the batched round's cache takes 4D masks, ``batch_cache.BatchKVCache``);
            or a target run outside torch (``protocol.TargetRunnerProtocol``: the target's GGUF
            file in llama.cpp, ``engine.runner_target``), whose forwards are never compiled.
        drafter: Proposes draft tokens; ``None`` gives plain autoregressive decoding
            with a KV cache (the baseline).
        eos_token_ids: Token ids that end generation.
        tokenizer: Needed only for ``stop_strings`` and for ``GenerationResult.text``.
        draft_control: Per-round draft length policy (adaptive draft exit, heuristic
            schedule, target-confidence gating); None drafts γ tokens every round.
            Ignored without a drafter.
        compile: The fast path for the round's forwards (``engine.batch_runner``: a static
            batch cache, forwards compiled at fixed widths, CUDA graphs on CUDA); None: the
            device default (``fast_path.default_compile``: on for CUDA, off for CPU).
            Ignored when ``runner`` is given. A drafter with a model of its own runs it with
            the same setting (its cache follows the target's).
        runner: A target ``fast_path.ModelRunner`` whose settings (``compile``, ``graphs``, ``dynamic_shapes``)
            the round takes, and whose one-row engine decoders sharing it share (``SpeculativeGenerator``
            keeps one per model); None makes one from ``compile``.
        overlap_rounds: Without a drafter, each round's successor forward runs while the host reads and
            emits the round (``engine.overlap``): True, False, or None for the device's default (CUDA
            only). An attribute too, read at each generation's start.

    Raises:
        InvalidArgumentError: If adaptive draft exit is asked of a drafter that gives
            no probabilities (``drafter.supports_exit_policy`` is False), a bad ``compile`` or
            ``overlap_rounds`` (True with a llama.cpp target).

    The output of greedy decoding equals target-only greedy decoding token for
    token (in float32; in lower precision a multi-token forward may round
    differently from a one-token forward). Sampling is distributed exactly as
    sampling from the target (Leviathan et al. 2022).
    """

    def __init__(
        self,
        target: PreTrainedModel,
        drafter: Drafter | None = None,
        *,
        eos_token_ids: Iterable[int] = (),
        tokenizer=None,
        draft_control: DraftPolicy | None = None,
        compile: bool | None = None,
        runner: ModelRunner | None = None,
        overlap_rounds: bool | None = None,
    ) -> None:
        engine_overlap_rounds(overlap_rounds, target)  # checked now, resolved by each engine
        if (
            draft_control is not None
            and draft_control.adaptive_exit
            and drafter is not None
            and not getattr(drafter, "supports_exit_policy", False)
        ):
            raise InvalidArgumentError(
                f"adaptive draft exit needs a drafter that gives probabilities (draft model, layer skip, "
                f"early exit); {type(drafter).__name__} does not"
            )
        self.target = target
        self.drafter = drafter
        self.draft_control = draft_control
        self.tokenizer = tokenizer
        self.eos_token_ids = frozenset(int(t) for t in eos_token_ids)
        self.vocab_size = logits_width(target)
        if runner is None and is_runner_target(target):
            if compile:
                raise InvalidArgumentError(f"compile=True compiles torch forwards, but the {target.name} runs in "
                                           "llama.cpp: use compile=None or False")
            runner = forwards_of(target)
        self.runner = runner if runner is not None else ModelRunner(target, compile=compile, name="target model")
        self.overlap_rounds = overlap_rounds
        self._engine: BatchedSpeculativeDecoder | None = None
        self._target_runners: list = []  # the round's target runners (BatchRunner) this decoder used

    def compile_time_s(self) -> float:
        """Seconds the round's runners (target and drafter) have spent compiling, over their lives."""
        drafter = self.drafter.compile_time_s if self.drafter is not None else 0.0
        return sum(r.compile_time_s for r in self._target_runners) + drafter

    def _engine_for(self, config: GenerationConfig, num_prompt_tokens: int) -> BatchedSpeculativeDecoder:
        """The one-row engine for a generation: kept while its γ matches and its cache holds the
        prompt, ``max_new_tokens`` and the longest block + 1; otherwise rebuilt, sized for it."""
        speculative = self.drafter is not None
        gamma = config.num_speculative_tokens if speculative else 0
        # The runner's latest one-row engine (this decoder's or another's with the same runner) owns
        # the newest cache and graphs: share them, never a stale engine of this decoder's own.
        engine = getattr(self.runner, "one_row_engine", None) or self._engine
        for unfinished in (self._engine, engine):  # an unfinished stream: this generation takes over
            if unfinished is not None and unfinished.has_work:
                unfinished.cancel_all()
        compile = self.runner.compile
        control = self.draft_control if speculative else None
        block = gamma
        if control is not None and control.active:
            block = control.controller(gamma).max_tokens
        margin = DRAFT_BUCKETS[-1] if compile else 0  # a drafter's static cache pads its forwards
        need = num_prompt_tokens + config.max_new_tokens + block + 1 + margin
        if engine is self._engine and engine is not None and engine.gamma == gamma and engine.max_length >= need \
                and getattr(engine.cache.fast, "dynamic_shapes", False) == getattr(self.runner, "dynamic_shapes", False):
            engine.overlap_rounds = engine_overlap_rounds(self.overlap_rounds, self.target)
            return engine
        length = -(-need // CACHE_STEP) * CACHE_STEP
        self._engine = BatchedSpeculativeDecoder(
            self.target,
            self.drafter,
            max_batch_size=1,
            max_length=length,
            num_speculative_tokens=gamma if speculative else 1,
            eos_token_ids=self.eos_token_ids,
            tokenizer=self.tokenizer,
            draft_control=control,
            compile=compile,
            graphs=getattr(self.runner, "graphs", True),
            dynamic_shapes=getattr(self.runner, "dynamic_shapes", False),
            prefill_pad_multiple=1,  # one prompt at a time: its own width, as transformers' generate
            shared_with=engine,
            overlap_rounds=self.overlap_rounds,
        )
        self._engine.contain_errors = False
        if all(r is not self._engine.runner for r in self._target_runners):
            self._target_runners.append(self._engine.runner)
        self.runner.one_row_engine = self._engine  # the next decoder with this runner shares its cache
        return self._engine

    def stream(
        self,
        input_ids: torch.Tensor | list[int],
        config: GenerationConfig | None = None,
        *,
        prompt_cache: DynamicCache | None = None,
    ) -> GenerationStream:
        """Start a generation whose tokens arrive as they are verified.

        Args:
            input_ids: (1, n) or (n,) long prompt ids, n >= 1; or a list of ints.
            config: Generation parameters; defaults to ``GenerationConfig()``.
            prompt_cache: Optional target cache holding the first m tokens of the prompt,
                1 <= m <= n - 1 (made by ``prompt_cache``); only tokens m..n-1 are then
                encoded. Its keys and values are copied into the round's cache; it is read,
                never modified, so one prefix serves many generations (a sliding-window
                layer trimmed to its window cannot be copied: the prompt is then re-encoded).

        Raises:
            InvalidArgumentError: If the prompt is empty or has a batch size other than 1,
                ``prompt_cache`` holds no tokens or not fewer than n, or n + ``max_new_tokens``
                exceeds the target's context length (``kv_cache.check_context_length``) or the draft model's
                (``Drafter.check_context``).
        """
        config = config or GenerationConfig()
        device = self.target.device
        input_ids = as_2d(input_ids)
        if input_ids.dim() != 2 or input_ids.shape[0] != 1:
            raise InvalidArgumentError(
                f"input_ids must have shape (1, n) (batch size 1), got {tuple(input_ids.shape)}"
            )
        if input_ids.shape[1] == 0:
            raise InvalidArgumentError("the prompt is empty: it must contain at least one token")
        kv_cache.check_context_length(self.target, int(input_ids.shape[1]), config.max_new_tokens)
        if self.drafter is not None:
            self.drafter.check_context(int(input_ids.shape[1]), config.max_new_tokens)
        check_prompt_cache(prompt_cache, int(input_ids.shape[1]))
        return GenerationStream(self, input_ids.to(device=device, dtype=torch.long), config, prompt_cache)

    @torch.inference_mode()
    def prompt_cache(self, prefix_ids: torch.Tensor | list[int]) -> DynamicCache:
        """Encode a prompt prefix once, for ``stream(..., prompt_cache=cache)``.

        Generations that share a prompt (a benchmark running several methods, a
        server with a fixed system prompt) can then skip re-encoding it. Pass the
        prompt without its last token: the generation encodes at least that one.

        Args:
            prefix_ids: (1, m) or (m,) long ids, m >= 1.

        Returns:
            A target cache holding the m positions (sliding layers laid out as in
            ``kv_cache.new_cache``).

        Raises:
            InvalidArgumentError: If the prefix is empty or has a batch size other than 1, or the
                target runs outside torch (llama.cpp: no torch keys and values to keep).
        """
        if is_runner_target(self.target):
            raise InvalidArgumentError(
                f"a prompt cache holds a torch model's keys and values, but the {self.target.name} runs in llama.cpp: "
                "pass the whole prompt"
            )
        prefix_ids = as_2d(prefix_ids)
        if prefix_ids.dim() != 2 or prefix_ids.shape[0] != 1 or prefix_ids.shape[1] == 0:
            raise InvalidArgumentError(
                f"prefix_ids must have shape (1, m) with m >= 1, got {tuple(prefix_ids.shape)}"
            )
        cache = kv_cache.new_cache(self.target)
        m = prefix_ids.shape[1]
        self.target(prefix_ids.to(self.target.device), past_key_values=cache, use_cache=True, logits_to_keep=1)
        kv_cache.rollback(cache, m, m)  # trims sliding layers, as after every forward
        return cache

    def generate(
        self,
        input_ids: torch.Tensor | list[int],
        config: GenerationConfig | None = None,
        *,
        prompt_cache: DynamicCache | None = None,
    ) -> GenerationResult:
        """Run a generation to the end. Same arguments and errors as ``stream``."""
        stream = self.stream(input_ids, config, prompt_cache=prompt_cache)
        for _ in stream:
            pass
        text = self.tokenizer.decode(stream.token_ids, skip_special_tokens=True) if self.tokenizer else ""
        return GenerationResult(stream.token_ids, text, stream.finish_reason, stream.stats, stream.logprobs)
