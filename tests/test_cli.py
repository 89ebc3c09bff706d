"""`python -m poptorch_lite run script.py` runs a PopTorch script whose `import poptorch` is unchanged."""

import os
import pathlib
import subprocess
import sys
import textwrap

import pytest

from patience import limit

ROOT = pathlib.Path(__file__).resolve().parents[1]

# A PopTorch-style script, as written for IPUs: nothing in it names poptorch_lite.
SCRIPT = textwrap.dedent('''
    import sys
    import torch
    import poptorch
    import poptorch.optim
    from poptorch.enums import ReductionType

    class Model(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.fc1 = torch.nn.Linear(4, 8)
            self.fc2 = torch.nn.Linear(8, 3)
            self.loss = torch.nn.CrossEntropyLoss()

        def forward(self, x, labels=None):
            with poptorch.Block("first", ipu_id=0):
                x = torch.relu(self.fc1(x))
            with poptorch.Block("second", ipu_id=1):
                x = self.fc2(x)
                return x if labels is None else (x, self.loss(x, labels))

    torch.manual_seed(0)
    steps = int(sys.argv[sys.argv.index("--steps") + 1])
    dataset = torch.utils.data.TensorDataset(torch.randn(8 * 3 * steps, 4), torch.randint(0, 3, (8 * 3 * steps,)))
    opts = poptorch.Options().deviceIterations(1)
    opts.Training.gradientAccumulation(3).accumulationAndReplicationReductionType(ReductionType.Mean)
    loader = poptorch.DataLoader(opts, dataset, batch_size=8)
    model = Model()
    training_model = poptorch.trainingModel(model, opts, poptorch.optim.SGD(model.parameters(), lr=0.1))
    losses = [float(training_model(x, y)[1]) for x, y in loader]
    training_model.detachFromDevice()
    print(__name__, sys.argv[1:], poptorch.__name__, type(training_model).__name__, len(losses))
''')


def run_cli(*args, cwd):
    return subprocess.run([sys.executable, "-W", "ignore", "-m", "poptorch_lite", *args],
                          capture_output=True, text=True, timeout=limit(300), cwd=cwd,
                          env={**os.environ, "PYTHONPATH": str(ROOT)})


def test_run_resolves_import_poptorch_and_passes_the_arguments(tmp_path):
    (tmp_path / "train.py").write_text(SCRIPT)
    result = run_cli("run", "train.py", "--steps", "4", "-h", cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.splitlines() == [
        "__main__ ['--steps', '4', '-h'] poptorch_lite PoplarExecutor 4"]


def test_the_script_alone_has_no_poptorch(tmp_path):
    (tmp_path / "train.py").write_text(SCRIPT)
    result = subprocess.run([sys.executable, "train.py", "--steps", "1"], capture_output=True,
                            text=True, timeout=limit(300), cwd=tmp_path,
                            env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert result.returncode == 1 and "No module named 'poptorch'" in result.stderr


def test_the_script_sees_its_own_folder_and_exit_status(tmp_path):
    (tmp_path / "helper.py").write_text("VALUE = 7\n")
    (tmp_path / "fails.py").write_text("import helper, sys\nprint(helper.VALUE)\nsys.exit(3)\n")
    result = run_cli("run", str(tmp_path / "fails.py"), cwd=ROOT)
    assert (result.returncode, result.stdout) == (3, "7\n")


@pytest.mark.parametrize("args, message", [
    ((), "the following arguments are required: COMMAND"),
    (("train", "x.py"), "invalid choice: 'train'"),
    (("run",), "run: error: give the SCRIPT to run, e.g. poptorch-lite run train.py (ARGS, the "
               "script's own arguments, are optional)"),
    (("run", "missing.py"), "run: no such script: 'missing.py'")])
def test_usage_errors_exit_2_with_the_usage(args, message, tmp_path, monkeypatch, capsys):
    from poptorch_lite import cli
    monkeypatch.chdir(tmp_path)
    with pytest.raises(SystemExit) as exited:
        cli.main(list(args))
    assert exited.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith("usage: poptorch-lite"), err
    assert message in err, err


def test_version_names_the_package_and_torch(tmp_path):
    import importlib.metadata

    import poptorch_lite
    result = run_cli("--version", cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    assert result.stdout == (f"poptorch-lite {poptorch_lite.__version__} "
                             f"(torch {importlib.metadata.version('torch')})\n")


def test_alias_gives_the_same_module_objects():
    from poptorch_lite import alias
    saved = {k: v for k, v in sys.modules.items() if k == "poptorch" or k.startswith("poptorch.")}
    path, environ = list(sys.path), dict(os.environ)
    try:
        alias.alias_poptorch()
        assert sys.path[1] == alias.CHILD_PATH  # for spawned children, after the script's folder
        assert os.environ["PYTHONPATH"].split(os.pathsep)[0] == alias.CHILD_PATH  # subprocesses
        import poptorch
        import poptorch.enums
        import poptorch.optim
        import poptorch_lite
        assert poptorch is poptorch_lite
        assert poptorch.optim is poptorch_lite.optim and poptorch.enums is poptorch_lite.enums
        import poptorch.optim.optimizers
        import poptorch.runtime.schedule  # modules of subpackages too
        import poptorch_lite.runtime.schedule
        assert poptorch.runtime.schedule is poptorch_lite.runtime.schedule
        assert poptorch.optim.optimizers.SGD is poptorch_lite.optim.SGD
        assert not {"poptorch.cli", "poptorch.side_modules", "poptorch.alias",
                    "poptorch.poprun"} & set(sys.modules)
    finally:
        for k in [k for k in sys.modules if k == "poptorch" or k.startswith("poptorch.")]:
            del sys.modules[k]
        sys.modules.update(saved)
        sys.path[:] = path
        os.environ.clear()
        os.environ.update(environ)


CHILDREN = textwrap.dedent('''
    import multiprocessing
    import subprocess
    import sys
    import torch
    import poptorch


    class Squares(torch.utils.data.Dataset):  # its module imports poptorch, as a user's does
        def __len__(self):
            return 4

        def __getitem__(self, i):
            return torch.tensor([float(i * i)])


    def child(queue):
        import poptorch_lite
        queue.put(poptorch.__name__ + " " + str(poptorch is poptorch_lite))


    if __name__ == "__main__":
        spawn = multiprocessing.get_context("spawn")
        queue = spawn.Queue()
        p = spawn.Process(target=child, args=(queue,))
        p.start()
        print("spawned:", queue.get())  # the test's own limit guards a hang
        p.join()
        out = subprocess.run([sys.executable, "-c", "import poptorch, poptorch.optim; "
                              "print('subprocess:', poptorch.__name__, poptorch.optim.__name__)"],
                             capture_output=True, text=True, check=True).stdout
        out += subprocess.run([sys.executable, "-c", "import popdist, popdist.poptorch, popart; "
                               "print('popdist first:', popdist.getNumInstances(), "
                               "popart.SyntheticDataMode.Zeros)"],  # before any poptorch
                              capture_output=True, text=True, check=True).stdout
        print(out, end="")
        loader = poptorch.DataLoader(poptorch.Options(), Squares(), batch_size=2, num_workers=2,
                                     multiprocessing_context="spawn")
        print("spawned DataLoader workers:", [b.flatten().tolist() for b in loader])
''')


def test_the_alias_reaches_spawned_children_and_subprocesses(tmp_path):
    # A child started with spawn imports the script as __mp_main__, and a subprocess starts
    # from nothing: neither inherits sys.modules, so each needs `import poptorch` to resolve.
    (tmp_path / "children.py").write_text(CHILDREN)
    result = run_cli("run", "children.py", cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.splitlines() == [
        "spawned: poptorch_lite True",
        "subprocess: poptorch_lite poptorch_lite.optim",
        "popdist first: 1 1",
        "spawned DataLoader workers: [[0.0, 1.0], [4.0, 9.0]]"]


# A program as Graphcore's applications write one: it loads its op library, then calls the op.
OPS_SCRIPT = textwrap.dedent('''
    import ctypes
    import torch
    import poptorch

    lib = ctypes.cdll.LoadLibrary("./custom_ops.so")
    x = torch.tensor([1.0, -2.0])
    print(poptorch.custom_op([x], "RemapCE", "ai.graphcore", 1, example_outputs=[x])[0].tolist())
    lib.some_function()
''')


def test_a_missing_op_library_is_stood_in_for_only_when_asked(tmp_path):
    (tmp_path / "ops.py").write_text(OPS_SCRIPT)
    refused = run_cli("run", "ops.py", cwd=tmp_path)  # without the flag, ctypes' own OSError
    assert refused.returncode == 1 and "OSError: ./custom_ops.so" in refused.stderr
    result = subprocess.run([sys.executable, "-m", "poptorch_lite", "run",
                             "--without-op-libraries", "ops.py"], capture_output=True, text=True,
                            timeout=limit(300), cwd=tmp_path,
                            env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert result.stdout == "[1.0, -2.0]\n"
    assert ("ctypes.cdll.LoadLibrary('./custom_ops.so'): no such file; poptorch-lite run "
            "--without-op-libraries stands in for it") in result.stderr
    assert "CustomOpError: some_function is a function of ./custom_ops.so, which does not " \
           "exist" in result.stderr and result.returncode == 1
