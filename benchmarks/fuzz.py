"""The differential fuzzer's long profile: new models for as long as it is given, and a report.

    python benchmarks/fuzz.py                    # 30 minutes, PENDING left out: new findings
    python benchmarks/fuzz.py --minutes 5 --all  # everything drawn: finds the pending ones too
    python benchmarks/fuzz.py --seed 3 --report /tmp/fuzz.txt
    python benchmarks/fuzz.py --prove --minutes 3  # the proof of power: each PENDING finding
    python benchmarks/fuzz.py --inductor 0       # compiled examples on aot_eager only

Draws (program, config) pairs from tests/support/fuzz_draw.py and checks each against plain
PyTorch (tests/support/fuzz_check.py, [Note: the fuzzer's oracle] there). A finding is shrunk
by Hypothesis to its minimal model and configuration and printed as Python; its *signature*
(the grammar's names and the configuration's categorical factors of the minimal example that
differ from the simplest) is then known, and later examples whose names hold a known signature
count as that finding again instead of stopping the search. An example that fails and then
passes when Hypothesis replays it (a difference that depends on timing, as a race between
streams does) is recorded too, marked flaky, unshrunk. The search goes on, with a new
seed, until the time is up.

Printed at the end (and written to ``--report``): examples run and their outcomes, the count
of examples per grammar name and per configuration factor, and each finding with its minimal
example. Exit status 1 when there was a finding.
"""

from __future__ import annotations

import argparse
import collections
import logging
import pathlib
import sys
import tempfile
import time
import warnings

ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests" / "support"))
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402
from hypothesis import HealthCheck, configuration, given, settings  # noqa: E402
from hypothesis import seed as hypothesis_seed  # noqa: E402
from hypothesis.errors import Flaky  # noqa: E402

import fuzz_draw  # noqa: E402
from fuzz_check import Finding, check  # noqa: E402
from fuzz_config import Config  # noqa: E402
from fuzz_grammar import Program  # noqa: E402
from fuzz_plain import Invalid  # noqa: E402

#: Factors whose values are sizes: left out of a signature (a bug at 2 stages is the same bug
#: at 3).
SIZES = ("stages=", "G=", "D=", "R=", "B=", "calls=")
SIMPLEST = fuzz_draw.atoms(Program(), Config())


class OutOfTime(BaseException):
    """The budget is spent: ends Hypothesis's run without counting as a failure."""


def signature(program: Program, config: Config) -> frozenset:
    """What a minimal example's finding is known by (see the module doc)."""
    return frozenset(a for a in fuzz_draw.atoms(program, config) - SIMPLEST
                     if not a.startswith(SIZES))


class Search:
    """Counters, known findings and the budget of one long run."""

    def __init__(self, deadline: float, pending, require=frozenset()):
        self.deadline, self.pending, self.require = deadline, pending, require
        self.outcomes = collections.Counter()
        self.coverage = collections.Counter()
        self.known: list = []          # (signature, first line, minimal example text)
        self.last = None
        self.first = 0                 # the examples run until the first finding

    def one(self, program: Program, config: Config) -> None:
        """Hypothesis's test: one example, unless the time is up."""
        if time.monotonic() > self.deadline:
            raise OutOfTime
        used = fuzz_draw.atoms(program, config)
        try:
            outcome = check(program, config)
        except Invalid:
            self.outcomes["invalid in plain PyTorch"] += 1
            return
        except Finding as e:
            for sig, first, _ in self.known:
                if sig <= used:
                    self.outcomes[f"known finding: {first[:70]}"] += 1
                    return
            self.outcomes["finding (being shrunk)"] += 1
            self.first = self.first or sum(self.outcomes.values())
            self.last = (program, config, str(e))
            raise
        self.coverage.update(used)
        self.outcomes[outcome] += 1

    def round(self, seed: int) -> bool:
        """Search with ``seed`` until a new finding (recorded) or the time is up (False)."""
        search = self

        @settings(max_examples=10 ** 6, deadline=None, database=None, derandomize=False,
                  suppress_health_check=list(HealthCheck), report_multiple_bugs=False,
                  print_blob=False)
        @hypothesis_seed(seed)
        @given(example=fuzz_draw.examples(self.pending, self.require))
        def fuzz(example):
            search.one(*example)

        self.last = None
        try:
            fuzz()
        except OutOfTime:
            if self.last is None:
                return False
            self._record(seed, " (the time ran out while shrinking it)")
            return False
        except Finding:
            self._record(seed, "")
        except Flaky:  # Hypothesis's replay of the failing example passed: timing decides it
            if self.last is None:
                raise
            self._record(seed, " (flaky: it failed, then passed when replayed)")
        return True

    def _record(self, seed: int, note: str) -> None:
        program, config, text = self.last  # the last failing example: the smallest so far
        first = text.splitlines()[0]
        self.known.append((signature(program, config), first + note, text))
        print(f"\n=== finding {len(self.known)} (seed {seed}){note} ===\n{text}", flush=True)

    def report(self, started: float) -> str:
        runs = sum(self.outcomes.values())
        lines = [f"{runs} examples in {(time.monotonic() - started) / 60:.1f} min; "
                 f"{len(self.known)} findings", "", "outcomes:"]
        lines += [f"  {n:6d}  {k}" for k, n in self.outcomes.most_common()]
        lines += ["", "examples per grammar name and configuration factor (checked ones):"]
        by_kind = collections.defaultdict(list)
        for atom, n in sorted(self.coverage.items()):
            by_kind["config" if "=" in atom else "grammar"].append(f"{atom}:{n}")
        for kind, items in sorted(by_kind.items()):
            lines.append(f"  {kind}: " + "  ".join(items))
        for k, (sig, first, text) in enumerate(self.known, 1):
            lines += ["", f"--- finding {k}: {first}", f"signature: {sorted(sig)}", text]
        return "\n".join(lines)


def prove(names: list, minutes: float, seed: int) -> int:
    """Whether the fuzzer finds each pending finding, and its minimal example (``--prove``)."""
    rows = []
    for name in names:
        started = time.monotonic()
        search = Search(started + 60 * minutes, frozenset(fuzz_draw.PENDING) - {name},
                        frozenset(name.split("&")))
        search.round(seed)
        took = (time.monotonic() - started) / 60
        found = (f"found after {search.first} examples, shrunk in {took:.1f} min"
                 if search.known else f"NOT FOUND in {sum(search.outcomes.values())} examples")
        rows.append(f"{name:28s} {found}")
        print(f"### {name}: {found}; {dict(search.outcomes)}", flush=True)
    print("\n" + "\n".join(rows))
    return 0 if all("NOT FOUND" not in r for r in rows) else 1


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--minutes", type=float, default=30.0)
    parser.add_argument("--seed", type=int, default=0, help="the first round's seed")
    parser.add_argument("--all", action="store_true",
                        help="draw the PENDING names too (finds the known findings)")
    parser.add_argument("--report", type=pathlib.Path, help="also write the report here")
    parser.add_argument("--prove", nargs="*", metavar="NAME",
                        help="the proof of power: for each PENDING entry (or each NAME), search "
                             "examples that use it, the other pending ones left out, for "
                             "--minutes each, and shrink what it finds")
    parser.add_argument("--inductor", type=int, default=4, metavar="N",
                        help="one in N compiled examples compiles with Inductor, the users' "
                             "default backend (0: none; it takes seconds per stage)")
    parser.add_argument("--processes", type=int, default=5, metavar="N",
                        help="one in N training examples on the CPU runs its replicas in two "
                             "processes (0: none; starting them takes seconds)")
    args = parser.parse_args()
    fuzz_draw.INDUCTOR_ONE_IN, fuzz_draw.PROCESSES_ONE_IN = args.inductor, args.processes
    warnings.simplefilter("ignore")
    logging.getLogger("poptorch_lite").setLevel(logging.ERROR)  # its notes, once per program
    storage = tempfile.TemporaryDirectory(prefix="hypothesis-")  # not ./.hypothesis
    configuration.set_hypothesis_home_dir(storage.name)
    torch.set_num_threads(1)  # a small model's ops gain nothing from more; the machine is shared
    if args.prove is not None:
        return prove(args.prove or list(fuzz_draw.PENDING), args.minutes, args.seed)
    started = time.monotonic()
    pending = frozenset() if args.all else frozenset(fuzz_draw.PENDING)
    search = Search(started + 60 * args.minutes, pending)
    seed = args.seed
    while search.round(seed):
        seed += 1
    text = search.report(started)
    print("\n" + text)
    if args.report:
        args.report.write_text(text + "\n")
    return 1 if search.known else 0


if __name__ == "__main__":
    sys.exit(main())
