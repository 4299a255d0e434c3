"""Command-line tools and human-readable renderings of plans.

* :mod:`flashplan.cli.render`: pure functions that turn a :class:`~flashplan.PlanSpec` and
  visibility masks into text (:func:`describe_plan`, :func:`ascii_visibility`).
* :mod:`flashplan.cli.demo`: ``python -m flashplan demo`` — plan and run a mixed batch,
  check it against a float64 dense attention.
* :mod:`flashplan.cli.explain`: ``python -m flashplan explain`` — print the plan and a
  picture of "which query sees which key" for a small layout given on the command line.
"""

from flashplan.cli.render import ascii_visibility, describe_plan, kernel_coverage

__all__ = ["ascii_visibility", "describe_plan", "kernel_coverage"]
