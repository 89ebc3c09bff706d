"""Did a change make a step slower? poptorch_lite at one commit against another, side by side.

    git worktree add ../base HEAD~3     # the commit to compare with, checked out beside
    python benchmarks/tax_ab.py --base ../base                    # tiny, conv8, conv16, mlp
    python benchmarks/tax_ab.py --base ../base --case tiny --pairs 3 --blocks 5

For each case of ``tax.py``, a pair of processes runs its poptorch_lite side (``tax.py --side
lite --serve``), one from each checkout (each imports its own ``poptorch_lite``), with one
intra-op thread. They take turns, block by block (about a quarter second of calls each;
which goes first alternates), the other waiting on its pipe, so their thread pools never
compete and the machine's drift falls on both alike. A pair's ratio is the median over its
blocks of (head block / base block beside it); the line gives the median over the pairs and
their spread, and each side's median time per optimizer step.
"""

import argparse
import os
import statistics
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
HEAD = os.path.dirname(HERE)
sys.path.insert(0, HERE)

from tax import take_turns  # noqa: E402

parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
parser.add_argument("--base", required=True, help="the other checkout (a git worktree)")
parser.add_argument("--head", default=HEAD, help="this checkout unless given")
parser.add_argument("--case", default="tiny,conv8,conv16,mlp",
                    help="tax.py's cases, comma-separated")
parser.add_argument("--pairs", type=int, default=5, help="process pairs per case")
parser.add_argument("--blocks", type=int, default=9, help="blocks per side and pair")
parser.add_argument("--calls", type=int, default=0,
                    help="calls per block (0: about a quarter second's worth)")


def command(root: str, case: str, calls: int) -> list:
    """tax.py's poptorch_lite side, served from the checkout at ``root``."""
    return [sys.executable, os.path.join(root, "benchmarks", "tax.py"), "--side", "lite",
            "--case", case, "--threads", "1", "--calls", str(calls), "--serve"]


def main():
    args = parser.parse_args()
    for case in args.case.split(","):
        ratios, head_ms, base_ms = [], [], []
        for k in range(args.pairs):
            got = take_turns({side: command(root, case, args.calls) for side, root in
                              (("base", args.base), ("head", args.head))},
                             args.blocks, "base" if k % 2 == 0 else "head")
            head, base = ([b["step_ms"] for b in got[side]] for side in ("head", "base"))
            ratios.append(statistics.median(h / b for h, b in zip(head, base)))
            head_ms.append(statistics.median(head))
            base_ms.append(statistics.median(base))
        print(f"{case:7} base {statistics.median(base_ms):9.3f} ms  head "
              f"{statistics.median(head_ms):9.3f} ms  head/base {statistics.median(ratios):.3f} "
              f"({min(ratios):.3f}-{max(ratios):.3f}), {args.pairs} pairs x {args.blocks} "
              f"blocks, 1 thread", flush=True)


if __name__ == "__main__":
    main()
