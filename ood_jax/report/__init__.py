"""`ood-jax report`: an effective-robustness report of run directories, as one static HTML page.

read.py   run directories (detector workdirs, eval-mllm runs, corruptions.json) -> runs.Run
runs.py   the record of one run: scores with intervals, in-domain / held-out pairs, per-domain
          bars, corruption curves
fit.py    panels of runs measuring one shift, the linear fit and each run's effective robustness
plots.py  the figures, as inline SVG
page.py   the HTML page
cli.py    `add_parser(subparsers)` (the command) and `write_report(...)` (the same as a function)

Nothing else in ood_jax imports this package.
"""

from ood_jax.report.cli import add_parser, write_report
from ood_jax.report.runs import RunError

__all__ = ["RunError", "add_parser", "write_report"]
