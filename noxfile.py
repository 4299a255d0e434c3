"""Nox sessions for flashplan.

CPU sessions install ``torch==2.13.0`` *before* the project so that pip never resolves
``torch>=2.4`` to a multi-GB CUDA build. Venvs are reusable: ``nox -r`` (or ``-R``).

    nox -s tests            # CPU test suite (everything not marked ``gpu``)
    nox -s lint             # ruff check + ruff format --check
    nox -s typecheck        # mypy
    nox -s demo             # python -m flashplan demo
    nox -s gpu              # GPU tests, in the *current* environment (see its docstring)
"""

from __future__ import annotations

import os

import nox

nox.options.sessions = ["lint", "typecheck", "tests", "demo"]
nox.options.reuse_existing_virtualenvs = True

PYTHON = "3.11"
TORCH_CPU = "torch==2.13.0"


def _dev_pin(name: str) -> str:
    """The pinned requirement of ``name`` in pyproject.toml's ``dev`` extra (one place)."""
    import tomllib

    with open("pyproject.toml", "rb") as f:
        dev = tomllib.load(f)["project"]["optional-dependencies"]["dev"]
    return next(r for r in dev if r.split("=")[0] == name)


RUFF = _dev_pin("ruff")
LINT_PATHS = ["flashplan", "tests", "benchmarks", "examples", "docs", "noxfile.py"]


def _install_project(session: nox.Session, extras: str) -> None:
    session.install(TORCH_CPU)
    session.install("-e", f".[{extras}]")


@nox.session(python=PYTHON)
def tests(session: nox.Session) -> None:
    """Run the CPU test suite (``-n 2 -m "not gpu"``: two pytest-xdist workers, as
    .ci/run and the README run it). Extra args are passed to pytest instead."""
    _install_project(session, "test,flashinfer")
    args = session.posargs or ["-q", "-n", "2", "-m", "not gpu"]
    session.run("python", "-m", "pytest", *args)


@nox.session(python=PYTHON)
def lint(session: nox.Session) -> None:
    """ruff check + ruff format --check."""
    session.install(RUFF)
    paths = [p for p in LINT_PATHS if os.path.exists(p)]
    session.run("ruff", "check", *paths)
    session.run("ruff", "format", "--check", *paths)


@nox.session(python=PYTHON)
def typecheck(session: nox.Session) -> None:
    """mypy over ``flashplan`` (config in pyproject.toml)."""
    _install_project(session, "test,flashinfer,dev")
    session.run("mypy", *session.posargs)


@nox.session(python=PYTHON)
def demo(session: nox.Session) -> None:
    """Run ``python -m flashplan demo`` on the CPU (reference executor): the lean install
    of the README's first command (no FlashInfer, no Triton)."""
    session.install(TORCH_CPU)
    session.install("-e", ".")
    session.run("python", "-m", "flashplan", "demo", *session.posargs)


@nox.session(python=False)
def gpu(session: nox.Session) -> None:
    """Run the GPU tests (``pytest -m gpu tests``) in the CURRENT environment.

    This session creates no venv and installs nothing (``python=False``, i.e. nox's
    ``venv_backend="none"``): on the GPU machine, first set up an environment with a
    CUDA build of torch and the project, e.g.::

        pip install -e '.[test,flashinfer]'   # keeps the CUDA torch already there
        nox -s gpu                              # or: python -m pytest -m gpu tests

    Extra args are passed to pytest.
    """
    session.run("python", "-m", "pytest", "-m", "gpu", "tests", *session.posargs, external=True)
