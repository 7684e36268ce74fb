"""The ``specdecode search`` command: validate, load the target, run the study, write best.json and plots.

A command-line module: it prints (a status line and progress bar on stderr, the result
table on stdout, with rich). Its parser is ``specdecode.cli``'s ``_add_search``, and
``specdecode.cli`` calls ``run`` (reporting a missing optuna, an optional extra).
"""

from __future__ import annotations

from pathlib import Path

import optuna
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from specdecode.errors import InvalidArgumentError
from specdecode.models import load_model
from specdecode.search.objective import load_calibration_prompts
from specdecode.search.settings import SearchSettings
from specdecode.search.storage import default_storage_url, default_study_name, open_storage, redact_url
from specdecode.search.study import SkipSetSearch


def _fmt(v) -> str:
    return "-" if v is None else f"{v:.3f}"


def run(args) -> int:
    """``specdecode search``: validate, load, run the study, write best.json and plots.

    Args:
        args: The parsed ``specdecode search`` arguments.

    Returns:
        The exit status: 0, or 130 when interrupted (the finished trials are kept).

    Raises:
        InvalidArgumentError: Before the model loads: a setting out of range, an --out that is an existing
            folder (--out names the best.json file) or whose folder cannot be created.
        StorageError, DatasetError: Before the model loads: a --storage that cannot be opened, a bad
            calibration file. Loading errors (``load_model``'s) and the study's pass through too.
    """
    settings = SearchSettings(
        trials=args.trials, objective=args.objective, sampler=args.sampler, timeout_s=args.timeout,
        calibration=args.calibration, num_prompts=args.num_prompts, prompt_offset=args.prompt_offset,
        chat=args.chat, max_new_tokens=args.max_new_tokens, max_gamma=args.max_gamma,
        num_speculative_tokens=args.num_speculative_tokens, min_skip_fraction=args.min_skip_fraction,
        max_skip_fraction=args.max_skip_fraction, remeasure=args.remeasure, seed=args.seed,
        timing_repeats=args.timing_repeats, heartbeat_interval_s=args.heartbeat_interval,
    )
    if not args.verbose:
        optuna.logging.set_verbosity(optuna.logging.WARNING)
    # Everything that needs no model first: a bad URL or file fails in a second, not after the load.
    out = Path(args.out)
    if out.is_dir():  # best.json would replace the folder only after the whole study
        raise InvalidArgumentError(
            f"--out {str(out)!r} is a folder: --out names the best.json file to write (the plots and the default "
            f"storage go beside it); pass e.g. --out {str(out / 'best.json')!r}")
    try:  # best.json is written after the study: an --out that cannot be written must fail now
        out.parent.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise InvalidArgumentError(f"cannot create the folder of --out {str(out)!r}: {e.strerror or e}; "
                                   "pass a writable path") from e
    storage = open_storage(args.storage, settings.heartbeat_interval_s) if args.storage else None
    prompts = load_calibration_prompts(
        settings.calibration, settings.num_prompts, offset=settings.prompt_offset, chat=settings.chat
    )
    err = Console(stderr=True)
    with err.status(f"loading {args.target}"):
        loaded = load_model(args.target, dtype=args.dtype, device=args.device, quantize=args.quantize,
                            prepack_linears=args.prepack_linears)
    dtype = str(loaded.model.dtype).removeprefix("torch.")
    if loaded.quantize != "none":
        dtype += f"-{loaded.quantize}"  # a quantized model gets its own study
    if loaded.prepacked:
        dtype += "-prepacked"  # so do oneDNN's linears (models.prepacked_linear): other sublayer costs
    study_name = args.study_name or default_study_name(args.target, dtype, settings.objective)
    if storage is None:
        storage = open_storage(default_storage_url(out, study_name), settings.heartbeat_interval_s)
    url = redact_url(str(storage.url))
    runner = SkipSetSearch(loaded, settings, storage, study_name, prompts)
    try:
        with err.status(f"study {study_name!r}: calibrating (once per study)"):
            runner.prepare()
        best = runner.best_value()
        bar = Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
                       TextColumn("best {task.fields[best]}"), TimeElapsedColumn(), console=err)
        task = bar.add_task(f"{settings.objective} trials", total=settings.trials,
                            completed=min(runner.num_finished(), settings.trials),
                            best="-" if best is None else f"{best:.3f}x")

        def on_trial(done: int, total: int, best_value: float | None) -> None:
            bar.update(task, completed=min(done, total), best="-" if best_value is None else f"{best_value:.3f}x")

        with bar:
            runner.optimize(progress=on_trial)
        remeasured = []
        if settings.objective == "modelled" and settings.remeasure:
            with err.status(f"re-measuring the {settings.remeasure} best sets by real decoding"):
                remeasured = runner.remeasure()
        result = runner.write_outputs(out, remeasured, plots=args.plots)
    except KeyboardInterrupt:
        err.print(f"interrupted: the finished trials are kept in {url} (study {study_name!r}); "
                  "run the same command again to resume")
        return 130
    table = Table(title=f"specdecode search: {study_name} ({result['num_trials']} trials)")
    for col in ("", "skip set", "gamma", "modelled", "measured", "acceptance (real)"):
        table.add_column(col)
    rows = result["remeasured"] or [{"trial": result["trial"], "attn": result["attn"], "mlp": result["mlp"],
                                     "modelled": result["modelled"], "measured": result["measured"]}]
    for r in rows:
        m, mm = r["modelled"] or {}, r["measured"] or {}
        table.add_row(
            "best" if r["trial"] == result["trial"] else f"trial {r['trial']}",
            f"attn={','.join(map(str, r['attn']))};mlp={','.join(map(str, r['mlp']))}",
            str(mm.get("num_speculative_tokens") or m.get("best_gamma") or "-"),
            "-" if m.get("speedup") is None else f"{m['speedup']:.3f}x (alpha {m['alpha']:.3f})",
            "-" if mm.get("speedup") is None else f"{mm['speedup']:.3f}x",
            _fmt(mm.get("acceptance_rate")),
        )
    console = Console()
    console.print(table)
    console.print(f"best.json selected by {result['selected_by']}; written: {', '.join(result['files'])}")
    console.print(f"storage: {url}")
    return 0


__all__ = ["run"]
