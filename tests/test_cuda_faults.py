"""A CUDA kernel fault ends the process's use of the GPU: the faulting test is named, the rest do not run
in the lost context (root conftest.py, "CUDA faults").  Simulated: the tests raise torch's message."""

from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

TESTS = '''
def test_a_pass():
    pass

def test_b_fault():
    raise RuntimeError("CUDA error: an illegal memory access was encountered")

def test_c_pass():
    pass

def test_d_ordinary_failure():
    assert 1 == 2
'''


def _project(pytester):
    pytester.makeconftest((ROOT / "conftest.py").read_text())
    pytester.makepyfile(test_kernels=TESTS)


def test_a_fault_stops_a_session_without_xdist(pytester):
    _project(pytester)
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider", "-p", "no:xdist")
    result.assert_outcomes(passed=1, failed=1)  # c and d never ran
    result.stdout.fnmatch_lines(["*CUDA context lost in test_kernels.py::test_b_fault (RuntimeError: CUDA error: "
                                 "an illegal memory access was encountered): the tests after it cannot use the GPU*"])
    assert result.ret == pytest.ExitCode.INTERRUPTED  # non-zero: a run with a fault never passes


def test_an_xdist_worker_exits_and_is_replaced(pytester):
    _project(pytester)
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider", "-n", "2")
    # the fault is the crashed test; every other test ran, the ordinary failure reported as usual
    result.assert_outcomes(passed=2, failed=2)
    result.stdout.fnmatch_lines(["*replacing crashed worker*"])
    result.stdout.fnmatch_lines(["*test_kernels.py::test_b_fault*"])
    result.stderr.fnmatch_lines(["*CUDA context lost in test_kernels.py::test_b_fault*this worker exits*"])
