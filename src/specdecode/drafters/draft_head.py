"""The draft model's LM head: every row, or only the rows of K frequent tokens (FR-Spec).

FR-Spec (Zhao et al. 2025, "FR-Spec: Accelerating Large-Vocabulary Language Models
via Frequency-Ranked Speculative Sampling", arXiv 2502.14856) lets the draft model
propose only among the K most frequent tokens of a corpus and computes the LM-head
logits for those K rows alone: ``logits_K = h @ W[ids].T (+ b[ids])``, a (K x H)
instead of a (V x H) matrix-vector product per draft token. For a 0.5B draft with
V = 151,936 and H = 896 the head is about 28% of the weights, so K = 32k cuts the
draft step by roughly a fifth.

Verification is unchanged. Greedy output stays exactly the target's (the target
rejects any token it would not have chosen). Under sampling the draft distribution q
is the softmax of the warped K logits, zero outside the K tokens, and the rejection
sampler compares the target's p with that same q, so the output keeps the target's
distribution (Leviathan et al. 2022; a token q cannot propose is reached through the
residual ``max(0, p - q)``).

How: ``DraftHead`` names the rows (``full()`` or ``truncated(ids)``); ``bind(model)``
gathers ``W[ids]`` (and the bias rows) once into a contiguous (K, H) matrix, or asks a
weight-only quantized head (``specdecode.models.quantize``) for a K-row copy of itself
through its ``select_rows(ids)``. While ``BoundDraftHead.applied()`` is active, the
``forward`` of the model's output-embedding module instance
(``model.get_output_embeddings()``) is swapped for ``F.linear(h, W[ids], b[ids])`` (or
the K-row copy's forward); the stock transformers forward runs unchanged around it, so
whatever it does after the head (Gemma 2's final logit soft-capping, for one) still
applies, and the model returns (…, K) logits whose column j belongs to token ``ids[j]``.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator, Sequence
from contextlib import contextmanager, nullcontext

import torch
import torch.nn.functional as F
from transformers import PreTrainedModel

from specdecode.errors import InvalidArgumentError, UnsupportedModelError


def _head_module(model: PreTrainedModel) -> tuple[torch.nn.Module, int]:
    """The model's output-embedding module (the LM head) and its number of rows V.

    The module either has a 2-D (V, H) ``weight`` or cuts its own rows with
    ``select_rows(ids)`` (a weight-only quantized linear, ``specdecode.models.quantize``).

    Raises:
        UnsupportedModelError: If the model has no such module.
    """
    get = getattr(model, "get_output_embeddings", None)
    head = get() if callable(get) else None
    if head is not None and callable(getattr(head, "select_rows", None)):
        return head, int(head.out_features)
    weight = getattr(head, "weight", None)
    if head is None or not isinstance(weight, torch.Tensor) or weight.dim() != 2:
        raise UnsupportedModelError(
            f"cannot truncate the LM head of {type(model).__name__}: a truncated draft head needs "
            "model.get_output_embeddings() to return a module with a 2-D (V, H) weight or a select_rows(ids) method"
        )
    return head, int(weight.shape[0])


class DraftHead:
    """Which rows of the draft model's LM head drafting computes: all, or those of K token ids.

    Build it with ``DraftHead.full()`` or ``DraftHead.truncated(ids)``; a drafter
    calls ``bind(model)`` once to gather the rows.

    Attributes:
        ids: (K,) long, distinct token ids in ascending order; None for the full head.
    """

    def __init__(self, ids: torch.Tensor | None = None) -> None:
        self.ids = ids

    @classmethod
    def full(cls) -> DraftHead:
        """Every row: the draft model's own forward, unchanged."""
        return cls(None)

    @classmethod
    def truncated(cls, ids: Sequence[int] | torch.Tensor) -> DraftHead:
        """Only the rows of ``ids`` (any order; stored ascending).

        Args:
            ids: K >= 1 distinct non-negative token ids (a list or a 1-D integer tensor).

        Raises:
            InvalidArgumentError: If ``ids`` is empty, not 1-D integers, negative or repeated.
        """
        t = torch.as_tensor(ids)
        if t.dim() != 1 or t.numel() == 0 or t.dtype.is_floating_point or t.dtype == torch.bool:
            raise InvalidArgumentError(
                f"a truncated draft head needs a non-empty 1-D list of integer token ids, got shape "
                f"{tuple(t.shape)} of {str(t.dtype).removeprefix('torch.')}"
            )
        t = torch.sort(t.to(torch.long).cpu()).values
        if int(t[0]) < 0:
            raise InvalidArgumentError(f"draft-head token id {int(t[0])} is negative; ids must be >= 0")
        repeated = t[1:][t[1:] == t[:-1]]
        if repeated.numel():
            raise InvalidArgumentError(f"draft-head token id {int(repeated[0])} is given more than once")
        return cls(t)

    @property
    def size(self) -> int | None:
        """K, or None for the full head."""
        return None if self.ids is None else int(self.ids.numel())

    def bind(self, model: PreTrainedModel) -> BoundDraftHead:
        """This head on ``model``: the K weight (and bias) rows gathered once, contiguous.

        Raises:
            InvalidArgumentError: If an id is not a row of the model's head (>= its V rows).
            UnsupportedModelError: If the model has no output-embedding module with a 2-D weight
                (or a ``select_rows`` method).
        """
        return BoundDraftHead(model, self.ids)

    def __repr__(self) -> str:
        return "DraftHead.full()" if self.ids is None else f"DraftHead.truncated(<{self.size} ids>)"


class BoundDraftHead:
    """A ``DraftHead`` applied to one draft model (see ``DraftHead.bind``).

    Attributes:
        ids: (K,) long on the model's device, or None for the full head.
        weight: (K, H) contiguous copy of the head's rows ``ids`` (None for the full head,
            and for a quantized head, which cuts its own rows: see ``rows``).
        bias: (K,) bias rows, or None.
        rows: What replaces the head's forward: (…, H) -> (…, K); None for the full head.
    """

    def __init__(self, model: PreTrainedModel, ids: torch.Tensor | None) -> None:
        self.model = model
        self.ids = self.weight = self.bias = self.rows = None
        if ids is None:
            return
        head, rows = _head_module(model)
        if int(ids[-1]) >= rows:
            raise InvalidArgumentError(
                f"draft-head token id {int(ids[-1])} is out of range: the draft model's LM head has {rows} "
                f"rows, allowed ids 0..{rows - 1}"
            )
        self._head = head
        device = next(itertools.chain(head.parameters(), head.buffers())).device
        self.ids = ids.to(device)
        with torch.no_grad():
            if callable(getattr(head, "select_rows", None)):
                self._rows_module = head.select_rows(self.ids)
                self.rows = self._rows_module.forward  # a method, not a module: no submodule gets registered
                return
            weight = self.weight = head.weight.detach()[self.ids].contiguous()
            bias = getattr(head, "bias", None)
            bias = self.bias = None if bias is None else bias.detach()[self.ids].contiguous()

        def rows_only(hidden_states: torch.Tensor) -> torch.Tensor:
            return F.linear(hidden_states, weight, bias)

        self.rows = rows_only

    @property
    def size(self) -> int | None:
        """K, or None for the full head."""
        return None if self.ids is None else int(self.ids.numel())

    def check_vocab(self, vocab_size: int) -> None:
        """Raise unless every id is below ``vocab_size`` (the target's V, ``Sampler.vocab_size``).

        Raises:
            InvalidArgumentError: Naming the largest id and the allowed range.
        """
        if self.ids is not None and int(self.ids[-1]) >= vocab_size:
            raise InvalidArgumentError(
                f"draft-head token id {int(self.ids[-1])} is outside the target's vocabulary 0..{vocab_size - 1}"
            )

    def applied(self):
        """A context in which ``model(...)`` returns logits over the K ids only: (…, K), column j = ``ids[j]``.

        The output-embedding module's ``forward`` is swapped on the instance and restored
        on exit, also on an exception; nesting is fine. A no-op for the full head. A compiled
        function does not see the swap (its graphs do not guard the modules, ``engine.compat``):
        call one always inside this context, or always outside, as the draft runner is.
        """
        return nullcontext() if self.ids is None else self._swapped()

    @contextmanager
    def _swapped(self) -> Iterator[None]:
        head = self._head
        previous = head.__dict__.get("forward")
        head.forward = self.rows
        try:
            yield
        finally:
            if previous is None:
                del head.forward
            else:
                head.forward = previous

    def check_logits(self, logits: torch.Tensor) -> None:
        """Raise unless a truncated head's forward gave K columns (the model applied its own head).

        Raises:
            UnsupportedModelError: If the model's forward does not compute its logits
                through ``get_output_embeddings()``.
        """
        if self.ids is not None and logits.shape[-1] != self.ids.numel():
            raise UnsupportedModelError(
                f"{type(self.model).__name__} gave {logits.shape[-1]} logits with a {self.size}-row draft head: "
                "its forward does not compute logits through get_output_embeddings(), so the head cannot "
                "be truncated"
            )

