"""A model run by llama.cpp: ``LlamaCppModel`` and ``LlamaCppCache`` (its runner: ``llama_cpp_target``).

On a CPU the draft model's step is most of a speculative round's cost. llama.cpp runs
the draft's own GGUF file (Q4_K_M for the offline models) with its quantized kernels:
measured on a 2-core EPYC with avx512_bf16 (torch 2.13, llama-cpp-python 0.3.36, 2
threads, 200 tokens of context; docs/benchmarks/llama_cpp_forward_cost.py and
forward_cost.py), one token of the Qwen2.5-Coder 0.5B costs 21.5 ms there against 27.6 ms
for specdecode's own int4 draft with its int4 head (``specdecode.models.quantize``). The
target stays a transformers model; the draft only proposes and the target verifies
every token, so the output is unchanged (greedy: exactly the target's; sampling: the
target's distribution, with the draft's q taken from llama.cpp's logits).

llama.cpp's forward over several tokens grows with every token on that machine (the 0.5B:
21.5, 38.5, 48.5, 83.8 ms for 1, 2, 4, 8 tokens; the 1.5B: 32.7, 56.0, 91.7, 215.0 ms), where
torch's bf16 forward barely grows (1.5B: 247, 211, 260, 278 ms), so it is a draft model here, not a
target to verify with. The target must be on the CPU too (the drafts are CPU tensors).

``models.llama_cpp_target.LlamaCppTargetRunner`` runs a model's forwards for the round, one
sequence addressed by position, for a target or a draft. A rollback removes the rejected
positions from llama.cpp's KV cache (``llama_memory_seq_rm``); nothing is recomputed.

A model holds one llama.cpp context, so one generation at a time: a new prefill takes the
context over, and the older generation's cache then refuses every forward and rollback.
Models whose memory cannot drop positions (recurrent or hybrid architectures) are refused.

llama-cpp-python is an optional extra (``pip install 'specdecode[llamacpp]'``, built from
source), imported only when a ``LlamaCppModel`` is made.

Source: llama.cpp's C API through llama-cpp-python (https://github.com/abetlen/llama-cpp-python):
``Llama`` loads the file and owns the context; ``llama_batch_init``, ``llama_decode``,
``llama_get_logits_ith`` and ``llama_memory_seq_rm`` run the forwards and the rollback.
"""

from __future__ import annotations

import logging
import math
import re
import sys
from pathlib import Path

import numpy as np
import torch

from specdecode.errors import InvalidArgumentError, ModelNotFoundError, UnsupportedModelError, VocabularyMismatchError
from specdecode.models.gguf import assemble_gguf
from specdecode.models.loading import LoadedModel, load_model, resolve_device
from specdecode.models.registry import OFFLINE_MODELS

logger = logging.getLogger(__name__)

INSTALL = "pip install 'specdecode[llamacpp]'"
#: The context (KV cache positions) grows in steps of this many tokens.
CONTEXT_STEP = 4096
_SPM_SPACE = "\u2581"  # SentencePiece's word-boundary mark "▁"
#: Most tokens per ``llama_decode`` call; a longer prefill runs in chunks of this many.
BATCH = 512
#: The KV cache's element types (``LlamaCppModel(kv_cache_type=...)``): llama.cpp's default f16, or f32.
KV_CACHE_TYPES = ("f16", "f32")


def import_llama_cpp(purpose: str, alternative: str = ""):
    """The ``llama_cpp`` module.

    Args:
        purpose: What needs it, for the error message (e.g. "method 'llama-cpp'").
        alternative: Appended to the message (e.g. ", or leave 'llama-cpp' out").

    Raises:
        InvalidArgumentError: llama-cpp-python is not installed (the message names the extra), or its
            build crashes on this CPU (``why_llama_cpp_build_crashes``; the message gives the rebuild).
    """
    try:
        import llama_cpp
    except ImportError as e:
        raise InvalidArgumentError(
            f"{purpose} needs llama-cpp-python, which is not installed ({e}); install it with: {INSTALL} "
            f"(it builds llama.cpp from source: cmake and a C++ compiler){alternative}"
        ) from None
    why = why_llama_cpp_build_crashes(llama_cpp.llama_print_system_info().decode(errors="replace"), cpu_flags(),
                                      getattr(llama_cpp, "__version__", ""))
    if why is not None:
        raise InvalidArgumentError(f"{purpose} cannot run on this llama-cpp-python build: {why}{alternative}")
    return llama_cpp


#: CMAKE_ARGS that build llama.cpp for this CPU ("native") without its AMX kernels (x86-64, gcc or clang).
CMAKE_ARGS_WITHOUT_AMX = ('-DGGML_NATIVE=ON "-DCMAKE_C_FLAGS=-mno-amx-tile -mno-amx-int8 -mno-amx-bf16" '
                          '"-DCMAKE_CXX_FLAGS=-mno-amx-tile -mno-amx-int8 -mno-amx-bf16"')


def cpu_flags() -> frozenset[str]:
    """This CPU's feature flags from ``/proc/cpuinfo`` (Linux; empty elsewhere or when unreadable)."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as f:
            for line in f:
                if line.startswith("flags"):
                    return frozenset(line.partition(":")[2].split())
    except OSError:
        pass
    return frozenset()


def why_llama_cpp_build_crashes(system_info: str, flags: frozenset[str], version: str = "") -> str | None:
    """Why this llama.cpp build cannot run here, or None: built with its AMX kernels (``system_info``,
    ``llama_print_system_info()``, says "AMX_INT8 = 1", as ``GGML_NATIVE=ON`` gives on an AMX CPU) on a CPU
    with AMX (``flags``, ``cpu_flags()``: "amx_int8"), where llama.cpp puts quantized weights in its AMX
    buffers. Measured on a 2-core Xeon with AMX (2026-11-27, llama-cpp-python 0.3.36): the first
    ``llama_decode`` of the Q4_K_M Qwen2.5-Coder 1.5B crashed the process (segmentation fault), in
    llama-cpp-python's own ``Llama.eval`` as in ours; built without the AMX kernels
    (``CMAKE_ARGS_WITHOUT_AMX``) it ran (llama.cpp issue 20824 reports the same crash in
    ``ggml_backend_amx_mul_mat``). A build with AMX on a CPU without it never uses those kernels.
    ``version``: llama-cpp-python's, pinned in the rebuild command the message gives. The refusal covers
    every GGUF file, also float32 and float16 ones, which the AMX kernels do not take."""
    built_with_amx = re.search(r"\bAMX_INT8\s*=\s*1\b", system_info) is not None
    if not (built_with_amx and "amx_int8" in flags):
        return None
    return ("it was built with llama.cpp's AMX kernels (AMX_INT8 = 1) and this CPU has AMX, where llama.cpp's AMX "
            "matrix multiply crashes the process on quantized GGUF files (a segmentation fault at the first forward, "
            f"llama.cpp issue 20824); rebuild it without them: CMAKE_ARGS='{CMAKE_ARGS_WITHOUT_AMX}' {sys.executable} -m "
            f"pip install --force-reinstall --no-deps --no-cache-dir llama-cpp-python{'==' + version if version else ''}")


def gguf_path(spec: str, cache_dir: str | Path | None = None, *, user: str = "", not_gguf: str | None = None) -> Path:
    """The GGUF file a model spec names: an offline model's assembled file, or a ``.gguf`` path.

    Args:
        spec: A model spec (``specdecode.models.load_model``).
        cache_dir: Where offline models are assembled (default ``default_cache_dir()``).
        user: Who needs the file, appended to the missing-file message (e.g. " for method 'llama-cpp'").
        not_gguf: The message when ``spec`` is not a GGUF file (default: the llama.cpp draft's).

    Raises:
        InvalidArgumentError: ``spec`` is a model folder or hub id (llama.cpp reads GGUF files only).
        ModelNotFoundError: The ``.gguf`` file does not exist, or an offline model's chunk packages
            are not installed.
        ChecksumMismatchError: An assembled offline model fails its sha256.
    """
    if spec in OFFLINE_MODELS:
        return assemble_gguf(OFFLINE_MODELS[spec], Path(cache_dir) if cache_dir is not None else None)
    if isinstance(spec, str) and spec.endswith(".gguf"):
        path = Path(spec).expanduser()
        if not path.is_file():
            raise ModelNotFoundError(f"GGUF file {spec!r}{user} does not exist")
        return path.resolve()
    raise InvalidArgumentError(not_gguf or (
        f"the llama.cpp backend runs GGUF files, but the draft model {spec!r} is not one; use an offline model "
        f"({', '.join(OFFLINE_MODELS)}) or a .gguf path, or the torch backend"
    ))


def check_llama_cpp_draft_options(draft: str | None, quantize: str, draft_quantize: str | None,
                                  draft_quantize_head: str | None, quantize_group_size: int | None) -> None:
    """Refuse the options that ``SpeculativeGenerator.from_pretrained`` cannot apply to a llama.cpp draft.

    Raises:
        InvalidArgumentError: No ``draft``; ``draft_quantize`` or ``draft_quantize_head`` given (the
            draft keeps its GGUF file's quantization); ``quantize_group_size`` without an int4
            target.
    """
    given = [f"{name}={value!r}" for name, value in (("draft_quantize", draft_quantize),
                                                     ("draft_quantize_head", draft_quantize_head)) if value is not None]
    if given:
        raise InvalidArgumentError(
            f"{' and '.join(given)} quantize a torch draft; with draft_backend='llama-cpp' the draft runs its GGUF "
            "file's own quantization: leave them out"
        )
    if not draft:
        raise InvalidArgumentError("draft_backend='llama-cpp' needs a draft model (an offline model or a .gguf file)")
    if quantize_group_size is not None and quantize != "int4":
        raise InvalidArgumentError(
            f"quantize_group_size={quantize_group_size!r} applies to int4 weights, but the target is "
            f"quantize={quantize!r} and the llama.cpp draft keeps its GGUF file's quantization; leave "
            "quantize_group_size out"
        )


def check_cpu_target(device: torch.device | str) -> None:
    """Raise unless the target runs on the CPU: a llama.cpp draft gives CPU tensors.

    Raises:
        InvalidArgumentError: Naming the target's device.
    """
    if torch.device(device).type != "cpu":
        raise InvalidArgumentError(
            f"the llama.cpp draft runs on the CPU, so the target must too, but it is on {device}; use device='cpu' "
            "(--device cpu) or the torch draft backend"
        )


def load_llama_cpp_model(spec: str, tokenizer, cache_dir: str | Path | None = None, *,
                         n_threads: int | None = None, name: str | None = None) -> LlamaCppModel:
    """A draft model for the llama.cpp backend: ``spec``'s GGUF file, checked against the target's tokenizer.

    Args:
        spec: An offline model name or a ``.gguf`` path.
        tokenizer: The target's tokenizer: every one of its ids must be the same token in the file.
        cache_dir, n_threads, name: As ``gguf_path`` and ``LlamaCppModel`` (name: default ``spec``).

    Raises:
        InvalidArgumentError, ModelNotFoundError, ChecksumMismatchError: As ``gguf_path``; also
            llama-cpp-python not installed.
        UnsupportedModelError: llama.cpp cannot load the file.
        VocabularyMismatchError: A token id means another token in the file, or the file has fewer
            tokens than the tokenizer.
    """
    model = LlamaCppModel(gguf_path(spec, cache_dir), n_threads=n_threads, name=name or spec)
    model.check_vocabulary(tokenizer)
    return model


def load_with_llama_cpp_draft(target: str, draft: str | None, *, dtype, device, cache_dir, quantize: str,
                              draft_quantize: str | None, draft_quantize_head: str | None,
                              quantize_group_size: int | None, prepack_linears: bool | None = None,
                              ) -> tuple[LoadedModel, LlamaCppModel]:
    """The target (``load_model``) and a llama.cpp draft, for ``SpeculativeGenerator.from_pretrained``.

    Every check that needs no model runs first (the options, the device, the draft's GGUF
    file, llama-cpp-python's import), so a bad one fails before the target's load.

    Raises:
        InvalidArgumentError: ``check_llama_cpp_draft_options``, ``check_cpu_target``, ``gguf_path``,
            ``import_llama_cpp``, and ``load_model``'s own.
        ModelNotFoundError, ChecksumMismatchError, UnsupportedModelError, VocabularyMismatchError:
            As ``load_model`` and ``load_llama_cpp_model``.
    """
    check_llama_cpp_draft_options(draft, quantize, draft_quantize, draft_quantize_head, quantize_group_size)
    check_cpu_target(device if isinstance(device, torch.device) else resolve_device(device))
    path = gguf_path(draft, cache_dir)
    import_llama_cpp(f"the llama.cpp draft model {draft!r}")
    t = load_model(target, dtype=dtype, device=device, cache_dir=cache_dir, quantize=quantize,
                   quantize_group_size=quantize_group_size, prepack_linears=prepack_linears)
    return t, load_llama_cpp_model(str(path), t.tokenizer, name=draft)


class LlamaCppModel:
    """A GGUF file loaded by llama.cpp, run one sequence at a time on the CPU.

    Args:
        path: The ``.gguf`` file.
        n_threads: llama.cpp's threads (default: ``torch.get_num_threads()``, as the target's).
        name: For messages (default: the file name).
        role: What it is, for messages: "draft model" (default) or "target model".
        kv_cache_type: The KV cache's keys and values: "f16" (llama.cpp's default) or "f32" (a
            float32 GGUF file then computes in float32 throughout: the exactness tests).

    Attributes:
        path, name, n_threads, role, kv_cache_type: As given.
        vocab_size: V, the width of its logits (the GGUF vocabulary).
        n_ctx_train: The positions it was trained for (the GGUF file's context length).
        n_ctx: Positions its current context holds (grows in ``CONTEXT_STEP``s).
        device: Always ``torch.device("cpu")``; logits are float32 on the CPU.

    Raises:
        InvalidArgumentError: llama-cpp-python is not installed, or an unknown ``kv_cache_type``.
        ModelNotFoundError: ``path`` does not exist.
        UnsupportedModelError: llama.cpp cannot load the file.
    """

    device = torch.device("cpu")
    dtype = torch.float32

    def __init__(self, path: str | Path, *, n_threads: int | None = None, name: str | None = None,
                 role: str = "draft model", kv_cache_type: str = "f16") -> None:
        self._llm = self._batch = None  # set first: ``close`` runs even when loading fails
        self.role = role
        if kv_cache_type not in KV_CACHE_TYPES:
            raise InvalidArgumentError(
                f"kv_cache_type must be one of {', '.join(KV_CACHE_TYPES)}, got {kv_cache_type!r}"
            )
        self.kv_cache_type = kv_cache_type
        self.path = Path(path)
        if not self.path.is_file():
            raise ModelNotFoundError(f"GGUF file {str(path)!r} does not exist")
        if n_threads is not None and (isinstance(n_threads, bool) or not isinstance(n_threads, int) or n_threads < 1):
            raise InvalidArgumentError(f"n_threads must be an integer >= 1 (or None for torch's), got {n_threads!r}")
        self.name = name or self.path.name
        self.llama_cpp = import_llama_cpp(f"the llama.cpp {self.role} {self.name!r}")
        self.n_threads = n_threads if n_threads is not None else torch.get_num_threads()
        self.generation = 0  # the generation that owns the context (LlamaCppTargetRunner.prefill)
        self._load(CONTEXT_STEP)
        lib = self.llama_cpp
        model = self._llm.model
        if lib.llama_model_is_recurrent(model) or lib.llama_model_is_hybrid(model):
            self.close()
            raise UnsupportedModelError(
                f"the llama.cpp {self.role} {self.name!r} is recurrent or hybrid: its memory cannot drop rejected "
                "positions, which drafting needs; use a transformer GGUF file or the torch backend"
            )

    def _load(self, n_ctx: int) -> None:
        """Load the file with a context of ``n_ctx`` positions (a reload reads the weights again)."""
        logger.info("llama.cpp: loading %s (n_ctx %d, %d threads)", self.path, n_ctx, self.n_threads)
        kv = self.llama_cpp.GGML_TYPE_F32 if self.kv_cache_type == "f32" else self.llama_cpp.GGML_TYPE_F16
        try:
            llm = self.llama_cpp.Llama(
                model_path=str(self.path), n_ctx=n_ctx, n_batch=BATCH, n_ubatch=BATCH, n_threads=self.n_threads,
                n_threads_batch=self.n_threads, logits_all=False, n_gpu_layers=0, type_k=kv, type_v=kv,
                verbose=False,
            )
        except ValueError as e:
            raise UnsupportedModelError(
                f"llama.cpp cannot load GGUF file {self.path} with a context of {n_ctx} positions: {e}"
            ) from e
        self.close()  # the old context only once the new one exists: a failed reload keeps the model usable
        self._llm = llm
        self.n_ctx = int(llm.n_ctx())
        self.vocab_size = int(llm.n_vocab())
        self.n_ctx_train = int(self.llama_cpp.llama_model_n_ctx_train(llm.model))
        self.batch_size = BATCH  # the batch's and the context's n_batch, fixed at load
        self._batch = self.llama_cpp.llama_batch_init(self.batch_size, 0, 1)

    def close(self) -> None:
        """Free the context, the weights and the batch (a later forward reloads nothing: make a new model)."""
        if self._batch is not None:
            self.llama_cpp.llama_batch_free(self._batch)
            self._batch = None
        if self._llm is not None:
            self._llm.close()
            self._llm = None

    def __del__(self) -> None:  # the C allocations are not tracked by Python's memory
        if getattr(self, "_llm", None) is not None or getattr(self, "_batch", None) is not None:
            self.close()

    def check_vocabulary(self, tokenizer) -> None:
        """Raise unless each id of ``tokenizer`` is the same token text in the GGUF vocabulary.

        GGUF files converted from a transformers model keep its token strings (byte-level BPE
        symbols such as "Ġ"), so the texts compare directly, but for SentencePiece's "▁",
        which llama.cpp may give back as a space: both sides compare with "▁" as " ".

        Raises:
            VocabularyMismatchError: Naming the first id that differs, or the two sizes.
        """
        lib = self.llama_cpp
        vocab = lib.llama_model_get_vocab(self._llm.model)
        n = len(tokenizer)
        if n > self.vocab_size:
            raise VocabularyMismatchError(
                f"the llama.cpp {self.role} {self.name!r} has {self.vocab_size} tokens, fewer than the target "
                f"tokenizer's {n}; the draft model must use the target's tokenizer"
            )
        tokens = tokenizer.convert_ids_to_tokens(list(range(n)))
        for i, token in enumerate(tokens):
            text = lib.llama_vocab_get_text(vocab, i).decode("utf-8", errors="replace")
            if token is not None and text.replace(_SPM_SPACE, " ") != token.replace(_SPM_SPACE, " "):
                raise VocabularyMismatchError(
                    f"token id {i} is {text!r} in the llama.cpp {self.role} {self.name!r} and {token!r} in the "
                    "target's tokenizer; the draft model must use the target's tokenizer"
                )

    def end_of_sequence_ids(self) -> set[int]:
        """The GGUF vocabulary's end-of-sequence and end-of-turn token ids (those it names)."""
        lib = self.llama_cpp
        vocab = lib.llama_model_get_vocab(self._llm.model)
        ids = {int(lib.llama_vocab_eos(vocab)), int(lib.llama_vocab_eot(vocab))}
        return {i for i in ids if 0 <= i < self.vocab_size}

    def ensure_context(self, num_positions: int, cached: list[int]) -> None:
        """Grow the context to hold ``num_positions``, re-encoding the ``cached`` tokens (rare: a long sequence).

        Raises:
            InvalidArgumentError: ``num_positions`` exceeds the model's training context.
        """
        if num_positions <= self.n_ctx:
            return
        limit = self.n_ctx_train
        if num_positions > limit:
            raise InvalidArgumentError(
                f"the llama.cpp {self.role} {self.name!r} would need {num_positions} positions, past its training "
                f"context of {limit}"
            )
        logger.info("%s: the llama.cpp context grows past %d positions (reload, then %d cached tokens re-encoded)",
                    self.name, self.n_ctx, len(cached))
        self._load(min(limit, CONTEXT_STEP * math.ceil(num_positions / CONTEXT_STEP)))
        if cached:
            self.decode(cached, 0, 1)

    def decode(self, ids: list[int], first_position: int, logits_to_keep: int) -> torch.Tensor:
        """One forward over ``ids`` at positions ``first_position ..``, appended to the KV cache.

        Args:
            ids: w >= 1 token ids (fed in chunks of ``batch_size``, ``BATCH`` at load).
            first_position: The position of ``ids[0]``: the positions the KV cache holds.
            logits_to_keep: Rows of logits to return, for the last ones of ``ids`` (1..w).

        Returns:
            (logits_to_keep, V) float32 logits, a fresh tensor.

        Raises:
            InvalidArgumentError: No ids, a token id outside the GGUF vocabulary, or
                ``logits_to_keep`` out of range.
            UnsupportedModelError: ``llama_decode`` failed (its return code is named).
        """
        if not ids:
            raise InvalidArgumentError("a llama.cpp forward needs at least one token id, got none")
        lib, batch, ctx = self.llama_cpp, self._batch, self._llm.ctx
        bad = next((t for t in ids if not 0 <= t < self.vocab_size), None)
        if bad is not None:
            raise InvalidArgumentError(
                f"token id {bad} is outside the vocabulary of the llama.cpp {self.role} {self.name!r} "
                f"(0..{self.vocab_size - 1})"
            )
        w, size = len(ids), self.batch_size
        last_chunk = w - (w - 1) // size * size  # tokens in the last chunk, which holds every kept row
        if not 1 <= logits_to_keep <= last_chunk:
            raise InvalidArgumentError(
                f"logits_to_keep must be in 1..{last_chunk} for a forward over {w} tokens, got {logits_to_keep}"
            )
        for start in range(0, w, size):
            chunk = ids[start:start + size]
            first_kept = w - logits_to_keep - start  # index in this chunk of the first row returned
            batch.n_tokens = len(chunk)
            for i, token in enumerate(chunk):
                batch.token[i] = token
                batch.pos[i] = first_position + start + i
                batch.n_seq_id[i] = 1
                batch.seq_id[i][0] = 0
                batch.logits[i] = i >= first_kept
            rc = lib.llama_decode(ctx, batch)
            if rc != 0:
                raise UnsupportedModelError(f"llama.cpp's llama_decode returned {rc} for {self.name!r}")
        rows = np.empty((logits_to_keep, self.vocab_size), dtype=np.float32)
        for j in range(logits_to_keep):
            pointer = lib.llama_get_logits_ith(ctx, last_chunk - logits_to_keep + j)
            rows[j] = np.ctypeslib.as_array(pointer, shape=(self.vocab_size,))
        return torch.from_numpy(rows)

    def take_over(self, num_positions: int) -> int:
        """Start a new generation on this context: any older generation's cache refuses from now on
        (``LlamaCppCache.check_owner``), the KV cache is emptied and the context grown to hold
        ``num_positions`` (``ensure_context``). Returns the new generation's number.

        Raises:
            InvalidArgumentError: As ``ensure_context`` (past the model's training context).
            UnsupportedModelError: As ``remove_from``.
        """
        self.generation += 1
        self.remove_from(0)
        self.ensure_context(num_positions, [])
        return self.generation

    def remove_from(self, position: int) -> None:
        """Drop the KV cache's positions from ``position`` on.

        Raises:
            UnsupportedModelError: llama.cpp could not drop them.
        """
        memory = self.llama_cpp.llama_get_memory(self._llm.ctx)
        if not self.llama_cpp.llama_memory_seq_rm(memory, 0, position, -1):
            raise UnsupportedModelError(
                f"llama.cpp could not drop positions {position}.. of the {self.role} {self.name!r}'s memory"
            )


class LlamaCppCache:
    """What a runner knows of the llama.cpp context's KV cache (``llama_cpp_target.LlamaCppTargetRunner``).

    Attributes:
        tokens: The ids whose keys and values the context holds, in position order.
        generation: Which prefill made it: it may touch the model's context only while
            ``model.generation`` is the same.
    """

    def __init__(self, model: LlamaCppModel, generation: int) -> None:
        self.model = model
        self.generation = generation
        self.tokens: list[int] = []

    def check_owner(self) -> None:
        """Raise unless this cache's generation still owns the model's context.

        Raises:
            InvalidArgumentError: A later generation took it over.
        """
        if self.generation != self.model.generation:
            raise InvalidArgumentError(
                f"another generation started on the llama.cpp {self.model.role} {self.model.name!r} and took over its "
                "context; generations that share a llama.cpp draft model cannot be interleaved (finish a stream "
                "before starting the next)"
            )
