"""Method ``llama-cpp``: the target's own GGUF file run by llama.cpp, target-only — a reference column.

A CPU user who does not speculate runs the quantized GGUF file with llama.cpp. This
method times exactly that next to specdecode's methods: the same GGUF file the target
was de-quantized from, the same prompt token ids (our tokenizer and chat template, fed
as ids, so llama.cpp tokenizes nothing), the same EOS ids and ``max_new_tokens``, as
many threads as torch uses (``torch.get_num_threads()``), and the same timing as
the other runners (``time.perf_counter`` around one whole generation, prompt
evaluation included). Greedy decoding takes llama.cpp's greedy sampler (argmax) after
neutral samplers only (repeat/frequency/presence penalties off); at temperature > 0,
llama.cpp samples at that temperature with top-k, top-p, min-p and typical-p off,
seeded with the prompt's seed (its random stream differs from torch's, so
sampled outputs are not comparable token by token).

It is a reference, never a speedup baseline (``specdecode.bench.report``): it runs
quantized Q4 kernels, so it is a different model from the de-quantized target and
its greedy tokens may differ from ours. The report puts our tok/s next to its.

With the target itself run by llama.cpp (``SpeculativeGenerator.from_pretrained(backend="llama-cpp")``,
``specdecode bench --backend llama-cpp``) both run the same file: the reference then takes the
target's file, threads and KV cache type (``backend_model``), and the report gives each method's
agreement with its greedy tokens (``exact_match_rate_vs_llama_cpp``).

llama-cpp-python is an optional extra (``pip install 'specdecode[llamacpp]'``, built
from source) and is imported only here, when the method is built.

Source: llama-cpp-python (https://github.com/abetlen/llama-cpp-python), ``Llama.eval``
and ``Llama.generate`` on token ids.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from specdecode import pipeline
from specdecode.bench.report import LLAMA_CPP as METHOD
from specdecode.bench.report import LLAMA_CPP_LOOKUP
from specdecode.bench.settings import BenchSettings
from specdecode.errors import InvalidArgumentError, UnsupportedModelError
from specdecode.models import OFFLINE_MODELS
from specdecode.models import llama_cpp as models_llama_cpp

if TYPE_CHECKING:
    from specdecode.bench.methods import PromptPrefix

logger = logging.getLogger(__name__)

INSTALL = models_llama_cpp.INSTALL
CONTEXT_STEP = 4096  # n_ctx grows in steps of this many tokens (KV cache memory: only what the prompts need)


def import_llama_cpp(method: str = METHOD):
    """The ``llama_cpp`` module, for ``method`` (``llama-cpp`` or ``llama-cpp-lookup``).

    Raises:
        InvalidArgumentError: llama-cpp-python is not installed (the message names the extra).
    """
    return models_llama_cpp.import_llama_cpp(f"method {method!r}", f", or leave {method!r} out")


def gguf_file(spec: str, cache_dir: str | Path | None = None, method: str = METHOD) -> Path:
    """The GGUF file a target spec names: an offline model's assembled file, or a ``.gguf`` path.

    Args:
        spec: A target spec (``specdecode.models.load_model``).
        cache_dir: Where offline models are assembled (default ``default_cache_dir()``).

    Raises:
        InvalidArgumentError: ``spec`` is not a GGUF file (a model folder, a hub id, or a
            model loaded without its file name).
        ModelNotFoundError: The ``.gguf`` file does not exist, or an offline model's chunk
            packages are not installed.
        ChecksumMismatchError: An assembled offline model fails its sha256.
    """
    return models_llama_cpp.gguf_path(spec, cache_dir, user=f" for method {method!r}", not_gguf=(
        f"method {method!r} runs the target's GGUF file, but target {spec!r} is not a GGUF file; use an offline "
        f"model ({', '.join(OFFLINE_MODELS)}) or a .gguf path as the target (API: BenchSettings(gguf_file=...)), "
        f"or leave {method!r} out"
    ))


def backend_model(generator: pipeline.SpeculativeGenerator):
    """The ``LlamaCppModel`` that runs ``generator``'s target (backend "llama-cpp"), or None (a torch target)."""
    if getattr(generator, "backend", "torch") != "llama-cpp":
        return None
    return generator.target.model.model


def check_available(spec: str, cache_dir: str | Path | None = None, method: str = METHOD) -> Path:
    """``gguf_file(spec, cache_dir)`` once llama-cpp-python is known to import: the checks of
    ``LlamaCppRunner``, early.

    Raises:
        InvalidArgumentError, ModelNotFoundError, ChecksumMismatchError: As ``gguf_file`` and
            ``import_llama_cpp``.
    """
    if spec not in OFFLINE_MODELS:
        gguf_file(spec, cache_dir, method)  # the cheap checks (not a GGUF, missing file) before the import
    import_llama_cpp(method)
    return gguf_file(spec, cache_dir, method)


class LlamaCppRunner:
    """Times one llama.cpp generation of the target's GGUF file (the bench's runner interface).

    The model is loaded once (``llama_cpp.Llama``, ``logits_all=False``); its context grows
    (a reload, outside the timing) when a prompt + ``max_new_tokens`` does not fit. With a target
    run by llama.cpp (backend "llama-cpp") it runs in that target's own ``Llama`` instead
    (``shares_target_context``), taking the context over for each generation as a new prefill does.

    Args:
        generator: Gives the EOS ids and, unless ``settings.gguf_file`` is set, the target
            spec (an offline model name) whose GGUF file is run. A target run by llama.cpp
            (backend "llama-cpp") gives its file, threads and KV cache type instead.
        settings: The run's settings (temperature, banned words, ``gguf_file``).

    Raises:
        InvalidArgumentError: Banned words (llama.cpp cannot match them), a target that is not
            a GGUF file, llama-cpp-python not installed, or (backend "llama-cpp") a ``gguf_file``
            other than the one the target runs.
        ModelNotFoundError, ChecksumMismatchError: As ``gguf_file``.
        UnsupportedModelError: llama.cpp cannot load the file.
    """

    kind = "llama.cpp"
    supports_prompt_cache = True
    name = METHOD
    #: With backend "llama-cpp", run in the target's own ``llama_cpp.Llama`` (``LlamaCppModel``): the same
    #: weights in memory and the same context as our methods. Two loaded copies of one file did not run
    #: alike: on a 2-core Xeon with AMX (2026-11-27, Qwen2.5-Coder 1.5B Q4_K_M, 2 threads), llama.cpp's own
    #: ``Llama.generate`` took 65.2-65.6 ms a token in the copy loaded first and 61.0-61.8 in the one loaded
    #: second, and the reverse with the load order reversed (61.3-61.6 against 64.1-64.5), so a second copy
    #: made the reference about 6% faster than the very same forwards in our target's copy.
    shares_target_context = True
    context_step = CONTEXT_STEP  # the context grows in steps of this many positions
    context_margin = 0  # positions past prompt + max_new_tokens that a generation may evaluate

    def __init__(self, generator: pipeline.SpeculativeGenerator, settings: BenchSettings) -> None:
        if settings.banned_words:
            raise InvalidArgumentError(
                f"method {self.name!r} cannot ban words (llama.cpp samples token ids); leave it out of a run with "
                "banned words"
            )
        self.settings = settings
        backend = backend_model(generator)
        self.kv_cache_type: str | None = None  # None: llama.cpp's default (f16)
        if backend is None:
            self.path = check_available(settings.gguf_file or generator.target.name, generator.cache_dir, self.name)
            self.n_threads = torch.get_num_threads()
        else:  # the file our methods' target runs, with its threads and KV cache: the same model, timed alike
            if getattr(backend, "path", None) is None:
                raise InvalidArgumentError(f"method {self.name!r} runs the target's GGUF file, but the target's "
                                           f"llama.cpp model {getattr(backend, 'name', '?')!r} names none")
            self.path = Path(backend.path)
            given = settings.gguf_file and check_available(settings.gguf_file, generator.cache_dir, self.name)
            if given and Path(given).resolve() != self.path.resolve():
                raise InvalidArgumentError(
                    f"method {self.name!r} runs the GGUF file the target runs with backend 'llama-cpp' "
                    f"({self.path}), but gguf_file is {settings.gguf_file!r} ({given}); leave gguf_file unset"
                )
            self.n_threads = int(backend.n_threads)
            self.kv_cache_type = backend.kv_cache_type
        self.llama_cpp = import_llama_cpp(self.name)
        self.eos = frozenset(pipeline.eos_token_ids(generator.target))
        self._own = None  # this runner's own Llama (None while shared)
        # backend "llama-cpp": the target's own llama.cpp context (weights and KV cache), not a second copy
        self._shared = backend if backend is not None and self.shares_target_context else None
        if self._shared is None:
            self._load(self.context_step)

    @property
    def llm(self):
        """The ``llama_cpp.Llama`` it generates with: the target's current one when shared (the target's
        prefill may grow its context, which loads a new one and frees the old), else its own."""
        return self._shared._llm if self._shared is not None else self._own

    def _load(self, n_ctx: int) -> None:
        if self._own is not None:
            self._own.close()
            self._own = None
        logger.info("llama.cpp: loading %s (n_ctx %d, %d threads)", self.path, n_ctx, self.n_threads)
        try:
            self._own = self.llama_cpp.Llama(
                model_path=str(self.path), n_ctx=n_ctx, n_threads=self.n_threads,
                n_threads_batch=self.n_threads, n_gpu_layers=0, verbose=False,
                **{"logits_all": False, **self._llama_options()},
            )
        except ValueError as e:
            raise UnsupportedModelError(f"llama.cpp cannot load GGUF file {self.path}: {e}") from e

    def _llama_options(self) -> dict[str, Any]:
        """More ``llama_cpp.Llama`` arguments (target only: the KV cache type of a target run by llama.cpp)."""
        if self.kv_cache_type is None:
            return {}
        kv = self.llama_cpp.GGML_TYPE_F32 if self.kv_cache_type == "f32" else self.llama_cpp.GGML_TYPE_F16
        return {"type_k": kv, "type_v": kv}

    @property
    def n_ctx(self) -> int:
        return int(self.llm.n_ctx())

    def sampling(self) -> dict[str, Any]:
        """The ``Llama.generate`` sampler arguments: greedy (argmax) or plain temperature sampling."""
        neutral = {"top_p": 1.0, "min_p": 0.0, "typical_p": 1.0, "repeat_penalty": 1.0,
                   "frequency_penalty": 0.0, "presence_penalty": 0.0, "mirostat_mode": 0}
        if self.settings.greedy:
            return {**neutral, "temp": 0.0, "top_k": 1}
        return {**neutral, "temp": self.settings.temperature, "top_k": 0}

    def describe(self) -> dict:
        info = self.llama_cpp.llama_print_system_info()
        return {
            "kind": self.kind,
            "description": "llama.cpp (llama-cpp-python), the target's GGUF file, target only; a reference, "
            "not a speedup baseline",
            "gguf_file": str(self.path),
            "llama_cpp_python": getattr(self.llama_cpp, "__version__", None),
            "n_threads": self.n_threads,
            "kv_cache_type": self.kv_cache_type or "f16",
            "n_ctx": self.n_ctx,
            "n_batch": self.llm.n_batch,
            "sampling": self.sampling(),
            "system_info": info.decode(errors="replace").strip() if isinstance(info, bytes) else info,
        }

    def _prepare(self, ids: Sequence[int], max_new_tokens: int) -> None:
        """Check the ids against the GGUF vocabulary and grow the context if needed (untimed)."""
        vocab = int(self.llm.n_vocab())
        bad = next((t for t in ids if not 0 <= t < vocab), None)
        if bad is not None:
            raise InvalidArgumentError(
                f"prompt token id {bad} is outside the vocabulary of {self.path} ({vocab} tokens); the target's "
                "tokenizer must come from the same GGUF file"
            )
        needed = len(ids) + max_new_tokens + self.context_margin
        if self._shared is not None:  # the target's context: this generation takes it over (its caches refuse)
            self._shared.take_over(needed)
        elif needed > self.n_ctx:
            self._load(self.context_step * math.ceil(needed / self.context_step))

    def __call__(
        self, input_ids: torch.Tensor, max_new_tokens: int, seed: int, prefix: PromptPrefix | None = None
    ) -> dict:
        """Generate from ``input_ids`` (1, n) until an EOS id or ``max_new_tokens`` tokens.

        With ``prefix`` (its m = n - 1 tokens), llama.cpp evaluates those m tokens outside
        the timing, as the other runners start from a copy of the prompt cache; else the
        whole prompt is evaluated inside it.

        Returns:
            The bench record fields (``token_ids`` with the EOS token included, ``seconds``;
            one target forward per token, no drafting).
        """
        ids = [int(t) for t in input_ids[0].tolist()]
        self._prepare(ids, max_new_tokens)
        llm = self.llm
        llm.reset()  # n_tokens = 0: the next eval drops the whole KV cache (no prefix reuse across calls)
        if not self.settings.greedy:
            llm.set_seed(seed)
        m = prefix.num_tokens if prefix is not None else 0
        if m:
            llm.eval(ids[:m])  # untimed, like the other runners' prompt-cache copy
        tokens: list[int] = []
        first_token_s = None
        finish = "length"
        self._start_counting(llm)
        try:
            t0 = time.perf_counter()
            stream = llm.generate(ids[m:], reset=False, **self.sampling())
            for token in stream:
                tokens.append(int(token))
                if first_token_s is None:
                    first_token_s = time.perf_counter() - t0
                if token in self.eos:
                    finish = "eos"
                    break
                if len(tokens) >= max_new_tokens:
                    break
            seconds = time.perf_counter() - t0
            stream.close()
        finally:
            self._stop_counting(llm)
        n = len(tokens)
        return self._counts(llm, n) | {
            "token_ids": tokens,
            "seconds": seconds,
            "finish_reason": finish,
            "prefill_s": first_token_s,
        }

    def _start_counting(self, llm) -> None:
        """Before the timed generation: nothing to count for target-only decoding."""

    def _stop_counting(self, llm) -> None:
        """After the timed generation, also when it raised: undo ``_start_counting``."""

    def _counts(self, llm, n: int) -> dict:
        """The record's forward and draft counts after a generation of ``n`` tokens."""
        return {
            "target_forwards": n,  # the prompt evaluation gives the first token, one eval per later token
            "verify_tokens": max(n - 1, 0),  # τ = 1 as for autoregressive: the prompt's token excluded
            "verify_forwards": max(n - 1, 0),
            "drafted": 0,
            "accepted": 0,
            "draft_forwards": None,
            "drafted_by_position": None,
            "accepted_by_position": None,
            "final_draft_threshold": None,
            "gated_steps": None,
            "banned_word_rollbacks": None,
            "banned_word_discarded_tokens": None,
        }


class LlamaCppLookupRunner(LlamaCppRunner):
    """``llama-cpp-lookup``: llama-cpp-python's own prompt-lookup speculation on the target's GGUF file.

    A CPU user who knows llama-cpp-python would try ``Llama(draft_model=LlamaPromptLookupDecoding())``
    before anything else, so it is a reference column like ``llama-cpp``: the same file, prompt
    ids, EOS ids, ``max_new_tokens``, sampler settings, threads and timing (``LlamaCppRunner``),
    never a speedup baseline. Its settings: ``num_pred_tokens=2`` (llama-cpp-python's README:
    10 "is the default and generally good for gpu, 2 performs better for cpu-only machines")
    and ``max_ngram_size=2`` (its default). A ``draft_model`` turns llama-cpp-python's
    ``logits_all`` on, so every evaluated position's logits are copied to its scores array, as
    its users get.

    The record's counts come from its ``Llama.eval`` calls in the timed generation (the
    first evaluates the prompt, each later one verifies the pending token and a draft):
    ``drafted`` = the draft tokens fed, ``accepted`` = new tokens - 1 - verifying forwards
    (each verifying forward gives one token that is not a draft's; slightly low when
    ``max_new_tokens`` cuts the last block). At temperature > 0 llama-cpp-python samples each
    position and keeps drafted tokens equal to the samples (not distribution-exact).

    Source: llama-cpp-python's ``llama_speculative.LlamaPromptLookupDecoding`` and
    ``Llama.generate`` (https://github.com/abetlen/llama-cpp-python), after Saxena's prompt
    lookup decoding (https://github.com/apoorvumang/prompt-lookup-decoding).
    """

    kind = "llama.cpp prompt lookup"
    name = LLAMA_CPP_LOOKUP
    shares_target_context = False  # its own Llama: a draft_model and logits_all=True are set at load
    NUM_PRED_TOKENS = 2
    MAX_NGRAM_SIZE = 2
    # logits_all=True sizes llama-cpp-python's scores array to n_ctx rows of V floats (Qwen2.5's V:
    # 0.6 GB a 1,024 positions), so the context grows in small steps; a drafted block may run past
    # max_new_tokens.
    context_step = 512
    context_margin = NUM_PRED_TOKENS + 1

    def _llama_options(self) -> dict[str, Any]:
        """The lookup drafter, and ``logits_all=True``: with a ``draft_model`` llama-cpp-python evaluates
        with every position's logits but sizes its scores array from the ``logits_all`` it was given
        (n_batch rows when False), so a prompt longer than n_batch (512) failed in ``Llama.eval``
        ("could not broadcast ... into shape (0,)", llama-cpp-python 0.3.36, ``Llama.__init__``)."""
        lookup = self.llama_cpp.llama_speculative.LlamaPromptLookupDecoding(
            max_ngram_size=self.MAX_NGRAM_SIZE, num_pred_tokens=self.NUM_PRED_TOKENS)
        return {**super()._llama_options(), "draft_model": lookup, "logits_all": True}

    def describe(self) -> dict:
        return {
            **super().describe(),
            "description": "llama.cpp (llama-cpp-python) with its own prompt-lookup speculation "
            "(LlamaPromptLookupDecoding), the target's GGUF file; a reference, not a speedup baseline",
            "num_pred_tokens": self.NUM_PRED_TOKENS,
            "max_ngram_size": self.MAX_NGRAM_SIZE,
        }

    def _start_counting(self, llm) -> None:
        evals: list[int] = []
        self._evals = evals
        original = type(llm).eval

        def counting_eval(tokens):
            evals.append(len(tokens))
            return original(llm, tokens)

        llm.eval = counting_eval  # Llama.generate calls self.eval: the instance's attribute comes first

    def _stop_counting(self, llm) -> None:
        llm.__dict__.pop("eval", None)  # back to the class's method

    def _counts(self, llm, n: int) -> dict:
        verify = self._evals[1:]  # the first eval is the prompt's (or its last token's)
        drafted = sum(w - 1 for w in verify)
        return {
            **super()._counts(llm, n),
            "target_forwards": len(self._evals),
            "verify_tokens": max(n - 1, 0),
            "verify_forwards": len(verify),
            "drafted": drafted,
            "accepted": min(drafted, max(n - 1 - len(verify), 0)),
        }
