"""The ``poptorch-lite`` command: running an unmodified PopTorch script, and ``poprun``.

``python -m poptorch_lite run script.py [args]`` (or the console entry point
``poptorch-lite run script.py [args]``) makes ``poptorch`` and its submodules
(``poptorch.optim``, ``poptorch.enums``, ...) the same module objects as
``poptorch_lite`` and its submodules (``alias``), then runs the script as ``__main__``,
the way ``python script.py [args]`` would: ``sys.argv`` is the script and its
arguments, and the script's folder comes first on ``sys.path``. ``poptorch-lite poprun``
is the ``poprun`` command (``poprun.py``).
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import runpy
import sys
from typing import Optional, Sequence

from . import alias, poprun
from .alias import alias_poptorch  # noqa: F401 - ../shared/tools/poptorch_suite.sh's import


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="poptorch-lite", description="Run a PopTorch script on poptorch_lite, unmodified.",
        epilog="example: poptorch-lite run examples/mnist_poptorch.py --data-dir ../shared/data "
               "--epochs 1")
    parser.add_argument("--version", action="version",
                        version=f"%(prog)s {_version()} (torch {_torch_version()})")
    commands = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    run = commands.add_parser("run", help="run SCRIPT with `import poptorch` resolved to poptorch_lite",
                              usage="%(prog)s [-h] [--compile] [--compile-backend NAME] "
                                    "[--without-op-libraries] SCRIPT [ARGS ...]",
                              description="Run SCRIPT as __main__ with `import poptorch` resolved "
                                          "to poptorch_lite; ARGS (optional) are passed to it as "
                                          "sys.argv[1:].")
    run.add_argument("--compile", action="store_true",
                     help="compile the stages of every wrapped model (on a GPU, each step "
                          "then replays as one CUDA graph): Options().compileStages(True) as "
                          "every Options' default")
    run.add_argument("--compile-backend", metavar="NAME", choices=_backends(),
                     help=f"with --compile, the backend: one of {', '.join(_backends())} "
                          f"(default: each device's, inductor)")
    run.add_argument("--without-op-libraries", action="store_true",
                     help="a custom-op library the script loads with ctypes.cdll.LoadLibrary "
                          "and that was not built is stood in for (one warning): its custom "
                          "ops run from their Python registrations")
    run.add_argument("script", metavar="SCRIPT", nargs="?", help="path of the Python script")
    run.add_argument("args", metavar="ARGS", nargs=argparse.REMAINDER,
                     help="the script's arguments (optional)")
    run.set_defaults(usage_error=run.error)
    commands.add_parser("poprun", add_help=False, help="launch instances as PopDist's poprun "
                        "does, on torchrun: poptorch-lite poprun --num-instances 2 "
                        "--num-replicas 4 python train.py ([Note: poprun])")
    return parser


def _backends() -> tuple:
    return importlib.import_module("poptorch_lite.options.options").BACKENDS


def compile_by_default(backend: Optional[str]) -> Optional[str]:
    """Make ``compileStages(True, backend)`` the default of every ``Options`` made in this
    process and its children, through ``POPTORCH_DEFAULT_OPTIONS`` (whatever it already
    sets stays, but for these two). Returns what is wrong with the variable, if it is not a
    JSON object (then nothing is set)."""
    current = os.environ.get("POPTORCH_DEFAULT_OPTIONS")
    try:
        values = json.loads(current) if current else {}
    except json.JSONDecodeError as e:
        values = e
    if not isinstance(values, dict):
        return (f"--compile adds to POPTORCH_DEFAULT_OPTIONS, which is not a JSON object "
                f"({current!r}); fix or unset it")
    values.update(compile_stages=True, compile_backend=backend)
    os.environ["POPTORCH_DEFAULT_OPTIONS"] = json.dumps(values)
    return None


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version
    try:
        return version("poptorch-lite")
    except PackageNotFoundError:  # run from a source tree that is not installed
        return importlib.import_module("poptorch_lite").__version__


def _torch_version() -> str:
    from importlib.metadata import PackageNotFoundError, version
    try:
        return version("torch")
    except PackageNotFoundError:
        return "not installed"


def main(argv: Optional[Sequence[str]] = None) -> int:
    """The ``poptorch-lite`` command: parse ``argv`` and run the script it names.

    Returns the exit status (0 when the script ends normally; a script's own
    ``sys.exit`` passes through). Usage errors (no or an unknown command, a
    missing script) print the usage and exit with status 2.

    Example:
        >>> main(["run", "train.py", "--epochs", "1"])  # doctest: +SKIP
        0
    """
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] == ["poprun"]:  # its flags are poprun's, then the program's
        return poprun.main(argv[1:])
    parser = _parser()
    args = parser.parse_args(argv)
    if args.script is None:
        args.usage_error("give the SCRIPT to run, e.g. poptorch-lite run train.py (ARGS, the "
                         "script's own arguments, are optional)")
    if not os.path.isfile(args.script):
        parser.error(f"run: no such script: {args.script!r} (give the path of a .py file)")
    if args.compile_backend is not None and not args.compile:
        args.usage_error("--compile-backend chooses the backend of --compile; give both, e.g. "
                         "poptorch-lite run --compile --compile-backend aot_eager train.py")
    wrong = compile_by_default(args.compile_backend) if args.compile else None
    if wrong:
        args.usage_error(wrong)
    alias.alias_poptorch()
    if args.without_op_libraries:  # [Note: custom ops] in custom_ops
        importlib.import_module("poptorch_lite.custom_ops").stand_in_for_missing_libraries()
    sys.argv = [args.script, *args.args]
    sys.path.insert(0, os.path.dirname(os.path.abspath(args.script)))
    runpy.run_path(args.script, run_name="__main__")
    return 0
