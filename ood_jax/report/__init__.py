"""`ood-jax report`: an effective-robustness report of run directories, as one static HTML page.

read.py   run directories (detector workdirs, eval-mllm runs, corruptions.json) -> runs.Run
runs.py   the record of one run: scores with intervals, in-domain / held-out pairs, per-domain
          bars, corruption curves
fit.py    panels of runs measuring one shift, the linear fit and each run's effective robustness
plots.py  the figures, as inline SVG
page.py   the HTML page

`write_report` is the command (ood_jax.cli.report) as a function.
"""

from __future__ import annotations

import os
from collections.abc import Sequence

from ood_jax import files
from ood_jax.report import fit, read
from ood_jax.report.fit import Panel
from ood_jax.report.runs import Run, RunError

DEFAULT_TITLE = "ood-jax effective-robustness report"


def write_report(
    run_dirs: Sequence[str | os.PathLike],
    out: str | os.PathLike,
    scale: str = "logit",
    title: str = DEFAULT_TITLE,
) -> tuple[list[Run], list[Panel]]:
    """Reads `run_dirs`, fits each shift on `scale` and writes the page to `out` atomically;
    returns the runs and panels it shows. A directory that is no run raises runs.RunError."""
    # matplotlib is imported when a page is drawn, not whenever `ood-jax` builds its parser.
    from ood_jax.report import page

    runs = read.read_runs(run_dirs)
    panels = fit.panels(runs, scale)
    files.write_atomic(out, page.render(runs, panels, title, scale))
    return runs, panels


__all__ = ["DEFAULT_TITLE", "RunError", "write_report"]
