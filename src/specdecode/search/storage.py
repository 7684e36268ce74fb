"""Where a study lives: an Optuna RDB storage (SQLite file or any SQLAlchemy URL), and what a search keeps in it.

``open_storage`` opens one with trial heartbeats (and, on SQLite, serialised
transactions, so that two workers never claim the same queued trial);
``default_storage_url`` and ``default_study_name`` give the defaults of
``specdecode search``; ``redact_url`` hides a password for logs, errors and best.json.

The study's user attributes (``ATTR_*``) hold what every worker of a search shares:
its identity, the calibration prompts, the target's continuations, the timings and
the re-measured sets. ``shared_once`` has exactly one worker compute a missing one;
``SearchState`` is what a worker has read of them.
"""

from __future__ import annotations

import logging
import os
import socket
import threading
import time
import uuid
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import optuna
from optuna.trial import TrialState

from specdecode.errors import InvalidArgumentError, StorageError
from specdecode.search.objective import DecodeCosts, is_int

logger = logging.getLogger(__name__)

# Trials that count toward ``SearchSettings.trials`` (every worker's).
FINISHED_STATES = (TrialState.COMPLETE, TrialState.PRUNED)

# Study user attributes (JSON values shared by every worker of a study).
ATTR_IDENTITY = "specdecode:identity"
ATTR_PROMPTS = "specdecode:prompts"
ATTR_REFERENCE = "specdecode:reference"
ATTR_COSTS = "specdecode:costs"
ATTR_MEASURED = "specdecode:measured:"  # + trial number


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
    label = model_label(model)
    raw = f"{label}-{dtype}-{objective}"
    return "".join(ch if ch.isalnum() or ch in "._-" else "-" for ch in raw)


def model_label(spec: str) -> str:
    """The model's name without the folder it sits in (so workers may keep it in different places)."""
    path = Path(spec).expanduser()
    return path.resolve().name if (spec.startswith((".", "/", "~")) or path.exists()) else spec


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

    if not is_int(heartbeat_interval_s) or heartbeat_interval_s < 1:
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


def shared_once(study: optuna.Study, key: str, compute: Callable[[], Any], beat_s: float, what: str) -> Any:
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


__all__ = [
    "ATTR_COSTS",
    "ATTR_IDENTITY",
    "ATTR_MEASURED",
    "ATTR_PROMPTS",
    "ATTR_REFERENCE",
    "FINISHED_STATES",
    "SearchState",
    "default_storage_url",
    "default_study_name",
    "model_label",
    "open_storage",
    "redact_url",
    "shared_once",
]
