"""``poprun``: PopDist's launcher, on torch's own (``torch.distributed.run`` and its elastic agent).

[Note: poprun]
``poprun --num-instances I --num-replicas R [--ipus-per-replica K] PROGRAM [ARGS]`` starts I
instances of PROGRAM, each running R/I replicas, as ``torchrun --nproc-per-node I --no-python
PROGRAM ARGS`` would, with PopDist's variables set for every instance (``POPDIST_NUM_*``:
[Note: instances] in ``popdist``) and ``import poptorch`` resolved to poptorch_lite in every
Python process started (``alias.reach_children``). The console commands are ``poprun`` and
``poptorch-lite poprun``.

- ``--host h1,h2,...``: the instances are spread evenly over the hosts. torchrun starts the
  processes of the host it runs on, so the same ``poprun`` command runs on every host (mpirun
  would log in to them); the hosts meet at the first one's c10d rendezvous (``--rdzv-endpoint
  h1``, at port ``MASTER_PORT`` where that is set, else torchrun's 29400), which numbers them.
- ``--tag-output`` (or within ``--mpi-global-args``/``--mpi-local-args``): each line of output
  starts ``[1,i]:``, i the instance (mpirun writes ``[1,i]<stdout>:``; torchrun's prefix
  cannot name the stream);
  ``--only-output-from-instance i``: the other instances' output is dropped (each instance's
  process is started through this module, which points stdout and stderr at ``/dev/null``
  where they are not wanted, then execs PROGRAM).
- ``--mpi-global-args``/``--mpi-local-args`` are mpirun's: of them ``-x NAME=VALUE`` exports a
  variable and ``--tag-output`` tags; the rest (``--bind-to``, ``--allow-run-as-root``, ...)
  have no torchrun meaning and are ignored with one note.
- ``--vipu-*`` and the other IPU-only flags (partitions, NUMA, the executable cache) are
  accepted, with one note.

PROGRAM is run as it is; a ``.py`` file that is not executable runs with this Python. A bad
flag or count is refused before anything starts; the exit status is torchrun's (non-zero when
an instance failed; torch's report names it).
"""

from __future__ import annotations

import dataclasses
import os
import shlex
import subprocess
import sys
import tempfile
from typing import Optional, Sequence

from .errors import OptionsError

USAGE = ("poprun [--num-instances I] --num-replicas R [--ipus-per-replica K] [--host H1,H2] "
         "[--tag-output] [--only-output-from-instance i] [--mpi-global-args ARGS] "
         "[--mpi-local-args ARGS] PROGRAM [ARGS ...]")
HELP = """Launch PROGRAM as I instances of R/I replicas each, as PopDist's poprun does, on torch's
own launcher (torch.distributed.run); `import poptorch` is poptorch_lite in every instance.

  --num-instances I             processes (default 1)
  --num-replicas R              replicas of all instances together (a multiple of I)
  --ipus-per-replica K          popdist.getNumIpusPerReplica() (default 1)
  --host H1,H2,...              spread the instances over these hosts; run the same command
                                on each (they meet at H1, port MASTER_PORT or 29400)
  --tag-output                  start each line of output with [1,i]:, i the instance
  --only-output-from-instance i show instance i's output alone
  --mpi-global-args ARGS        mpirun's arguments: -x NAME=VALUE exports, --tag-output tags,
  --mpi-local-args ARGS         the rest are ignored with a note
  --vipu-*, --update-partition, ... IPU-only flags: accepted and ignored, with a note"""
# poprun's flags and whether each takes a value; ``None``: accepted and ignored (IPU only)
FLAGS = {"--num-instances": True, "--num-replicas": True, "--ipus-per-replica": True,
         "--host": True, "-H": True, "--tag-output": False,
         "--only-output-from-instance": True, "--mpi-global-args": True,
         "--mpi-local-args": True}
IPU_ONLY = {"--update-partition": True, "--reset-partition": True, "--remove-partition": True,
            "--print-topology": True, "--numa-aware": True, "--host-subnet": True,
            "--executable-cache-path": True, "--sync-type": True, "--offline-mode": True,
            "--process-placement": True, "--ipus-per-instance": True}
# mpirun's flags that take a value (so that their value is not read as a flag)
MPI_VALUED = {"-x", "--bind-to", "--map-by", "--rank-by", "--mca", "-mca", "--hostfile",
              "-np", "-n", "--prefix", "--output-filename", "-wdir", "--wdir"}


class ShowHelp(Exception):
    """``-h``/``--help`` among poprun's flags."""


@dataclasses.dataclass
class Launch:
    """One ``poprun`` command line, parsed and checked.

    Example:
        >>> launch = parse(["--num-instances", "2", "--num-replicas", "4", "python", "t.py"])
        >>> launch.instances, launch.local_replicas, launch.program
        (2, 2, ['python', 't.py'])
    """

    instances: int
    replicas: int
    ipus_per_replica: int
    hosts: tuple
    tag_output: bool
    only_instance: Optional[int]
    exports: dict
    program: list
    ignored: list  # flags accepted without effect, for the note

    @property
    def local_replicas(self) -> int:
        return self.replicas // self.instances

    @property
    def per_host(self) -> int:
        return self.instances // len(self.hosts)

    def environment(self) -> dict:
        """The variables every instance gets beside torchrun's ``RANK``/``WORLD_SIZE``."""
        return {"POPDIST_NUM_TOTAL_REPLICAS": str(self.replicas),
                "POPDIST_NUM_LOCAL_REPLICAS": str(self.local_replicas),
                "POPDIST_NUM_IPUS_PER_REPLICA": str(self.ipus_per_replica),
                "POPDIST_UNIFORM_REPLICAS_PER_INSTANCE": "1", **self.exports}

    def torchrun_args(self, python: str = sys.executable) -> list:
        """``torch.distributed.run``'s arguments for this launch.

        Example:
            >>> parse(["--num-replicas", "2", "--num-instances", "2", "--tag-output",
            ...        "t.sh"]).torchrun_args()[:6]
            ['--standalone', '--nproc-per-node', '2', '--max-restarts', '0', '--tee']
        """
        if len(self.hosts) > 1:
            port = os.environ.get("MASTER_PORT")
            args = ["--nnodes", str(len(self.hosts)), "--rdzv-backend", "c10d",
                    "--rdzv-endpoint", f"{self.hosts[0]}:{port}" if port else self.hosts[0]]
        else:
            args = ["--standalone"]
        args += ["--nproc-per-node", str(self.per_host), "--max-restarts", "0"]
        if self.tag_output:
            args += ["--tee", "3", "--log-line-prefix-template", "[1,${rank}]: "]
        program = list(self.program)
        if program[0].endswith(".py") and not os.access(program[0], os.X_OK):
            program.insert(0, python)
        if self.only_instance is not None:
            program = [python, "-m", "poptorch_lite.poprun", "--instance-output",
                       str(self.only_instance), *program]
        return args + ["--no-python", *program]


def _value(flag: str, argv: list, i: int) -> tuple[str, int]:
    """The value of ``flag`` at ``argv[i]`` (``--flag=v`` or ``--flag v``) and the next index."""
    head, eq, tail = argv[i].partition("=")
    if eq:
        return tail, i + 1
    if i + 1 >= len(argv):
        raise OptionsError(f"{flag} needs a value, e.g. {flag}=2")
    return argv[i + 1], i + 2


def _count(flag: str, text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise OptionsError(f"{flag} {text!r} is not a positive integer; give e.g. {flag} 2")
    return value


def _mpi(text: str, exports: dict, ignored: list) -> bool:
    """Read mpirun's arguments ``text``: ``-x`` exports into ``exports``, the rest into
    ``ignored``; returns whether ``--tag-output`` was among them."""
    words, tag, i = shlex.split(text), False, 0
    while i < len(words):
        word = words[i]
        if word in ("--tag-output", "-tag-output"):
            tag = True
        elif word == "-x" and i + 1 < len(words):
            name, eq, value = words[i + 1].partition("=")
            if eq:
                exports[name] = value  # without a value, torchrun passes this one's on anyway
            i += 1
        else:
            ignored.append(word if word not in MPI_VALUED or i + 1 >= len(words)
                           else f"{word} {words[i + 1]}")
            i += word in MPI_VALUED
        i += 1
    return tag


def parse(argv: Sequence[str]) -> Launch:
    """Read a ``poprun`` command line (flags, then PROGRAM and its arguments).

    Raises:
        OptionsError: an unknown flag, a bad count, replicas the instances or instances the
            hosts do not divide, an instance index out of range, or no PROGRAM.
    """
    argv, got, exports, ignored, tag, i = list(argv), {}, {}, [], False, 0
    while i < len(argv) and argv[i].startswith("-"):
        flag = argv[i].partition("=")[0]
        if flag in ("-h", "--help"):
            raise ShowHelp()
        if flag in FLAGS:
            if not FLAGS[flag]:
                tag, i = True, i + 1
                continue
            got[flag], i = _value(flag, argv, i)
            if flag in ("--mpi-global-args", "--mpi-local-args"):
                tag |= _mpi(got[flag], exports, ignored)
        elif flag in IPU_ONLY or flag.startswith("--vipu-"):
            value, i = _value(flag, argv, i)
            ignored.append(f"{flag}={value}")
        else:
            raise OptionsError(f"poprun has no flag {flag!r} here; its flags: "
                             f"{', '.join(sorted(FLAGS))}, --vipu-* and the IPU-only "
                             f"{', '.join(sorted(IPU_ONLY))} (usage: {USAGE})")
    program = argv[i:]
    if not program:
        raise OptionsError(f"give the PROGRAM to launch, e.g. poprun --num-replicas 2 "
                         f"--num-instances 2 python train.py (usage: {USAGE})")
    if "--num-replicas" not in got:
        raise OptionsError("give --num-replicas, the replicas of every instance together "
                         "(e.g. --num-replicas 4 --num-instances 2: 2 replicas each)")
    instances = _count("--num-instances", got.get("--num-instances", "1"))
    replicas = _count("--num-replicas", got["--num-replicas"])
    if replicas % instances:
        raise OptionsError(f"--num-replicas {replicas} is not a multiple of --num-instances "
                         f"{instances}: each instance runs the same number of replicas; give "
                         f"--num-replicas {instances * max(1, replicas // instances)}")
    hosts = tuple(h for h in got.get("--host", got.get("-H", "localhost")).split(",") if h)
    if not hosts or instances % len(hosts):
        raise OptionsError(f"--num-instances {instances} does not spread evenly over the "
                         f"{len(hosts)} host(s) {list(hosts)}; give a multiple of {len(hosts)}")
    only = got.get("--only-output-from-instance")
    if only is not None:
        index = int(only) if only.isdigit() else -1
        if not 0 <= index < instances:
            raise OptionsError(f"--only-output-from-instance {only!r} is not an instance index "
                             f"(0 to {instances - 1})")
        only = index
    return Launch(instances, replicas, _count("--ipus-per-replica",
                                              got.get("--ipus-per-replica", "1")),
                  hosts, tag, only, exports, program, ignored)


def _instance_output(argv: list) -> None:
    """In one instance's process: drop its output unless it is the one wanted, then exec the
    program (``argv``: the wanted index, then the program and its arguments)."""
    wanted, program = int(argv[0]), argv[1:]
    if int(os.environ.get("RANK", "0")) != wanted:
        null = os.open(os.devnull, os.O_WRONLY)
        os.dup2(null, 1)
        os.dup2(null, 2)
    os.execvp(program[0], program)


def main(argv: Optional[Sequence[str]] = None) -> int:
    """The ``poprun`` command: launch the instances and wait for them; torchrun's exit status
    (2 and the reason for a bad command line; 0 and the usage for ``-h``)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        launch = parse(argv)
    except ShowHelp:
        print(f"usage: {USAGE}\n\n{HELP}")
        return 0
    except OptionsError as e:
        print(f"poprun: {e}", file=sys.stderr)
        return 2
    if launch.ignored:
        print(f"poprun: note: ignored, as they tune IPU hardware or mpirun: "
              f"{' '.join(launch.ignored)}", file=sys.stderr)
    from .alias import reach_children
    reach_children()  # `import poptorch` is poptorch_lite in every instance
    env = {**os.environ, **launch.environment()}
    # torchrun's agent keeps its instances' error files in a log folder, which it makes in
    # the temporary directory and leaves there; one of poprun's own, removed when the run ends
    # (torch's report of a failed instance is printed by then), leaves nothing behind.
    with tempfile.TemporaryDirectory(prefix="poprun-", ignore_cleanup_errors=True) as logs:
        command = [sys.executable, "-m", "torch.distributed.run", "--log-dir", logs,
                   *launch.torchrun_args()]
        try:
            return subprocess.run(command, env=env).returncode
        except KeyboardInterrupt:
            return 130


if __name__ == "__main__":
    if sys.argv[1:2] == ["--instance-output"]:
        _instance_output(sys.argv[2:])
    sys.exit(main())
