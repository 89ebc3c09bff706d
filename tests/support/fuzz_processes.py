"""One process of a fuzzer example in several processes, its replicas or its pipeline's
stages spread over them ([Note: the fuzzer's processes] in fuzz_check), started with
torchrun's variables by ``fuzz_check._in_processes``:

    python tests/support/fuzz_processes.py EXAMPLE.pkl OUT

runs ``fuzz_check._run`` for its rank on the pickled (program, config) and pickles what it
found (or plain PyTorch's ``Invalid``) to ``OUT/rank<r>.pkl``.
"""

import logging
import os
import pathlib
import pickle
import sys
import warnings

import torch

import fuzz_check
from fuzz_plain import Invalid


def main() -> None:
    example, out = map(pathlib.Path, sys.argv[1:3])
    program, config = pickle.loads(example.read_bytes())
    rank = int(os.environ["RANK"])
    warnings.simplefilter("ignore")
    logging.getLogger("poptorch_lite").setLevel(logging.ERROR)
    torch.set_num_threads(1)
    try:
        result = fuzz_check._run(program, config, rank)
    except Invalid as e:
        result = e
    (out / f"rank{rank}.pkl").write_bytes(pickle.dumps(result))


if __name__ == "__main__":
    main()
