"""Run a command beside CPU-bound processes: the test command on a busy machine.

    python benchmarks/busy.py -n 4 -- .venv/bin/python -m pytest -q -n auto --maxprocesses 4

``-n`` processes (default 4) each spin a pure-Python loop on their own until the command ends;
then they are stopped, and the command's exit status and wall time are printed and returned.
A user runs the test command beside other work and CI machines are shared: the suite's
verdicts must not depend on how fast the machine is (CONTRIBUTING "A busy machine"). Each
spinner is a separate process (no GIL shared with the command) at the default priority, so
the command's processes get about ``cores / (n + their own count)`` of the machine.
"""

from __future__ import annotations

import argparse
import multiprocessing
import subprocess
import sys
import time


def spin() -> None:
    x = 0
    while True:  # until terminated
        x = (x * 1103515245 + 12345) & 0x7FFFFFFF


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("-n", type=int, default=4, help="CPU-bound processes beside the command")
    parser.add_argument("command", nargs=argparse.REMAINDER,
                        help="the command, after --")
    args = parser.parse_args(argv)
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command:
        parser.error("no command given: busy.py -n 4 -- <command ...>")
    if args.n < 0:
        parser.error(f"-n {args.n}: give 0 or more processes")
    spinners = [multiprocessing.Process(target=spin, daemon=True) for _ in range(args.n)]
    for p in spinners:
        p.start()
    start = time.monotonic()
    try:
        rc = subprocess.call(command)
    finally:
        for p in spinners:
            p.terminate()
        for p in spinners:
            p.join()
    minutes = (time.monotonic() - start) / 60
    print(f"busy.py: {' '.join(command)!r} beside {args.n} CPU-bound processes: exit status "
          f"{rc}, {minutes:.1f} min", flush=True)
    return rc


if __name__ == "__main__":
    sys.exit(main())
