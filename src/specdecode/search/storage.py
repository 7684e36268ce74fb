"""Where a study lives: an Optuna RDB storage (SQLite file or any SQLAlchemy URL).

``open_storage`` opens one with trial heartbeats (and, on SQLite, serialised
transactions, so that two workers never claim the same queued trial);
``default_storage_url`` and ``default_study_name`` give the defaults of
``specdecode search``; ``redact_url`` hides a password for logs, errors and best.json.
"""

from __future__ import annotations

import logging
import time
import warnings
from pathlib import Path

import optuna

from specdecode.errors import InvalidArgumentError, StorageError
from specdecode.search.objective import is_int

logger = logging.getLogger(__name__)


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


__all__ = ["default_storage_url", "default_study_name", "model_label", "open_storage", "redact_url"]
