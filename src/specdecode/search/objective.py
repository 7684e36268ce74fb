"""What a trial of the skip-set search scores.

The speedup model (``expected_speedup``, ``best_speedup``); the search space, one
binary parameter per attention and per MLP sublayer (``param_names``,
``params_to_skip_lists``, ``skip_set_params``, ``seed_skip_sets``); the calibration
prompts; the target's greedy continuations; the teacher-forced acceptance estimate α
(``teacher_forced_draft_tokens``, ``acceptance_estimate``); the decode-step, sublayer
and verification timings behind the cost ratio c (``DecodeCosts``,
``measure_decode_costs``); real layer-skip decoding against the autoregressive loop
(``measure_speedup``); and which trials count (``feasible_trials``). The docstring of
``specdecode.search`` explains the objectives and when teacher-forced agreement
equals real acceptance.
"""

from __future__ import annotations

import copy
import logging
import math
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import optuna
import torch
from optuna.trial import TrialState
from transformers import DynamicCache

from specdecode.bench.datasets import HUMANEVAL, SPEC_BENCH, Prompt, load_prompts, read_jsonl
from specdecode.config import GenerationConfig
from specdecode.drafters.layer_skip import SUBLAYERS, LayerSkipDrafter, SkipSet, decoder_layers, draft_mode
from specdecode.engine import kv_cache
from specdecode.engine.decoder import SpeculativeDecoder
from specdecode.errors import DatasetError, InvalidArgumentError

logger = logging.getLogger(__name__)


def is_int(v) -> bool:
    """Whether ``v`` is an int and not a bool (shared by the search's argument checks)."""
    return isinstance(v, int) and not isinstance(v, bool)


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
    if not is_int(gamma) or gamma < 1:
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
    if not is_int(max_gamma) or max_gamma < 1:
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


# ---------------------------------------------------------------------------------------------
# calibration prompts, continuations, acceptance estimate, timings


def load_calibration_prompts(
    spec: str, num_prompts: int, *, offset: int = 0, chat: bool | None = None
) -> list[Prompt]:
    """The calibration prompts: ``num_prompts`` of them after skipping ``offset``, in file order.

    Args:
        spec: "humaneval", "spec-bench" (all categories), "spec-bench:CATEGORY", or a
            JSONL file (``specdecode.bench.datasets`` describes the fields).
        num_prompts: How many, >= 1 (fewer when the source has fewer after ``offset``).
        offset: Prompts skipped first, >= 0.
        chat: Override of the dataset's chat-template default.

    Raises:
        DatasetError: A missing, unreadable or malformed file; no prompt left after ``offset``.
        InvalidArgumentError: An unknown Spec-Bench category (the allowed ones are
            listed) or a count out of range.
    """
    if not is_int(num_prompts) or num_prompts < 1:
        raise InvalidArgumentError(f"num_prompts must be an integer >= 1, got {num_prompts!r}")
    if not is_int(offset) or offset < 0:
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
                f"calibration file {spec!r} {'is not a file' if path.exists() else 'does not exist'}; --calibration takes a JSONL file (one object per "
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
    # Eager decoding, also on CUDA: each trial's skip set would compile graphs of its own.
    decoder = SpeculativeDecoder(model, None, eos_token_ids=eos, compile=False)
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
    ``prompt_caches`` goes to; the ``specdecode.search`` docstring says when this equals real
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
    if not is_int(max_tokens) or max_tokens < 1:
        raise InvalidArgumentError(f"max_tokens must be an integer >= 1, got {max_tokens!r}")
    if not is_int(repeats) or repeats < 1 or not is_int(warmup) or warmup < 0:
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
    # Eager on every device, like the reference: a fast-path graph per trial's skip set would cost
    # more compile time than the trial measures.
    drafter = LayerSkipDrafter(model, skip_set)
    decoder = SpeculativeDecoder(model, drafter, eos_token_ids=eos, compile=False)
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
        from_forwards += stats.num_accepted_tokens + stats.num_target_forwards  # τ's numerator
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
# which trials count


def feasible_trials(study: optuna.Study) -> list[optuna.trial.FrozenTrial]:
    """The study's COMPLETE trials inside the skip-fraction bounds (every constraint <= 0), best value first."""
    trials = [
        t for t in study.get_trials(deepcopy=False, states=(TrialState.COMPLETE,))
        if t.value is not None and all(v <= 0 for v in t.constraints.values())
    ]
    return sorted(trials, key=lambda t: (-t.value, t.number))


__all__ = [
    "DecodeCosts",
    "acceptance_estimate",
    "best_speedup",
    "expected_speedup",
    "feasible_trials",
    "greedy_continuations",
    "is_int",
    "load_calibration_prompts",
    "measure_decode_costs",
    "measure_speedup",
    "param_names",
    "params_to_skip_lists",
    "seed_skip_sets",
    "skip_set_params",
    "teacher_forced_draft_tokens",
]
