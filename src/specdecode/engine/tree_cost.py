"""The draft size per round from costs and acceptance measured while decoding: ``MeasuredSizePolicy``.

A drafter that costs nothing per node (Token Recycling, prompt lookup) can offer a tree of any
size; what pays depends on the device. On a GPU a target forward over 64 tokens costs about 1.2
steps (issue 29's H100 table), on a 2-core CPU in float32 a forward over 9 tokens costs several
steps. So the size is chosen per round from what this device measured, not from a constant:

    size*  = argmax_n (1 + A(n)) / T(n),   n in the candidate sizes (0 = a plain step)

where T(n) is the running mean of the seconds a round with a draft of up to n nodes took
(draft, verification and the round's host work: what tokens per second actually pay) and A(n)
the running mean of the tokens it accepted. Both are exponentially weighted means per size,
measured online from the engine's own rounds (``record_round``, after compilation time is
taken out), so the costs are those of the path that runs (compiled or eager, this device,
this load). Each size is tried once at first (the plain step first); then every
``probe_every``-th round tries the next larger or smaller size than the best in turn, so
estimates follow the text. Where no size beats the plain step, the policy drafts nothing but
its probes: it loses at most a probe per ``probe_every`` rounds to plain decoding.

The estimates live in the policy and are shared by every generation that uses it (the device
and the drafter's learning carry over, as Token Recycling's matrix does). The one-row engine
(``SpeculativeDecoder``) is where this is exact; with several rows a round's seconds are
shared by the rows, and each row's controller records them against its own size.

This is the measured, model-free counterpart of ``engine.cost_model`` (which prices linear
drafts from forward costs measured at warm-up and a per-token acceptance rate); it needs no
structure of the draft (tree or chain) and no warm-up measurement.
"""

from __future__ import annotations

from specdecode.engine.protocol import DraftPolicy, RoundController
from specdecode.errors import InvalidArgumentError

#: Candidate sizes (drafted tokens or tree nodes) up to the generation's γ, which is always one.
SIZES = (0, 1, 2, 4, 8, 16, 32, 64)


class SizeEstimates:
    """Running means per size: seconds per round and tokens accepted per round (None: not measured).

    Args:
        decay: The weight kept by the old mean at each update, in [0, 1).
    """

    def __init__(self, decay: float = 0.8) -> None:
        if not 0.0 <= decay < 1.0:
            raise InvalidArgumentError(f"decay must be in [0, 1), got {decay!r}")
        self.decay = decay
        self.seconds: dict[int, float] = {}
        self.accepted: dict[int, float] = {}

    def _mean(self, table: dict[int, float], size: int, value: float) -> None:
        old = table.get(size)
        table[size] = value if old is None else self.decay * old + (1.0 - self.decay) * value

    def add_round(self, size: int, seconds: float) -> None:
        """A round drafted under ``size`` took ``seconds``."""
        self._mean(self.seconds, size, seconds)

    def add_accepted(self, size: int, accepted: int) -> None:
        """A round drafted under ``size`` accepted ``accepted`` tokens."""
        self._mean(self.accepted, size, float(accepted))

    def rate(self, size: int) -> float | None:
        """Expected tokens per second with ``size``, or None before a round of it was timed."""
        seconds = self.seconds.get(size)
        if seconds is None or seconds <= 0.0:
            return None
        return (1.0 + (self.accepted.get(size, 0.0) if size else 0.0)) / seconds


class MeasuredSizeController(RoundController):
    """The per-generation ``RoundController`` (``engine.protocol``) of a ``MeasuredSizePolicy``.

    Args:
        estimates: The policy's shared ``SizeEstimates``.
        max_tokens: The largest size (the generation's γ), >= 1.
        probe_every: Rounds between two probes of a neighbouring size (>= 1).

    Attributes:
        exit, gate: None. ``max_tokens``: as given. ``sizes``: the candidate sizes, ascending.
        last: The size of the latest ``round_cap``.
    """

    exit = None
    gate = None

    def __init__(self, estimates: SizeEstimates, max_tokens: int, probe_every: int = 8) -> None:
        if isinstance(max_tokens, bool) or not isinstance(max_tokens, int) or max_tokens < 1:
            raise InvalidArgumentError(f"max_tokens must be an integer >= 1, got {max_tokens!r}")
        self.estimates = estimates
        self.max_tokens = max_tokens
        self.sizes = sorted({s for s in SIZES if s <= max_tokens} | {max_tokens})
        self.probe_every = probe_every
        self.last = 0
        self._rounds = 0
        self._probe_up = True

    def _best(self) -> int:
        rates = {s: self.estimates.rate(s) for s in self.sizes}
        unmeasured = [s for s, r in rates.items() if r is None]
        if unmeasured:
            return unmeasured[0]
        return max(self.sizes, key=lambda s: (rates[s], -s))

    def _next(self) -> tuple[int, bool]:
        """The next round's size, and whether it is a probe (no state changes)."""
        best = self._best()
        if (self._rounds + 1) % self.probe_every or self.estimates.rate(best) is None:
            return best, False
        i = self.sizes.index(best)
        up = i == 0 or (self._probe_up and i + 1 < len(self.sizes))
        return self.sizes[min(i + 1, len(self.sizes) - 1) if up else i - 1], True

    def round_cap(self) -> int:
        """The size of the next round: the best measured one, a size not yet measured, or a probe."""
        size, probe = self._next()
        self._rounds += 1
        if probe:
            self._probe_up = not self._probe_up
        self.last = size
        return size

    @property
    def gated(self) -> bool:
        """Whether the next round is a plain step (size 0)."""
        return self._next()[0] == 0

    def record(self, cap: int, num_drafted: int, num_accepted: int) -> None:
        """After verifying a draft of ``num_drafted`` >= 1 under ``cap``: its accepted tokens count for ``cap``."""
        self.estimates.add_accepted(cap, num_accepted)

    def record_round(self, cap: int, num_drafted: int, seconds: float, *, draft_seconds: float = 0.0,
                     depth: int | None = None) -> None:
        """After every round (the engine calls it): the round was given ``cap``, drafted ``num_drafted``
        and took ``seconds``. Choosing ``cap`` is what is priced: a round in which the drafter had
        nothing to offer counts for ``cap`` with no token accepted."""
        self.estimates.add_round(cap, seconds)
        if cap and not num_drafted:
            self.estimates.add_accepted(cap, 0)


class MeasuredSizePolicy(DraftPolicy):
    """A ``DraftPolicy`` (``engine.protocol``) choosing each round's draft size from measured rounds
    (module docstring). Not frozen: its ``estimates`` learn across the generations that use it.

    Args:
        decay: As ``SizeEstimates``.
        probe_every: As ``MeasuredSizeController``.

    Raises:
        InvalidArgumentError: ``decay`` outside [0, 1) or ``probe_every`` < 1.
    """

    adaptive_exit = False

    def __init__(self, decay: float = 0.8, probe_every: int = 8) -> None:
        if isinstance(probe_every, bool) or not isinstance(probe_every, int) or probe_every < 1:
            raise InvalidArgumentError(f"probe_every must be an integer >= 1, got {probe_every!r}")
        self.estimates = SizeEstimates(decay)
        self.probe_every = probe_every

    @property
    def active(self) -> bool:
        """Always True: the size changes from round to round."""
        return True

    def controller(self, gamma: int) -> MeasuredSizeController:
        """Per-generation state, sizes up to γ."""
        return MeasuredSizeController(self.estimates, gamma, self.probe_every)
