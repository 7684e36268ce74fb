"""What a search reports: the best distinct sets re-measured, and best.json.

``SkipSetSearch`` (``specdecode.search.study``) keeps its public methods
(``top_distinct``, ``remeasure``, ``result``, ``write_outputs``) and delegates
their work here: ``top_distinct`` picks the best feasible trials with distinct
skip sets, ``remeasure_trials`` decodes them for real (storing each measurement
in the study, so a rerun reuses it), ``best_result`` builds the dict written to
best.json and ``write_outputs`` writes it and, optionally, the plots.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable
from pathlib import Path

import optuna
from optuna.trial import TrialState

from specdecode.drafters.layer_skip import SkipSet
from specdecode.errors import SpecDecodeError
from specdecode.files import write_text_atomic
from specdecode.search.objective import feasible_trials, params_to_skip_lists
from specdecode.search.plots import plot_study
from specdecode.search.settings import SearchSettings
from specdecode.search.storage import ATTR_MEASURED, FINISHED_STATES, SearchState, redact_url

logger = logging.getLogger(__name__)


def top_distinct(study: optuna.Study, k: int) -> list[optuna.trial.FrozenTrial]:
    """The ``k`` best feasible COMPLETE trials of ``study`` with distinct skip sets."""
    seen, out = set(), []
    for t in feasible_trials(study):
        key = tuple(sorted(t.params.items()))
        if key in seen:
            continue
        seen.add(key)
        out.append(t)
        if len(out) == k:
            break
    return out


def remeasure_trials(
    study: optuna.Study,
    top: list[optuna.trial.FrozenTrial],
    num_layers: int,
    num_speculative_tokens: int | None,
    measure: Callable[[SkipSet, int], dict],
    progress: Callable[[int, int], None] | None = None,
) -> list[dict]:
    """Decode the skip sets of the trials ``top`` for real, reusing measurements stored in ``study``.

    Args:
        study: The study; each measurement is stored in it (``ATTR_MEASURED`` + trial number).
        top: The trials to re-measure, best modelled first (``top_distinct``).
        num_layers: The model's decoder layers.
        num_speculative_tokens: γ for every set; None takes each trial's modelled best γ.
        measure: ``SkipSetSearch.measure`` (skip set, γ -> ``measure_speedup``'s figures).
        progress: Called after every set with (sets done, len(top)).

    Returns:
        One dict per set: ``trial``, ``attn``, ``mlp``, ``modelled`` (the trial's
        figures) and ``measured`` (``measure_speedup``'s), in the order of ``top``.
    """
    out = []
    for j, t in enumerate(top):
        skip = SkipSet(*params_to_skip_lists(t.params, num_layers))
        gamma = num_speculative_tokens or int(t.user_attrs["best_gamma"])
        key = f"{ATTR_MEASURED}{t.number}"
        stored = study.user_attrs.get(key)
        if stored is not None and stored.get("num_speculative_tokens") == gamma:
            measured = stored
        else:
            logger.info("re-measuring trial %d (%s, modelled %.3f×) with γ=%d", t.number, skip, t.value, gamma)
            measured = measure(skip, gamma)
            study.set_user_attr(key, measured)
        logger.info("trial %d: modelled %.3f×, measured %.3f× (acceptance %s)", t.number, t.value,
                    measured["speedup"], format_rate(measured["acceptance_rate"]))
        out.append({"trial": t.number, **skip.to_dict(), "modelled": _modelled_attrs(t), "measured": measured})
        if progress is not None:
            progress(j + 1, len(top))
    return out


def best_result(
    study: optuna.Study,
    settings: SearchSettings,
    state: SearchState,
    *,
    identity: dict,
    num_layers: int,
    study_name: str,
    storage_url: str,
    remeasured: list[dict] | None = None,
) -> dict:
    """The best set of ``study`` and its figures, in the form written to best.json (``SkipSetSearch.result``).

    Selection: with re-measured sets (modelled objective), the best MEASURED
    speedup among them; otherwise the best objective value.

    Raises:
        SpecDecodeError: No feasible completed trial yet.
    """
    feasible = feasible_trials(study)
    if not feasible:
        raise SpecDecodeError(
            f"study {study_name!r} has no completed trial inside the skip bounds yet: run more trials "
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
        measured = _measured_attrs(best) if settings.objective == "measured" else None
        selected_by = f"the best {settings.objective} speedup"
    modelled = _modelled_attrs(best) if settings.objective == "modelled" else None
    if measured is not None:
        gamma = measured["num_speculative_tokens"]
    elif modelled is not None:
        gamma = modelled["best_gamma"]
    else:
        gamma = settings.measured_gamma
    skip = SkipSet(*params_to_skip_lists(best.params, num_layers))
    states = [t.state for t in study.get_trials(deepcopy=False)]
    return {
        **skip.to_dict(),
        "model": identity["model"],
        "dtype": identity["dtype"],
        "num_layers": num_layers,
        "num_speculative_tokens": gamma,
        "objective": settings.objective,
        "selected_by": selected_by,
        "trial": best.number,
        "modelled": modelled,
        "measured": measured,
        "remeasured": remeasured or [],
        "num_trials": sum(s in FINISHED_STATES for s in states),
        "trial_states": {s.name.lower(): states.count(s) for s in TrialState if states.count(s)},
        "num_infeasible": sum("infeasible" in t.user_attrs for t in study.get_trials(deepcopy=False)),
        "study_name": study_name,
        "storage": redact_url(storage_url),
        "calibration": {
            "source": identity["calibration"],
            "prompts": state.prompt_labels,
            "max_new_tokens": settings.max_new_tokens,
            "target_teacher_forced_agreement": state.target_agreement,
            "decode_step_ms": 1e3 * state.costs.step_s if state.costs else None,
            "verify_ratios": list(state.costs.verify_ratios) if state.costs else None,
        },
    }


def write_outputs(
    out: str | Path, make_result: Callable[[], dict], study: optuna.Study, num_layers: int, plots: bool = True
) -> dict:
    """Write best.json (``make_result()``) at ``out`` and, with ``plots``, the plots of ``study`` beside it.

    Returns:
        The result dict, with ``files``: the paths written.
    """
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    result = make_result()
    write_text_atomic(out, json.dumps(result, indent=2) + "\n")
    files = [out]
    if plots:
        files += plot_study(study, out.parent, num_layers)
    result["files"] = [str(f) for f in files]
    return result


def format_rate(v: float | None) -> str:
    """A rate for the logs: three decimals, or "-" for None."""
    return "-" if v is None else f"{v:.3f}"


def _modelled_attrs(t: optuna.trial.FrozenTrial) -> dict:
    keys = ("speedup", "alpha", "alpha_positions", "cost_ratio", "best_gamma", "speedup_v1", "best_gamma_v1")
    return {k: t.user_attrs.get(k) for k in keys}


def _measured_attrs(t: optuna.trial.FrozenTrial) -> dict:
    keys = ("speedup", "tokens_per_s", "baseline_tokens_per_s", "acceptance_rate", "mean_accepted_tokens",
            "num_speculative_tokens", "num_prompts", "decode_tokens", "decode_seconds")
    return {k: t.user_attrs.get(k) for k in keys}


__all__ = ["best_result", "format_rate", "remeasure_trials", "top_distinct", "write_outputs"]
