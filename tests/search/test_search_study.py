"""`specdecode search` studies (specdecode.search.study, .storage) on tiny random models: resuming
after SIGKILL, two workers on one study, queued trials claimed once, bounds with the GP sampler, the
measured objective, storage and study errors."""

from __future__ import annotations

import json
import logging
import multiprocessing
import signal
import sys
import time
from datetime import datetime
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


def _worker(args, delay: float, log_file: Path | None, go: Path | None) -> None:
    """A search worker in a forked child (it inherits the imported modules: no start-up cost)."""
    if delay:
        figures = SkipSetSearch.modelled_figures

        def slowed(self, skip_set):  # the trial is RUNNING, its parameters suggested
            time.sleep(delay)
            return figures(self, skip_set)

        SkipSetSearch.modelled_figures = slowed
    if log_file is not None:
        log = logging.getLogger("specdecode.search")
        log.addHandler(logging.FileHandler(log_file))
        log.setLevel(logging.INFO)
    while go is not None and not go.exists():
        time.sleep(0.01)
    sys.exit(main(args))


def _fork(args, delay=0.0, log_file=None, go=None):
    proc = multiprocessing.get_context("fork").Process(target=_worker, args=(args, delay, log_file, go),
                                                       daemon=True)
    proc.start()
    return proc


def test_killed_search_resumes_with_its_trials(folders, tmp_path, capsys):
    url = f"sqlite:///{tmp_path / 'study.db'}"
    args = _search_args(folders, tmp_path / "best.json", "--trials", 8, "--storage", url, "--study-name", "kill",
                        "--remeasure", 0, "--no-plots", "--heartbeat-interval", 1)
    proc = _fork(args, delay=0.3)
    deadline = time.monotonic() + 120
    try:
        while time.monotonic() < deadline and proc.is_alive():
            time.sleep(0.05)
            try:
                trials = _load_study(url, "kill").trials
            except KeyError:  # the study does not exist yet
                continue
            done = [t for t in trials if t.state == TrialState.COMPLETE]
            # Kill it mid-trial (each evaluation sleeps 0.3 s first), once the running trial has sent its
            # first heartbeat, which Optuna records just after the trial starts: a trial killed before
            # that has no heartbeat, and Optuna never declares such a trial stale.
            started = [t.datetime_start for t in trials if t.state == TrialState.RUNNING]
            if len(done) >= 2 and started and (datetime.now() - started[0]).total_seconds() >= 0.15:
                break
        assert proc.is_alive(), f"the worker ended (exit code {proc.exitcode}) before it could be killed"
        proc.kill()  # SIGKILL
        proc.join(30)
        assert proc.exitcode == -signal.SIGKILL
    finally:
        if proc.is_alive():
            proc.kill()
    # Older than the grace period (2 x 1 s): SQLite's CURRENT_TIMESTAMP, on both the heartbeat and the
    # stale check, has 1 s resolution, so 2 s + 1 s + margin.
    time.sleep(3.2)
    killed = _load_study(url, "kill")
    before = {t.number: (t.params, t.value) for t in killed.get_trials(states=(TrialState.COMPLETE,))}
    running = [t.number for t in killed.get_trials(states=(TrialState.RUNNING,))]
    assert 2 <= len(before) < 8 and len(running) <= 1

    # The same command again.
    assert main(args) == 0
    study = _load_study(url, "kill")
    after = {t.number: (t.params, t.value) for t in study.get_trials(states=(TrialState.COMPLETE,))}
    assert all(after[n] == before[n] for n in before)  # every completed trial kept as it was
    assert len(_finished(study)) == 8  # one worker: exactly the requested total
    states = {t.state for t in study.trials}
    assert TrialState.RUNNING not in states and TrialState.WAITING not in states
    # The trial killed mid-way was marked failed (stale heartbeat) and re-run once with its parameters.
    assert [t.number for t in study.get_trials(states=(TrialState.FAIL,))] == running
    for n in running:
        retries = [r for r in study.trials if r.system_attrs.get("failed_trial") == n]
        assert len(retries) == 1 and retries[0].state == TrialState.COMPLETE
        assert retries[0].params == study.trials[n].params
    assert json.loads((tmp_path / "best.json").read_text())["num_trials"] == 8


def test_two_workers_share_one_study(folders, tmp_path, capsys, monkeypatch, caplog):
    """A forked worker process and this one, started together on one new SQLite study."""
    url = f"sqlite:///{tmp_path / 'shared.db'}"
    go, child_log = tmp_path / "go", tmp_path / "child.log"

    def args(i):
        return _search_args(folders, tmp_path / f"w{i}" / "best.json", "--trials", 8, "--storage", url,
                            "--study-name", "shared", "--remeasure", 0, "--no-plots", "--seed", i,
                            "--heartbeat-interval", 3)

    proc = _fork(args(0), delay=0.2, log_file=child_log, go=go)
    try:
        figures = SkipSetSearch.modelled_figures

        def slowed(self, skip_set):
            time.sleep(0.2)
            return figures(self, skip_set)

        monkeypatch.setattr(SkipSetSearch, "modelled_figures", slowed)
        go.touch()
        with caplog.at_level("INFO", logger="specdecode.search"):
            assert main(args(1)) == 0
        proc.join(180)
        assert proc.exitcode == 0
    finally:
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
