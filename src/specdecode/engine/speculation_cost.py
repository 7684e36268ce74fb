"""One cost model for every drafter: each round, the draft size that maximises expected tokens per second.

Before each round the controller chooses the draft size n (tokens of a chain, nodes of a tree;
0 = a plain target step) with the most expected tokens per second::

    n*           = argmax_n  E[tokens](n) / seconds(n),   n in the candidate sizes up to γ
    seconds(n)   = n · s_node + C_target(n + 1)            (n = 0: C_target(1), a plain step)
    E[tokens](n) = 1 + Σ_{d=1..n} Π_{j=1..d} α_j          (a chain of n tokens)
                 = 1 + A(n)                                (a tree of n nodes)

The 1 is the target's bonus (or replacement) token. With one α for every depth the chain's
E[tokens] is Leviathan et al. (2023)'s (1 - α^(n+1)) / (1 - α) (``cost_model.expected_tokens``)
and the choice is that formula's argmax (tests/engine/test_speculation_cost.py checks they agree).
This is the engine's only cost model: ``DraftControl(length_schedule="cost-model")``, the
llama.cpp target's measured-cost policy (``engine.runner_target.measured_cost_policy``) and
"token-recycling"'s default tree size (``pipeline``) are each a ``SpeculationCostPolicy``.

* **C_target(w)**, the target's forward over w tokens per row, is measured by the engine
  before its first round (``DraftPolicy.calibrate``, ``BatchedSpeculativeDecoder._measure_forwards``):
  on the fast path each compiled width bucket once (a width between two buckets runs the wider
  one and costs what it costs); eagerly at ``EAGER_WIDTHS`` up to the widest verification,
  interpolated between them (``cost_model.ForwardCosts``). On a llama.cpp target the same
  through its runner, or given (``measured_cost_policy``: timed in llama.cpp at
  ``cost_model.MEASURED_WIDTHS``, with ``max_size`` keeping every verification within them).
  Measured once per policy (a policy is one drafter's, on one device), over the rows of the first
  round: exact for one row (``SpeculativeDecoder``); a batched engine whose row count changes
  keeps the first round's costs.
* **s_node**, the drafter's seconds per drafted node: a running mean of the seconds of its
  ``propose`` over the nodes it drafted (a draft model: about one forward per token; prompt
  lookup and Token Recycling: host work only), or a fixed number given (the llama.cpp draft's
  measured one-token forward). With several rows a round's draft seconds are shared by the rows
  and each row charges all of them to its own nodes (exact at one row). On a GPU ``propose``
  returns once the draft's work is queued unless the drafter waits on it, so s_node may be low.
* **α_d**, the probability that depth d is accepted given depth d - 1 was (``DepthAcceptance``):
  a chain round that drafted k tokens and accepted a is a success at depths 1 .. a and, if
  a < k, a failure at depth a + 1 (nothing is learned past it). Each depth's counts decay by
  ``decay`` per trial and start at the prior: ``prior_weight`` trials at the drafter's measured
  acceptance (``cost_model.PROMPT_LOOKUP_PRIOR`` 0.56 for drafters without a model,
  ``cost_model.DRAFT_MODEL_PRIOR`` 0.88 for drafters with one, those that give probabilities).
* **A(n)**, a tree's expected accepted tokens at n nodes: the running mean of the tokens trees of
  n nodes accepted (``SizeMeans``), at the sizes ``cost_model.SIZES`` up to γ. A tree's acceptance at
  depth d depends on its branching there, which its static shape changes with n, so one set of
  α_d cannot price every size; a mean per size needs no model of the shape and is exact for the
  shapes the drafter makes. A tree size not measured yet is tried once, unless even accepting
  all its n nodes could not beat the best rate known (then it is skipped).

**Priced by the match** (a drafter that reports ``Draft.ngram_sizes``: prompt lookup's chains). Prompt
lookup asks nothing of a model, so each round the controller lets it propose the longest block (γ) and
then keeps, per row, the size that pays under the α_d of blocks that continued a match of the same
n-gram size (``trim``): a three-token match is copied far more often than a one-token one (replayed
over llama.cpp's greedy outputs of 10 HumanEval prompts, 2.87 of 5 tokens accepted on average after a
three-token match, 0.60 after a one-token match: ``docs/benchmarks/prompt_lookup_replay.py``), and one α_d
over all matches, low, made most blocks plain steps where the long matches would have paid. Each n-gram size starts at the prior and has its own probes
(one token after ``probe_every`` plain steps of that size, backing off as below).

The controller starts as a chain; once a round reports a tree (``record_round``'s depth below
the nodes drafted) the policy prices trees. It keeps probing so that the estimates follow the
text: a chain whose best size is 0 tries one token every ``probe_every`` plain steps (and keeps
trying each round until a round has actually drafted, as a probe with nothing to draft is no
evidence; a probe after which still no size pays doubles the wait, up to ``RARE_PROBE_FACTOR`` x
``probe_every``, and any round after which a size pays resets it: a probe's draft-model catch-up
and wider verification cost more than a plain step); a chain whose best size is k < γ tries k + 1 every ``probe_every`` rounds (so α_{k+1}
is measured); a tree tries the next larger and smaller candidate size in turn every
``probe_every`` rounds. Where no size pays even at α = ``PLAUSIBLE_ACCEPTANCE`` (0.95) at every depth, it drafts
only a rare one-token probe (every ``RARE_PROBE_FACTOR`` x ``probe_every`` plain steps), and only while
the draft cost is measured online (a cost measured once too high can fall); with a fixed draft
cost, or none measured yet, it never drafts. Where the engine gives a row less than it chose (its
share of ``max_verify_tokens``, the tokens left), the controller chooses within the engine's cap
for ``probe_every`` rounds.

Where this follows the literature. SpecDec++ (Huang et al. 2024, "SpecDec++: Boosting Speculative
Decoding via Adaptive Candidate Lengths") casts the candidate length as a decision that trades
expected accepted tokens against the draft's and the verification's costs and stops where one
more token is not worth its cost; its acceptance probabilities come from a trained prediction
head, here from running counts by depth. DISCO (Mamou et al. 2024, "Dynamic Speculation
Lookahead Accelerates Speculative Decoding of Large Language Models") chooses the lookahead anew
every round instead of a constant or a heuristic schedule; its decision is a trained classifier,
here the argmax above over measured costs, so it needs no training and prices a GPU's flat
verification and a CPU's steep one alike.

**With an adaptive draft exit** (``DraftControl(adaptive_exit=True, length_schedule="cost-model")``) the
exit decides each draft's length from the draft's confidence in this context, which α_d, an average
over contexts, cannot see, and the model of n · s_node + C_target(n + 1) cannot price a length not
known in advance. So the policy then chooses between two arms by their measured rates: a round that
drafts up to the cap (``max_draft_tokens``; the exit stops it earlier) and a plain step. Each arm's
tokens per second is a running ratio of its rounds' tokens (accepted + 1) to their seconds (round
wall time without compilation or a deferred draft prefill; ``RateMean``). Nothing is timed before
the first round: the first round drafts, and the rounds after the first drafting round are plain
steps until one gives the plain arm its first rate (real rounds, host work included as in the
drafting arm's; the first is a warm-up, not counted, as a first one-token forward may set up
kernels; a policy built with the target's costs starts the plain arm from C_target(1) instead).
A round drafts while its arm's rate is at least the
plain one's (or none was measured); otherwise it is a plain step, and the drafting arm is
probed after ``probe_every`` plain steps (a plain step's seconds count only from rounds where no row
drafted), twice as long after each failed probe (up to
``RARE_PROBE_FACTOR`` x). A probe drafts at most ``EXIT_PROBE_TOKENS`` tokens, as a failed one costs
its draft forwards and a wider verification; it is judged by its rate against the plain arm's (its
accepted tokens and the target's over its seconds, the draft model's catch-up on the plain steps' tokens
included: the cautious side, as the full-cap rounds after it do not pay one): when it beat plain steps the generation drafts again at the full
cap and measures that arm afresh (one full round, then the rates decide again). Judging it by its
acceptance alone (every token accepted) kept prose in plain steps where drafting paid: on a 2-core Xeon
with AMX, whose bf16 verification of 4 tokens costs a plain step, the cascade under this policy took
plain steps in 559 of 1,021 Spec-Bench rounds and ran 15% slower than the exit alone. A generation decides by its own drafting rounds once it has one (texts
differ, so one good probe can turn a generation back to drafting) and before that by the drafting
rounds of the generations before it; the plain arm is measured over the policy's life, and priced by a
generation's own plain steps once it has one (a step costs more on a longer context). This generalises the confidence gate (a threshold on the target's
confidence) into a decision in tokens per second.

The policy (``SpeculationCostPolicy``) holds the estimates and is shared by every generation that
uses it (one drafter's); it is not frozen. ``drafters.control.DraftControl(length_schedule=
"cost-model")`` holds one, so every method with a drafter can select it (``generate
--draft-length-schedule cost-model``, the bench's ``+cost-model``).
"""

from __future__ import annotations

import logging
import math
from collections.abc import Sequence

from specdecode.engine.cost_model import (
    DRAFT_MODEL_PRIOR,
    PROMPT_LOOKUP_PRIOR,
    SIZES,
    DepthAcceptance,
    ForwardCosts,
    RateMean,
    SizeMeans,
    best_size,
    check_count,
    expected_tokens,
)
from specdecode.engine.protocol import DraftPolicy, Drafter, MeasureForwards, RoundController
from specdecode.errors import InvalidArgumentError

logger = logging.getLogger(__name__)

#: Widths an eager target is timed at (those up to the widest verification, and that one).
EAGER_WIDTHS = (1, 2, 3, 5, 9, 17, 33, 65)

#: The acceptance, at every depth, at which ``SpeculationCostPolicy.can_pay`` asks whether any size could beat a
#: plain step: a draft model's on text it copies. A drafter that would not pay even there does not draft (with a
#: fixed draft cost not even a probe; a measured one gets a rare probe, as it may fall), as a probe's draft-model
#: catch-up and wider verification cost more than a round could return (the
#: llama.cpp 0.5B draft beside the 1.5B target on a 2-core Xeon: 44 ms a token against a 64 ms step, where
#: 3 tokens at α = 1 would pay by 3% and its probes made "draft" 0.83x target-only).
PLAUSIBLE_ACCEPTANCE = 0.95


def _check_seconds(name: str, value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value < 0:
        raise InvalidArgumentError(f"{name} must be finite seconds >= 0, got {value!r}")


def calibration_widths(max_width: int) -> tuple[int, ...]:
    """The widths to time for verifications up to ``max_width`` tokens: ``EAGER_WIDTHS`` below it, and it.

    Raises:
        InvalidArgumentError: ``max_width`` < 1.
    """
    check_count("max_width", max_width, 1)
    return tuple(sorted({w for w in EAGER_WIDTHS if w < max_width} | {max_width}))


class SpeculationCostPolicy(DraftPolicy):
    """A ``DraftPolicy`` choosing every round's draft size from forward costs and acceptance (module docstring).

    Not frozen: its estimates learn across the generations that use it, so give each drafter its own.

    Args:
        target_costs: The target's forward costs; None: measured by the engine's ``calibrate``.
        draft_node_s: Seconds per drafted node, fixed (the llama.cpp draft's one-token forward);
            None: measured from the drafter's ``propose`` calls (0 until the first).
        prior: α_d before any round, in [0, 1]; None: ``PROMPT_LOOKUP_PRIOR`` for a drafter without a
            model, ``DRAFT_MODEL_PRIOR`` for one with (``Drafter.supports_exit_policy``), decided at
            ``calibrate`` (``PROMPT_LOOKUP_PRIOR`` without one).
        prior_weight, decay: As ``DepthAcceptance``.
        size_decay: As ``SizeMeans`` (trees' accepted tokens, the measured seconds per node).
        probe_every: Rounds between two probes (>= 1).
        max_size: The largest size considered (>= 1; a generation's γ caps it too), and the widest
            verification calibrated is max_size + 1; None: γ (the llama.cpp target: 7, the widest
            of its measured widths less one, so no cost is extrapolated).

    Attributes:
        adaptive_exit: False (``exit_mode``: unused). ``trees``: whether the drafter's rounds were trees.
        depths: The ``DepthAcceptance`` (None until the prior is known).
        tree_accepted: The ``SizeMeans`` of a tree's accepted tokens by size.
        node_seconds: The ``SizeMeans`` (at key 0) of the measured seconds per drafted node.
        exit_rounds, plain_rounds: With an adaptive draft exit, the ``RateMean`` of every generation's rounds
            that drafted, and of the plain steps (``plain_rate``; with no target costs given, each
            generation's first plain step is a warm-up, not counted: a first one-token forward may set up
            kernels, and every row of a batched round skips that round alike).

    Raises:
        InvalidArgumentError: A value outside its range.
    """

    adaptive_exit = False
    exit_mode = "per-step"  # no exit of its own (``DraftControl`` pairs one with it)

    def __init__(self, target_costs: ForwardCosts | None = None, draft_node_s: float | None = None,
                 prior: float | None = None, prior_weight: float = 2.0, decay: float = 0.9, size_decay: float = 0.8,
                 probe_every: int = 16, max_size: int | None = None) -> None:
        if target_costs is not None and not isinstance(target_costs, ForwardCosts):
            raise InvalidArgumentError(f"target_costs must be a ForwardCosts or None, got {target_costs!r}")
        if draft_node_s is not None:
            _check_seconds("draft_node_s", draft_node_s)
        check_count("probe_every", probe_every, 1)
        if max_size is not None:
            check_count("max_size", max_size, 1)
        DepthAcceptance(0.5 if prior is None else prior, prior_weight, decay)  # validates them
        self.target_costs = target_costs
        self.draft_node_s = draft_node_s
        self.prior, self.prior_weight, self.decay = prior, prior_weight, decay
        self.probe_every = probe_every
        self.max_size = max_size
        self.tree_accepted = SizeMeans(size_decay)
        self.node_seconds = SizeMeans(size_decay)
        self.size_decay = size_decay
        self.exit_rounds = RateMean(size_decay)
        self.plain_rounds = RateMean(size_decay)
        self.trees = False
        self.depths: DepthAcceptance | None = None if prior is None else DepthAcceptance(prior, prior_weight, decay)
        self.by_match = False
        self.match_depths: dict[int | tuple[str, int], DepthAcceptance] = {}  # by ``match_key``

    @property
    def active(self) -> bool:
        """Always True: the size changes from round to round."""
        return True

    def calibrate(self, measure: MeasureForwards, max_width: int, drafter: Drafter) -> None:
        """Time the target at ``calibration_widths(max_width)`` (only while it has no costs, or wider ones are
        needed; ``max_width`` capped at ``max_size`` + 1) and take the prior from ``drafter`` (``prime``)."""
        if self.max_size is not None:
            max_width = min(max_width, self.max_size + 1)
        self.prime(drafter)
        known = self.target_costs.seconds if self.target_costs is not None else {}
        if max_width not in known and (not known or max_width > max(known)):
            widths = calibration_widths(max_width)
            self.target_costs = ForwardCosts({**known, **dict(measure(widths))})
            logger.info("cost model: target forwards %s; acceptance prior %.2f", ", ".join(
                f"{w} tok {s * 1e3:.1f} ms" for w, s in sorted(self.target_costs.seconds.items())), self.depths.prior)

    def prime(self, drafter: Drafter) -> None:
        """Take the acceptance prior from ``drafter`` (only while the policy has none), timing nothing: all an
        adaptive draft exit's two arms need before their rounds measure them (``DraftControl.calibrate``)."""
        if self.depths is None:
            prior = DRAFT_MODEL_PRIOR if getattr(drafter, "supports_exit_policy", False) else PROMPT_LOOKUP_PRIOR
            self.depths = DepthAcceptance(prior, self.prior_weight, self.decay)
        self.by_match = bool(getattr(drafter, "reports_ngram_sizes", False))

    def acceptance(self, ngram_size: int | tuple[str, int] | None = None) -> DepthAcceptance:
        """The depth estimates (made with ``PROMPT_LOOKUP_PRIOR`` if no prior is known yet); with ``ngram_size``
        (a ``match_key``), those of the blocks that continued a match of that many tokens in the row's sequence,
        or of ``(source, n)`` (``by_match``), from the same prior."""
        if self.depths is None:
            self.depths = DepthAcceptance(PROMPT_LOOKUP_PRIOR, self.prior_weight, self.decay)
        if ngram_size is None:
            return self.depths
        depths = self.match_depths.get(ngram_size)
        if depths is None:
            depths = self.match_depths[ngram_size] = DepthAcceptance(self.depths.prior, self.prior_weight, self.decay)
        return depths

    def node_cost(self) -> float:
        """s_node: seconds per drafted node (fixed, or the measured mean; 0 before any is measured)."""
        if self.draft_node_s is not None:
            return float(self.draft_node_s)
        return self.node_seconds.get(0) or 0.0

    def seconds(self, size: int) -> float:
        """seconds(n) = n · s_node + C_target(n + 1); before calibration every width costs 1 s (flat)."""
        verify = self.target_costs.at(size + 1) if self.target_costs is not None else 1.0
        return size * self.node_cost() + verify

    def expected_tokens(self, size: int, ngram_size: int | tuple[str, int] | None = None) -> float | None:
        """E[tokens](n): a chain's from the depth estimates (those after a match of ``ngram_size`` tokens, if
        given); a tree's 1 + A(n) (None: not measured)."""
        if size == 0:
            return 1.0
        if not self.trees:
            return 1.0 + self.acceptance(ngram_size).expected_accepted(size)
        accepted = self.tree_accepted.get(size)
        return None if accepted is None else 1.0 + accepted

    def rate(self, size: int, ngram_size: int | tuple[str, int] | None = None) -> float | None:
        """Expected tokens per second at ``size`` (None: a tree size not measured); ``ngram_size`` as in
        ``expected_tokens``."""
        tokens = self.expected_tokens(size, ngram_size)
        return None if tokens is None else tokens / self.seconds(size)

    def break_even(self, k: int, tolerance: float = 1e-6) -> float | None:
        """The smallest α, one at every depth, at which a chain of k >= 1 tokens is at least as fast as a
        plain step (bisection; None where even α = 1 does not pay). Before calibration every width costs 1 s.

        Raises:
            InvalidArgumentError: ``k`` < 1.
        """
        check_count("k", k, 1)
        plain, seconds = 1.0 / self.seconds(0), self.seconds(k)
        if expected_tokens(1.0, k) / seconds < plain:
            return None
        lo, hi = 0.0, 1.0
        while hi - lo > tolerance:
            mid = (lo + hi) / 2
            lo, hi = (lo, mid) if expected_tokens(mid, k) / seconds >= plain else (mid, hi)
        return hi

    def can_pay(self, sizes: Sequence[int]) -> bool:
        """Whether some size > 0 would beat a plain step at acceptance ``PLAUSIBLE_ACCEPTANCE`` at every depth."""
        plain = 1.0 / self.seconds(0)
        return any(expected_tokens(PLAUSIBLE_ACCEPTANCE, n) / self.seconds(n) > plain for n in sizes if n > 0)

    def plain_rate(self) -> float | None:
        """Tokens per second of a plain step: measured over plain rounds, else 1 / C_target(1) where the
        target's costs are known (None otherwise: with an adaptive exit, a plain round measures it)."""
        measured = self.plain_rounds.rate
        if measured is not None:
            return measured
        return None if self.target_costs is None else 1.0 / self.target_costs.at(1)

    def observe_draft(self, num_drafted: int, draft_seconds: float) -> None:
        """A round drafted ``num_drafted`` >= 1 nodes in ``draft_seconds``: the measured s_node moves."""
        if num_drafted >= 1 and draft_seconds >= 0 and math.isfinite(draft_seconds):
            self.node_seconds.add(0, draft_seconds / num_drafted)

    def observe_block(self, cap: int, num_drafted: int, num_accepted: int, depth: int | None,
                      ngram_size: int | tuple[str, int] | None = None) -> None:
        """A verified draft of ``num_drafted`` >= 1 nodes, ``depth`` deep (None: a chain), given ``cap``,
        of which ``num_accepted`` were accepted: a chain updates α_d (those after a match of ``ngram_size``
        tokens, if given); once the drafter has made a tree, every round also updates the mean of its ``cap``.

        Raises:
            InvalidArgumentError: As ``DepthAcceptance.update``.
        """
        is_tree = depth is not None and depth < num_drafted
        self.trees = self.trees or is_tree
        if self.trees:  # a tree drafter's round at ``cap`` (a chain when its tree had one branch)
            self.tree_accepted.add(cap, float(num_accepted))
        if not is_tree:
            self.acceptance(ngram_size).update(num_drafted, num_accepted)

    def controller(self, gamma: int, exit=None) -> SpeculationCostController:
        """Per-generation state, sizes up to γ (and ``max_size``); ``exit``: an adaptive draft exit
        (``drafters.control.AdaptiveDraftExit``) that stops each round's draft within its size, or None.

        Raises:
            InvalidArgumentError: ``gamma`` < 1.
        """
        check_count("max_tokens", gamma, 1)
        return SpeculationCostController(self, gamma if self.max_size is None else min(gamma, self.max_size), exit)


def match_key(ngram_size: int, source: str = "sequence") -> int | tuple[str, int]:
    """The key of ``SpeculationCostPolicy.match_depths`` for a block continuing a match of ``ngram_size`` tokens
    in ``source``: the size alone for the row's own sequence, else ``(source, ngram_size)``."""
    return ngram_size if source == "sequence" else (source, ngram_size)


#: With an adaptive draft exit, a probe of the drafting arm drafts at most this many tokens (the exit may stop
#: it sooner); only if the target accepts them all does the generation draft again (at the full cap).
EXIT_PROBE_TOKENS = 3

#: Where no size can pay at a measured draft cost, one token is still tried every this many
#: ``probe_every`` plain steps, so that a cost measured once too high (a first round's kernels) can fall.
RARE_PROBE_FACTOR = 8


class SpeculationCostController(RoundController):
    """The per-generation ``RoundController`` of a ``SpeculationCostPolicy``: its size each round, and probes.

    Args:
        policy: The policy (its estimates are shared).
        max_tokens: The largest size (γ), >= 1.
        exit: An adaptive draft exit (``update(drafted, accepted, cap)`` after each verified block) that
            the drafter applies within each round's size, or None.

    Attributes:
        gate: None. ``exit``, ``max_tokens``: as given. ``last``: the latest ``round_cap``.
        exit_rounds: With ``exit``, the ``RateMean`` of this generation's rounds that drafted.
        plain_rounds: With ``exit``, the ``RateMean`` of this generation's plain steps (as the policy's, without
            its first where the policy measures the target's costs by rounds): once it has one, the plain arm's rate is this generation's (``plain_rate``), as a step's cost grows
            with the context and the policy's may come from shorter prompts.
        num_probes: Rounds that drafted another size than the best, to measure it.

    Raises:
        InvalidArgumentError: ``max_tokens`` < 1.
    """

    gate = None

    def __init__(self, policy: SpeculationCostPolicy, max_tokens: int, exit=None) -> None:
        check_count("max_tokens", max_tokens, 1)
        self.policy = policy
        self.max_tokens = max_tokens
        self.exit = exit
        self.exit_rounds = RateMean(policy.size_decay)
        self.plain_rounds = RateMean(policy.size_decay)
        self._explore = False  # with ``exit``: the next round drafts, whatever the rates (a probe succeeded)
        self._plain_warmed = False  # with ``exit``: this generation's first plain step was seen (a warm-up)
        self._probing = False  # with ``exit``: the latest ``round_cap`` was a probe
        self.last = 0
        self.num_probes = 0
        self._rounds = 0
        self._plain_steps = 0
        self._probe_due = False  # a chain's probe was allowed and no round has drafted since
        self._backoff = 1  # the plain steps between a chain's probes are probe_every x this
        self._probe_up = True
        self._pending: tuple[int, int, int] | None = None
        self._ceiling: int | None = None  # the engine's lower cap (``record_round``), for probe_every rounds
        self._ceiling_rounds = 0
        self._match: int | tuple[str, int] | None = None  # ``trim``: the ``match_key`` of the block being verified
        self._match_probe = False  # ``trim``: that block is a probe
        self._match_plain: dict = {}  # per ``match_key``: blocks trimmed to nothing since its last draft
        self._match_backoff: dict = {}  # per ``match_key``: as ``_backoff``

    @property
    def sizes(self) -> list[int]:
        """The candidate sizes: 0 .. γ for a chain; ``cost_model.SIZES`` up to γ, and γ, for a tree. Where the
        engine lowered the size it was given (a row's share of ``max_verify_tokens``, the tokens left), the
        sizes stop at the engine's cap for ``probe_every`` rounds, so a size the engine cannot give is not
        chosen, and left unmeasured, round after round."""
        top = self.max_tokens if self._ceiling is None else min(self.max_tokens, self._ceiling)
        if self.policy.trees:
            return sorted({s for s in SIZES if s <= top} | {top})
        return list(range(top + 1))

    def _next(self) -> tuple[int, bool]:
        """The next round's size and whether it is a probe (no state changes)."""
        policy, sizes = self.policy, self.sizes
        if self.exit is not None:  # two arms, each priced by its measured rounds (module docstring)
            drafting, plain = self.exit_rounds.rate, self.plain_rate()
            if drafting is None and not self._explore:  # before this generation's first drafting round
                drafting = policy.exit_rounds.rate
            if sizes[-1] == 0:  # the engine allows no draft now
                return 0, False
            if plain is None and drafting is not None and not self._explore:
                return 0, False  # the plain arm's first rate: a real plain step, measured like the drafting arm
            if self._explore or drafting is None or plain is None or drafting >= plain:
                return sizes[-1], False
            due = self._probe_due or self._plain_steps + 1 >= policy.probe_every * self._backoff
            return (min(EXIT_PROBE_TOKENS, sizes[-1]), True) if due else (0, False)
        if policy.by_match and not policy.trees and policy.can_pay(sizes):  # nothing asked of a model: ``trim`` decides
            return sizes[-1], False
        if not policy.can_pay(sizes):
            # A measured draft cost may come from a slow first round (first-shape kernels): a rare probe
            # lets it be measured again; a fixed one (the llama.cpp draft's) or none never changes.
            rare = policy.draft_node_s is None and policy.node_seconds.get(0) is not None \
                and self._plain_steps + 1 >= RARE_PROBE_FACTOR * policy.probe_every
            return (1, True) if rare else (0, False)
        probe_round = (self._rounds + 1) % policy.probe_every == 0
        if policy.trees:
            best = best_size(sizes, policy.rate)
            best_rate = policy.rate(best)
            for n in sizes:  # a size not measured: tried once, if it could beat the best at all
                if policy.rate(n) is None and (best_rate is None or (1.0 + n) / policy.seconds(n) > best_rate):
                    return n, False
            if not probe_round:
                return best, False
            i = sizes.index(best)
            up = i == 0 or (self._probe_up and i + 1 < len(sizes))
            return sizes[min(i + 1, len(sizes) - 1) if up else i - 1], True
        best = best_size(sizes, policy.rate)
        if best == 0:
            due = self._probe_due or self._plain_steps + 1 >= policy.probe_every * self._backoff
            return (1, True) if due else (0, False)
        if probe_round and best < self.max_tokens:
            return best + 1, True
        return best, False

    def plain_rate(self) -> float | None:
        """With an adaptive exit, the plain arm's tokens per second: this generation's plain steps' once it has
        one, else the policy's (``SpeculationCostPolicy.plain_rate``)."""
        rate = self.plain_rounds.rate
        return rate if rate is not None else self.policy.plain_rate()

    @property
    def gated(self) -> bool:
        """Whether the next round is a plain step (size 0)."""
        return self._next()[0] == 0

    def round_cap(self) -> int:
        """The size of the next round; call once per round."""
        size, probe = self._next()
        self._rounds += 1
        self._probing = self.exit is not None and probe and size > 0  # this round is the exit mode's probe
        if probe:
            self.num_probes += 1
            if self.policy.trees and self.exit is None:
                self._probe_up = not self._probe_up
            elif self.exit is not None or best_size(self.sizes, self.policy.rate) == 0:
                self._probe_due = True
        self._plain_steps = self._plain_steps + 1 if size == 0 else 0
        if self._ceiling is not None:
            self._ceiling_rounds += 1
            if self._ceiling_rounds > self.policy.probe_every:
                self._ceiling = None
        self.last = size
        return size

    def trim(self, num_tokens: int, ngram_size: int, source: str = "sequence") -> int:
        """The tokens of a block of ``num_tokens`` that continues a match of ``ngram_size`` tokens found in
        ``source`` (``Draft.match_sources``) to verify.

        With a drafter that reports its matches (``by_match``: prompt lookup's chains) each n-gram size of
        each source has its own α_d (``match_key``), as a longer match is accepted more often; the size with the most expected tokens per
        second under them is kept (0: a plain step). Where none pays, one token is tried after
        ``probe_every`` plain steps of that n-gram size (twice as long after each probe that changed
        nothing, up to ``RARE_PROBE_FACTOR`` x); where the best size is below the block, one more token every
        ``probe_every`` rounds. Otherwise (other drafters, trees, an adaptive exit) the block is kept.
        """
        policy = self.policy
        self._match, self._match_probe = None, False
        key = match_key(ngram_size, source)
        if not policy.by_match or policy.trees or self.exit is not None or num_tokens < 1:
            return num_tokens
        self._match = key
        if not policy.can_pay(self.sizes):  # ``round_cap``'s rare probe (a measured draft cost may have fallen)
            return min(num_tokens, 1)
        top = min(num_tokens, self.sizes[-1])
        best = best_size(range(top + 1), lambda n: policy.rate(n, key))
        if best == 0:
            waited = self._match_plain.get(key, 0) + 1
            if top and waited >= policy.probe_every * self._match_backoff.get(key, 1):
                self._match_plain[key] = 0
                self._match_probe = True
                self.num_probes += 1
                return 1
            self._match_plain[key] = waited
            return 0
        self._match_plain[key] = 0
        if self._rounds % policy.probe_every == 0 and best < top:
            self.num_probes += 1
            return best + 1
        return best

    def record(self, cap: int, num_drafted: int, num_accepted: int) -> None:
        """After verifying ``num_drafted`` >= 1 nodes under ``cap``; counted at ``record_round`` (which knows
        the draft's depth).

        Raises:
            InvalidArgumentError: ``num_accepted`` outside 0 .. ``num_drafted``.
        """
        if num_drafted < 0 or not 0 <= num_accepted <= max(num_drafted, 0):
            raise InvalidArgumentError(f"a verified block accepts 0..drafted tokens, got {num_accepted!r} of "
                                       f"{num_drafted!r}")
        self._pending = (cap, num_drafted, num_accepted)
        if self.exit is not None and num_drafted >= 1:
            self.exit.update(num_drafted, num_accepted, cap)

    def record_round(self, cap: int, num_drafted: int, seconds: float, *, draft_seconds: float = 0.0,
                     depth: int | None = None) -> None:
        """After every round: a round that drafted feeds s_node and, with its ``record``, the acceptance
        (a chain's by depth, a tree's by size); one that drafted nothing is no evidence."""
        pending, self._pending = self._pending, None
        policy = self.policy
        if cap < self.last:  # the engine gave less than chosen: choose within its cap for a while
            self._ceiling, self._ceiling_rounds = cap, 0
        match, probe = self._match, self._match_probe
        self._match = None
        if not num_drafted:
            # a plain step's seconds, where no row drafted this round (another row's draft would count)
            if self.exit is not None and self.last == 0 and draft_seconds == 0.0:
                if policy.target_costs is None and not self._plain_warmed:
                    self._plain_warmed = True  # a first one-token forward may set up its kernels: a warm-up
                else:
                    self.plain_rounds.add(1, seconds)
                    policy.plain_rounds.add(1, seconds)
            return
        policy.observe_draft(num_drafted, draft_seconds)
        if pending is not None and pending[1] >= 1:
            p_cap, drafted, accepted = pending
            policy.observe_block(p_cap, drafted, accepted, depth if depth is not None and depth < drafted else None,
                                 match)
            if match is not None:  # as a chain's probes: a probe after which its n-gram size still does not pay
                # waits twice as long for the next; any block after which it pays resets the wait
                if best_size(range(self.max_tokens + 1), lambda n: policy.rate(n, match)) > 0:
                    self._match_backoff[match] = 1
                elif probe:
                    self._match_backoff[match] = min(2 * self._match_backoff.get(match, 1), RARE_PROBE_FACTOR)
            if self._probing:  # the exit mode's short probe: did its tokens come faster than plain steps'?
                plain = self.plain_rate()
                paying = plain is not None and seconds > 0 and (accepted + 1) / seconds >= plain
                if paying:  # drafting pays again here: draft at the full cap, measuring that arm afresh
                    self.exit_rounds, self._explore = RateMean(policy.size_decay), True
            elif self.exit is not None:
                self._explore = False
                self.exit_rounds.add(accepted + 1, seconds)
                policy.exit_rounds.add(accepted + 1, seconds)
                rate = self.exit_rounds.rate
                paying = rate is not None and rate >= (self.plain_rate() or 0.0)
            else:
                paying = policy.trees or best_size(self.sizes, policy.rate) > 0
            # a probe after which drafting still does not pay waits twice as long for the next
            probed = self._probing if self.exit is not None else self._probe_due
            self._backoff = 1 if paying or not probed else min(2 * self._backoff, RARE_PROBE_FACTOR)
            self._probe_due = self._probing = False
