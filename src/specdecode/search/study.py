"""The search: one Optuna study of layer-skip sets, shared by any number of workers.

``SkipSetSearch`` opens (or creates) the study, checks that it was made for this model
and these settings, gets the one-off measurements (made by one worker, stored in the
study: ``storage.shared_once``), seeds it, runs trials until the study holds the
requested number, re-measures the best sets and writes best.json (the work of these
last two is in ``specdecode.search.results``). The docstring of ``specdecode.search``
describes storage, resuming and several workers.
"""

from __future__ import annotations

import logging
import os
import socket
import time
import warnings
from collections.abc import Callable
from pathlib import Path

import optuna
from optuna.trial import TrialState
from transformers import DynamicCache

from specdecode.bench.datasets import HUMANEVAL, SPEC_BENCH, Prompt
from specdecode.drafters.layer_skip import SUBLAYERS, SkipSet, decoder_layers
from specdecode.engine.decoder import SpeculativeDecoder
from specdecode.engine.sampling import logits_width
from specdecode.errors import (
    InvalidArgumentError,
    NonFiniteLogitsError,
    SpecDecodeError,
    StorageError,
    StudyMismatchError,
)
from specdecode.models import LoadedModel
from specdecode.pipeline import SpeculativeGenerator, eos_token_ids
from specdecode.search.objective import (
    DecodeCosts,
    acceptance_estimate,
    best_speedup,
    feasible_trials,
    greedy_continuations,
    load_calibration_prompts,
    measure_decode_costs,
    measure_speedup,
    params_to_skip_lists,
    seed_skip_sets,
    skip_set_params,
)
from specdecode.search.results import best_result, format_rate, remeasure_trials, top_distinct, write_outputs
from specdecode.search.settings import SearchSettings
from specdecode.search.storage import (
    ATTR_COSTS,
    ATTR_IDENTITY,
    ATTR_PROMPTS,
    ATTR_REFERENCE,
    FINISHED_STATES,
    SearchState,
    shared_once,
    model_label,
    open_storage,
    redact_url,
)

logger = logging.getLogger(__name__)

CONSTRAINT_KEY = "skip_fraction"

# Identity keys that name the model; the rest are search settings.
MODEL_KEYS = ("model", "model_type", "num_layers", "hidden_size", "vocab_size", "dtype", "quantize")


def _constraint_violation(num_skipped: int, lo: int, hi: int, num_sublayers: int) -> float:
    """0.0 when lo <= num_skipped <= hi, else the distance outside, as a fraction of all sublayers."""
    return max(lo - num_skipped, num_skipped - hi, 0) / num_sublayers


# ---------------------------------------------------------------------------------------------
# the search


def _calibration_label(spec: str) -> str:
    return spec if spec in (HUMANEVAL, SPEC_BENCH) or spec.startswith(SPEC_BENCH + ":") else Path(spec).name


def model_identity(loaded: LoadedModel) -> dict:
    """What makes two runs search the same model: name, architecture, sizes, dtype, quantization, and
    whether its linears are prepacked (named only then, so older studies still match)."""
    cfg = loaded.model.config
    prepacked = {"prepacked_linears": True} if getattr(loaded, "prepacked", False) else {}
    return {
        "model": model_label(loaded.name),
        "model_type": getattr(cfg, "model_type", type(loaded.model).__name__),
        "num_layers": len(decoder_layers(loaded.model)),
        "hidden_size": getattr(cfg, "hidden_size", None),
        "vocab_size": logits_width(loaded.model),
        "dtype": str(loaded.model.dtype).removeprefix("torch."),
        "quantize": getattr(loaded, "quantize", "none"),
        **prepacked,
    }


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
        # Studies made before quantization existed hold no "quantize": they were "none".
        diffs = [k for k in self.identity if stored.get(k, "none" if k == "quantize" else None) != self.identity[k]]
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
        stored_prompts = shared_once(study, ATTR_PROMPTS, self._encode_prompts, beat, "calibration prompts")
        self.state.prompts = [list(p) for p in stored_prompts["ids"]]
        self.state.prompt_labels = list(stored_prompts["labels"])
        self.state.reference = shared_once(
            study, ATTR_REFERENCE, self._reference, beat, "target's greedy continuations"
        )
        if self.settings.objective == "modelled":
            costs = shared_once(study, ATTR_COSTS, self._costs, beat, "decode-step and sublayer timings")
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
            format_rate(figures["acceptance_rate"]), gamma,
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

    # -- results (specdecode.search.results) ------------------------------------------------

    def top_distinct(self, k: int) -> list[optuna.trial.FrozenTrial]:
        """The ``k`` best feasible COMPLETE trials with distinct skip sets."""
        return top_distinct(self.study, k)

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
        return remeasure_trials(
            self.study, top, self.num_layers, self.settings.num_speculative_tokens, self.measure, progress
        )

    def result(self, remeasured: list[dict] | None = None) -> dict:
        """The best set and its figures, in the form written to best.json (``best_result``).

        Selection: with re-measured sets (modelled objective), the best MEASURED
        speedup among them; otherwise the best objective value.

        Raises:
            SpecDecodeError: No feasible completed trial yet.
        """
        return best_result(
            self.study, self.settings, self.state, identity=self.identity, num_layers=self.num_layers,
            study_name=self.study_name, storage_url=self.storage_url, remeasured=remeasured,
        )

    def write_outputs(self, out: str | Path, remeasured: list[dict] | None = None, plots: bool = True) -> dict:
        """Write best.json (``result``) at ``out`` and, with ``plots``, the plots beside it.

        Returns:
            The result dict, with ``files``: the paths written.
        """
        return write_outputs(out, lambda: self.result(remeasured), self.study, self.num_layers, plots)


def _failed_by_another_worker(e: BaseException) -> bool:
    """Whether ``e`` is Optuna's error on finishing a trial that another worker set to FAIL meanwhile."""
    context = e.__context__
    return isinstance(context, ValueError) and "Cannot tell a FAIL trial" in str(context)


__all__ = [
    "CONSTRAINT_KEY",
    "MODEL_KEYS",
    "SkipSetSearch",
    "model_identity",
]
