"""Plots of a skip-set study: optimisation history, parameter importances, skip-frequency heat map."""

from __future__ import annotations

import logging
import math
import warnings
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import optuna

from specdecode.drafters.layer_skip import SUBLAYERS
from specdecode.files import write_atomic, write_png_atomic
from specdecode.search.objective import feasible_trials

logger = logging.getLogger(__name__)

HISTORY_PNG = "search_history.png"
HISTORY_HTML = "search_history.html"
IMPORTANCES_PNG = "search_importances.png"
IMPORTANCES_HTML = "search_importances.html"
HEATMAP_PNG = "search_skip_heatmap.png"


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
    "HEATMAP_PNG",
    "HISTORY_HTML",
    "HISTORY_PNG",
    "IMPORTANCES_HTML",
    "IMPORTANCES_PNG",
    "plot_study",
    "skip_frequencies",
]
