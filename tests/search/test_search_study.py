"""`specdecode search` studies (specdecode.search.study, .storage) on tiny random models: resuming
after SIGKILL, two workers on one study, queued trials claimed once, bounds with the GP sampler, the
measured objective, storage and study errors."""

from __future__ import annotations

import json
import logging
import multiprocessing
import signal
import sys
import threading
import time
from pathlib import Path

import pytest

optuna = pytest.importorskip("optuna")

from conftest import make_tiny_model, make_tiny_tokenizer  # noqa: E402
from specdecode import search  # noqa: E402
from specdecode.cli import main  # noqa: E402
from specdecode.errors import StorageError, StudyMismatchError  # noqa: E402
from specdecode.models import LoadedModel  # noqa: E402
from specdecode.search import SearchSettings, SkipSetSearch  # noqa: E402
import optuna  # noqa: E402
from optuna.trial import TrialState  # noqa: E402

from search_helpers import NUM_LAYERS, _finished, _load_study, _search_args, folders  # noqa: E402,F401


# --- 3. resuming after SIGKILL, 4. two workers ------------------------------------------------
# Workers are forked (multiprocessing "fork"): real separate processes with their own database
# connections, killed with a real SIGKILL, without a second start-up of torch and transformers.


def _worker(args, methods: dict, log_file: Path | None, go: Path | None) -> None:
    """A search worker in a forked child (it inherits the imported modules: no start-up cost), with
    ``methods`` of SkipSetSearch replaced in the child."""
    for name, method in methods.items():
        setattr(SkipSetSearch, name, method)
    if log_file is not None:
        log = logging.getLogger("specdecode.search")
        log.addHandler(logging.FileHandler(log_file))
        log.setLevel(logging.INFO)
    while go is not None and not go.exists():
        time.sleep(0.01)
    sys.exit(main(args))


def _fork(args, methods=None, log_file=None, go=None):
    proc = multiprocessing.get_context("fork").Process(target=_worker, args=(args, methods or {}, log_file, go),
                                                       daemon=True)
    proc.start()
    return proc


def _poll(condition, deadline_s: float) -> bool:
    """Poll ``condition()`` every 50 ms until it is true (True) or ``deadline_s`` has passed (False)."""
    deadline = time.monotonic() + deadline_s
    while not condition():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True


def _wait_until(condition, what: str, deadline_s: float = 300.0) -> None:
    """``_poll``, failing the test naming ``what`` after a generous deadline (a hung worker, not a
    slow machine: no check depends on how long the wait takes)."""
    if not _poll(condition, deadline_s):
        pytest.fail(f"gave up after {deadline_s:.0f} s waiting for {what}")


def _stopping_at_third_evaluation(stop_at: Path) -> dict:
    """``modelled_figures`` that, once the study holds two COMPLETE trials, creates ``stop_at`` and
    waits for ever (until the test kills the process): the trial stays RUNNING, its parameters
    suggested, however slow the machine."""
    figures = SkipSetSearch.modelled_figures

    def stopping(self, skip_set):
        if len(self.study.get_trials(deepcopy=False, states=(TrialState.COMPLETE,))) >= 2:
            stop_at.touch()
            threading.Event().wait()
        return figures(self, skip_set)

    return {"modelled_figures": stopping}


def _has_heartbeat(storage, trial_id: int) -> bool:
    """Whether Optuna's heartbeat thread has recorded a heartbeat of ``trial_id`` (its table, read only)."""
    with storage.engine.connect() as connection:
        count = connection.exec_driver_sql("SELECT COUNT(*) FROM trial_heartbeats WHERE trial_id = ?",
                                           (trial_id,)).scalar()
    return count > 0


def test_killed_search_resumes_with_its_trials(folders, tmp_path, capsys):
    url = f"sqlite:///{tmp_path / 'study.db'}"
    args = _search_args(folders, tmp_path / "best.json", "--trials", 8, "--storage", url, "--study-name", "kill",
                        "--remeasure", 0, "--no-plots", "--heartbeat-interval", 1)
    stopped = tmp_path / "stopped"
    proc = _fork(args, _stopping_at_third_evaluation(stopped))
    try:
        # The worker stops inside the evaluation of its third trial (two COMPLETE) and stays there.
        _wait_until(lambda: stopped.exists() or not proc.is_alive(), "the worker to reach its third evaluation")
        assert proc.is_alive(), f"the worker ended (exit code {proc.exitcode}) before it could be killed"
        # The resumed search's storage: the same heartbeat interval, so the same grace period (2 x 1 s).
        storage = search.open_storage(url, 1)
        killed = optuna.load_study(study_name="kill", storage=storage)
        running = killed.get_trials(deepcopy=False, states=(TrialState.RUNNING,))
        assert len(running) == 1
        victim = running[0]
        # Optuna's heartbeat thread records the trial's first heartbeat just after the trial starts;
        # a trial killed before that has none, and Optuna never declares such a trial stale.
        _wait_until(lambda: _has_heartbeat(storage, victim._trial_id), f"trial {victim.number}'s first heartbeat")
        proc.kill()  # SIGKILL, mid-trial
        proc.join(30)
        assert proc.exitcode == -signal.SIGKILL
    finally:
        if proc.is_alive():
            proc.kill()
    # Wait until the trial is stale by the storage's own check (its last heartbeat older than the
    # grace period by the database's clock, which has 1 s resolution on SQLite): what the resumed
    # search tests before its first trial.
    _wait_until(lambda: victim._trial_id in storage._get_stale_trial_ids(killed._study_id),
                f"trial {victim.number}'s heartbeat to go stale")
    before = {t.number: (t.params, t.value) for t in killed.get_trials(states=(TrialState.COMPLETE,))}
    assert 2 <= len(before) < 8
    assert [t.number for t in killed.get_trials(states=(TrialState.RUNNING,))] == [victim.number]

    # The same command again.
    assert main(args) == 0
    study = _load_study(url, "kill")
    after = {t.number: (t.params, t.value) for t in study.get_trials(states=(TrialState.COMPLETE,))}
    assert all(after[n] == before[n] for n in before)  # every completed trial kept as it was
    assert len(_finished(study)) == 8  # one worker: exactly the requested total
    states = {t.state for t in study.trials}
    assert TrialState.RUNNING not in states and TrialState.WAITING not in states
    # The trial killed mid-way was marked failed (stale heartbeat) and re-run once with its parameters.
    assert [t.number for t in study.get_trials(states=(TrialState.FAIL,))] == [victim.number]
    retries = [r for r in study.trials if r.system_attrs.get("failed_trial") == victim.number]
    assert len(retries) == 1 and retries[0].state == TrialState.COMPLETE
    assert retries[0].params == victim.params
    assert json.loads((tmp_path / "best.json").read_text())["num_trials"] == 8


def _interleaved(other_log: Path) -> dict:
    """SkipSetSearch methods that make two workers overlap however the machine schedules them.

    ``_costs`` (the one-off timings) starts only once the other worker has logged that it waits for
    them, so that worker reuses them rather than arriving after they are stored; each
    ``modelled_figures`` starts only once the study holds a trial of the other worker, so neither
    runs all the trials before the other starts; each then takes 0.2 s more, so trials overlap.
    Past a deadline they go on anyway (and the test's checks fail)."""
    costs, figures = SkipSetSearch._costs, SkipSetSearch.modelled_figures

    def gated_costs(self):
        _poll(lambda: other_log.exists() and "decode-step and sublayer timings: waiting for worker"
              in other_log.read_text(), 60)
        return costs(self)

    def gated_figures(self, skip_set):  # the trial is RUNNING, its "worker" attribute set
        _poll(lambda: any(t.user_attrs.get("worker") not in (None, self._worker)
                          for t in self.study.get_trials(deepcopy=False)), 120)
        time.sleep(0.2)
        return figures(self, skip_set)

    return {"_costs": gated_costs, "modelled_figures": gated_figures}


def test_two_workers_share_one_study(folders, tmp_path, capsys, monkeypatch, caplog):
    """A forked worker process and this one, started together on one new SQLite study."""
    url = f"sqlite:///{tmp_path / 'shared.db'}"
    go, child_log, own_log = tmp_path / "go", tmp_path / "child.log", tmp_path / "own.log"

    def args(i):
        return _search_args(folders, tmp_path / f"w{i}" / "best.json", "--trials", 8, "--storage", url,
                            "--study-name", "shared", "--remeasure", 0, "--no-plots", "--seed", i,
                            "--heartbeat-interval", 3)

    proc = _fork(args(0), _interleaved(own_log), log_file=child_log, go=go)
    log = logging.getLogger("specdecode.search")
    handler = logging.FileHandler(own_log)
    log.addHandler(handler)
    try:
        for name, method in _interleaved(child_log).items():
            monkeypatch.setattr(SkipSetSearch, name, method)
        go.touch()
        with caplog.at_level("INFO", logger="specdecode.search"):
            assert main(args(1)) == 0
        proc.join(180)
        assert proc.exitcode == 0
    finally:
        log.removeHandler(handler)
        handler.close()
        if proc.is_alive():
            proc.kill()
    study = _load_study(url, "shared")
    numbers = sorted(t.number for t in study.trials)
    assert numbers == list(range(len(study.trials)))  # no duplicate (or missing) trial numbers
    finished = _finished(study)
    assert 8 <= len(finished) <= 9  # each worker may finish the trial it had started
    assert len({t.user_attrs["worker"] for t in finished}) == 2  # both did some of the work
    # The one-off timings were measured by one worker only; the other waited and reused them.
    logs = [child_log.read_text(), caplog.text]
    assert sum(log.count("decode-step and sublayer timings: measuring") for log in logs) == 1
    assert sum(log.count("decode-step and sublayer timings: using the one another worker stored")
               for log in logs) == 1


def _claim_queued_trials(url, results):
    study = optuna.load_study(study_name="queue", storage=search.open_storage(url))
    claimed = []
    while (trial_id := study._pop_waiting_trial_id()) is not None:  # what Study.ask does first
        claimed.append(trial_id)
    results.put(claimed)


def test_workers_never_claim_the_same_queued_trial(tmp_path):
    """SQLite ignores SELECT ... FOR UPDATE: without open_storage's BEGIN IMMEDIATE, about 5% of the
    queued trials (seed sets, re-queued stale trials) were claimed by two workers, which then both ran
    them and one failed with "Cannot tell a COMPLETE trial" (a CI failure of test_two_workers_share_one_study)."""
    url = f"sqlite:///{tmp_path / 'queue.db'}"
    study = optuna.create_study(study_name="queue", storage=search.open_storage(url))
    queued = 120
    for i in range(queued):
        study.enqueue_trial({"x": i})
    context = multiprocessing.get_context("fork")
    results = context.Queue()
    workers = [context.Process(target=_claim_queued_trials, args=(url, results), daemon=True) for _ in range(3)]
    for w in workers:
        w.start()
    claimed = [results.get(timeout=120) for _ in workers]
    for w in workers:
        w.join(30)
    ids = [i for c in claimed for i in c]
    assert len(ids) == len(set(ids)), f"{len(ids) - len(set(ids))} queued trials were claimed twice"
    assert len(ids) == queued


# --- bounds, the GP sampler, the measured objective (library API) ----------------------------


def _loaded(num_layers=NUM_LAYERS) -> LoadedModel:
    return LoadedModel(make_tiny_model("llama", num_layers=num_layers), make_tiny_tokenizer(), f"llama{num_layers}")


def _prompts(folders):
    return search.load_calibration_prompts(str(folders["calib"]), 3)


def test_bounds_make_out_of_range_sets_infeasible_with_gp(folders, tmp_path):
    settings = SearchSettings(trials=11, sampler="gp", seed=0, min_skip_fraction=0.25, max_skip_fraction=0.5,
                              max_new_tokens=10, max_gamma=3, timing_repeats=1, remeasure=0,
                              calibration=str(folders["calib"]), num_prompts=3)
    runner = SkipSetSearch(_loaded(), settings, f"sqlite:///{tmp_path / 'gp.db'}", "gp", _prompts(folders))
    runner.optimize()
    trials = runner.study.get_trials(states=(TrialState.COMPLETE,))
    assert len(trials) == 11  # the last one sampled by the Gaussian process (10 startup trials)
    assert any(not 2 <= sum(t.params.values()) <= 4 for t in trials)  # the seeded sampler did go outside
    for t in trials:
        k = sum(t.params.values())
        inside = 2 <= k <= 4  # 25 %..50 % of 8 sublayers
        assert (t.constraints[search.CONSTRAINT_KEY] <= 0) == inside
        if not inside:
            assert t.value == 0.0 and "infeasible" in t.user_attrs and "alpha" not in t.user_attrs
    best = runner.result()
    assert 2 <= len(best["attn"]) + len(best["mlp"]) <= 4
    assert best["modelled"]["speedup"] == max(t.value for t in trials if t.constraints[search.CONSTRAINT_KEY] <= 0)


def test_measured_objective_reports_each_prompt(folders, tmp_path):
    settings = SearchSettings(trials=3, objective="measured", seed=0, max_new_tokens=10, remeasure=0,
                              calibration=str(folders["calib"]), num_prompts=3, num_speculative_tokens=2)
    runner = SkipSetSearch(_loaded(), settings, f"sqlite:///{tmp_path / 'm.db'}", "m", _prompts(folders))
    runner.optimize()
    trials = runner.study.get_trials(states=(TrialState.COMPLETE,))
    assert len(trials) == 3
    for t in trials:
        if "duplicate_of" in t.user_attrs:
            continue
        assert sorted(t.intermediate_values) == [0, 1, 2]  # trial.report after each prompt
        assert t.intermediate_values[2] == pytest.approx(t.value)
        assert t.user_attrs["num_speculative_tokens"] == 2 and t.value > 0
    result = runner.result()
    assert result["measured"]["speedup"] == max(t.value for t in trials) and result["modelled"] is None
    assert result["num_speculative_tokens"] == 2


# --- 5. errors --------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "storage,message",
    [
        ("nosuchdialect://x/y", "cannot open storage 'nosuchdialect://x/y'"),
        ("sqlite:////nonexistent-dir-xyz/sub/study.db", "cannot open storage 'sqlite:////nonexistent-dir-xyz"),
        ("not a url", "not a database URL"),
        ("sqlite://", "in-memory SQLite database"),
        ("sqlite:///:memory:", "in-memory SQLite database"),
        ("postgresql://user:secret@127.0.0.1:1/db", "cannot open storage 'postgresql://user:***@127.0.0.1:1/db'"),
    ],
)
def test_bad_storage_url_is_a_clear_error(folders, tmp_path, capsys, storage, message):
    code = main(_search_args(folders, tmp_path / "best.json", "--storage", storage))
    out, err = capsys.readouterr()
    assert code == 2 and message in err and out == ""
    assert "secret" not in err
    with pytest.raises(StorageError, match="expected a (SQLAlchemy URL|file)"):
        search.open_storage(storage)


def test_study_for_another_model_or_settings_is_refused(folders, tmp_path, capsys):
    url = f"sqlite:///{tmp_path / 's.db'}"
    settings = SearchSettings(calibration=str(folders["calib"]), num_prompts=3, max_new_tokens=12, max_gamma=4)
    SkipSetSearch(LoadedModel(make_tiny_model("llama", num_layers=3), make_tiny_tokenizer(), str(folders["model3"])),
                  settings, url, "study").open_study()
    code = main(_search_args(folders, tmp_path / "best.json", "--storage", url, "--study-name", "study"))
    _, err = capsys.readouterr()
    assert code == 2
    assert "was made for a different model" in err and "num_layers=3" in err and "num_layers=4" in err
    # Same model, other settings: named field by field.
    with pytest.raises(StudyMismatchError, match=r"objective: study 'modelled', this run 'measured'"):
        SkipSetSearch(LoadedModel(make_tiny_model("llama", num_layers=3), make_tiny_tokenizer(),
                                  str(folders["model3"])),
                      SearchSettings(calibration=str(folders["calib"]), num_prompts=3, max_new_tokens=12,
                                     max_gamma=4, objective="measured"), url, "study").open_study()
