"""Turning logits into next-token distributions and tokens.

Temperature, top-k and min-p are applied with transformers' own logits warpers, top-p by
``Sampler.nucleus_probs`` (transformers' rule but for tied logits, kept together; on a CPU without sorting every
logit where the nucleus lies among a row's most likely tokens), so the draft and the target distributions are
shaped alike before the speculative-sampling test compares them. The context-dependent processors (penalties,
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
)

from specdecode.config import GenerationConfig
from specdecode.engine.batch_cache import to_device
from specdecode.engine.processors import DraftProcessing, LogitsProcessing, fit_width
from specdecode.errors import INVALID_DISTRIBUTION, NonFiniteLogitsError


#: Under top-p on a CPU, ``Sampler.nucleus_probs`` looks for each row's nucleus among this many most likely
#: tokens, then among the next count, before sorting every logit; () sorts at once.
NUCLEUS_CANDIDATES = (256, 4096)


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
    """Each row's ``Sampler.probs`` (with ``ids``, ``probs_over``), rows whose samplers share a ``warp_key``
    warped in one call, by the group's first sampler: the warpers act row by row, so each row gets the values
    it gets alone (checked on CPU; on CUDA a batched softmax may round a last bit differently, so a seed's draw
    could rarely differ, the law never), with a handful of operations per distinct setting instead of per row.
    Nothing is read back.

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

    groups = grouped(samplers, lambda sampler: sampler.warp_key)
    if len(groups) == 1:
        out = warp(samplers[0], flat)
    else:
        out = None
        for members in groups:
            index = to_device(members, logits.device)  # pinned, non-blocking: no wait for the device
            q = warp(samplers[members[0]], flat.index_select(0, index))
            out = q.new_empty((shape[0], *q.shape[1:])) if out is None else out
            out.index_copy_(0, index, q)
    return out.view(*shape[:-1], -1)


def grouped(samplers: Sequence[Sampler], key) -> list[list[int]]:
    """The indices of ``samplers`` grouped by ``key(sampler)``, groups in order of first appearance."""
    groups: dict = {}
    for j, sampler in enumerate(samplers):
        groups.setdefault(key(sampler), []).append(j)
    return list(groups.values())


def generator_groups(samplers: Sequence[Sampler]) -> list[list[int]]:
    """The indices of ``samplers`` grouped by the ``torch.Generator`` they draw from (``grouped``): the rows of an
    engine's requests without a seed share its generator (``Sampler``), a seeded request's row has its own."""
    return grouped(samplers, lambda sampler: id(sampler.generator))


def draw_tokens(samplers: Sequence[Sampler], probs: torch.Tensor, rows: Sequence[int] | None = None,
                failed: dict[int, Exception] | None = None, check: bool = True) -> torch.Tensor:
    """One token per row, drawn from ``probs`` by each row's generator with ``torch.multinomial``'s own method
    (``race``: an exponential draw per entry, then one division and one ``argmax`` for all the rows). Rows
    whose samplers share a generator draw their noise in one call, as vLLM's sampler draws its requests
    without a seed together; a row with a generator of its own draws alone, on its row of the one noise
    tensor, as vLLM's does for a seeded request. A row draws the values ``torch.multinomial`` draws for it
    (checked on CPU), so a seed gives the same tokens as before. Nothing is read back.

    Args:
        samplers: Per drawn row, its sampler (m >= 0 rows).
        probs: (n, V) float32, rows summing to 1.
        rows: The rows of ``probs`` to draw from, ``samplers[i]`` drawing from ``probs[rows[i]]``; None: all
            (m = n).
        failed: None: a draw that raises propagates. A dict: the index i of each row whose draw raised is
            recorded with its exception (a shared draw that raises is retried row by row, so only a row whose
            own draw fails is recorded); its token is any id.
        check: ``race``'s check (a draft's q need not pass it: a NaN q's token is rejected).

    Returns:
        (m,) long on ``probs``' device; with ``check``, -1 for a row that is not a distribution (``race``).
    """
    if not samplers:
        return torch.empty(0, dtype=torch.long, device=probs.device)
    m = len(samplers)
    rows = None if rows is None else list(rows)
    everyone = rows is None or rows == list(range(probs.shape[0]))
    chosen = probs if everyone else probs.index_select(0, to_device(rows, probs.device))
    noise = torch.empty_like(chosen)

    def fill(group: list[int]) -> None:  # the group's rows of the noise, from their shared generator
        if len(group) == m:
            samplers[group[0]].exponential(noise)
        elif len(group) == 1:
            samplers[group[0]].exponential(noise[group[0]])  # its row of the noise, in place
        else:
            block = samplers[group[0]].exponential(noise.new_empty((len(group), noise.shape[-1])))
            noise.index_copy_(0, to_device(group, noise.device), block)

    for group in generator_groups(samplers):  # a failed row's noise: any positive value, its token is dropped
        draw_or_retry(fill, group, failed, lambda i: noise[i].fill_(1.0))
    return race(chosen, noise, check)


def draw_or_retry(draw, rows: list[int], failed: dict[int, Exception] | None, stand_in) -> list:
    """``[draw(rows)]``, one draw for ``rows``, whose samplers share a generator. If it raises: with ``failed``
    None, the error propagates; with a dict, each row draws alone, and each row whose own draw raises is
    recorded in ``failed`` with its exception and gets ``stand_in(row)`` (the caller drops its result). Returns
    the parts in the rows' order, to concatenate where ``draw`` returns tensors."""
    try:
        return [draw(rows)]
    except Exception as exc:  # noqa: BLE001 -- recorded: the caller fails that row alone
        if failed is None:
            raise
        if len(rows) == 1:
            failed[rows[0]] = exc
            return [stand_in(rows[0])]
        return [part for j in rows for part in draw_or_retry(draw, [j], failed, stand_in)]


def draw_uniforms(samplers: Sequence[Sampler], rows: list[int], count: int, device: torch.device,
                  failed: dict[int, Exception] | None) -> torch.Tensor:
    """``count`` uniforms for each of ``rows`` (whose samplers share one generator) in one draw, (len(rows) *
    count,) float32, row by row; a failed row's are ones, its result dropped by the caller (``draw_or_retry``)."""
    return torch.cat(draw_or_retry(lambda group: samplers[group[0]].uniform(len(group) * count, device), rows,
                                   failed, lambda j: torch.ones(count, device=device)))


def race(probs: torch.Tensor, noise: torch.Tensor, check: bool = True) -> torch.Tensor:
    """Tokens drawn from ``probs`` given Exp(1) ``noise``: argmax(p / E), the exponential race (the Gumbel-max
    trick) that ``torch.multinomial`` runs for one sample (reference: pytorch/pytorch#11931; the same division
    into the noise, so the same tokens), with its input checks replaced by one on the drawn entry (``check``):
    a row whose score there is not > 0 (NaN, or no mass) gets -1 rather than an error (on CUDA,
    ``torch.multinomial``'s checks are device asserts that fail the device). Without ``check``, a row with a
    NaN draws a NaN entry (``argmax`` takes NaN as the largest).

    Args:
        probs: (m, V) float32; noise: (m, V) float32, Exp(1) draws, overwritten with the scores.
        check: Whether to give -1 for a row that is not a distribution.

    Returns:
        (m,) long.
    """
    scores = torch.div(probs, noise, out=noise)
    tokens = scores.argmax(-1)
    if not check:
        return tokens
    return torch.where(scores.gather(-1, tokens.unsqueeze(-1)).squeeze(-1) > 0, tokens, -1)


def greedy_tokens(logits: torch.Tensor) -> torch.Tensor:
    """(..., V) -> (...) long: the argmax over the last dimension, the first of equal values (a NaN counts as the
    largest). On a CPU through ``max(-1).indices``, which documents the same choice: torch 2.13's CPU ``argmax``
    is 5-8x slower over bfloat16 and float16 (0.50 and 0.66 ms for 151,936 logits on a 2-core EPYC, against
    0.09 ms) and no faster over float32. Elsewhere ``argmax``."""
    return logits.max(-1).indices if logits.device.type == "cpu" else logits.argmax(-1)


def finite_rows(logits: torch.Tensor) -> torch.Tensor:
    """(..., V) -> (...) bool: whether each position's logits are all finite. On a CPU from the largest and the
    smallest (a NaN or an inf shows in one of them): 4-12x faster there than ``isfinite(...).all(-1)``, which
    builds a (..., V) mask (0.04 against 0.18 ms for 151,936 bfloat16 logits on a 2-core EPYC). Elsewhere that
    mask, in fewer kernels."""
    if logits.device.type == "cpu":
        return torch.isfinite(logits.amax(-1)) & torch.isfinite(logits.amin(-1))
    return torch.isfinite(logits).all(-1)


def safe_logits(logits: torch.Tensor, finite: torch.Tensor) -> torch.Tensor:
    """``logits`` with every position whose raw logits were not all finite set to zeros: a draw from them
    is a uniform one, not a NaN distribution (``race``'s -1), until the round's one host sync reads ``finite``
    and drops what was drawn. Positions whose raw logits were
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


def _nucleus_floor(top: torch.Tensor, p: torch.Tensor, top_p: float) -> torch.Tensor:
    """For logits ``top`` (..., K) sorted in descending order and their probabilities ``p``: (..., 1) the
    smallest logit top-p keeps, that of the first token at which the cumulative mass reaches ``top_p`` (the
    K-th when none does). Every token with a logit at least that large is kept, so a group of tied logits
    across the boundary stays whole. A NaN row gives NaN (nothing kept)."""
    count = (p.cumsum(dim=-1) < top_p).sum(dim=-1, keepdim=True) + 1
    return top.gather(-1, count.clamp_(max=top.shape[-1]) - 1)


def raise_invalid_distribution() -> None:
    """Raise ``NonFiniteLogitsError`` for a sampling distribution that came out NaN or without mass (``race``
    gave -1): finite logits whose warping overflowed (a tiny temperature over huge logits).

    Raises:
        NonFiniteLogitsError: Always.
    """
    raise NonFiniteLogitsError(INVALID_DISTRIBUTION)


def check_finite(logits: torch.Tensor, who: str) -> None:
    """Raise if ``logits`` holds NaN or infinity.

    Args:
        logits: Any-shaped raw model logits.
        who: Which model produced them, for the message ("target model", "draft model").

    Raises:
        NonFiniteLogitsError: If any entry is NaN or +/-inf.
    """
    if not bool(finite_rows(logits).all()):
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
        generator: Without a ``config.seed``, the generator to draw from, shared with other samplers (an engine's
            requests without a seed: ``draw_tokens`` draws their rows in one call); None, or with a seed: a
            generator of its own, seeded with ``config.seed`` or from the system's entropy. On ``device``.
    """

    def __init__(self, config: GenerationConfig, vocab_size: int, device: torch.device | str,
                 generator: torch.Generator | None = None) -> None:
        self.greedy = config.greedy
        self.vocab_size = vocab_size
        if config.seed is None and generator is not None:
            self.generator = generator
        else:
            self.generator = torch.Generator(device=device)
            if config.seed is None:
                self.generator.seed()
            else:
                self.generator.manual_seed(config.seed)
        # transformers' warpers around top-p (``nucleus_probs``): temperature and top-k before, min-p after
        self._before_top_p, self._after_top_p = LogitsProcessorList(), LogitsProcessorList()
        if not self.greedy:
            if config.temperature != 1.0:
                self._before_top_p.append(TemperatureLogitsWarper(config.temperature))
            if config.top_k > 0:
                self._before_top_p.append(TopKLogitsWarper(top_k=config.top_k))
            if config.min_p > 0.0:
                self._after_top_p.append(MinPLogitsWarper(min_p=config.min_p))
        self._warpers = LogitsProcessorList([*self._before_top_p, *self._after_top_p])  # without top-p
        self._top_p = config.top_p if not self.greedy and config.top_p < 1.0 else None
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
        return greedy_tokens(fit_width(logits, self.vocab_size))

    def probs(self, logits: torch.Tensor) -> torch.Tensor:
        """Warped distributions. ``logits``: (m, V') any float dtype -> (m, V) float32, rows sum to 1.

        The target's p and a draft model's q alike. Under top-p, ``nucleus_probs``."""
        return self._warp(fit_width(logits, self.vocab_size).float())

    def _warp(self, scores: torch.Tensor) -> torch.Tensor:
        """(m, W) float32 logits -> (m, W) float32 distributions: ``nucleus_probs`` under top-p, else
        transformers' warpers and a softmax (``probs`` over V, ``probs_over`` over a truncated head's K)."""
        if self._top_p is not None:
            return self.nucleus_probs(scores)
        return torch.softmax(self._warpers(self._no_ids, scores), dim=-1)

    def nucleus_probs(self, scores: torch.Tensor) -> torch.Tensor:
        """``probs`` under top-p (nucleus sampling, Holtzman et al. 2020): each row keeps the smallest set of its
        most likely tokens whose mass reaches top_p, tied logits kept or dropped together. On a CPU each row is
        looked for among its K most likely tokens, for the first K of ``NUCLEUS_CANDIDATES`` that settles it,
        and among all V otherwise (a flat distribution, or NaN); elsewhere among all V.

        A token is kept when its logit is at least the floor: the logit of the first token, in descending
        order, at which the cumulative mass (normalized over all V) reaches top_p (``_nucleus_floor``). That is
        transformers' ``TopPLogitsWarper``'s rule (remove a token whose ascending cumulative probability is at
        most 1 - top_p), except among tied logits: the warper ranks them
        by ``torch.sort``'s order, which is not stable on a CPU, so a tie across the boundary keeps an arbitrary
        part of it; here the whole group stays, whatever the order, as transformers' top-k and min-p keep ties.
        Without ties the kept set is the warper's, up to rounding (the cumulative sum runs the other way and is
        normalized by a ``logsumexp``; a token within rounding of the boundary can flip). bfloat16 logits tie
        often: over 663 positions of the real Qwen2.5-Coder 1.5B's logits the kept sets differed in 2-35% of rows
        (more at higher temperature and top_p), all but once by such a group (``2026-11-29-nucleus.md``).

        A row's K settle it when its K-th token's logit lies below the floor: every token past them is then
        dropped by the rule. ``topk`` of 256 costs about 0.1 ms a row against 5 ms for sorting Qwen2.5's
        V = 151,936 on a 2-core CPU. Each K costs one read of an (m,) flag, free on a CPU; on a GPU the read would
        be a host sync and the sort costs microseconds, so there every row sorts. Temperature and top-k act
        before, min-p after, as in ``probs``. A row's result depends on that row only.

        Args:
            scores: (m, V) float32 logits, cut to V.

        Returns:
            (m, V) float32, rows sum to 1 and are zero outside their nucleus (a NaN row comes out NaN).
        """
        warped = self._before_top_p(self._no_ids, scores)
        log_norm = torch.logsumexp(warped, dim=-1, keepdim=True)
        vocab = scores.shape[-1]
        out = rest = None  # the rows placed so far (the others zero); the rows left to place (None: all)

        def nucleus(k: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:  # the rest's K most likely
            rows = warped if rest is None else warped.index_select(0, rest)
            top, ids = rows.topk(k, dim=-1) if k < vocab else rows.sort(dim=-1, descending=True)
            p = torch.exp(top - (log_norm if rest is None else log_norm.index_select(0, rest)))
            floor = _nucleus_floor(top, p, self._top_p)  # (r, 1)
            kept = torch.where(top >= floor, top, -float("inf"))
            # settled: the K-th token lies below the floor, so it and every token past it are dropped
            settled = top[:, -1] < floor[:, 0]  # False for a NaN row
            return torch.softmax(self._after_top_p(self._no_ids, kept), dim=-1), ids, settled  # (r, K), (r, K), (r,)

        for k in [k for k in NUCLEUS_CANDIDATES if k < vocab] if scores.device.type == "cpu" else []:
            q, ids, done = nucleus(k)
            fill = q.new_zeros((q.shape[0], vocab)).scatter_(1, ids, torch.where(done[:, None], q, 0.0))
            out = fill if out is None else out.index_add_(0, rest, fill)
            if bool(done.all()):
                return out
            rest = (torch.arange(len(q), device=q.device) if rest is None else rest)[~done]
        q, ids, _ = nucleus(vocab)  # every token ranked
        fill = q.new_zeros(q.shape).scatter_(1, ids, q)
        return fill if out is None else out.index_copy_(0, rest, fill)

    def probs_over(self, logits: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """Warped distributions over the tokens ``ids`` only (a truncated draft head, FR-Spec).

        The same temperature / top-k / top-p / min-p as ``probs``, applied to the K logits; the
        result is what ``probs`` gives for a full row that is -inf outside ``ids``.

        Args:
            logits: (m, K) any float dtype; column j is the logit of token ``ids[j]``.
            ids: (K,) long, distinct ids in 0..V-1, on the logits' device.

        Returns:
            (m, V) float32, rows sum to 1, zero outside ``ids``.
        """
        q = self._warp(logits.float())
        return q.new_zeros((q.shape[0], self.vocab_size)).index_copy_(1, ids, q)

    def choose(self, logits: torch.Tensor) -> int:
        """The first new token from the prefill's (1, V') logits, after the processors: the argmax
        when greedy, else a draw from ``probs`` (a host sync: read before drafting can start).
        Its logprob is kept when asked."""
        logits = self.process(logits)
        token = int(self.argmax(logits)[0]) if self.greedy else int(self.sample(self.probs(logits))[0])
        if token < 0:
            raise_invalid_distribution()
        if self.processors is not None:
            self.processors.record(0, logits, [token])
        return token

    def sample(self, probs: torch.Tensor) -> torch.Tensor:
        """Draw one token per row with this sampler's generator (``race``: ``torch.multinomial``'s method and
        draws). ``probs``: (m, V) -> (m,) long, -1 for a row that is not a distribution."""
        return race(probs, self.exponential(torch.empty_like(probs)))

    def exponential(self, out: torch.Tensor) -> torch.Tensor:
        """``out`` (any shape) filled in place with Exp(1) draws from this sampler's generator; returns it.

        For a contiguous float32 ``out`` on a CPU (every caller's: the race's noise), -log1p(-U) of float64
        uniforms ``U`` rounded to float32: the values ``Tensor.exponential_`` gives, bit for bit, with the same
        generator state after (its CPU method in torch 2.13; a test holds it), at about a quarter of its cost
        (0.6 against 2.2 ms for Qwen2.5's V = 151,936 logits on a 2-core CPU: it runs element by element, while
        ``rand`` and ``log1p`` are vectorized). Otherwise ``exponential_`` itself.
        """
        if out.device.type != "cpu" or out.dtype != torch.float32 or not out.is_contiguous():
            return out.exponential_(generator=self.generator)
        uniform = torch.rand(out.shape, generator=self.generator, dtype=torch.float64)
        return out.copy_(uniform.neg_().log1p_().neg_())

    def uniform(self, n: int, device: torch.device) -> torch.Tensor:
        """``n`` draws from U[0, 1) as a (n,) float32 tensor, from this sampler's generator."""
        return torch.rand(n, generator=self.generator, device=device)
