"""A CUDA kernel fault ends the process's use of the GPU: the faulting test is named, the rest do not run
in the lost context (root conftest.py, "CUDA faults").  Simulated: the tests raise torch's and Triton's
messages; an ordinary failure that quotes one is not a fault."""

from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

TESTS = '''
def test_a_pass():
    pass

def test_b_quotes_a_fault():
    assert "CUDA error: an illegal memory access was encountered" == "", "an ordinary failure"

def test_c_fault():
    {fault}

def test_d_pass():
    pass
'''

FAULTS = {
    "torch": 'raise RuntimeError("CUDA error: an illegal memory access was encountered")',
    "chained": 'raise ValueError("wrapped") from RuntimeError("Triton Error [CUDA]: unspecified launch failure")',
    # Hypothesis reports distinct failures of one test as an exception group
    "group": 'raise ExceptionGroup("two", [AssertionError("L"), RuntimeError("CUDA error: misaligned address")])',
}


def _project(pytester, fault):
    pytester.makeconftest((ROOT / "conftest.py").read_text())
    pytester.makepyfile(test_kernels=TESTS.format(fault=FAULTS[fault]))


@pytest.mark.parametrize("fault", sorted(FAULTS))
def test_a_fault_stops_a_session_without_xdist(pytester, perf_session, fault):
    _project(pytester, fault)
    # in this process (a fresh interpreter would spend seconds importing torch): the hook takes the same path,
    # the session's config being no xdist worker's
    result = perf_session("-p", "no:cacheprovider", "-p", "no:xdist")
    result.assert_outcomes(passed=1, failed=2)  # b failed as usual and the session went on; d never ran
    result.stdout.fnmatch_lines(["*CUDA context lost in test_kernels.py::test_c_fault (*): the tests after it "
                                 "cannot use the GPU in this process*"])
    assert "CUDA context lost in test_kernels.py::test_b" not in result.stdout.str()
    assert result.ret == pytest.ExitCode.INTERRUPTED  # non-zero: a run with a fault never passes


@pytest.mark.slow  # an xdist session of its own (~14 s)
def test_an_xdist_worker_exits_and_is_replaced(pytester):
    _project(pytester, "torch")
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider", "-n", "2")
    # the fault is the crashed test; every other test ran, the ordinary failure reported as usual
    result.assert_outcomes(passed=2, failed=2)
    result.stdout.fnmatch_lines(["*replacing crashed worker*"])
    result.stdout.fnmatch_lines(["*test_kernels.py::test_c_fault*"])
    result.stderr.fnmatch_lines(["*CUDA context lost in test_kernels.py::test_c_fault*this worker exits*"])
