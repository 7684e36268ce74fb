"""A target model run by llama.cpp: ``LlamaCppTargetRunner``, one sequence addressed by position.

On a CPU a user's alternative to speculative decoding is plain llama.cpp on the quantized
GGUF file (issue 30): the target has to run where those kernels are. This runner gives a
decode loop what it needs of such a target, on one ``LlamaCppModel`` (``models.llama_cpp``):

* ``prefill(ids)``: the prompt at positions 0 .. n - 1 (the context taken over and emptied
  first), the logits after its last token;
* ``forward(ids, start, logits_to_keep)``: w tokens at positions ``start ..``, the logits at
  every position kept (verification reads all k + 1 of a drafted block); a ``start`` below the
  positions held first drops the positions from ``start`` on, so a rollback is implicit in the
  next forward, as in the batched engine's static cache (``engine.batch_runner.BatchRunner``);
* ``rollback(n)``: keep positions 0 .. n - 1 (``llama_memory_seq_rm``; nothing is recomputed);
* ``__call__(ids, starts, logits_to_keep)``: ``BatchRunner``'s call at one row, (1, w) ids and
  ``starts = [start]``, for the batched round at B = 1;
* ``measure_forward_costs(context_ids)``: seconds per forward at widths 1, 2, 4 and 8 (at
  warm-up, after a prompt-sized context), for the draft length per round
  (``engine.runner_target.measured_cost_policy``: the cost model, ``engine.speculation_cost``).

``load_llama_cpp_target`` loads it for ``SpeculativeGenerator.from_pretrained(backend="llama-cpp")``:
the target's GGUF file in llama.cpp and its tokenizer, no torch weights. A draft model beside it
runs in llama.cpp too (its GGUF file, another ``LlamaCppModel`` and its own runner, loaded on
first use: ``SpeculativeGenerator.llama_cpp_draft``); a torch draft beside it is refused
(``check_llama_cpp_target_options``).

Every forward's logits are float32 on the CPU, a fresh (rows, V) tensor. Exactness: greedy
decoding through this runner gives llama.cpp's own greedy tokens wherever llama.cpp's
kernels give the same logits for a token whatever the batch it is in (checked in float32
on a tiny GGUF file, tests/models/test_llama_cpp_target.py); on quantized weights a batch
of k tokens may round differently from single steps (the bench reports the agreement).

It serves a GGUF draft model too (``drafters.draft_model.DraftModelDrafter``'s ``runner``). It
implements ``engine.protocol.TargetRunnerProtocol`` and ``BatchRunnerProtocol`` structurally (the models layer does not
import the engine; tests/test_interfaces.py checks it).

Source: llama.cpp's C API through llama-cpp-python (https://github.com/abetlen/llama-cpp-python):
``llama_decode`` with ``logits`` set for every kept row, ``llama_get_logits_ith``,
``llama_memory_seq_rm``.
"""

from __future__ import annotations

import hashlib
import logging
import shutil
import statistics
import tempfile
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from types import MappingProxyType

import torch

from specdecode.errors import InvalidArgumentError
from specdecode.models.dense_cache import dense_cache_valid, dense_dir
from specdecode.models.llama_cpp import CONTEXT_STEP, LlamaCppCache, LlamaCppModel, gguf_path, import_llama_cpp
from specdecode.models.loading import DTYPES, LoadedModel, resolve_device
from specdecode.models.registry import OFFLINE_MODELS, default_cache_dir

logger = logging.getLogger(__name__)

#: The widths ``measure_forward_costs`` times by default (``engine.cost_model.MEASURED_WIDTHS``).
COST_WIDTHS = (1, 2, 3, 4, 6, 8)


def _as_ids(ids, what: str) -> list[int]:
    """``ids`` (a sequence of ints, a 1-D tensor or array, or a (1, w) tensor) as a list of ints.

    Raises:
        InvalidArgumentError: A tensor with more than one row, or no ids.
    """
    if isinstance(ids, torch.Tensor):
        if ids.dim() == 2 and ids.shape[0] == 1:
            ids = ids[0]
        if ids.dim() != 1:
            raise InvalidArgumentError(f"{what} must be one sequence of token ids, got a tensor of shape "
                                       f"{tuple(ids.shape)}")
        ids = ids.tolist()
    out = [int(t) for t in ids]
    if not out:
        raise InvalidArgumentError(f"{what} needs at least one token id, got none")
    return out


class LlamaCppTargetRunner:
    """Runs a target model's forwards in llama.cpp for one sequence at a time (module docstring).

    Args:
        model: The target's GGUF file in llama.cpp (``LlamaCppModel(path, role="target model")``).
        name: For messages.

    Attributes:
        model, name: As given.
        vocab_size: V, the width of the logits.
        context_length: The positions the model was trained for (the GGUF file's), or None when
            the model does not say.
        device: Always the CPU; ``dtype`` float32.
        forward_costs: Width -> seconds per forward, from ``measure_forward_costs`` (empty before).
        num_forwards: Forwards run (prefills included), over its life.
    """

    device = torch.device("cpu")
    dtype = torch.float32
    compile_time_s = 0.0  # nothing is compiled
    takes_trees = False  # linear blocks only (tree verification: engine.tree)

    def __init__(self, model: LlamaCppModel, name: str = "target model") -> None:
        self.model = model
        self.name = name
        self.vocab_size = int(model.vocab_size)
        trained = getattr(model, "n_ctx_train", None)
        self.context_length = int(trained) if isinstance(trained, int) and trained > 0 else None
        self.forward_costs: Mapping[int, float] = MappingProxyType({})
        self.num_forwards = 0
        self._cache: LlamaCppCache | None = None

    def end_of_sequence_ids(self) -> set[int]:
        """The GGUF vocabulary's end-of-sequence and end-of-turn ids (``LlamaCppModel.end_of_sequence_ids``)."""
        ids = getattr(self.model, "end_of_sequence_ids", None)
        return set(ids()) if callable(ids) else set()

    @property
    def num_cached(self) -> int:
        """Positions the sequence holds in llama.cpp's memory (0 before a prefill)."""
        return len(self._cache.tokens) if self._cache is not None else 0

    @property
    def tokens(self) -> list[int]:
        """The token ids at those positions (a copy)."""
        return list(self._cache.tokens) if self._cache is not None else []

    def _owned(self) -> LlamaCppCache:
        if self._cache is None:
            raise InvalidArgumentError(f"{self.name}: no sequence yet; prefill a prompt first")
        self._cache.check_owner()
        return self._cache

    def prefill(self, ids, max_new_tokens: int = 0) -> torch.Tensor:
        """Start a sequence: the prompt at positions 0 .. n - 1, in chunks of the model's batch size.

        The model's context is taken over (a generation holding it before is refused from then
        on) and emptied; it is sized for ``n + max_new_tokens`` positions and more.

        Args:
            ids: The n >= 1 prompt token ids (a list, a 1-D or (1, n) tensor).
            max_new_tokens: Positions to make room for past the prompt (a hint, >= 0).

        Returns:
            (V,) float32 logits after the last prompt token.

        Raises:
            InvalidArgumentError: No ids, a token id outside the vocabulary, or a prompt past the
                model's training context.
            UnsupportedModelError: ``llama_decode`` failed.
        """
        ids = _as_ids(ids, f"{self.name}'s prefill")
        model = self.model
        generation = model.take_over(len(ids) + max(0, max_new_tokens) + CONTEXT_STEP // 4)
        self._cache = LlamaCppCache(model, generation)
        return self.forward(ids, 0, 1)[0]

    def forward(self, ids, start: int, logits_to_keep: int | None = None) -> torch.Tensor:
        """w tokens at positions ``start .. start + w - 1``, after dropping any held from ``start`` on.

        Args:
            ids: The w >= 1 token ids (a list, a 1-D or (1, w) tensor).
            start: Their first position, 0 .. ``num_cached``.
            logits_to_keep: Rows of logits to return, the last ones (default: all w; at most
                the tokens of the last chunk of ``model.batch_size``).

        Returns:
            (logits_to_keep, V) float32 logits: row i predicts the token after position
            ``start + w - logits_to_keep + i``.

        Raises:
            InvalidArgumentError: No sequence yet, another generation took the model's context
                over, ``start`` past the positions held (a gap), or ``LlamaCppModel.decode``'s.
            UnsupportedModelError: ``llama_decode`` failed, or the rollback did.
        """
        ids = _as_ids(ids, f"a forward of the {self.name}")
        cache = self._owned()
        held = len(cache.tokens)
        if isinstance(start, bool) or not isinstance(start, int) or not 0 <= start <= held:
            raise InvalidArgumentError(
                f"{self.name}: a forward must start at a position in 0..{held} (the positions held), got {start!r}"
            )
        if start < held:
            self.rollback(start)
        self.model.ensure_context(start + len(ids), cache.tokens)
        logits = self.model.decode(ids, start, len(ids) if logits_to_keep is None else logits_to_keep)
        cache.tokens.extend(ids)
        self.num_forwards += 1
        return logits

    def verify(self, ids, start: int) -> torch.Tensor:
        """``forward(ids, start)`` keeping the logits at every position: (w, V)."""
        return self.forward(ids, start, None)

    def rollback(self, num_positions: int) -> None:
        """Keep positions 0 .. ``num_positions`` - 1 and drop the rest from llama.cpp's memory.

        Raises:
            InvalidArgumentError: No sequence yet, another generation owns the context, or
                ``num_positions`` outside 0 .. ``num_cached``.
            UnsupportedModelError: llama.cpp could not drop them.
        """
        cache = self._owned()
        held = len(cache.tokens)
        if isinstance(num_positions, bool) or not isinstance(num_positions, int) or not 0 <= num_positions <= held:
            raise InvalidArgumentError(
                f"{self.name}: a rollback keeps 0..{held} positions (those held), got {num_positions!r}"
            )
        if num_positions < held:
            self.model.remove_from(num_positions)
            del cache.tokens[num_positions:]

    @torch.inference_mode()
    def __call__(self, ids: torch.Tensor, starts: Sequence[int], logits_to_keep: int, trees=None) -> torch.Tensor:
        """``engine.batch_runner.BatchRunner``'s call at one row: (1, w) ids at ``starts[0]``.

        Returns:
            (1, logits_to_keep, V) float32 logits.

        Raises:
            InvalidArgumentError: More than one row (llama.cpp's multi-sequence batches are not
                built), a tree forward (``takes_trees`` is False: its forwards here are linear),
                or ``forward``'s.
        """
        if trees is not None:
            raise InvalidArgumentError(f"the llama.cpp {self.name} runs linear blocks only, not token trees")
        if ids.dim() != 2 or ids.shape[0] != 1 or len(starts) != 1:
            raise InvalidArgumentError(
                f"the llama.cpp {self.name} runs one sequence at a time, got ids of shape {tuple(ids.shape)} "
                f"and {len(starts)} start(s)"
            )
        return self.forward(ids, int(starts[0]), logits_to_keep).unsqueeze(0)

    def measure_forward_costs(self, context_ids, widths: Sequence[int] = COST_WIDTHS, repeats: int = 5,
                              warmup: int = 1) -> Mapping[int, float]:
        """Seconds per forward at each width, after ``context_ids`` (a warm-up step).

        The context is prefilled (a prompt-sized one measures what a generation pays: attention
        grows with it); then, per width w, ``warmup`` + ``repeats`` forwards of w tokens at the
        position after it, each rolled back; the median of the timed ones (``time.perf_counter``
        around the forward and its logits' copy) is kept. Afterwards the runner holds the
        context; the next ``prefill`` takes over as always.

        Returns:
            Width -> seconds, also kept as ``forward_costs``.

        Raises:
            InvalidArgumentError: A width < 1, ``repeats`` < 1 or ``warmup`` < 0, or ``prefill``'s.
        """
        if not widths or any(isinstance(w, bool) or not isinstance(w, int) or w < 1 for w in widths):
            raise InvalidArgumentError(f"widths must be integers >= 1, got {list(widths)!r}")
        if repeats < 1 or warmup < 0:
            raise InvalidArgumentError(f"repeats must be >= 1 and warmup >= 0, got {repeats!r} and {warmup!r}")
        context = _as_ids(context_ids, f"{self.name}'s cost measurement")
        self.prefill(context, max(widths))
        n, token = len(context), context[-1]
        costs = {}
        for w in sorted(set(widths)):
            times = []
            for i in range(warmup + repeats):
                t0 = time.perf_counter()
                self.forward([token] * w, n, w)
                seconds = time.perf_counter() - t0
                self.rollback(n)
                if i >= warmup:
                    times.append(seconds)
            costs[w] = statistics.median(times)
        self.forward_costs = MappingProxyType(costs)
        logger.info("%s: llama.cpp forward costs after %d positions, %d threads: %s", self.name, n,
                    self.model.n_threads, ", ".join(f"{w} tok {s * 1e3:.1f} ms" for w, s in costs.items()))
        return self.forward_costs


#: What ``backend="llama-cpp"`` loads: the target in llama.cpp (``SpeculativeGenerator.from_pretrained``).
TARGET_BACKENDS = ("torch", "llama-cpp")


def check_llama_cpp_target_options(*, dtype, device, quantize: str, draft_quantize, draft_quantize_head,
                                   quantize_group_size, draft_backend: str | None,
                                   prepack_linears: bool | None = None) -> None:
    """Refuse the loading options that a target run by llama.cpp cannot apply (before anything is loaded).

    Raises:
        InvalidArgumentError: A torch quantization (``quantize`` other than "none", ``draft_quantize``,
            ``draft_quantize_head``, ``quantize_group_size``): the GGUF file keeps its own; a ``dtype``
            other than "auto" or "float32" (llama.cpp's logits are float32); a device other than
            "auto" or the CPU; ``draft_backend="torch"`` (a torch draft beside a llama.cpp target is not
            built: the draft runs in llama.cpp too; None or "llama-cpp" is that); ``prepack_linears=True``
            (oneDNN's kernel for torch linear layers, ``models.prepacked_linear``: there are none).
    """
    given = [f"{name}={value!r}" for name, value in (
        ("quantize", None if quantize == "none" else quantize), ("draft_quantize", draft_quantize),
        ("draft_quantize_head", draft_quantize_head), ("quantize_group_size", quantize_group_size),
    ) if value is not None]
    if given:
        raise InvalidArgumentError(
            f"{' and '.join(given)} quantize torch weights, but backend='llama-cpp' runs the target's GGUF file with "
            "its own quantization and loads no torch weights: leave them out"
        )
    if prepack_linears:
        raise InvalidArgumentError(
            "prepack_linears=True puts torch linear layers on oneDNN's kernel, but backend='llama-cpp' runs the "
            "target's GGUF file in llama.cpp and loads no torch layers: leave it out"
        )
    if dtype not in ("auto", "float32", torch.float32):
        raise InvalidArgumentError(
            f"dtype={dtype!r}: backend='llama-cpp' runs the GGUF file's own weight types and gives float32 logits; "
            "leave dtype out (or 'float32')"
        )
    dev = torch.device("cpu") if device == "auto" else device if isinstance(device, torch.device) else \
        resolve_device(device)  # "auto": the CPU, where llama.cpp runs
    if dev.type != "cpu":
        raise InvalidArgumentError(
            f"backend='llama-cpp' runs the target on the CPU, but the device is {dev}; use device='cpu' (--device cpu)"
        )
    if draft_backend not in (None, "llama-cpp"):
        raise InvalidArgumentError(
            f"draft_backend={draft_backend!r} with backend='llama-cpp': a torch draft beside a llama.cpp target is "
            "not built; with backend='llama-cpp' the draft model runs in llama.cpp too (its GGUF file: an offline "
            "model or a .gguf path): leave draft_backend out, or use 'llama-cpp' (allowed: llama-cpp, or None)"
        )


def _target_tokenizer(spec: str, path: Path, cache_dir):
    """The tokenizer of ``spec``: an offline model's dense copy's when one exists, else the one read from the
    GGUF file once (33 s for Qwen2.5-Coder's on a 2-core EPYC) and kept under ``cache_dir``/tokenizers."""
    from transformers import AutoTokenizer

    cache = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    if spec in OFFLINE_MODELS:
        for dtype in DTYPES.values():
            folder = dense_dir(cache, OFFLINE_MODELS[spec].name, dtype)
            if dense_cache_valid(folder):
                return AutoTokenizer.from_pretrained(str(folder))
    st = path.stat()
    ident = hashlib.sha256(f"{path}:{st.st_size}:{st.st_mtime_ns}".encode()).hexdigest()[:16]
    kept = cache / "tokenizers" / f"{path.stem}-{ident}"
    if (kept / "tokenizer_config.json").is_file():
        return AutoTokenizer.from_pretrained(str(kept))
    logger.info("reading the tokenizer of %s (once; kept in %s)", path, kept)
    tokenizer = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    tmp = None
    try:
        kept.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".{kept.name}.", suffix=".partial", dir=kept.parent))
        tokenizer.save_pretrained(str(tmp))
        tmp.rename(kept)
    except OSError as e:  # the tokenizer in memory is fine; only the next start reads the file again
        logger.warning("could not keep the tokenizer in %s (%s); the next start reads the GGUF file again", kept, e)
        if tmp is not None:
            shutil.rmtree(tmp, ignore_errors=True)
    return tokenizer


def load_llama_cpp_target(spec: str, *, cache_dir=None, n_threads: int | None = None, **loading) -> LoadedModel:
    """The target for ``backend="llama-cpp"``: its GGUF file in llama.cpp, and only the tokenizer from transformers.

    Args:
        spec: An offline model name (its packaged GGUF file, assembled once) or a ``.gguf`` path.
        cache_dir: Where offline models are assembled (default ``default_cache_dir()``).
        n_threads: llama.cpp's threads (default: torch's).
        loading: ``SpeculativeGenerator.from_pretrained``'s other options, checked first: backend
            (must be "llama-cpp"), and ``check_llama_cpp_target_options``'s (dtype, device,
            quantize, draft_quantize, draft_quantize_head, quantize_group_size, draft_backend).

    Returns:
        A ``LoadedModel`` whose ``model`` is a ``LlamaCppTargetRunner`` (the KV cache in float16,
        llama.cpp's default), with the tokenizer; no torch weights.

    Raises:
        InvalidArgumentError: An unknown backend; ``check_llama_cpp_target_options``'s; ``spec`` is not a GGUF file or
            offline model, or llama-cpp-python is not installed.
        ModelNotFoundError, ChecksumMismatchError: As ``gguf_path``.
        UnsupportedModelError: llama.cpp cannot load the file.
        VocabularyMismatchError: The tokenizer's ids are other tokens in the GGUF file.
    """
    if loading.get("backend", "llama-cpp") != "llama-cpp":
        raise InvalidArgumentError(f"unknown backend {loading['backend']!r}; allowed: {', '.join(TARGET_BACKENDS)}")
    loading.pop("backend", None)
    options = dict(dtype="auto", device="cpu", quantize="none", draft_quantize=None, draft_quantize_head=None,
                   quantize_group_size=None, draft_backend=None, prepack_linears=None)
    unknown = set(loading) - set(options)
    if unknown:
        raise InvalidArgumentError(f"unknown loading options {sorted(unknown)}; allowed: {', '.join(options)}")
    check_llama_cpp_target_options(**{**options, **loading})
    path = gguf_path(spec, cache_dir, user=" (backend 'llama-cpp')", not_gguf=(
        f"backend='llama-cpp' runs the target's GGUF file, but {spec!r} is not one; use an offline model "
        f"({', '.join(OFFLINE_MODELS)}) or a .gguf path, or backend='torch'"
    ))
    import_llama_cpp(f"the llama.cpp target model {spec!r}")
    tokenizer = _target_tokenizer(spec, path, cache_dir)
    model = LlamaCppModel(path, n_threads=n_threads, name=spec, role="target model")
    model.check_vocabulary(tokenizer)
    return LoadedModel(LlamaCppTargetRunner(model, name="target model"), tokenizer, spec)
