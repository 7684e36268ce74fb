"""Bayesian optimisation of the layer-skip set with Optuna (``specdecode search``).

Which sublayers the layer-skip drafter (``specdecode.layer_skip``) bypasses decides
whether self-speculation pays. This module searches that choice: one binary
parameter per attention and per MLP sublayer (``attn_0``, ``mlp_0``, ...,
``attn_{L-1}``, ``mlp_{L-1}``: 2L parameters), with Optuna's TPE (default) or
Gaussian-process sampler, in a study kept in a database.

Objectives
----------
``modelled`` (default): cheap and nearly noise-free. Once per study, and stored in
the study so that resumed runs and other workers reuse it:

1. the target's greedy continuations of the calibration prompts (the autoregressive
   decoder of ``specdecode.decoding``, ``max_new_tokens`` each);
2. the time of a one-token decode step with a warm KV cache, T, and of each
   sublayer inside it (forward pre/post hooks on every ``self_attn`` and ``mlp``;
   medians over repeats after a warm-up); the fixed cost (embedding, norms, LM
   head) is T minus the sum of the sublayer times;
3. the verification cost ratio v(k) = time of a target forward over k new tokens
   / time of a forward over 1 token (warm cache), k = 1 .. max_gamma + 1. On a
   GPU v is about 1; on a CPU in bfloat16 it grows about linearly with k, so a
   model that assumes v = 1 would favour long drafts that do not pay there.

Each trial then costs one forward per calibration prompt, over the continuation
only: the draft (the target inside ``draft_mode``) runs teacher-forced over the
continuation on top of a copy of the target's KV cache of the prompt (encoded once
per worker, ``SkipSetSearch.prompt_caches``); the acceptance estimate α is the fraction of drafted positions (continuation tokens
2..M; the first comes from the prefill and is never drafted) where the draft's
argmax equals the target's token. The cost ratio is
c = (T − Σ costs of the skipped sublayers) / T, and the score is the expected
speedup at the best γ in 1..max_gamma::

    S(α, c, γ) = (1 − α^(γ+1)) / ((1 − α) · (γ·c + v(γ+1)))        (→ (γ+1)/(γ·c + v(γ+1)) at α = 1)

i.e. expected tokens per round over the round's cost in target decode steps. With
v ≡ 1 this is Draft & Verify's / Leviathan et al.'s (1 − α^(γ+1)) / ((1 − α)(γc + 1));
both figures are recorded per trial (user attributes ``speedup`` and ``speedup_v1``,
with ``alpha``, ``cost_ratio``, ``best_gamma`` and ``best_gamma_v1``).

``measured``: real self-speculative decoding (``LayerSkipDrafter``, greedy, γ =
``num_speculative_tokens``, default 5) of the calibration prompts after a warm-up,
scored as decode-phase tokens/s over the autoregressive loop's tokens/s on the same prompts
(measured once per study and stored). The running speedup is reported after each
prompt and a ``MedianPruner`` stops bad trials part-way.

After a ``modelled`` search the ``remeasure`` (default 3) best distinct sets are
decoded for real like a ``measured`` trial (γ = their modelled best γ unless
``num_speculative_tokens`` is given). ``best.json`` then holds the set with the best
MEASURED speedup among them, with both figures; with ``remeasure=0`` it holds the
best modelled set.

Teacher-forced vs real acceptance
---------------------------------
In real decoding the layer-skip drafter writes into the target's KV cache, so for
confirmed positions the draft attends to the TARGET's keys/values, and only its own
new positions carry draft-mode keys/values. The teacher-forced draft forward
attends to the target's keys/values for the prompt too, but to draft-mode
keys/values for every continuation position. The two coincide exactly when the
skip set touches only the last decoder layer: every earlier layer sees the same
input in both passes, hence writes the same keys/values, and the last layer's
keys/values are either unused (its attention skipped) or computed before its MLP.
For such a set, greedy, the token the real drafter proposes at any position whose
prefix is the target's own output equals the teacher-forced argmax there; with
γ = 1 every round drafts exactly one such position, so the real acceptance rate
equals the teacher-forced agreement at the drafted positions, and for any γ each
round accepts the leading run of teacher-forced agreements (capped at γ). That
leading-run rule is the model behind S above, whose α is a per-position
probability, not the "accepted / drafted" rate that ``SpecDecodingStats`` reports
(which also counts tokens drafted after a rejection). For deeper skip sets the
draft's logits differ between the two passes (tests/test_search.py checks that they
do, and by how much the two acceptance figures differ on a tiny model), so α is an
estimate; the re-measurement reports the real figure beside it.

Search space and bounds
-----------------------
``min_skip_fraction`` / ``max_skip_fraction`` bound the fraction of the 2L
sublayers skipped; the empty set is never allowed (``SkipSet`` rejects it). A
trial outside the bounds is NOT pruned: it completes at once, without a forward or
any decoding, with value 0.0 and a positive constraint value (Optuna 5's
``Trial.set_constraint``; every trial sets the constraint, ≤ 0 when feasible).
Why: Optuna 5's TPE and GP samplers both model constraints and
``Study.best_trial`` skips infeasible trials, but ``GPSampler`` fits only COMPLETE
trials, so a pruned infeasible trial would be invisible to it and it could propose
the same set again and again. The study is seeded with a few known-reasonable sets
(``seed_skip_sets``) via ``enqueue_trial(skip_if_exists=True)``. A set already
evaluated in the study is not evaluated again: the trial copies its value.

Storage, resuming, several workers
----------------------------------
The study lives in an Optuna ``RDBStorage``: by default the SQLite file
``<folder of --out>/<study name>.db``, or any SQLAlchemy URL. Completed trials are
committed one by one, so killing a search (even with SIGKILL) loses only the trial
in flight. Running trials send a heartbeat (every ``heartbeat_interval_s``); a trial
silent for twice that (e.g. its worker was killed) is marked FAIL by the next worker
that starts a trial after that grace period (plus up to 1 s on SQLite, whose
timestamps have 1 s resolution), and re-queued once with the same
parameters (``RetryHeartbeatStaleTrialCallback``); a worker killed in the
milliseconds between starting a trial and its first heartbeat leaves that trial
RUNNING for good (Optuna judges only trials with a heartbeat), which costs nothing
but a RUNNING entry: it does not count toward ``trials``. On SQLite every transaction
begins with ``BEGIN IMMEDIATE`` (``open_storage``): SQLite ignores the ``SELECT ... FOR
UPDATE`` with which Optuna claims a queued trial, so two workers could otherwise both
run one queued seed set or re-queued trial. A worker killed while making the
one-off measurements is replaced after 3 heartbeats by the next one that starts.
``trials`` = N means N finished (COMPLETE or PRUNED) trials in the study in total
(``MaxTrialsCallback``), so re-running the same command finishes the remainder,
and several workers started with the same storage and study name share the work
through Optuna's own distributed optimisation (each may finish one trial beyond N
while the others stop). The study records the model and the search settings
(``identity``); opening it with another model, layer count, dtype, objective or
calibration is a ``StudyMismatchError``. The one-off measurements are claimed
through a lease in the study (``_shared_once``: one worker computes, the others
wait), which assumes the workers' clocks agree within a few heartbeats.

N workers against PostgreSQL: create an empty database once, then run the same
command on each machine (or several times on one)::

    specdecode search --target qwen2.5-coder-1.5b-instruct --dtype bfloat16 --trials 200 \\
        --storage postgresql://user:password@dbhost/specdecode --study-name qwen15-skip

(needs a PostgreSQL driver such as ``psycopg2-binary``). Every worker stops when
the study holds 200 finished trials, re-measures and writes its own ``best.json``;
pass ``--remeasure 0 --no-plots`` to all but one. Give each worker a different
``--seed`` or none (the default, random), or they may propose the same sets.
Timings are per machine: mix machines only with the modelled objective, whose
timing table is measured once (by the first worker) for the whole study.
"""

from __future__ import annotations

import copy
import json
import logging
import math
import os
import socket
import statistics
import threading
import time
import uuid
import warnings
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import optuna
import torch
from optuna.trial import TrialState
from transformers import DynamicCache

from specdecode import kv_cache
from specdecode.config import GenerationConfig, check_num_speculative_tokens
from specdecode.datasets import HUMANEVAL, SPEC_BENCH, Prompt, load_prompts, read_jsonl
from specdecode.decoding import SpeculativeDecoder
from specdecode.errors import (
    DatasetError,
    InvalidArgumentError,
    NonFiniteLogitsError,
    SpecDecodeError,
    StorageError,
    StudyMismatchError,
)
from specdecode.files import write_atomic, write_png_atomic, write_text_atomic
from specdecode.layer_skip import SUBLAYERS, LayerSkipDrafter, SkipSet, decoder_layers, draft_mode
from specdecode.models import LoadedModel
from specdecode.pipeline import SpeculativeGenerator, eos_token_ids

logger = logging.getLogger(__name__)

OBJECTIVES = ("modelled", "measured")
SAMPLERS = ("tpe", "gp")
FINISHED_STATES = (TrialState.COMPLETE, TrialState.PRUNED)
CONSTRAINT_KEY = "skip_fraction"

# Study user attributes (JSON values shared by every worker of a study).
ATTR_IDENTITY = "specdecode:identity"
ATTR_PROMPTS = "specdecode:prompts"
ATTR_REFERENCE = "specdecode:reference"
ATTR_COSTS = "specdecode:costs"
ATTR_MEASURED = "specdecode:measured:"  # + trial number
# Identity keys that name the model; the rest are search settings.
MODEL_KEYS = ("model", "model_type", "num_layers", "hidden_size", "vocab_size", "dtype")

HISTORY_PNG = "search_history.png"
HISTORY_HTML = "search_history.html"
IMPORTANCES_PNG = "search_importances.png"
IMPORTANCES_HTML = "search_importances.html"
HEATMAP_PNG = "search_skip_heatmap.png"


# ---------------------------------------------------------------------------------------------
# settings


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


@dataclass(frozen=True)
class SearchSettings:
    """How a skip-set search runs.

    Attributes:
        trials: Finished (COMPLETE or PRUNED) trials the study should hold in total, >= 1.
        objective: "modelled" or "measured" (see the module docstring).
        sampler: "tpe" (``TPESampler``) or "gp" (``GPSampler``, needs scipy).
        timeout_s: Stop starting trials after this many seconds of optimisation
            (the one-off calibration is not counted); None: no limit.
        calibration: "humaneval", "spec-bench", "spec-bench:CATEGORY" or a JSONL file.
        num_prompts: Calibration prompts used, >= 1.
        prompt_offset: Calibration prompts skipped first (keep held-out prompts out), >= 0.
        chat: Override the dataset's chat-template default (see ``specdecode.datasets``).
        max_new_tokens: Tokens of each greedy continuation / measured generation, >= 2.
        max_gamma: Largest γ the modelled objective considers, >= 1.
        num_speculative_tokens: γ of measured decoding; None: 5 for the measured
            objective, each set's modelled best γ when re-measuring.
        min_skip_fraction, max_skip_fraction: Bounds on the fraction of the 2L
            sublayers skipped, 0 <= min <= max <= 1.
        remeasure: Best distinct modelled sets decoded for real afterwards, >= 0.
        seed: Sampler seed (None: random). Give parallel workers different seeds.
        timing_repeats: Timed repeats per measurement of the modelled objective, >= 1.
        warmup_tokens: Length of the warm-up generation before measured decoding, >= 1.
        heartbeat_interval_s: Seconds between heartbeats of a running trial, >= 1;
            a trial silent for twice this is marked failed.

    Raises:
        InvalidArgumentError: A value outside the range given above.
    """

    trials: int = 100
    objective: str = "modelled"
    sampler: str = "tpe"
    timeout_s: float | None = None
    calibration: str = HUMANEVAL
    num_prompts: int = 4
    prompt_offset: int = 0
    chat: bool | None = None
    max_new_tokens: int = 64
    max_gamma: int = 12
    num_speculative_tokens: int | None = None
    min_skip_fraction: float = 0.0
    max_skip_fraction: float = 1.0
    remeasure: int = 3
    seed: int | None = None
    timing_repeats: int = 5
    warmup_tokens: int = 8
    heartbeat_interval_s: int = 10

    def __post_init__(self) -> None:
        def need_int(name: str, lo: int) -> None:
            v = getattr(self, name)
            if not _is_int(v) or v < lo:
                raise InvalidArgumentError(f"{name} must be an integer >= {lo}, got {v!r}")

        need_int("trials", 1)
        need_int("num_prompts", 1)
        need_int("prompt_offset", 0)
        need_int("max_new_tokens", 2)
        need_int("max_gamma", 1)
        need_int("remeasure", 0)
        need_int("timing_repeats", 1)
        need_int("warmup_tokens", 1)
        need_int("heartbeat_interval_s", 1)
        if self.objective not in OBJECTIVES:
            raise InvalidArgumentError(f"unknown objective {self.objective!r}; allowed: {', '.join(OBJECTIVES)}")
        if self.sampler not in SAMPLERS:
            raise InvalidArgumentError(f"unknown sampler {self.sampler!r}; allowed: {', '.join(SAMPLERS)}")
        if self.timeout_s is not None and not (isinstance(self.timeout_s, (int, float)) and self.timeout_s > 0):
            raise InvalidArgumentError(f"timeout must be a number of seconds > 0 (or unset), got {self.timeout_s!r}")
        if self.num_speculative_tokens is not None:
            check_num_speculative_tokens(self.num_speculative_tokens)
        for name in ("min_skip_fraction", "max_skip_fraction"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not (0.0 <= v <= 1.0):
                raise InvalidArgumentError(f"{name} must be a number in [0, 1], got {v!r}")
        if self.min_skip_fraction > self.max_skip_fraction:
            raise InvalidArgumentError(
                f"min_skip_fraction {self.min_skip_fraction} is above max_skip_fraction {self.max_skip_fraction}; "
                "need 0 <= min <= max <= 1"
            )
        if self.chat not in (None, True, False):
            raise InvalidArgumentError(f"chat must be True, False or None (auto), got {self.chat!r}")
        if not isinstance(self.calibration, str) or not self.calibration.strip():
            raise InvalidArgumentError(
                "calibration must be 'humaneval', 'spec-bench', 'spec-bench:CATEGORY' or a JSONL file, "
                f"got {self.calibration!r}"
            )

    @property
    def measured_gamma(self) -> int:
        """γ of the measured objective: ``num_speculative_tokens``, or ``GenerationConfig``'s default (5)."""
        return self.num_speculative_tokens or GenerationConfig.num_speculative_tokens

    def skip_count_bounds(self, num_layers: int) -> tuple[int, int]:
        """(lo, hi): the allowed numbers of skipped sublayers for a model with ``num_layers`` layers.

        Raises:
            InvalidArgumentError: If no non-empty skip set fits the fraction bounds.
        """
        n = 2 * num_layers
        lo = max(math.ceil(self.min_skip_fraction * n - 1e-9), 1)
        hi = math.floor(self.max_skip_fraction * n + 1e-9)
        if lo > hi:
            raise InvalidArgumentError(
                f"no skip set fits the bounds [{self.min_skip_fraction}, {self.max_skip_fraction}]: the model has "
                f"{n} sublayers ({num_layers} layers), so the bounds must admit a whole number of skipped "
                f"sublayers k with 1 <= k <= {n}, i.e. max_skip_fraction >= {1 / n:.4g} and "
                f"the interval [min*{n}, max*{n}] must contain an integer"
            )
        return lo, hi


# ---------------------------------------------------------------------------------------------
# the speedup model


def expected_speedup(alpha: float, cost_ratio: float, gamma: int, verify_ratio: float = 1.0) -> float:
    """Expected speedup of speculative decoding over the autoregressive loop.

    ``(1 − α^(γ+1)) / ((1 − α)(γ·c + v))``: the expected tokens per round (accepted
    draft tokens + the target's bonus/replacement token, assuming each draft token is
    accepted with probability α given the earlier ones were) over the round's cost in
    one-token target decode steps (γ draft forwards of relative cost c, one
    verification forward of relative cost v over γ + 1 tokens). At α = 1 the
    numerator is γ + 1.

    Args:
        alpha: Per-token acceptance probability in [0, 1].
        cost_ratio: c, draft forward time / target decode-step time, >= 0.
        gamma: Draft tokens per round, >= 1.
        verify_ratio: v(γ+1), verification forward time / decode-step time, > 0.

    Raises:
        InvalidArgumentError: A value outside those ranges.
    """
    if isinstance(alpha, bool) or not isinstance(alpha, (int, float)) or not (0.0 <= alpha <= 1.0):
        raise InvalidArgumentError(f"alpha must be in [0, 1], got {alpha!r}")
    if not isinstance(cost_ratio, (int, float)) or not math.isfinite(cost_ratio) or cost_ratio < 0:
        raise InvalidArgumentError(f"cost_ratio must be a finite number >= 0, got {cost_ratio!r}")
    if not _is_int(gamma) or gamma < 1:
        raise InvalidArgumentError(f"gamma must be an integer >= 1, got {gamma!r}")
    if not isinstance(verify_ratio, (int, float)) or not math.isfinite(verify_ratio) or verify_ratio <= 0:
        raise InvalidArgumentError(f"verify_ratio must be a finite number > 0, got {verify_ratio!r}")
    tokens = gamma + 1.0 if alpha == 1.0 else (1.0 - alpha ** (gamma + 1)) / (1.0 - alpha)
    return tokens / (gamma * cost_ratio + verify_ratio)


def best_speedup(
    alpha: float, cost_ratio: float, verify_ratios: Sequence[float] | None = None, max_gamma: int = 12
) -> tuple[int, float]:
    """The γ in 1..max_gamma with the largest ``expected_speedup``, and that speedup.

    Args:
        alpha, cost_ratio: As in ``expected_speedup``.
        verify_ratios: v(k) for k = 1 .. max_gamma + 1 (index k − 1); None means v ≡ 1.
        max_gamma: Largest γ tried, >= 1.

    Returns:
        (γ, speedup); ties go to the smaller γ.

    Raises:
        InvalidArgumentError: Bad arguments, or fewer than max_gamma + 1 verify ratios.
    """
    if not _is_int(max_gamma) or max_gamma < 1:
        raise InvalidArgumentError(f"max_gamma must be an integer >= 1, got {max_gamma!r}")
    if verify_ratios is not None and len(verify_ratios) < max_gamma + 1:
        raise InvalidArgumentError(
            f"verify_ratios must hold v(k) for k = 1..{max_gamma + 1} ({max_gamma + 1} values), "
            f"got {len(verify_ratios)}"
        )
    best = (0, -math.inf)
    for gamma in range(1, max_gamma + 1):
        v = 1.0 if verify_ratios is None else float(verify_ratios[gamma])
        s = expected_speedup(alpha, cost_ratio, gamma, v)
        if s > best[1]:
            best = (gamma, s)
    return best


# ---------------------------------------------------------------------------------------------
# search space


def param_names(num_layers: int) -> list[str]:
    """``["attn_0", "mlp_0", "attn_1", ...]``: the 2L binary parameters of the search."""
    return [f"{kind}_{i}" for i in range(num_layers) for kind in SUBLAYERS]


def params_to_skip_lists(params: dict[str, Any], num_layers: int) -> tuple[list[int], list[int]]:
    """(attn indices, mlp indices) whose parameter is True; either may be empty."""
    return (
        [i for i in range(num_layers) if params.get(f"attn_{i}")],
        [i for i in range(num_layers) if params.get(f"mlp_{i}")],
    )


def skip_set_params(skip_set: SkipSet, num_layers: int) -> dict[str, bool]:
    """The trial parameters (every one of the 2L names) that select ``skip_set``."""
    skip_set.check(num_layers)
    return {
        f"{kind}_{i}": i in getattr(skip_set, kind) for i in range(num_layers) for kind in SUBLAYERS
    }


def seed_skip_sets(num_layers: int) -> list[SkipSet]:
    """Known-reasonable starting points, distinct, for a model with ``num_layers`` layers.

    Later layers matter least to the next token in most pretrained LMs (Draft & Verify,
    LayerSkip), so: alternate whole layers of the later half; the later half's MLPs;
    every other layer's attention; the later half's alternate attentions (lighter).
    The first and last layers are kept whole except where a model has too few layers.
    """
    L = num_layers
    half = L // 2
    later = list(range(half, L - 1)) or [L - 1]
    alternate = later[::2]
    candidates = [
        SkipSet(attn=alternate, mlp=alternate),
        SkipSet(mlp=later),
        SkipSet(attn=list(range(1, max(L - 1, 2), 2)) if L > 1 else [0]),
        SkipSet(attn=alternate),
    ]
    out: list[SkipSet] = []
    for s in candidates:
        if s not in out:
            out.append(s)
    return out


def _constraint_violation(num_skipped: int, lo: int, hi: int, num_sublayers: int) -> float:
    """0.0 when lo <= num_skipped <= hi, else the distance outside, as a fraction of all sublayers."""
    return max(lo - num_skipped, num_skipped - hi, 0) / num_sublayers


# ---------------------------------------------------------------------------------------------
# calibration prompts, continuations, acceptance estimate, timings


def load_calibration_prompts(
    spec: str, num_prompts: int, *, offset: int = 0, chat: bool | None = None
) -> list[Prompt]:
    """The calibration prompts: ``num_prompts`` of them after skipping ``offset``, in file order.

    Args:
        spec: "humaneval", "spec-bench" (all categories), "spec-bench:CATEGORY", or a
            JSONL file (``specdecode.datasets`` describes the fields).
        num_prompts: How many, >= 1 (fewer when the source has fewer after ``offset``).
        offset: Prompts skipped first, >= 0.
        chat: Override of the dataset's chat-template default.

    Raises:
        DatasetError: A missing, unreadable or malformed file; no prompt left after ``offset``.
        InvalidArgumentError: An unknown Spec-Bench category (the allowed ones are
            listed) or a count out of range.
    """
    if not _is_int(num_prompts) or num_prompts < 1:
        raise InvalidArgumentError(f"num_prompts must be an integer >= 1, got {num_prompts!r}")
    if not _is_int(offset) or offset < 0:
        raise InvalidArgumentError(f"prompt offset must be an integer >= 0, got {offset!r}")
    if spec in (HUMANEVAL, SPEC_BENCH):
        prompts = load_prompts(spec, chat=chat)
    elif spec.startswith(SPEC_BENCH + ":"):
        category = spec.split(":", 1)[1].strip()
        if not category:
            raise InvalidArgumentError(f"calibration {spec!r} names no category; use e.g. 'spec-bench:coding'")
        prompts = load_prompts(SPEC_BENCH, categories=[category], chat=chat)
    else:
        path = Path(spec).expanduser()
        if not path.is_file():
            raise DatasetError(
                f"calibration file {spec!r} does not exist; --calibration takes a JSONL file (one object per "
                "line with a 'prompt' string or a 'turns' list), 'humaneval', 'spec-bench' or 'spec-bench:CATEGORY'"
            )
        prompts = read_jsonl(path, chat=chat)
    if offset >= len(prompts):
        raise DatasetError(
            f"calibration {spec!r} has {len(prompts)} prompts, none left after skipping {offset}; "
            f"the offset must be < {len(prompts)}"
        )
    return prompts[offset : offset + num_prompts]


def greedy_continuations(
    model: torch.nn.Module, prompts: Sequence[Sequence[int]], max_new_tokens: int, eos: Sequence[int] = ()
) -> list[dict]:
    """The target's greedy continuations with the autoregressive loop, timed.

    Returns:
        One dict per prompt: ``tokens`` (the new ids, EOS included when reached),
        ``num_new_tokens`` and ``seconds``: wall time of the decode phase (the prefill,
        which encodes the prompt and yields the first token, excluded: it is the same
        target forward with or without a drafter, and in bfloat16 on a CPU it can
        outweigh the decoding being measured).
    """
    decoder = SpeculativeDecoder(model, None, eos_token_ids=eos)
    config = GenerationConfig(max_new_tokens=max_new_tokens)
    out = []
    for ids in prompts:
        result = decoder.generate(list(ids), config)
        out.append(
            {
                "tokens": result.token_ids,
                "num_new_tokens": result.stats.num_new_tokens,
                "seconds": result.stats.decode_time_s,
            }
        )
    return out


@torch.inference_mode()
def teacher_forced_draft_tokens(
    model: torch.nn.Module,
    skip_set: SkipSet | None,
    prompt: Sequence[int],
    continuation: Sequence[int],
    prompt_cache: DynamicCache | None = None,
) -> torch.Tensor:
    """The draft's argmax at every drafted position, from one teacher-forced forward.

    Runs ``model`` (inside ``draft_mode(model, skip_set)``; the full model when
    ``skip_set`` is None) once over ``continuation[:-1]`` on top of a copy of
    ``prompt_cache``, the TARGET's cache of the prompt, so prompt positions carry the
    target's keys and values as in real decoding (and the forward costs M − 1 tokens,
    not n + M − 1). Without ``prompt_cache`` the forward covers
    ``prompt + continuation[:-1]`` with a fresh cache (draft keys/values everywhere).

    Args:
        prompt: n >= 1 prompt ids.
        continuation: The target's M new tokens.
        prompt_cache: ``SpeculativeDecoder(model).prompt_cache(prompt)``, or None; not modified.

    Returns:
        (M − 1,) long on the model's device: entry j is the draft's prediction of
        ``continuation[j + 1]`` (the first continuation token comes from the prefill
        and is never drafted); empty when M < 2.

    Raises:
        InvalidArgumentError: Empty prompt, a prompt cache of another length than the
            prompt, or a skip-set index out of range.
    """
    m = len(continuation)
    if len(prompt) == 0:
        raise InvalidArgumentError("the prompt is empty: teacher forcing needs at least one prompt token")
    if m < 2:
        return torch.empty(0, dtype=torch.long, device=model.device)
    if prompt_cache is not None:
        if prompt_cache.get_seq_length() != len(prompt):
            raise InvalidArgumentError(
                f"the prompt cache holds {prompt_cache.get_seq_length()} positions but the prompt has {len(prompt)}"
            )
        cache = copy.deepcopy(prompt_cache)
        ids = torch.tensor([list(continuation[:-1])], dtype=torch.long, device=model.device)
    else:
        cache = kv_cache.new_cache(model)
        ids = torch.tensor([list(prompt) + list(continuation[:-1])], dtype=torch.long, device=model.device)

    def run():
        return model(ids, past_key_values=cache, use_cache=True, logits_to_keep=m - 1).logits[0]

    if skip_set is None:
        logits = run()
    else:
        with draft_mode(model, skip_set):
            logits = run()
    return logits.argmax(dim=-1)


def acceptance_estimate(
    model: torch.nn.Module,
    skip_set: SkipSet | None,
    prompts: Sequence[Sequence[int]],
    continuations: Sequence[Sequence[int]],
    prompt_caches: Sequence[DynamicCache] | None = None,
) -> tuple[int, int]:
    """(agreements, drafted positions) of the teacher-forced draft over all prompts.

    α = agreements / positions: how often the draft's argmax equals the target's
    greedy token (see ``teacher_forced_draft_tokens``, which each prompt's entry of
    ``prompt_caches`` goes to; the module docstring says when this equals real
    decoding's acceptance).
    """
    agree = total = 0
    caches = prompt_caches if prompt_caches is not None else [None] * len(prompts)
    for prompt, cont, cache in zip(prompts, continuations, caches):
        pred = teacher_forced_draft_tokens(model, skip_set, prompt, cont, cache)
        if pred.numel() == 0:
            continue
        target = torch.tensor(list(cont[1:]), dtype=torch.long, device=pred.device)
        agree += int((pred == target).sum())
        total += int(pred.numel())
    return agree, total


@dataclass(frozen=True)
class DecodeCosts:
    """Measured times of one-token decode steps and of verification forwards.

    Attributes:
        step_s: T, median seconds of a one-token target forward with a warm cache.
        attn_s: Median seconds of each layer's attention sublayer inside that step (L,).
        mlp_s: Median seconds of each layer's MLP sublayer (L,).
        fixed_s: T − Σ sublayer times (embedding, norms, LM head, overhead), >= 0.
        verify_ratios: v(k) for k = 1 .. K (index k − 1; v(1) = 1): median seconds of
            a forward over k new tokens / over 1 token.
        verify_s: The medians behind ``verify_ratios`` (K,).
        context_tokens: Cached positions the steps attended to.
        repeats: Timed repeats (after the warm-up) behind each median.
        device: Where it was measured, e.g. "cpu", "cuda:0".
    """

    step_s: float
    attn_s: tuple[float, ...]
    mlp_s: tuple[float, ...]
    fixed_s: float
    verify_ratios: tuple[float, ...]
    verify_s: tuple[float, ...]
    context_tokens: int
    repeats: int
    device: str = "cpu"

    @property
    def total_s(self) -> float:
        """fixed + Σ sublayers: the step cost the ratios are taken against."""
        return self.fixed_s + sum(self.attn_s) + sum(self.mlp_s)

    def cost_ratio(self, skip_set: SkipSet) -> float:
        """c = (T − Σ costs of the sublayers ``skip_set`` skips) / T, in [0, 1]."""
        skipped = sum(self.attn_s[i] for i in skip_set.attn) + sum(self.mlp_s[i] for i in skip_set.mlp)
        total = self.total_s
        return (total - skipped) / total if total > 0 else 1.0

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> DecodeCosts:
        return cls(**{k: tuple(v) if isinstance(v, list) else v for k, v in d.items() if k in cls.__dataclass_fields__})


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


@torch.inference_mode()
def measure_decode_costs(
    model: torch.nn.Module, context: Sequence[int], max_tokens: int, *, repeats: int = 5, warmup: int = 2
) -> DecodeCosts:
    """Time a one-token decode step (whole and per sublayer) and forwards over 1..max_tokens tokens.

    A prefix of ``context`` is prefilled once; every timed forward appends to that
    warm cache and is rolled back after. Sublayer times come from forward pre/post
    hooks on each ``self_attn`` and ``mlp`` (with a CUDA synchronise in each hook on a
    GPU), in a separate forward from the unhooked one that gives T, so the hooks'
    overhead does not enter T. Medians over ``repeats`` after ``warmup`` rounds; the
    rounds interleave all forwards so that a load change affects all alike.

    Args:
        context: Token ids (e.g. a prompt and its continuation); repeated when shorter
            than max_tokens + 2.
        max_tokens: K, the longest forward timed (max_gamma + 1 for verification), >= 1.
        repeats, warmup: Timed rounds (>= 1) and untimed rounds before them (>= 0).

    Raises:
        InvalidArgumentError: Empty context or a count out of range.
    """
    if not context:
        raise InvalidArgumentError("the timing context is empty: pass at least one token id")
    if not _is_int(max_tokens) or max_tokens < 1:
        raise InvalidArgumentError(f"max_tokens must be an integer >= 1, got {max_tokens!r}")
    if not _is_int(repeats) or repeats < 1 or not _is_int(warmup) or warmup < 0:
        raise InvalidArgumentError(f"repeats must be >= 1 and warmup >= 0, got {repeats!r} and {warmup!r}")
    layers = decoder_layers(model)
    device = model.device
    ctx = list(context)
    while len(ctx) < max_tokens + 2:
        ctx = ctx + list(context)
    ids = torch.tensor([ctx], dtype=torch.long, device=device)
    n = len(ctx) - max_tokens
    cache = kv_cache.new_cache(model)
    model(ids[:, :n], past_key_values=cache, use_cache=True, logits_to_keep=1)
    kv_cache.rollback(cache, n, n)

    active = [False]
    starts: dict[str, float] = {}
    spent: dict[str, float] = {}
    handles = []

    def pre(key):
        def hook(module, args, kwargs=None):
            if active[0]:
                _sync(device)
                starts[key] = time.perf_counter()

        return hook

    def post(key):
        def hook(module, args, output):
            if active[0]:
                _sync(device)
                spent[key] = spent.get(key, 0.0) + time.perf_counter() - starts[key]

        return hook

    for i, layer in enumerate(layers):
        for kind, module in (("attn", layer.self_attn), ("mlp", layer.mlp)):
            handles.append(module.register_forward_pre_hook(pre(f"{kind}{i}")))
            handles.append(module.register_forward_hook(post(f"{kind}{i}")))

    def timed(k: int) -> float:
        _sync(device)
        t0 = time.perf_counter()
        model(ids[:, n : n + k], past_key_values=cache, use_cache=True)
        _sync(device)
        dt = time.perf_counter() - t0
        kv_cache.rollback(cache, n + k, n)
        return dt

    forward_s: list[list[float]] = [[] for _ in range(max_tokens)]
    sub_s: dict[str, list[float]] = {f"{kind}{i}": [] for i in range(len(layers)) for kind in SUBLAYERS}
    try:
        for r in range(warmup + repeats):
            for k in range(1, max_tokens + 1):
                dt = timed(k)
                if r >= warmup:
                    forward_s[k - 1].append(dt)
            spent.clear()
            active[0] = True
            try:
                timed(1)
            finally:
                active[0] = False
            if r >= warmup:
                for key in sub_s:
                    sub_s[key].append(spent.get(key, 0.0))
    finally:
        for h in handles:
            h.remove()
    verify_s = tuple(statistics.median(v) for v in forward_s)
    step = verify_s[0]
    attn = tuple(statistics.median(sub_s[f"attn{i}"]) for i in range(len(layers)))
    mlp = tuple(statistics.median(sub_s[f"mlp{i}"]) for i in range(len(layers)))
    fixed = step - sum(attn) - sum(mlp)
    if fixed < 0:
        logger.warning(
            "the sublayer times add up to %.3g ms, more than the %.3g ms of a whole decode step (timing noise); "
            "the fixed cost is taken as 0", 1e3 * (sum(attn) + sum(mlp)), 1e3 * step,
        )
        fixed = 0.0
    return DecodeCosts(
        step_s=step,
        attn_s=attn,
        mlp_s=mlp,
        fixed_s=fixed,
        verify_ratios=tuple(v / step for v in verify_s),
        verify_s=verify_s,
        context_tokens=n,
        repeats=repeats,
        device=str(device),
    )


def measure_speedup(
    model: torch.nn.Module,
    skip_set: SkipSet,
    prompts: Sequence[Sequence[int]],
    reference: Sequence[dict],
    *,
    num_speculative_tokens: int,
    max_new_tokens: int,
    eos: Sequence[int] = (),
    warmup_tokens: int = 8,
    on_prompt: Callable[[int, float], None] | None = None,
) -> dict:
    """Decode the prompts with the layer-skip drafter (greedy) and compare with the autoregressive loop.

    Args:
        skip_set: The drafter's skip set.
        prompts: Prompt ids.
        reference: Per prompt, the autoregressive run's ``num_new_tokens`` and
            ``seconds`` (``greedy_continuations``).
        num_speculative_tokens: γ, >= 1.
        max_new_tokens: Tokens per generation (as in the reference).
        warmup_tokens: Length of an untimed generation first.
        on_prompt: Called after each prompt i with the speedup so far; may raise
            (``optuna.TrialPruned``) to stop.

    Returns:
        ``speedup`` (pooled decode-phase tokens/s ÷ the reference's over the same
        prompts; the prefill and its token are left out on both sides),
        ``tokens_per_s``, ``baseline_tokens_per_s``, ``acceptance_rate`` (accepted ÷
        drafted), ``mean_accepted_tokens`` (tokens per target forward, bonus included),
        ``num_speculative_tokens``, ``num_prompts``, ``decode_tokens``, ``decode_seconds``.

    Raises:
        NonFiniteLogitsError: If the draft's logits are NaN/inf (e.g. a float16 overflow).
    """
    decoder = SpeculativeDecoder(model, LayerSkipDrafter(model, skip_set), eos_token_ids=eos)
    config = GenerationConfig(max_new_tokens=max_new_tokens, num_speculative_tokens=num_speculative_tokens)
    decoder.generate(list(prompts[0]), GenerationConfig(max_new_tokens=warmup_tokens,
                                                        num_speculative_tokens=num_speculative_tokens))
    tokens = seconds = base_tokens = base_seconds = 0.0
    drafted = accepted = forwards = from_forwards = 0
    speedup = 0.0
    for i, (ids, ref) in enumerate(zip(prompts, reference)):
        stats = decoder.generate(list(ids), config).stats
        # Decode phase only, on both sides: the tokens after the prefill's, over decode seconds.
        tokens += stats.num_new_tokens - 1
        seconds += stats.decode_time_s
        base_tokens += ref["num_new_tokens"] - 1
        base_seconds += ref["seconds"]
        drafted += stats.num_drafted_tokens
        accepted += stats.num_accepted_tokens
        forwards += stats.num_target_forwards
        from_forwards += stats.num_tokens_from_forwards
        speedup = (tokens / seconds) / (base_tokens / base_seconds) if seconds > 0 and base_seconds > 0 else 0.0
        if on_prompt is not None:
            on_prompt(i, speedup)
    return {
        "speedup": speedup,
        "tokens_per_s": tokens / seconds if seconds > 0 else 0.0,
        "baseline_tokens_per_s": base_tokens / base_seconds if base_seconds > 0 else 0.0,
        "acceptance_rate": accepted / drafted if drafted else None,
        "mean_accepted_tokens": from_forwards / forwards if forwards else None,
        "num_speculative_tokens": num_speculative_tokens,
        "num_prompts": len(prompts),
        "decode_tokens": int(tokens),
        "decode_seconds": seconds,
    }


# ---------------------------------------------------------------------------------------------
# storage


def redact_url(url: str) -> str:
    """``url`` with any password replaced by ``***`` (for logs, errors and best.json)."""
    try:
        from sqlalchemy.engine import make_url

        return make_url(url).render_as_string(hide_password=True)
    except Exception:  # not a URL at all: nothing to hide that a user did not type
        return url


def default_storage_url(out: str | Path, study_name: str) -> str:
    """``sqlite:///<absolute folder of out>/<study_name>.db``."""
    return f"sqlite:///{(Path(out).expanduser().resolve().parent / f'{study_name}.db').as_posix()}"


def default_study_name(model: str, dtype: str, objective: str) -> str:
    """``<model>-<dtype>-<objective>`` with any character outside [A-Za-z0-9._-] replaced by '-'."""
    label = _model_label(model)
    raw = f"{label}-{dtype}-{objective}"
    return "".join(ch if ch.isalnum() or ch in "._-" else "-" for ch in raw)


def open_storage(url: str, heartbeat_interval_s: int = 10) -> optuna.storages.RDBStorage:
    """Open (creating the tables if needed) an Optuna RDB storage with trial heartbeats.

    Args:
        url: Any SQLAlchemy URL: ``sqlite:///path/to/file.db``, ``postgresql://user:pw@host/db``, ...
        heartbeat_interval_s: Seconds between heartbeats of a running trial (>= 1); a
            trial silent for twice that is marked FAIL and re-queued once.

    Raises:
        StorageError: The URL is malformed, its driver is not installed, it names an
            in-memory SQLite database, or the database cannot be reached or created (the
            URL is named, password hidden).
        InvalidArgumentError: A heartbeat interval < 1.
    """
    import sqlalchemy.exc

    if not _is_int(heartbeat_interval_s) or heartbeat_interval_s < 1:
        raise InvalidArgumentError(f"heartbeat interval must be an integer >= 1 s, got {heartbeat_interval_s!r}")
    allowed = "a SQLAlchemy URL such as sqlite:///path/to/study.db or postgresql://user:password@host/dbname"
    if not isinstance(url, str) or "://" not in url:
        raise StorageError(f"cannot open storage {url!r}: not a database URL; expected {allowed}")
    sqlite = url.startswith("sqlite")
    if sqlite and _is_in_memory_sqlite(url):
        raise StorageError(
            f"cannot open storage {url!r}: an in-memory SQLite database is lost when the search ends and cannot "
            f"be shared by workers; expected a file, sqlite:///path/to/study.db, or {allowed.split(' or ')[1]}"
        )
    engine_kwargs = {"connect_args": {"timeout": 60}} if sqlite else {}
    attempts = 5
    try:
        for attempt in range(attempts):
            try:
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
                    storage = optuna.storages.RDBStorage(
                        url,
                        engine_kwargs=engine_kwargs,
                        heartbeat_interval=heartbeat_interval_s,
                        grace_period=2 * heartbeat_interval_s,
                        heartbeat_stale_trial_callback=optuna.storages.RetryHeartbeatStaleTrialCallback(max_retry=1),
                    )
                if sqlite:
                    _serialize_sqlite_transactions(storage.engine)
                return storage
            except (sqlalchemy.exc.IntegrityError, sqlalchemy.exc.OperationalError) as e:
                # Workers that start together on a new database race to create Optuna's tables
                # ("table ... already exists", a duplicate alembic_version row, "database is
                # locked"): the loser retries and finds the tables made.
                racing = isinstance(e, sqlalchemy.exc.IntegrityError) or any(
                    text in str(e) for text in ("locked", "already exists")
                )
                if not racing or attempt == attempts - 1:
                    raise
                logger.info("storage %s is being initialised by another worker; retrying", redact_url(url))
                time.sleep(0.2 * (attempt + 1))
    except (sqlalchemy.exc.SQLAlchemyError, ImportError, OSError, ValueError, RuntimeError) as e:
        reason = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        if isinstance(e, ImportError) and e.__cause__ is not None:
            reason += f" ({e.__cause__})"
        raise StorageError(f"cannot open storage {redact_url(url)!r}: {reason}; expected {allowed}") from None


def _is_in_memory_sqlite(url: str) -> bool:
    """Whether a ``sqlite`` SQLAlchemy URL names an in-memory database (no file, ``:memory:``)."""
    import sqlalchemy.engine
    import sqlalchemy.exc

    try:
        parsed = sqlalchemy.engine.make_url(url)
    except sqlalchemy.exc.ArgumentError:
        return False  # malformed: RDBStorage reports it
    return parsed.database in (None, "", ":memory:") or parsed.query.get("mode") == "memory"


def _serialize_sqlite_transactions(engine) -> None:
    """Make every transaction on a SQLite ``engine`` take the database's write lock at BEGIN.

    Optuna claims a queued (WAITING) trial by reading its state and writing RUNNING, relying
    on ``SELECT ... FOR UPDATE``, which SQLite ignores; Python's sqlite3 also starts the
    transaction only at the write. Two workers could therefore both read WAITING and both
    run the same trial (an enqueued seed set, or a stale trial re-queued), and the second
    to finish fails with "Cannot tell a COMPLETE trial". With ``BEGIN IMMEDIATE`` the read
    and the write are one serialised transaction (SQLAlchemy's documented pysqlite recipe).
    Connections opened before this call are discarded so that all later ones follow it.
    """
    from sqlalchemy import event

    def on_connect(dbapi_connection, _record) -> None:
        dbapi_connection.isolation_level = None  # no implicit BEGIN from sqlite3; we emit our own

    def on_begin(connection) -> None:
        connection.exec_driver_sql("BEGIN IMMEDIATE")

    event.listen(engine, "connect", on_connect)
    event.listen(engine, "begin", on_begin)
    engine.dispose()


# ---------------------------------------------------------------------------------------------
# the search


def _model_label(spec: str) -> str:
    """The model's name without the folder it sits in (so workers may keep it in different places)."""
    path = Path(spec).expanduser()
    return path.resolve().name if (spec.startswith((".", "/", "~")) or path.exists()) else spec


def _calibration_label(spec: str) -> str:
    return spec if spec in (HUMANEVAL, SPEC_BENCH) or spec.startswith(SPEC_BENCH + ":") else Path(spec).name


def model_identity(loaded: LoadedModel) -> dict:
    """What makes two runs search the same model: name, architecture, sizes, dtype."""
    cfg = loaded.model.config
    return {
        "model": _model_label(loaded.name),
        "model_type": getattr(cfg, "model_type", type(loaded.model).__name__),
        "num_layers": len(decoder_layers(loaded.model)),
        "hidden_size": getattr(cfg, "hidden_size", None),
        "vocab_size": int(loaded.model.get_output_embeddings().weight.shape[0]),
        "dtype": str(loaded.model.dtype).removeprefix("torch."),
    }


def _shared_once(study: optuna.Study, key: str, compute: Callable[[], Any], beat_s: float, what: str) -> Any:
    """The study user attribute ``key``, computed by exactly one worker if it is missing.

    A worker claims the job by writing ``key + ":claim"`` (owner, time), waits a
    moment, and computes only if its claim is still the one stored (a simultaneous
    claimer's later write wins); while computing it refreshes the claim every
    ``beat_s``. Others wait for the value, and take over a claim not refreshed for
    3 × ``beat_s`` (its worker died).
    """
    claim_key = key + ":claim"
    token = f"{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:8]}"
    stale_s = 3.0 * beat_s
    settle_s = min(1.0, beat_s)
    waiting = False
    while True:
        attrs = study.user_attrs
        if key in attrs:
            if waiting:
                logger.info("%s: using the one another worker stored", what)
            return attrs[key]
        claim = attrs.get(claim_key)
        if isinstance(claim, dict) and claim.get("owner") == token:
            break
        if isinstance(claim, dict) and time.time() - float(claim.get("time", 0)) < stale_s:
            if not waiting:
                logger.info("%s: waiting for worker %s, which is measuring it", what, claim.get("owner"))
                waiting = True
            time.sleep(settle_s)
            continue
        study.set_user_attr(claim_key, {"owner": token, "time": time.time()})
        time.sleep(settle_s)
    stop = threading.Event()

    def beat() -> None:
        while not stop.wait(beat_s):
            study.set_user_attr(claim_key, {"owner": token, "time": time.time()})

    thread = threading.Thread(target=beat, name=f"specdecode-claim-{key}", daemon=True)
    thread.start()
    try:
        logger.info("%s: measuring (once for the study)", what)
        value = compute()
    finally:
        stop.set()
        thread.join()
    study.set_user_attr(key, value)
    return value


@dataclass
class SearchState:
    """What a search has read from or stored in its study (shared by every worker)."""

    prompts: list[list[int]] = field(default_factory=list)
    prompt_labels: list[str] = field(default_factory=list)
    reference: list[dict] = field(default_factory=list)
    costs: DecodeCosts | None = None
    target_agreement: float | None = None


class SkipSetSearch:
    """A layer-skip-set search over one target model, in one Optuna study.

    Typical use (what ``specdecode search`` does)::

        search = SkipSetSearch(loaded, settings, storage_url, study_name)
        search.prepare()      # open/create the study, check identity, one-off measurements
        search.optimize()     # until the study holds settings.trials finished trials
        search.remeasure()    # modelled objective: decode the best sets for real
        result = search.write_outputs("out/best.json")

    Args:
        loaded: The target model (eval mode) and tokenizer.
        settings: See ``SearchSettings``.
        storage: An SQLAlchemy URL or an open ``RDBStorage`` (``open_storage``).
        study_name: Name of the study in the storage.
        prompts: Calibration prompts; None loads them from ``settings.calibration``
            (only needed when the study has none stored yet).

    Raises:
        StorageError: The storage cannot be opened.
        InvalidArgumentError: The fraction bounds admit no skip set of this model.
        UnsupportedModelError: The model's decoder layers cannot be found.
    """

    def __init__(
        self,
        loaded: LoadedModel,
        settings: SearchSettings,
        storage: str | optuna.storages.RDBStorage,
        study_name: str,
        prompts: list[Prompt] | None = None,
    ) -> None:
        if not isinstance(study_name, str) or not study_name.strip():
            raise InvalidArgumentError(f"the study name must be a non-empty string, got {study_name!r}")
        self.loaded = loaded
        self.model = loaded.model
        self.settings = settings
        self.num_layers = len(decoder_layers(self.model))
        self.count_bounds = settings.skip_count_bounds(self.num_layers)
        if isinstance(storage, str):
            self.storage_url = storage
            self.storage = open_storage(storage, settings.heartbeat_interval_s)
        else:
            self.storage_url = str(storage.url)
            self.storage = storage
        self.study_name = study_name
        self._prompts = prompts
        self._eos = sorted(eos_token_ids(loaded))
        self.identity = {
            **model_identity(loaded),
            "objective": settings.objective,
            "calibration": _calibration_label(settings.calibration),
            "num_prompts": settings.num_prompts,
            "prompt_offset": settings.prompt_offset,
            "chat": settings.chat,
            "max_new_tokens": settings.max_new_tokens,
            "max_gamma": settings.max_gamma,
            "min_skip_fraction": settings.min_skip_fraction,
            "max_skip_fraction": settings.max_skip_fraction,
            "num_speculative_tokens": settings.num_speculative_tokens if settings.objective == "measured" else None,
        }
        self.state = SearchState()
        self.study: optuna.Study | None = None
        self._prompt_caches: list[DynamicCache] | None = None  # the target's, per worker (not storable)
        self._worker = f"{socket.gethostname()}:{os.getpid()}"

    # -- study ------------------------------------------------------------------------------

    def _sampler(self) -> optuna.samplers.BaseSampler:
        s = self.settings
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
            if s.sampler == "gp":
                try:
                    import scipy  # noqa: F401  (GPSampler needs it; fail before the search, not inside)
                except ImportError:
                    raise SpecDecodeError(
                        "--sampler gp needs scipy (Optuna's GPSampler): pip install 'specdecode[search]' or scipy"
                    ) from None
                return optuna.samplers.GPSampler(
                    seed=s.seed, n_startup_trials=10, deterministic_objective=s.objective == "modelled"
                )
            return optuna.samplers.TPESampler(seed=s.seed, n_startup_trials=10, multivariate=True)

    def _pruner(self) -> optuna.pruners.BasePruner:
        if self.settings.objective == "measured":
            return optuna.pruners.MedianPruner(n_startup_trials=5, n_warmup_steps=0)
        return optuna.pruners.NopPruner()

    def open_study(self) -> optuna.Study:
        """Create the study or load the existing one, and check it is for this model and settings.

        Raises:
            StudyMismatchError: The study was made for another model, layer count,
                dtype, objective or calibration (every differing field is named).
            StorageError: The storage fails while opening the study.
        """
        import sqlalchemy.exc

        try:
            study = optuna.create_study(
                storage=self.storage,
                study_name=self.study_name,
                direction="maximize",
                sampler=self._sampler(),
                pruner=self._pruner(),
                load_if_exists=True,
            )
            stored = study.user_attrs.get(ATTR_IDENTITY)
            if stored is None:
                study.set_user_attr(ATTR_IDENTITY, self.identity)
                stored = study.user_attrs.get(ATTR_IDENTITY)
        except sqlalchemy.exc.SQLAlchemyError as e:
            raise StorageError(
                f"storage {redact_url(self.storage_url)!r} failed while opening study {self.study_name!r}: "
                f"{str(e).splitlines()[0]}"
            ) from None
        if study.direction != optuna.study.StudyDirection.MAXIMIZE:
            raise StudyMismatchError(
                f"study {self.study_name!r} in {redact_url(self.storage_url)!r} minimises; a skip-set search "
                "maximises the speedup: use another --study-name"
            )
        self._check_identity(stored)
        self.study = study
        return study

    def _check_identity(self, stored: dict) -> None:
        diffs = [k for k in self.identity if stored.get(k) != self.identity[k]]
        if not diffs:
            return
        where = f"study {self.study_name!r} in {redact_url(self.storage_url)!r}"
        model_diffs = [k for k in diffs if k in MODEL_KEYS]
        if model_diffs:
            theirs = ", ".join(f"{k}={stored.get(k)!r}" for k in MODEL_KEYS)
            ours = ", ".join(f"{k}={self.identity[k]!r}" for k in MODEL_KEYS)
            raise StudyMismatchError(
                f"{where} was made for a different model ({theirs}); this run has {ours}. "
                "A study holds one model's search: pass another --study-name (or storage) for this model"
            )
        detail = "; ".join(f"{k}: study {stored.get(k)!r}, this run {self.identity[k]!r}" for k in diffs)
        raise StudyMismatchError(
            f"{where} was made with other search settings ({detail}); rerun with the study's settings to "
            "resume it, or pass another --study-name"
        )

    # -- one-off measurements ---------------------------------------------------------------

    def prepare(self) -> None:
        """Open the study, enqueue the seed sets, and get (or make) the one-off measurements.

        Raises:
            StudyMismatchError, StorageError: See ``open_study``.
            DatasetError, InvalidArgumentError: Calibration prompts cannot be loaded
                (only when the study has none stored yet).
        """
        study = self.open_study() if self.study is None else self.study
        beat = self.settings.heartbeat_interval_s
        stored_prompts = _shared_once(study, ATTR_PROMPTS, self._encode_prompts, beat, "calibration prompts")
        self.state.prompts = [list(p) for p in stored_prompts["ids"]]
        self.state.prompt_labels = list(stored_prompts["labels"])
        self.state.reference = _shared_once(
            study, ATTR_REFERENCE, self._reference, beat, "target's greedy continuations"
        )
        if self.settings.objective == "modelled":
            costs = _shared_once(study, ATTR_COSTS, self._costs, beat, "decode-step and sublayer timings")
            self.state.costs = DecodeCosts.from_dict(costs["costs"])
            self.state.target_agreement = costs["target_agreement"]
            if len(self.state.costs.attn_s) != self.num_layers:
                raise StudyMismatchError(
                    f"study {self.study_name!r} holds timings of {len(self.state.costs.attn_s)} layers; the model "
                    f"has {self.num_layers}: pass another --study-name"
                )
        self._enqueue_seeds(study)  # no-op unless a worker died between creating the study and seeding it
        logger.info(
            "study %r: %d prompts, %d finished trials of %d", self.study_name, len(self.state.prompts),
            self.num_finished(), self.settings.trials,
        )

    def _encode_prompts(self) -> dict:
        s = self.settings
        prompts = self._prompts
        if prompts is None:
            prompts = load_calibration_prompts(s.calibration, s.num_prompts, offset=s.prompt_offset, chat=s.chat)
        else:
            prompts = list(prompts)[: s.num_prompts]
        gen = SpeculativeGenerator(self.loaded)
        ids = [gen.encode(p.text, p.chat)[0].tolist() for p in prompts]
        # The worker that sets the study up seeds it too, before the others (waiting for these
        # prompts) could enqueue the same sets at the same time.
        self._enqueue_seeds(self.study)
        return {"labels": [p.id for p in prompts], "ids": ids}

    def _reference(self) -> list[dict]:
        s = self.settings
        prompts = self.state.prompts
        # Warm-up: the first prompt, a few tokens, untimed.
        greedy_continuations(self.model, prompts[:1], s.warmup_tokens, self._eos)
        ref = greedy_continuations(self.model, prompts, s.max_new_tokens, self._eos)
        if not any(r["num_new_tokens"] >= 2 for r in ref):
            raise SpecDecodeError(
                "every greedy continuation of the calibration prompts ended after fewer than 2 tokens, so there "
                "is no drafted position to score: use other prompts or a larger --max-new-tokens"
            )
        return ref

    def _costs(self) -> dict:
        s = self.settings
        context = self.state.prompts[0] + self.state.reference[0]["tokens"]
        costs = measure_decode_costs(
            self.model, context, s.max_gamma + 1, repeats=s.timing_repeats, warmup=max(1, s.timing_repeats // 2)
        )
        agree, total = acceptance_estimate(
            self.model, None, self.state.prompts, self._continuations(), self.prompt_caches()
        )
        logger.info(
            "decode step %.2f ms (fixed %.2f ms), v(2) = %.2f, v(%d) = %.2f; target's teacher-forced agreement "
            "with its own greedy tokens %.3f", 1e3 * costs.step_s, 1e3 * costs.fixed_s, costs.verify_ratios[1],
            s.max_gamma + 1, costs.verify_ratios[-1], agree / total,
        )
        return {"costs": costs.to_dict(), "target_agreement": agree / total}

    def prompt_caches(self) -> list[DynamicCache]:
        """The target's KV caches of the calibration prompts, encoded once per worker.

        Every trial's teacher-forced draft forward starts from a copy, so it costs the
        continuation's tokens only and sees the target's keys and values for the prompt,
        as real decoding does.
        """
        if self._prompt_caches is None:
            decoder = SpeculativeDecoder(self.model)
            self._prompt_caches = [decoder.prompt_cache(p) for p in self.state.prompts]
        return self._prompt_caches

    def _continuations(self) -> list[list[int]]:
        return [r["tokens"] for r in self.state.reference]

    def _enqueue_seeds(self, study: optuna.Study) -> None:
        lo, hi = self.count_bounds
        for skip in seed_skip_sets(self.num_layers):
            if lo <= len(skip.attn) + len(skip.mlp) <= hi:
                study.enqueue_trial(skip_set_params(skip, self.num_layers), skip_if_exists=True)

    # -- trials ---------------------------------------------------------------------------

    def num_finished(self) -> int:
        """COMPLETE + PRUNED trials in the study (every worker's)."""
        return len(self.study.get_trials(deepcopy=False, states=FINISHED_STATES))

    def feasible_trials(self) -> list[optuna.trial.FrozenTrial]:
        """COMPLETE trials inside the bounds, best value first (``feasible_trials``)."""
        return feasible_trials(self.study)

    def best_value(self) -> float | None:
        """The best feasible value so far, or None."""
        trials = self.feasible_trials()
        return trials[0].value if trials else None

    def _objective(self, trial: optuna.Trial) -> float:
        L = self.num_layers
        for i in range(L):
            for kind in SUBLAYERS:
                trial.suggest_categorical(f"{kind}_{i}", (False, True))
        attn, mlp = params_to_skip_lists(trial.params, L)
        k = len(attn) + len(mlp)
        lo, hi = self.count_bounds
        violation = _constraint_violation(k, lo, hi, 2 * L)
        with warnings.catch_warnings():
            # A re-queued (retried) trial already carries the constraint, with the same value.
            warnings.filterwarnings("ignore", message="The constraint value is ignored")
            trial.set_constraint(CONSTRAINT_KEY, violation)
        trial.set_user_attr("worker", self._worker)
        trial.set_user_attr("skip_fraction", k / (2 * L))
        if violation > 0:
            reason = (
                "empty skip set" if k == 0 else
                f"{k} of {2 * L} sublayers skipped, outside the allowed {lo}..{hi}"
            )
            trial.set_user_attr("infeasible", reason)
            logger.info("trial %d: infeasible (%s), value 0", trial.number, reason)
            return 0.0
        skip = SkipSet(attn=attn, mlp=mlp)
        trial.set_user_attr("skip_set", str(skip))
        for other in self.study.get_trials(deepcopy=False, states=(TrialState.COMPLETE,)):
            if other.params == trial.params and other.number != trial.number and other.value is not None:
                for key, value in other.user_attrs.items():
                    if key not in ("worker", "duplicate_of"):
                        trial.set_user_attr(key, value)
                trial.set_user_attr("duplicate_of", other.number)
                logger.info("trial %d: same set as trial %d, value %.4f reused", trial.number, other.number,
                            other.value)
                return other.value
        if self.settings.objective == "modelled":
            return self._modelled(trial, skip)
        return self._measured(trial, skip)

    def modelled_figures(self, skip_set: SkipSet) -> dict:
        """α, c, best γ and the modelled speedups (measured v and v ≡ 1) of ``skip_set``.

        Needs ``prepare()`` (modelled objective) first.
        """
        if self.state.costs is None:
            raise SpecDecodeError("modelled_figures needs the modelled objective's timings: call prepare() first")
        s = self.settings
        agree, total = acceptance_estimate(
            self.model, skip_set, self.state.prompts, self._continuations(), self.prompt_caches()
        )
        alpha = agree / total
        c = self.state.costs.cost_ratio(skip_set)
        gamma, speedup = best_speedup(alpha, c, self.state.costs.verify_ratios, s.max_gamma)
        gamma1, speedup1 = best_speedup(alpha, c, None, s.max_gamma)
        return {
            "speedup": speedup,
            "alpha": alpha,
            "alpha_positions": total,
            "cost_ratio": c,
            "best_gamma": gamma,
            "speedup_v1": speedup1,
            "best_gamma_v1": gamma1,
        }

    def _modelled(self, trial: optuna.Trial, skip: SkipSet) -> float:
        figures = self.modelled_figures(skip)
        for key, value in figures.items():
            trial.set_user_attr(key, value)
        logger.info(
            "trial %d: %s  α=%.3f c=%.3f γ=%d modelled %.3f× (v≡1: %.3f× at γ=%d)", trial.number, skip,
            figures["alpha"], figures["cost_ratio"], figures["best_gamma"], figures["speedup"],
            figures["speedup_v1"], figures["best_gamma_v1"],
        )
        return figures["speedup"]

    def measure(self, skip_set: SkipSet, gamma: int, on_prompt: Callable[[int, float], None] | None = None) -> dict:
        """Real layer-skip decoding of the calibration prompts (``measure_speedup``) against the stored reference."""
        return measure_speedup(
            self.model, skip_set, self.state.prompts, self.state.reference,
            num_speculative_tokens=gamma, max_new_tokens=self.settings.max_new_tokens, eos=self._eos,
            warmup_tokens=self.settings.warmup_tokens, on_prompt=on_prompt,
        )

    def _measured(self, trial: optuna.Trial, skip: SkipSet) -> float:
        gamma = self.settings.measured_gamma

        def on_prompt(i: int, speedup: float) -> None:
            trial.report(speedup, i)
            if trial.should_prune():
                trial.set_user_attr("pruned_after_prompts", i + 1)
                logger.info("trial %d: %s pruned after %d prompt(s) at %.3f×", trial.number, skip, i + 1, speedup)
                raise optuna.TrialPruned()

        try:
            figures = self.measure(skip, gamma, on_prompt)
        except NonFiniteLogitsError as e:
            trial.set_user_attr("error", str(e))
            logger.warning("trial %d: %s gives non-finite draft logits (%s); value 0", trial.number, skip, e)
            return 0.0
        for key, value in figures.items():
            trial.set_user_attr(key, value)
        logger.info(
            "trial %d: %s  measured %.3f× (acceptance %s, γ=%d)", trial.number, skip, figures["speedup"],
            _fmt(figures["acceptance_rate"]), gamma,
        )
        return figures["speedup"]

    def optimize(self, progress: Callable[[int, int, float | None], None] | None = None) -> None:
        """Run trials until the study holds ``settings.trials`` finished ones (or the timeout).

        Args:
            progress: Called after every trial of this worker with (finished trials in
                the study, settings.trials, best feasible value or None).
        """
        if self.study is None:
            self.prepare()
        study = self.study
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
            failed_before = len(study.get_trials(deepcopy=False, states=(TrialState.FAIL,)))
            optuna.storages.fail_stale_trials(study)
        failed = len(study.get_trials(deepcopy=False, states=(TrialState.FAIL,))) - failed_before
        if failed:
            logger.info("marked %d stale running trial(s) of a stopped worker as failed (re-queued once)", failed)
        callbacks = [optuna.study.MaxTrialsCallback(self.settings.trials, states=FINISHED_STATES)]
        if progress is not None:
            callbacks.append(lambda _study, _trial: progress(self.num_finished(), self.settings.trials,
                                                             self.best_value()))
        start = time.monotonic()
        while True:
            remaining = self.settings.trials - self.num_finished()
            if remaining <= 0:
                logger.info("study %r holds %d finished trials (asked for %d)", self.study_name,
                            self.num_finished(), self.settings.trials)
                return
            timeout = None
            if self.settings.timeout_s is not None:
                timeout = self.settings.timeout_s - (time.monotonic() - start)
                if timeout <= 0:
                    return
            try:
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
                    study.optimize(self._objective, n_trials=remaining, timeout=timeout, callbacks=callbacks)
                return
            except AssertionError as e:
                if not _failed_by_another_worker(e):
                    raise
                # Optuna 5 raises when a trial that another worker declared stale (late heartbeat)
                # finishes; the other worker has re-queued it, so carry on with the next one.
                logger.warning(
                    "a running trial of this worker was marked failed by another worker (its heartbeat was more "
                    "than %d s late: raise --heartbeat-interval on a busy machine); it was re-queued, continuing",
                    2 * self.settings.heartbeat_interval_s,
                )

    # -- results --------------------------------------------------------------------------

    def top_distinct(self, k: int) -> list[optuna.trial.FrozenTrial]:
        """The ``k`` best feasible COMPLETE trials with distinct skip sets."""
        seen, out = set(), []
        for t in self.feasible_trials():
            key = tuple(sorted(t.params.items()))
            if key in seen:
                continue
            seen.add(key)
            out.append(t)
            if len(out) == k:
                break
        return out

    def remeasure(self, progress: Callable[[int, int], None] | None = None) -> list[dict]:
        """Decode the ``settings.remeasure`` best modelled sets for real (modelled objective only).

        Results are stored in the study (one attribute per trial), so a rerun reuses them.

        Returns:
            One dict per set: ``trial``, ``attn``, ``mlp``, ``modelled`` (the trial's
            figures) and ``measured`` (``measure_speedup``'s), best modelled first.
        """
        if self.settings.objective != "modelled" or self.settings.remeasure == 0:
            return []
        if not self.state.reference:
            self.prepare()
        top = self.top_distinct(self.settings.remeasure)
        out = []
        for j, t in enumerate(top):
            skip = SkipSet(*params_to_skip_lists(t.params, self.num_layers))
            gamma = self.settings.num_speculative_tokens or int(t.user_attrs["best_gamma"])
            key = f"{ATTR_MEASURED}{t.number}"
            stored = self.study.user_attrs.get(key)
            if stored is not None and stored.get("num_speculative_tokens") == gamma:
                measured = stored
            else:
                logger.info("re-measuring trial %d (%s, modelled %.3f×) with γ=%d", t.number, skip, t.value, gamma)
                measured = self.measure(skip, gamma)
                self.study.set_user_attr(key, measured)
            logger.info("trial %d: modelled %.3f×, measured %.3f× (acceptance %s)", t.number, t.value,
                        measured["speedup"], _fmt(measured["acceptance_rate"]))
            out.append({"trial": t.number, **skip.to_dict(), "modelled": _modelled_attrs(t), "measured": measured})
            if progress is not None:
                progress(j + 1, len(top))
        return out

    def result(self, remeasured: list[dict] | None = None) -> dict:
        """The best set and its figures, in the form written to best.json.

        Selection: with re-measured sets (modelled objective), the best MEASURED
        speedup among them; otherwise the best objective value.

        Raises:
            SpecDecodeError: No feasible completed trial yet.
        """
        feasible = self.feasible_trials()
        if not feasible:
            raise SpecDecodeError(
                f"study {self.study_name!r} has no completed trial inside the skip bounds yet: run more trials "
                "or widen --min-skip-fraction/--max-skip-fraction"
            )
        by_number = {t.number: t for t in feasible}
        if remeasured:
            pick = max(remeasured, key=lambda r: (r["measured"]["speedup"], -r["trial"]))
            best = by_number[pick["trial"]]
            measured = pick["measured"]
            selected_by = (
                f"the best measured speedup among the {len(remeasured)} best modelled distinct sets (re-measured)"
            )
        else:
            best = feasible[0]
            measured = _measured_attrs(best) if self.settings.objective == "measured" else None
            selected_by = f"the best {self.settings.objective} speedup"
        modelled = _modelled_attrs(best) if self.settings.objective == "modelled" else None
        if measured is not None:
            gamma = measured["num_speculative_tokens"]
        elif modelled is not None:
            gamma = modelled["best_gamma"]
        else:
            gamma = self.settings.measured_gamma
        skip = SkipSet(*params_to_skip_lists(best.params, self.num_layers))
        states = [t.state for t in self.study.get_trials(deepcopy=False)]
        return {
            **skip.to_dict(),
            "model": self.identity["model"],
            "dtype": self.identity["dtype"],
            "num_layers": self.num_layers,
            "num_speculative_tokens": gamma,
            "objective": self.settings.objective,
            "selected_by": selected_by,
            "trial": best.number,
            "modelled": modelled,
            "measured": measured,
            "remeasured": remeasured or [],
            "num_trials": sum(s in FINISHED_STATES for s in states),
            "trial_states": {s.name.lower(): states.count(s) for s in TrialState if states.count(s)},
            "num_infeasible": sum("infeasible" in t.user_attrs for t in self.study.get_trials(deepcopy=False)),
            "study_name": self.study_name,
            "storage": redact_url(self.storage_url),
            "calibration": {
                "source": self.identity["calibration"],
                "prompts": self.state.prompt_labels,
                "max_new_tokens": self.settings.max_new_tokens,
                "target_teacher_forced_agreement": self.state.target_agreement,
                "decode_step_ms": 1e3 * self.state.costs.step_s if self.state.costs else None,
                "verify_ratios": list(self.state.costs.verify_ratios) if self.state.costs else None,
            },
        }

    def write_outputs(self, out: str | Path, remeasured: list[dict] | None = None, plots: bool = True) -> dict:
        """Write best.json (``result``) at ``out`` and, with ``plots``, the plots beside it.

        Returns:
            The result dict, with ``files``: the paths written.
        """
        out = Path(out)
        out.parent.mkdir(parents=True, exist_ok=True)
        result = self.result(remeasured)
        write_text_atomic(out, json.dumps(result, indent=2) + "\n")
        files = [out]
        if plots:
            files += plot_study(self.study, out.parent, self.num_layers)
        result["files"] = [str(f) for f in files]
        return result


def feasible_trials(study: optuna.Study) -> list[optuna.trial.FrozenTrial]:
    """The study's COMPLETE trials inside the skip-fraction bounds (every constraint <= 0), best value first."""
    trials = [
        t for t in study.get_trials(deepcopy=False, states=(TrialState.COMPLETE,))
        if t.value is not None and all(v <= 0 for v in t.constraints.values())
    ]
    return sorted(trials, key=lambda t: (-t.value, t.number))


def _failed_by_another_worker(e: BaseException) -> bool:
    """Whether ``e`` is Optuna's error on finishing a trial that another worker set to FAIL meanwhile."""
    context = e.__context__
    return isinstance(context, ValueError) and "Cannot tell a FAIL trial" in str(context)


def _fmt(v) -> str:
    return "-" if v is None else f"{v:.3f}"


def _modelled_attrs(t: optuna.trial.FrozenTrial) -> dict:
    keys = ("speedup", "alpha", "alpha_positions", "cost_ratio", "best_gamma", "speedup_v1", "best_gamma_v1")
    return {k: t.user_attrs.get(k) for k in keys}


def _measured_attrs(t: optuna.trial.FrozenTrial) -> dict:
    keys = ("speedup", "tokens_per_s", "baseline_tokens_per_s", "acceptance_rate", "mean_accepted_tokens",
            "num_speculative_tokens", "num_prompts", "decode_tokens", "decode_seconds")
    return {k: t.user_attrs.get(k) for k in keys}


# ---------------------------------------------------------------------------------------------
# plots


def skip_frequencies(trials: Sequence[optuna.trial.FrozenTrial], num_layers: int) -> list[list[float]]:
    """[[attn freq per layer], [mlp freq per layer]]: how often each sublayer is skipped in ``trials``."""
    rows = [[0.0] * num_layers for _ in SUBLAYERS]
    for t in trials:
        for r, kind in enumerate(SUBLAYERS):
            for i in range(num_layers):
                rows[r][i] += bool(t.params.get(f"{kind}_{i}"))
    n = max(len(trials), 1)
    return [[v / n for v in row] for row in rows]


def plot_study(study: optuna.Study, out_dir: str | Path, num_layers: int) -> list[Path]:
    """Optimisation history, parameter importances and the skip-frequency heat map, as PNG (+ HTML).

    The heat map (ours) shows, per sublayer (rows attn/mlp, columns layers), the
    fraction of the best ~10 % (at least 5) feasible trials that skip it. HTML
    versions of Optuna's history and importance plots (sharing one ``plotly.min.js``
    beside them) are written when plotly is installed (otherwise a warning is logged). A plot that cannot be drawn (e.g.
    importances with fewer than two completed trials) is logged and skipped.

    Returns:
        The files written.
    """
    from matplotlib import pyplot as plt
    from matplotlib.figure import Figure

    out_dir = Path(out_dir)
    written: list[Path] = []
    ranked = feasible_trials(study)

    def save_optuna(name: str, draw: Callable[[], Any]) -> None:
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
                ax = draw()
            fig = ax.figure
            write_png_atomic(fig, out_dir / name)
            plt.close(fig)
            written.append(out_dir / name)
        except (ValueError, RuntimeError, ZeroDivisionError, IndexError) as e:
            logger.warning("plot %s not drawn: %s", name, e)

    import optuna.visualization as ov
    import optuna.visualization.matplotlib as ovm

    # Optuna's matplotlib plots call plt.style.use("ggplot"); the context undoes that for the caller.
    with plt.style.context("default"):
        if ranked:
            top = ranked[: max(5, math.ceil(0.1 * len(ranked)))]
            freq = skip_frequencies(top, num_layers)
            fig = Figure(figsize=(max(4.0, 0.35 * num_layers + 2.0), 2.6))
            ax = fig.subplots()
            im = ax.imshow(freq, vmin=0.0, vmax=1.0, cmap="viridis", aspect="auto")
            ax.set_yticks(range(len(SUBLAYERS)), list(SUBLAYERS))
            ax.set_xticks(range(num_layers), [str(i) for i in range(num_layers)], fontsize="small")
            ax.set_xlabel("decoder layer")
            ax.set_title(f"fraction of the best {len(top)} of {len(ranked)} feasible trials skipping each sublayer",
                         fontsize="medium")
            fig.colorbar(im, ax=ax, fraction=0.03)
            write_png_atomic(fig, out_dir / HEATMAP_PNG)
            written.append(out_dir / HEATMAP_PNG)
        else:
            logger.warning("plot %s not drawn: no feasible completed trial", HEATMAP_PNG)
        save_optuna(HISTORY_PNG, lambda: ovm.plot_optimization_history(study))
        save_optuna(IMPORTANCES_PNG, lambda: ovm.plot_param_importances(study))

    if ov.is_available():
        for name, draw in ((HISTORY_HTML, ov.plot_optimization_history), (IMPORTANCES_HTML, ov.plot_param_importances)):
            try:
                # "directory": one plotly.min.js beside the pages, shared, and no network needed to view them.
                figure = draw(study)
                write_atomic(out_dir / name, lambda tmp: figure.write_html(str(tmp), include_plotlyjs="directory"))
                written.append(out_dir / name)
            except (ValueError, RuntimeError, ZeroDivisionError, IndexError) as e:
                logger.warning("plot %s not drawn: %s", name, e)
    else:
        logger.warning("plotly is not installed: HTML plots skipped (pip install 'specdecode[search]' or plotly)")
    return written


__all__ = [
    "OBJECTIVES",
    "SAMPLERS",
    "DecodeCosts",
    "SearchSettings",
    "SkipSetSearch",
    "acceptance_estimate",
    "best_speedup",
    "default_storage_url",
    "default_study_name",
    "expected_speedup",
    "feasible_trials",
    "greedy_continuations",
    "load_calibration_prompts",
    "measure_decode_costs",
    "measure_speedup",
    "model_identity",
    "open_storage",
    "param_names",
    "params_to_skip_lists",
    "plot_study",
    "redact_url",
    "seed_skip_sets",
    "skip_frequencies",
    "skip_set_params",
    "teacher_forced_draft_tokens",
]
