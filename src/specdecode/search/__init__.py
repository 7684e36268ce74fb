"""Bayesian optimisation of the layer-skip set with Optuna (``specdecode search``).

Which sublayers the layer-skip drafter (``specdecode.drafters.layer_skip``) bypasses decides
whether self-speculation pays. This package searches that choice: one binary
parameter per attention and per MLP sublayer (``attn_0``, ``mlp_0``, ...,
``attn_{L-1}``, ``mlp_{L-1}``: 2L parameters), with Optuna's TPE (default) or
Gaussian-process sampler, in a study kept in a database.

Objectives
----------
``modelled`` (default): cheap and nearly noise-free. Once per study, and stored in
the study so that resumed runs and other workers reuse it:

1. the target's greedy continuations of the calibration prompts (the autoregressive
   decoder of ``specdecode.engine.decoder``, ``max_new_tokens`` each);
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
draft's logits differ between the two passes (tests/search/test_search_objective.py checks that they
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
through a lease in the study (``shared_once``: one worker computes, the others
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

Modules
-------
``objective`` (what a trial scores: the speedup model, the search space, calibration
prompts, teacher-forced α, timings, real decoding), ``settings`` (``SearchSettings``),
``storage`` (the study's database, and what every worker keeps in it), ``study``
(``SkipSetSearch``: workers, resuming, results), ``results`` (the re-measured sets and
best.json, for ``SkipSetSearch``), ``plots``, and ``command`` (the ``specdecode search``
command, which prints; not imported here). Every public name is re-exported here.
"""

from __future__ import annotations

from specdecode.search.objective import (
    DecodeCosts,
    acceptance_estimate,
    best_speedup,
    expected_speedup,
    feasible_trials,
    greedy_continuations,
    load_calibration_prompts,
    measure_decode_costs,
    measure_speedup,
    param_names,
    params_to_skip_lists,
    seed_skip_sets,
    skip_set_params,
    teacher_forced_draft_tokens,
)
from specdecode.search.plots import (
    HEATMAP_PNG,
    HISTORY_HTML,
    HISTORY_PNG,
    IMPORTANCES_HTML,
    IMPORTANCES_PNG,
    plot_study,
    skip_frequencies,
)
from specdecode.search.settings import OBJECTIVES, SAMPLERS, SearchSettings
from specdecode.search.storage import (
    ATTR_COSTS,
    ATTR_IDENTITY,
    ATTR_MEASURED,
    ATTR_PROMPTS,
    ATTR_REFERENCE,
    FINISHED_STATES,
    SearchState,
    default_storage_url,
    default_study_name,
    open_storage,
    redact_url,
)
from specdecode.search.study import CONSTRAINT_KEY, MODEL_KEYS, SkipSetSearch, model_identity

__all__ = [
    "ATTR_COSTS",
    "ATTR_IDENTITY",
    "ATTR_MEASURED",
    "ATTR_PROMPTS",
    "ATTR_REFERENCE",
    "CONSTRAINT_KEY",
    "FINISHED_STATES",
    "HEATMAP_PNG",
    "HISTORY_HTML",
    "HISTORY_PNG",
    "IMPORTANCES_HTML",
    "IMPORTANCES_PNG",
    "MODEL_KEYS",
    "OBJECTIVES",
    "SAMPLERS",
    "DecodeCosts",
    "SearchSettings",
    "SearchState",
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
