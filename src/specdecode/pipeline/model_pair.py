"""The models of a ``SpeculativeGenerator``: loading the target and draft pair, and what is derived
from the draft model's files.

``ModelPair`` holds the loaded target (a transformers model, or its GGUF file in llama.cpp), the
optional torch draft and the llama.cpp draft (loaded on first use), and makes from them what the
drafters need: the llama.cpp draft and its one-sequence runner, the draft's truncated LM head
(FR-Spec, ``draft_vocab_size``) and its token frequencies. ``ModelPair.from_pretrained`` loads a
pair with its quantization. The decoders built on a pair are ``specdecode.pipeline.generator``'s.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Self

import torch

from specdecode.defaults import DEFAULT_DRAFT, DEFAULT_TARGET, DRAFT_BACKENDS, eos_token_ids
from specdecode.drafters.datastore import NgramDatastore, load_or_build
from specdecode.drafters.draft_head import DraftHead
from specdecode.errors import InvalidArgumentError
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
from specdecode.models.registry import OFFLINE_MODELS, default_cache_dir
from specdecode.models.token_frequencies import TokenFrequencies, load_or_count, special_token_ids

logger = logging.getLogger(__name__)


class ModelPair:
    """A target model, an optional draft model, and what is derived from their files (the base of
    ``SpeculativeGenerator``, which builds the decoders on them).

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
        self._token_frequencies: TokenFrequencies | None = None
        self._datastores: dict[str, NgramDatastore] = {}  # prompt lookup's, by corpus
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
    ) -> Self:
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

    def datastore(self, corpus: str | Path) -> NgramDatastore:
        """Prompt lookup's datastore of ``corpus`` (``drafters.datastore.corpus_files``) in the target's tokens,
        made once per generator and corpus, its arrays cached in the cache folder's ``datastore``.

        Raises:
            InvalidArgumentError: As ``drafters.datastore.load_or_build``.
        """
        key = str(corpus)
        if key not in self._datastores:
            tok = self.tokenizer
            self._datastores[key] = load_or_build(  # a special token's text in the corpus is text, not the token
                corpus, lambda text: tok(text, add_special_tokens=False, split_special_tokens=True)["input_ids"],
                f"{type(tok).__name__}|{getattr(tok, 'name_or_path', '')}|{len(tok)}",
                self.cache_dir if self.cache_dir is not None else default_cache_dir())
        return self._datastores[key]

    def _draft_dense_folder(self) -> Path | None:
        """The dense-cache folder of the draft model, or None (a folder or hub model has none)."""
        folder = self.draft.dense_folder
        return folder if folder is not None and dense_cache_valid(folder) else None


__all__ = ["ModelPair"]
