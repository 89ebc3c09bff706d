"""The hygiene plugin (``tests/support/hygiene.py``) names what a test left behind.

It forgives only what a library sets up once per process."""

import copy
import os
import tempfile

import hygiene


def _snapshots():
    before = hygiene.snapshot()
    return before, copy.deepcopy(before)


def test_an_open_file_a_thread_and_a_variable_left_behind_are_named():
    before, after = _snapshots()
    after["open files"][999] = "/tmp/left-open"
    after["threads"][12345] = "a-worker"
    after["os.environ"]["LEFT_BEHIND"] = "1"
    assert hygiene.left_behind(before, after) == [
        "thread 12345: a-worker", "open file 999: /tmp/left-open",
        "os.environ: LEFT_BEHIND was '<unset>', now '1'"]
    assert hygiene.left_behind(before, copy.deepcopy(before)) == []


def test_the_files_of_cudas_context_are_forgiven_only_to_the_test_that_made_it():
    """The first test of a process that touches a GPU opens the driver's files for the
    process's life; a later test's open file is still a leak, and so is a thread of the
    first (on an H200 the plugin once failed six CUDA tests for the driver's files)."""
    before, after = _snapshots()
    before["cuda"], after["cuda"] = False, True
    after["open files"][999] = "/dev/nvidia0"
    after["threads"][12345] = "a-worker"
    assert hygiene.left_behind(before, after) == ["thread 12345: a-worker"]
    before["cuda"] = True  # CUDA was there before this test: its files are its own
    assert hygiene.left_behind(before, after) == ["thread 12345: a-worker",
                                                  "open file 999: /dev/nvidia0"]


def test_a_file_left_in_the_temporary_directory_is_named_and_multiprocessings_is_not():
    """Each process of the suite has a temporary directory of its own, every process it starts
    too (TMPDIR): what a test leaves there is named; multiprocessing's folder, made at its
    first use for the process's life, is not."""
    assert os.environ["TMPDIR"] == tempfile.gettempdir() == hygiene._TEMP[0]
    before = hygiene.snapshot()
    left = tempfile.mkdtemp(prefix="left-")
    pymp = tempfile.mkdtemp(prefix="pymp-")
    try:
        assert hygiene.left_behind(before, hygiene.snapshot()) == [f"temp file {left}"]
    finally:
        os.rmdir(left)
        os.rmdir(pymp)
    assert hygiene.left_behind(before, hygiene.snapshot()) == []


def test_inductors_caches_reached_through_a_processs_temporary_directory_are_the_machines():
    """Inductor keeps some of its caches under the temporary directory whatever
    TORCHINDUCTOR_CACHE_DIR says: through the link the plugin makes (by torch's own rule for
    the folder's name), a session reuses what earlier ones compiled."""
    from torch._inductor.runtime.cache_dir_utils import default_cache_dir
    here = default_cache_dir()
    assert os.path.dirname(here) == hygiene._TEMP[0]
    assert os.path.basename(here) == hygiene.inductor_cache_name()
    assert os.path.realpath(here) == os.path.realpath(
        os.path.join(os.environ["PYTEST_DEBUG_TEMPROOT"], os.path.basename(here)))
