"""Turning logits into next-token distributions and tokens.

Temperature, top-k, top-p and min-p are applied with transformers' own logits warpers,
so the draft and the target distributions are shaped identically before the
speculative-sampling test compares them. The context-dependent processors (penalties,
``logit_bias``) and logprobs are ``engine.processors``'s; a ``Sampler`` carries a generation's
``LogitsProcessing`` once ``start`` gave it the prompt.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from transformers.generation.logits_process import (
    LogitsProcessorList,
    MinPLogitsWarper,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

from specdecode.config import GenerationConfig
from specdecode.engine.batch_cache import to_device
from specdecode.engine.processors import DraftProcessing, LogitsProcessing, fit_width
from specdecode.errors import NonFiniteLogitsError


def logits_width(model: torch.nn.Module) -> int:
    """V, the number of logits ``model`` gives per position: its output embedding's rows.

    The output embedding is an ``nn.Linear`` or a weight-only quantized layer
    (``specdecode.models.quantize``); both carry ``out_features``, and a module with only a
    (V, H) ``weight`` also counts. A target run outside torch (``protocol.TargetRunnerProtocol``,
    llama.cpp) states its own ``vocab_size`` (its GGUF file's).
    """
    if not isinstance(model, torch.nn.Module) and isinstance(getattr(model, "vocab_size", None), int):
        return int(model.vocab_size)
    head = model.get_output_embeddings()
    return int(getattr(head, "out_features", None) or head.weight.shape[0])


def warped_probs(samplers: Sequence[Sampler], logits: torch.Tensor, ids: torch.Tensor | None = None) -> torch.Tensor:
    """Each row's ``Sampler.probs`` (or, with ``ids``, ``probs_over``), rows whose samplers share a ``warp_key``
    warped in one call, by the group's first sampler: the warpers act row by row, so each row gets the
    values it gets alone (checked on CPU; on CUDA a batched softmax may round a last bit differently, so a
    seed's draw could rarely differ, the law never), with a handful of operations per distinct setting
    instead of per row. Nothing is read back.

    Args:
        samplers: Per row, its sampler (m rows; none greedy).
        logits: (m, ..., V') float; row i is shaped by ``samplers[i]``.
        ids: A truncated head's (K,) token ids (``logits`` then has K columns), or None.

    Returns:
        (m, ..., V) float32, each distribution summing to 1.
    """
    shape = logits.shape
    flat = logits.reshape(shape[0], -1, shape[-1])

    def warp(sampler: Sampler, rows: torch.Tensor) -> torch.Tensor:  # (r, T, V') -> (r, T, V)
        two = rows.reshape(-1, shape[-1])
        q = sampler.probs(two) if ids is None else sampler.probs_over(two, ids)
        return q.view(rows.shape[0], rows.shape[1], -1)

    groups: dict = {}
    for i, sampler in enumerate(samplers):
        groups.setdefault(sampler.warp_key, []).append(i)
    if len(groups) == 1:
        out = warp(samplers[0], flat)
    else:
        out = None
        for members in groups.values():
            index = to_device(members, logits.device)  # pinned, non-blocking: no wait for the device
            q = warp(samplers[members[0]], flat.index_select(0, index))
            out = q.new_empty((shape[0], *q.shape[1:])) if out is None else out
            out.index_copy_(0, index, q)
    return out.view(*shape[:-1], -1)


def safe_logits(logits: torch.Tensor, finite: torch.Tensor) -> torch.Tensor:
    """``logits`` with every position whose raw logits were not all finite set to zeros: a draw from them
    (a uniform one) cannot fail (``torch.multinomial`` raises on NaN, or fails the device on CUDA) before
    the round's one host sync reads ``finite`` and drops what was drawn. Positions whose raw logits were
    finite are untouched, the -inf of a processor's mask included.

    Args:
        logits: (..., V) float, possibly processed since ``finite`` was computed.
        finite: Bool of ``logits``' shape but the last dimension, or broadcastable to it with a trailing 1:
            whether each position's raw logits were all finite.

    Returns:
        A tensor of ``logits``' shape (one operation, nothing read back).
    """
    mask = finite if finite.dim() == logits.dim() else finite.unsqueeze(-1)
    return torch.where(mask, logits, 0.0)


def check_finite(logits: torch.Tensor, who: str) -> None:
    """Raise if ``logits`` holds NaN or infinity.

    Args:
        logits: Any-shaped raw model logits.
        who: Which model produced them, for the message ("target model", "draft model").

    Raises:
        NonFiniteLogitsError: If any entry is NaN or +/-inf.
    """
    if not bool(torch.isfinite(logits).all()):
        raise_non_finite(who, logits.dtype)


def raise_non_finite(who: str, dtype: torch.dtype) -> None:
    """Raise ``NonFiniteLogitsError`` for logits of ``who`` (a model name) computed in ``dtype``.

    For callers that test finiteness on the device and read the flag with other values in
    one host sync (the engine's round) instead of calling ``check_finite``.

    Raises:
        NonFiniteLogitsError: Always.
    """
    raise NonFiniteLogitsError(
        f"the {who} produced non-finite logits (NaN or inf) in a {str(dtype)} forward; "
        "logits must be finite. Try --dtype float32 or bfloat16 instead of float16."
    )


class Sampler:
    """Shapes logits into probabilities and draws tokens, for one generation.

    Args:
        config: Sampling parameters (temperature, top_k, top_p, min_p, seed; the processors and
            logprobs once ``start`` is called).
        vocab_size: V, the target model's logit width. Wider logits (a draft model
            with more padding rows) are cut to V; narrower ones are padded with
            zero probability, so draft and target distributions share one support.
        device: Device of the ``torch.Generator``.
    """

    def __init__(self, config: GenerationConfig, vocab_size: int, device: torch.device | str) -> None:
        self.greedy = config.greedy
        self.vocab_size = vocab_size
        self.generator = torch.Generator(device=device)
        if config.seed is None:
            self.generator.seed()
        else:
            self.generator.manual_seed(config.seed)
        warpers = LogitsProcessorList()
        if not self.greedy:
            if config.temperature != 1.0:
                warpers.append(TemperatureLogitsWarper(config.temperature))
            if config.top_k > 0:
                warpers.append(TopKLogitsWarper(top_k=config.top_k))
            if config.top_p < 1.0:
                warpers.append(TopPLogitsWarper(top_p=config.top_p))
            if config.min_p > 0.0:
                warpers.append(MinPLogitsWarper(min_p=config.min_p))
        self._warpers = warpers
        #: Rows whose samplers share this key shape logits alike (``warped_probs`` warps them together).
        self.warp_key = None if self.greedy else (config.temperature, config.top_k, config.top_p, config.min_p)
        self._no_ids = torch.empty(0, dtype=torch.long)
        self._config = config
        self._device = device
        #: The generation's context-dependent processors and logprobs (``start``); None: none asked.
        self.processors: LogitsProcessing | None = None

    def start(self, prompt_ids: torch.Tensor | list[int]) -> LogitsProcessing | None:
        """Begin a generation after ``prompt_ids``: build its ``LogitsProcessing`` (None when the
        config asks for no processor and no logprobs). Returns it.

        Raises:
            InvalidArgumentError: A ``logit_bias`` or ``stop_token_ids`` id outside 0..V-1.
        """
        self.processors = LogitsProcessing.from_config(self._config, self.vocab_size, self._device, prompt_ids)
        return self.processors

    def process(self, logits: torch.Tensor, drafted: torch.Tensor | None = None) -> torch.Tensor:
        """A verification block after the processors (``LogitsProcessing.block``): (W, V') -> (W, V)
        float32; unchanged when there are none."""
        if self.processors is None:
            return logits
        return self.processors.block(logits, drafted)

    def drafting(self, sequence: torch.Tensor | list[int]) -> DraftProcessing | None:
        """The processors for a draft model's q on its own context (``LogitsProcessing.drafting``),
        or None when no processor changes logits. Exactness never depends on q: this keeps the
        draft's proposals close to the processed target's, so acceptance does not drop."""
        if self.processors is None or not self.processors.changes_logits:
            return None
        return self.processors.drafting(sequence)

    def argmax(self, logits: torch.Tensor) -> torch.Tensor:
        """Greedy tokens. ``logits``: (m, V') -> (m,) long."""
        return fit_width(logits, self.vocab_size).argmax(dim=-1)

    def probs(self, logits: torch.Tensor) -> torch.Tensor:
        """Warped distributions. ``logits``: (m, V') any float dtype -> (m, V) float32, rows sum to 1."""
        scores = self._warpers(self._no_ids, fit_width(logits, self.vocab_size).float())
        return torch.softmax(scores, dim=-1)

    def probs_over(self, logits: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """Warped distributions over the tokens ``ids`` only (a truncated draft head, FR-Spec).

        The same temperature / top-k / top-p as ``probs``, applied to the K logits; the
        result is what ``probs`` gives for a full row that is -inf outside ``ids``.

        Args:
            logits: (m, K) any float dtype; column j is the logit of token ``ids[j]``.
            ids: (K,) long, distinct ids in 0..V-1, on the logits' device.

        Returns:
            (m, V) float32, rows sum to 1, zero outside ``ids``.
        """
        q = torch.softmax(self._warpers(self._no_ids, logits.float()), dim=-1)
        return q.new_zeros((q.shape[0], self.vocab_size)).index_copy_(1, ids, q)

    def choose(self, logits: torch.Tensor) -> int:
        """The first new token from the prefill's (1, V') logits, after the processors: the argmax
        when greedy, else a draw from ``probs`` (a host sync: read before drafting can start).
        Its logprob is kept when asked."""
        logits = self.process(logits)
        token = int(self.argmax(logits)[0]) if self.greedy else int(self.sample(self.probs(logits))[0])
        if self.processors is not None:
            self.processors.record(0, logits, [token])
        return token

    def sample(self, probs: torch.Tensor) -> torch.Tensor:
        """Draw one token per row. ``probs``: (m, V) -> (m,) long, using this sampler's generator."""
        return torch.multinomial(probs, 1, generator=self.generator).squeeze(-1)

    def uniform(self, n: int, device: torch.device) -> torch.Tensor:
        """``n`` draws from U[0, 1) as a (n,) float32 tensor, from this sampler's generator."""
        return torch.rand(n, generator=self.generator, device=device)
