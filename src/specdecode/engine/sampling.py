"""Turning logits into next-token distributions and tokens.

Temperature, top-k and top-p are applied with transformers' own logits warpers,
so the draft and the target distributions are shaped identically before the
speculative-sampling test compares them.
"""

from __future__ import annotations

import torch
from transformers.generation.logits_process import (
    LogitsProcessorList,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

from specdecode.config import GenerationConfig
from specdecode.errors import NonFiniteLogitsError


def logits_width(model: torch.nn.Module) -> int:
    """V, the number of logits ``model`` gives per position: its output embedding's rows.

    The output embedding is an ``nn.Linear`` or a weight-only quantized layer
    (``specdecode.models.quantize``); both carry ``out_features``, and a module with only a
    (V, H) ``weight`` also counts.
    """
    head = model.get_output_embeddings()
    return int(getattr(head, "out_features", None) or head.weight.shape[0])


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
    one host sync (the decoder's greedy round) instead of calling ``check_finite``.

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
        config: Sampling parameters (temperature, top_k, top_p, seed).
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
        self._warpers = warpers
        self._no_ids = torch.empty(0, dtype=torch.long)

    def _fit(self, logits: torch.Tensor) -> torch.Tensor:
        width = logits.shape[-1]
        if width > self.vocab_size:
            return logits[..., : self.vocab_size]
        if width < self.vocab_size:
            pad = logits.new_full((*logits.shape[:-1], self.vocab_size - width), float("-inf"))
            return torch.cat([logits, pad], dim=-1)
        return logits

    def argmax(self, logits: torch.Tensor) -> torch.Tensor:
        """Greedy tokens. ``logits``: (m, V') -> (m,) long."""
        return self._fit(logits).argmax(dim=-1)

    def probs(self, logits: torch.Tensor) -> torch.Tensor:
        """Warped distributions. ``logits``: (m, V') any float dtype -> (m, V) float32, rows sum to 1."""
        scores = self._warpers(self._no_ids, self._fit(logits).float())
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
        """One token from (1, V') logits: the argmax when greedy, else a draw from ``probs``
        (a host sync: the prefill's first token, read before drafting can start)."""
        if self.greedy:
            return int(self.argmax(logits)[0])
        return int(self.sample(self.probs(logits))[0])

    def sample(self, probs: torch.Tensor) -> torch.Tensor:
        """Draw one token per row. ``probs``: (m, V) -> (m,) long, using this sampler's generator."""
        return torch.multinomial(probs, 1, generator=self.generator).squeeze(-1)

    def uniform(self, n: int, device: torch.device) -> torch.Tensor:
        """``n`` draws from U[0, 1) as a (n,) float32 tensor, from this sampler's generator."""
        return torch.rand(n, generator=self.generator, device=device)
