"""The self-hosted GPU workflow (.github/workflows/perf-gpu.yml), checked where it cannot run.

The workflow needs GPU runners, so these tests check what can be checked without them:

* structure: triggers, one concurrency group, runner labels, timeouts on every job and shell step,
  install steps that keep the machine's CUDA torch, a CUDA assertion, artifacts uploaded ``if: always()``;
* agreement with benchmarks.json: the matrix of each job is expanded (``${{ matrix.* }}`` substituted,
  step ``if:`` conditions evaluated) and every ``--perf-group`` the jobs run must be a group of the gpu
  profile, every gpu group of every suite must be run by a job on the right runner, NCCL groups under
  torchrun with NCCL_NVLS_ENABLE=0, gloo groups from a plain pytest;
* that what it calls exists: every ``python -m`` module imports (project modules have a ``main``), every
  pytest option is registered (``pytest perf/ --help``), torchrun accepts its arguments, every path a
  pytest command names exists, the gates and report CLIs accept the exact argv the workflow gives them,
  and the inline "Pick the GPUs and the baseline" script decides as documented (run with a fake torch).

The workflow is read with PyYAML (a dev dependency), with YAML 1.1's boolean ``on`` key mapped back to
the "on" GitHub reads.
"""

from __future__ import annotations

import copy
import fnmatch
import glob
import importlib
import importlib.util
import itertools
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import tomllib
import types
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import yaml

from cs336_systems import machine, matrix

ROOT = Path(__file__).resolve().parent.parent
WORKFLOW = ROOT / ".github" / "workflows" / "perf-gpu.yml"

# Which runner each suite needs.  A suite in neither set fails test_every_suite_has_a_runner_kind, so a
# new suite forces a decision here and a job in the workflow.
SINGLE_GPU_SUITES = {"end_to_end", "warmup_study", "checkpointing", "attention", "flash", "leaderboard"}
MULTI_GPU_SUITES = {"allreduce", "data_parallel"}


def _from_pyyaml(data):
    """PyYAML (YAML 1.1) reads the key ``on`` as True; GitHub reads it as "on"."""
    if isinstance(data, dict) and True in data:
        data = {("on" if k is True else k): v for k, v in data.items()}
    return data


# --- the workflow, expanded -------------------------------------------------------------------------


@dataclass
class Command:
    """One simple shell command of a step: argv after ``VAR=value`` prefixes, which go to ``env``."""

    step_index: int
    argv: list[str]
    env: dict[str, str]  # workflow, job and step env, then the prefixes
    prefix: dict[str, str]  # the VAR=value words written before the command


@dataclass
class Instance:
    """One job of the workflow with one combination of its matrix: active steps, their commands."""

    job_id: str
    job: dict
    matrix: dict
    env: dict  # workflow env, then job env
    steps: list[tuple[int, dict]] = field(default_factory=list)  # (index in the job, step) if active
    commands: list[Command] = field(default_factory=list)


@dataclass
class PerfRun:
    """One pytest run of the perf suite inside an instance."""

    instance: Instance
    command: Command
    args: list[str]  # pytest's arguments
    torchrun: object | None  # torchrun's parsed arguments, or None for a plain pytest

    def option(self, name: str) -> str | None:
        for arg in self.args:
            if arg.startswith(name + "="):
                return arg.split("=", 1)[1]
        return None

    @property
    def groups(self) -> list[str] | None:
        """The groups of ``--perf-group=A[,B...]`` (one pytest session), or None without the option."""
        value = self.option("--perf-group")
        return None if value is None else [g.strip() for g in value.split(",") if g.strip()]


def load_workflow() -> dict:
    return _from_pyyaml(yaml.safe_load(WORKFLOW.read_text()))


def _substitute(text: str, values: dict) -> str:
    def one(m: re.Match) -> str:
        key = m.group(1)
        if key not in values:
            raise KeyError(f"${{{{ matrix.{key} }}}} has no value in this combination: {values}")
        return str(values[key])

    return re.sub(r"\$\{\{\s*matrix\.([A-Za-z0-9_-]+)\s*\}\}", one, text)


def _condition(expr, values: dict) -> bool:
    """A step's ``if:`` on the success path: matrix comparisons are evaluated, status functions
    (always, !cancelled, success) and needs.*.result == 'success' hold.  Anything else is refused, so a
    new kind of condition makes this test say so instead of guessing."""
    if expr is None:
        return True
    text = str(expr).strip()
    m = re.fullmatch(r"\$\{\{(.*)\}\}", text)
    text = m.group(1).strip() if m else text
    result = True
    for term in (t.strip() for t in text.split("&&")):
        if term in ("always()", "!cancelled()", "success()"):
            continue
        m = re.fullmatch(r"matrix\.([A-Za-z0-9_-]+)\s*(==|!=)\s*'([^']*)'", term)
        if m:
            equal = str(values.get(m.group(1))) == m.group(3)
            result &= equal if m.group(2) == "==" else not equal
            continue
        if re.fullmatch(r"needs\.[A-Za-z0-9_-]+\.result\s*==\s*'success'", term):
            continue
        raise ValueError(f"condition {expr!r} is not understood by this test; extend _condition")
    return result


def matrix_combinations(job: dict) -> list[dict]:
    spec = (job.get("strategy") or {}).get("matrix")
    if spec is None:
        return [{}]
    unsupported = set(spec) & {"exclude"}
    if unsupported:
        raise ValueError(f"matrix {sorted(unsupported)} is not expanded by this test")
    axes = {k: v for k, v in spec.items() if k != "include"}
    include = spec.get("include", [])
    if axes and include:
        raise ValueError("a matrix with both axes and include is not expanded by this test")
    if include:
        return [dict(entry) for entry in include]
    return [dict(zip(axes, values)) for values in itertools.product(*axes.values())]


def _logical_lines(script: str) -> list[str]:
    """Shell lines with backslash continuations joined and heredoc bodies dropped."""
    lines, heredoc_end = [], None
    for line in script.replace("\\\n", " ").split("\n"):
        if heredoc_end is not None:
            if line.strip() == heredoc_end:
                heredoc_end = None
            continue
        m = re.search(r"<<-?\s*'?\"?([A-Za-z_]+)'?\"?", line)
        if m:
            heredoc_end = m.group(1)
        lines.append(line)
    return lines


def heredoc(script: str, marker: str = "PY") -> str:
    """The body of the ``<<'PY'`` heredoc in ``script``."""
    m = re.search(rf"<<'{marker}'\n(.*?)\n{marker}\n", script, re.S)
    assert m, f"no <<'{marker}' heredoc in the script"
    return m.group(1) + "\n"


def instances(workflow: dict) -> list[Instance]:
    out = []
    workflow_env = {k: str(v) for k, v in (workflow.get("env") or {}).items()}
    for job_id, job in workflow["jobs"].items():
        for values in matrix_combinations(job):
            env = {**workflow_env, **{k: str(v) for k, v in (job.get("env") or {}).items()}}
            inst = Instance(job_id, job, values, env)
            for index, step in enumerate(job["steps"]):
                if not _condition(step.get("if"), values):
                    continue
                step = copy.deepcopy(step)
                if "run" in step:
                    step["run"] = _substitute(step["run"], values)
                if "with" in step:
                    step["with"] = {k: _substitute(str(v), values) for k, v in step["with"].items()}
                inst.steps.append((index, step))
                for line in _logical_lines(step.get("run", "")):
                    argv = shlex.split(line)
                    prefix = {}
                    while argv and re.fullmatch(r"[A-Z_][A-Z0-9_]*=\S*", argv[0]):
                        key, value = argv.pop(0).split("=", 1)
                        prefix[key] = value
                    if argv:
                        step_env = {k: str(v) for k, v in (step.get("env") or {}).items()}
                        inst.commands.append(Command(index, argv, {**inst.env, **step_env, **prefix}, prefix))
            out.append(inst)
    return out


def _is_python(word: str) -> bool:
    return os.path.basename(word) in ("python", "python3") or word == "$py"


def python_modules(inst: Instance) -> list[tuple[Command, str, list[str]]]:
    """(command, module, its arguments) of every ``python -m module ...`` (and torchrun -m)."""
    out = []
    for cmd in inst.commands:
        if _is_python(cmd.argv[0]) and len(cmd.argv) > 2 and cmd.argv[1] == "-m":
            out.append((cmd, cmd.argv[2], cmd.argv[3:]))
        elif cmd.argv[0] == "torchrun":
            args = torchrun_args(cmd.argv)
            if args.module:
                out.append((cmd, args.training_script, args.training_script_args))
    return out


def torchrun_args(argv: list[str]):
    from torch.distributed.run import get_args_parser

    return get_args_parser().parse_args(argv[1:])  # SystemExit (a test failure) on a bad option


def pytest_runs(inst: Instance) -> list[PerfRun]:
    runs = []
    for cmd in inst.commands:
        if cmd.argv[0] == "pytest":
            runs.append(PerfRun(inst, cmd, cmd.argv[1:], None))
        elif _is_python(cmd.argv[0]) and cmd.argv[1:3] == ["-m", "pytest"]:
            runs.append(PerfRun(inst, cmd, cmd.argv[3:], None))
        elif cmd.argv[0] == "torchrun":
            args = torchrun_args(cmd.argv)
            if args.module and args.training_script == "pytest":
                runs.append(PerfRun(inst, cmd, list(args.training_script_args), args))
    return runs


def perf_runs(insts: list[Instance]) -> list[PerfRun]:
    return [r for inst in insts for r in pytest_runs(inst) if r.option("--perf-profile") is not None]


def group_problems(runs: list[PerfRun], m: matrix.Matrix) -> list[str]:
    """What is wrong between the workflow's perf runs and the matrix's gpu profile (empty: nothing)."""
    problems = []
    groups = {suite: {c["group"] for c in m.cases(suite, "gpu")} for suite in m.suites}
    for suite in set(m.suites) - SINGLE_GPU_SUITES - MULTI_GPU_SUITES:
        problems.append(f"suite {suite!r} is in neither SINGLE_GPU_SUITES nor MULTI_GPU_SUITES")
    for run in runs:
        labels = run.instance.job["runs-on"]
        where = f"job {run.instance.job_id} {run.instance.matrix}"
        if run.option("--perf-profile") != "gpu":
            problems.append(f"{where}: --perf-profile={run.option('--perf-profile')}, expected gpu")
        if run.groups is None:
            problems.append(f"{where}: runs the whole gpu profile instead of --perf-group")
        for group in run.groups or []:
            suites = {s for s, names in groups.items() if group in names}
            if not suites:
                problems.append(f"{where}: --perf-group names {group!r}, not a group of benchmarks.json's gpu profile")
            if suites & MULTI_GPU_SUITES and "multi-gpu" not in labels:
                problems.append(f"{where}: multi-GPU group {group} on runner {labels}")
            if suites & SINGLE_GPU_SUITES and "single-gpu" not in labels:
                problems.append(f"{where}: single-GPU group {group} on runner {labels}")
            paths = [a for a in run.args if not a.startswith("-")]
            for suite in suites:
                marker = f'@pytest.mark.suite("{suite}")'
                if not any(marker in f.read_text() for p in paths for f in _test_files(ROOT / p)):
                    problems.append(f"{where}: no test marked {marker} under {paths}")
    ran = {g for r in runs for g in r.groups or []}
    for suite, names in groups.items():
        for name in sorted(names - ran):
            problems.append(f"gpu group {name!r} of suite {suite!r} is run by no job")
    return problems


def _test_files(path: Path) -> list[Path]:
    if path.is_file():
        return [path]
    return sorted(path.rglob("test_*.py")) if path.is_dir() else []


@pytest.fixture(scope="module")
def workflow() -> dict:
    return load_workflow()


@pytest.fixture(scope="module")
def insts(workflow) -> list[Instance]:
    return instances(workflow)


@pytest.fixture(scope="module")
def gpu_matrix() -> matrix.Matrix:
    return matrix.load(ROOT / "benchmarks.json")


def _jobs_running(insts: list[Instance], predicate) -> list[Instance]:
    return [i for i in insts if any(predicate(r) for r in pytest_runs(i))]


def _step_named(inst: Instance, needle: str) -> tuple[int, dict]:
    """The one active step whose name starts with ``needle``."""
    found = [(i, s) for i, s in inst.steps if s.get("name", "").startswith(needle)]
    assert len(found) == 1, f"job {inst.job_id}: expected one step named {needle!r}..., got {found}"
    return found[0]


# --- the parser itself -------------------------------------------------------------------------------

# --- triggers, concurrency, runners, timeouts --------------------------------------------------------


def test_triggers(workflow):
    on = workflow["on"]
    assert "workflow_dispatch" in on
    crons = [entry["cron"] for entry in on["schedule"]]
    assert crons and all(len(c.split()) == 5 for c in crons), crons
    assert on["push"]["branches"] == ["main"]
    paths = on["push"]["paths"]
    assert "benchmarks.json" in paths
    for pattern in paths:
        assert list(ROOT.glob(pattern)), f"push path {pattern!r} matches no file in the repository"


def test_one_concurrency_group_for_every_run(workflow):
    group = workflow["concurrency"]["group"]
    # A group built from the ref or run id would let two runs share a GPU box.
    assert isinstance(group, str) and group and "${{" not in group
    assert workflow["concurrency"]["cancel-in-progress"] is False


def test_runner_labels_and_timeouts(workflow, insts):
    for job_id, job in workflow["jobs"].items():
        labels = job["runs-on"]
        assert isinstance(labels, list) and {"self-hosted", "gpu"} <= set(labels), (job_id, labels)
        assert not {"single-gpu", "multi-gpu"} <= set(labels), (job_id, labels)
        limit = job["timeout-minutes"]
        assert isinstance(limit, int) and 0 < limit <= 360, (job_id, limit)
        for step in job["steps"]:
            if "run" in step:
                step_limit = step.get("timeout-minutes")
                assert isinstance(step_limit, int) and 0 < step_limit <= limit, (job_id, step.get("name"))
        for step in job["steps"]:
            if "uses" in step:
                version = re.search(r"@v(\d+)$", step["uses"])
                assert version and int(version.group(1)) >= 4, f"{job_id}: {step['uses']} (v3 and older are retired)"
    tests_jobs = _jobs_running(insts, lambda r: "tests/" in r.args and "-m" not in r.args)
    assert tests_jobs and all("single-gpu" in i.job["runs-on"] for i in tests_jobs)
    multi_tests = _jobs_running(insts, lambda r: "tests/" in r.args and "multi_gpu" in r.args)
    assert multi_tests and all("multi-gpu" in i.job["runs-on"] for i in multi_tests)
    torchrun_jobs = [i for i in insts if any(r.torchrun for r in pytest_runs(i))]
    assert torchrun_jobs and all("multi-gpu" in i.job["runs-on"] for i in torchrun_jobs)


# --- install, CUDA check, tests ----------------------------------------------------------------------


def test_install_keeps_the_machines_cuda_torch_and_checks_cuda(insts):
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    assert "dev" in extras
    for inst in _jobs_running(insts, lambda r: True):
        first_pytest = min(r.command.step_index for r in pytest_runs(inst))
        checkout = [i for i, s in inst.steps if s.get("uses", "").startswith("actions/checkout@")]
        install_index, install = _step_named(inst, "Install")
        check_index, _ = _step_named(inst, "Check that torch sees CUDA")
        assert checkout and checkout[0] < install_index < check_index < first_pytest, inst.job_id
        cmds = [c for c in inst.commands if c.step_index == install_index]
        venvs = [c for c in cmds if _is_python(c.argv[0]) and c.argv[1:3] == ["-m", "venv"]]
        # --system-site-packages: the venv sees the machine's CUDA torch, so pip finds torch>=2.11 met.
        assert len(venvs) == 1 and "--system-site-packages" in venvs[0].argv, inst.job_id
        venv_dir = venvs[0].argv[-1]
        pips = [c for c in cmds if c.argv[1:4] == ["-m", "pip", "install"]]
        assert len(pips) == 1 and pips[0].argv[4] == "-e" and len(pips[0].argv) == 6, inst.job_id
        wanted = re.fullmatch(r"\.\[([a-z,]+)\]", pips[0].argv[5])
        assert wanted and "dev" in wanted.group(1).split(","), pips[0].argv
        assert set(wanted.group(1).split(",")) <= set(extras), f"unknown extra in {pips[0].argv[5]}"
        assert pips[0].argv[0] == f"{venv_dir}/bin/python", "pip must install into the venv"
        for c in inst.commands:
            if "install" in c.argv and ("pip" in c.argv or "pip3" in c.argv[0]):
                assert not any(a.startswith("torch") for a in c.argv), f"{inst.job_id} installs torch: {c.argv}"
        # torch's version and location, read before and after pip install, must not change.
        probe = r"-c 'import torch; print\(torch.__version__, torch.__file__\)'"
        assert re.search(rf'before="\$\("\$py" {probe}\)"', install["run"]), install["run"]
        assert re.search(rf'after="\$\("{re.escape(venv_dir)}/bin/python" {probe}\)"', install["run"])
        assert 'if [ "$before" != "$after" ]' in install["run"]
        assert f"{venv_dir}/bin" in install["run"] and '>> "$GITHUB_PATH"' in install["run"]
        checks = [c for c in inst.commands if c.step_index == check_index and c.argv[1:2] == ["-c"]]
        assert len(checks) == 1
        _assert_cuda_check_behaves(checks[0].argv[2])


def _assert_cuda_check_behaves(code: str):
    """Run the CUDA-check one-liner against fake torch modules: it must fail without CUDA."""
    def fake_torch(available: bool):
        cuda = types.SimpleNamespace(is_available=lambda: available, device_count=lambda: int(available),
                                     get_device_name=lambda i=0: "NVIDIA H100 80GB HBM3")
        return types.SimpleNamespace(__version__="2.11.0+cu130", version=types.SimpleNamespace(cuda="13.0"),
                                     cuda=cuda)

    saved = sys.modules["torch"]
    try:
        sys.modules["torch"] = fake_torch(True)
        exec(compile(code, "cuda-check", "exec"), {})
        sys.modules["torch"] = fake_torch(False)
        with pytest.raises(AssertionError):
            exec(compile(code, "cuda-check", "exec"), {})
    finally:
        sys.modules["torch"] = saved


def test_multi_gpu_runner_runs_the_multi_gpu_marked_tests(insts):
    runs = [(i, r) for i in insts for r in pytest_runs(i) if "tests/" in r.args and "multi_gpu" in r.args]
    assert len(runs) == 1
    inst, run = runs[0]
    assert run.args[run.args.index("-m") + 1] == "multi_gpu" and "multi-gpu" in inst.job["runs-on"]
    assert run.command.prefix.get("NCCL_NVLS_ENABLE") == "0", run.command.argv  # NCCL: multicast off


def test_tests_job_runs_all_of_tests_including_gpu_marked(insts):
    runs = [r for i in insts for r in pytest_runs(i) if "tests/" in r.args and "multi_gpu" not in r.args]
    assert len(runs) == 1
    args = runs[0].args
    # GPU-marked tests run by themselves where CUDA is present; deselecting them here would hide them.
    assert not any(a in ("-m", "-k") or a.startswith(("-m=", "-k=")) for a in args), args
    assert (ROOT / "tests").is_dir()


def test_shared_steps_are_identical_in_every_job(workflow):
    for needle in ("Install", "Check that torch sees CUDA", "Pick the GPUs"):
        bodies = {
            job_id: step["run"]
            for job_id, job in workflow["jobs"].items()
            for step in job["steps"]
            if step.get("name", "").startswith(needle)
        }
        assert len(set(bodies.values())) == 1, f"the {needle!r} steps differ between jobs {sorted(bodies)}"


# --- groups vs benchmarks.json -----------------------------------------------------------------------


def test_every_suite_has_a_runner_kind(gpu_matrix):
    assert set(gpu_matrix.suites) == SINGLE_GPU_SUITES | MULTI_GPU_SUITES


def test_workflow_groups_are_exactly_the_gpu_profile_groups(insts, gpu_matrix):
    runs = perf_runs(insts)
    assert runs
    assert group_problems(runs, gpu_matrix) == []
    groups = [g for r in runs for g in r.groups]
    assert len(groups) == len(set(groups)), "a group is run twice"


def _sessions(insts, m: matrix.Matrix) -> list[list[dict]]:
    """The gpu-profile cases of each perf session (pytest run) of the workflow."""
    cases = [{**c, "suite": suite} for suite in m.suites for c in m.cases(suite, "gpu")]
    return [[c for c in cases if c["group"] in run.groups] for run in perf_runs(insts)]


def split_gate_pairs(sessions: list[list[dict]], m: matrix.Matrix) -> tuple[set, set]:
    """(gate pairs the cases of all sessions together contain, those no single session contains)."""
    from cs336_systems import gates

    fields = gates.case_fields_of(m)

    def measured(cases):
        entries = [{**c, "stats": {"median": 1.0, "mean": 1.0, "min": 1.0}} for c in cases]
        return {(c.gate, c.case) for c in gates.evaluate(m.gates, entries, fields) if c.ratio is not None}

    everything = measured([c for session in sessions for c in session])
    return everything, everything - set().union(*(measured(session) for session in sessions))


def test_every_gate_pair_runs_in_one_session(insts, gpu_matrix):
    # Gates pair cases of one run; a pair split over two sessions would be "not measured" for ever.
    everything, split = split_gate_pairs(_sessions(insts, gpu_matrix), gpu_matrix)
    assert everything, "no gate has a pair in the gpu profile"
    assert split == set(), sorted(split)
    # The check can fail: one session per implementation splits the leaderboard gate's pairs.
    leaderboard = [c for c in gpu_matrix.cases("leaderboard", "gpu")]
    by_impl = [[{**c, "suite": "leaderboard"} for c in leaderboard if c["impl"] == impl]
               for impl in {c["impl"] for c in leaderboard}]
    assert split_gate_pairs(by_impl, gpu_matrix)[1]


def test_every_data_parallel_case_shares_a_session_with_its_torch_ddp_twin(insts, gpu_matrix):
    # The report's ratio to torch DDP is exact only within one run (across runs it carries a dagger).
    twin = ("size", "context", "batch_size", "precision", "world_size", "backend")
    for session in _sessions(insts, gpu_matrix):
        dp = [c for c in session if c["suite"] == "data_parallel"]
        baselines = {tuple(c[f] for f in twin) for c in dp if c["variant"] == "torch-ddp"}
        for case in dp:
            assert tuple(case[f] for f in twin) in baselines, f"{case['group']} {case['variant']}: no torch-ddp twin"


def _renamed(group: str, new: str) -> matrix.Matrix:
    data = json.loads((ROOT / "benchmarks.json").read_text())
    renamed = 0
    for suite in data["suites"].values():
        for grid in suite["profiles"].get("gpu", []):
            if grid.get("group") == group:
                grid["group"] = new
                renamed += 1
    assert renamed, f"benchmarks.json has no gpu grid of group {group!r}"
    return matrix.parse(data)


@pytest.mark.parametrize("group", ["leaderboard", "ddp-bf16"])
def test_renaming_a_group_in_benchmarks_json_fails_the_check(insts, group):
    problems = group_problems(perf_runs(insts), _renamed(group, group + "-renamed"))
    assert any(f"--perf-group names '{group}', not a group" in p for p in problems), problems
    assert any(f"gpu group '{group}-renamed'" in p for p in problems), problems


def test_nccl_groups_run_under_torchrun_gloo_groups_from_plain_pytest(insts, gpu_matrix):
    cases = [c for suite in MULTI_GPU_SUITES for c in gpu_matrix.cases(suite, "gpu")]
    for run in perf_runs(insts):
        group_cases = [c for c in cases if c["group"] in run.groups]
        if not group_cases:
            continue
        backends = {c["backend"] for c in group_cases}
        assert len(backends) == 1, f"{run.groups} mix backends {backends}: one launcher cannot run both"
        if backends == {"nccl"}:
            assert run.torchrun is not None, f"NCCL groups {run.groups} must run under torchrun"
            nproc = int(run.torchrun.nproc_per_node)
            assert nproc == int(run.instance.env["GPUS"]), "torchrun's ranks are the GPUs the job picks"
            assert any(c["world_size"] == nproc for c in group_cases), (
                f"no case of {run.groups} has world_size {nproc}: every case would be skipped"
            )
            # On the torchrun line itself (visible in the log, kept if the env block is edited) and in
            # the environment the command runs with.
            assert run.command.prefix.get("NCCL_NVLS_ENABLE") == "0", run.command.argv
            assert run.command.env["NCCL_NVLS_ENABLE"] == "0"
            assert run.torchrun.standalone, "--standalone: a free rendezvous port on a shared box"
        else:
            assert run.torchrun is None, f"gloo groups {run.groups} spawn their ranks per case from a plain pytest"


def test_workflow_env_turns_nvlink_multicast_off(workflow):
    env = workflow["env"]
    assert env["NCCL_NVLS_ENABLE"] == "0"
    assert env["TORCH_SYMM_MEM_DISABLE_MULTICAST"] == "1" and env["NVSHMEM_DISABLE_NVLS"] == "1"


# --- what it calls exists ----------------------------------------------------------------------------


def test_python_modules_exist_and_project_clis_have_main(insts):
    modules = {module for inst in insts for _, module, _ in python_modules(inst)}
    assert {"cs336_systems.gates", "cs336_systems.report", "pytest", "pip", "venv"} <= modules, modules
    for module in sorted(modules):
        assert importlib.util.find_spec(module) is not None, f"python -m {module}: no such module"
        if module.startswith("cs336_systems"):
            assert callable(getattr(importlib.import_module(module), "main", None)), f"{module} has no main()"


def test_torchrun_is_torchs_console_script():
    from importlib.metadata import entry_points

    (entry,) = entry_points(group="console_scripts", name="torchrun")
    assert entry.value == "torch.distributed.run:main"


def test_pytest_options_are_registered_and_paths_exist(insts, workflow):
    options = set()
    for inst in insts:
        for run in pytest_runs(inst):
            for index, arg in enumerate(run.args):
                if index and run.args[index - 1] in ("-m", "-k"):
                    continue  # a marker or keyword expression, not a path
                if arg.startswith("--"):
                    options.add(arg.split("=", 1)[0])
                elif not arg.startswith(("-", "$")):
                    assert (ROOT / arg).exists(), f"job {inst.job_id}: pytest path {arg!r} does not exist"
    for job in workflow["jobs"].values():  # the conditional comparison flags live in a bash array
        for step in job["steps"]:
            for body in re.findall(r"compare=\(([^)]*)\)", step.get("run", "")):
                options |= {a.split("=", 1)[0] for a in shlex.split(body)}
    assert {"--perf-profile", "--perf-group", "--benchmark-json", "--benchmark-storage", "--benchmark-compare",
            "--benchmark-compare-fail"} <= options, options
    assert "--compare-any-machine" not in options, "CI must not force comparisons across machines"
    help_text = subprocess.run(
        [sys.executable, "-m", "pytest", "perf/", "--help", "-p", "no:cacheprovider"],
        cwd=ROOT, capture_output=True, text=True, timeout=120, check=True,
    ).stdout
    for option in sorted(options):
        assert re.search(rf"(^|[\s,]){re.escape(option)}([=\s,]|$)", help_text, re.M), f"pytest has no {option}"


def test_perf_runs_compare_with_the_per_gpu_baseline(insts, workflow):
    for run in perf_runs(insts):
        storage = run.option("--benchmark-storage")
        assert storage == "file://results/$GPU_SLUG/baselines", storage
        assert "${compare[@]}" in run.args, "the comparison flags are passed when a comparable baseline exists"
        saved = run.option("--benchmark-json")
        assert re.fullmatch(r"out/[A-Za-z0-9_.-]+\.json", saved), saved
        if len(run.groups) == 1:
            assert saved == f"out/{run.groups[0]}.json", "a one-group run is saved under the group's name"
        step = dict(run.instance.steps)[run.command.step_index]
        assert re.search(r"compare=\(--benchmark-compare --benchmark-compare-fail=median:10%\)", step["run"])
        assert 'if [ "$BENCH_COMPARE" = 1 ]' in step["run"]
        pick_index, _ = _step_named(run.instance, "Pick the GPUs")
        assert pick_index < run.command.step_index


# --- the inline "Pick the GPUs and the baseline" script ---------------------------------------------


def _pick_script(workflow) -> str:
    step = next(s for s in workflow["jobs"]["perf"]["steps"] if "Pick the GPUs" in s.get("name", ""))
    return heredoc(step["run"])


def _run_pick(script, tmp_path, monkeypatch, *, gpus, name, count, visible=None, saved_facts=None, facts=None):
    from pytest_benchmark.utils import get_machine_id

    cuda = types.SimpleNamespace(is_available=lambda: count > 0, device_count=lambda: count,
                                 get_device_name=lambda i=0: name)
    monkeypatch.setitem(sys.modules, "torch", types.SimpleNamespace(cuda=cuda))
    monkeypatch.setattr(machine, "machine_facts", lambda: dict(facts or {}))
    env_file = tmp_path / "github_env"
    env_file.write_text("")
    monkeypatch.setenv("GITHUB_ENV", str(env_file))
    monkeypatch.setenv("GPUS", str(gpus))
    if visible is None:
        monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    else:
        monkeypatch.setenv("CUDA_VISIBLE_DEVICES", visible)
    monkeypatch.chdir(tmp_path)
    if saved_facts is not None:
        slug = saved_facts.pop("_slug")
        store = tmp_path / "results" / slug / "baselines" / get_machine_id()
        store.mkdir(parents=True)
        (store / "0001_baseline.json").write_text(
            json.dumps({"machine_info": {"cs336_systems": saved_facts}, "benchmarks": []})
        )
    exec(compile(script, "pick-step", "exec"), {"__name__": "__main__"})
    return dict(line.split("=", 1) for line in env_file.read_text().splitlines())


H100 = {"gpu_name": "NVIDIA H100 80GB HBM3", "gpu_count": 1, "cuda": "13.0", "torch": "2.11.0+cu130",
        "triton": "3.6.0"}


def test_pick_step_compares_with_a_matching_baseline(workflow, tmp_path, monkeypatch, capsys):
    env = _run_pick(_pick_script(workflow), tmp_path, monkeypatch, gpus=1, name=H100["gpu_name"], count=1,
                    saved_facts={**H100, "_slug": "h100"}, facts={**H100, "gpu_count": 1})
    assert env == {"CUDA_VISIBLE_DEVICES": "0", "GPU_SLUG": "h100", "BENCH_COMPARE": "1"}
    assert "comparing with" in capsys.readouterr().out
    assert (ROOT / "results" / "h100").is_dir(), "the slug names the committed results folder"


def test_pick_step_skips_a_baseline_from_other_software(workflow, tmp_path, monkeypatch, capsys):
    env = _run_pick(_pick_script(workflow), tmp_path, monkeypatch, gpus=1, name=H100["gpu_name"], count=1,
                    saved_facts={**H100, "_slug": "h100"}, facts={**H100, "torch": "2.13.0+cu130"})
    assert env["BENCH_COMPARE"] == "0"
    out = capsys.readouterr().out
    assert "::warning" in out and "torch now '2.13.0+cu130'" in out


def test_pick_step_takes_the_first_gpus_of_a_bigger_box_and_warns_without_baseline(
    workflow, tmp_path, monkeypatch, capsys
):
    facts = {**H100, "gpu_name": "NVIDIA H200", "gpu_count": 8}
    env = _run_pick(_pick_script(workflow), tmp_path, monkeypatch, gpus=2, name="NVIDIA H200", count=4,
                    visible="4,5,6,7", facts=facts)
    assert env == {"CUDA_VISIBLE_DEVICES": "4,5", "GPU_SLUG": "h200x2", "BENCH_COMPARE": "0"}
    assert "::warning title=No baseline" in capsys.readouterr().out
    assert (ROOT / "results" / "h200x2").is_dir()


def test_pick_step_compares_the_job_gpu_count_not_the_box(workflow, tmp_path, monkeypatch):
    saved = {**H100, "gpu_name": "NVIDIA H200", "gpu_count": 2, "_slug": "h200x2"}
    env = _run_pick(_pick_script(workflow), tmp_path, monkeypatch, gpus=2, name="NVIDIA H200", count=8,
                    saved_facts=saved, facts={**H100, "gpu_name": "NVIDIA H200", "gpu_count": 8})
    assert env["BENCH_COMPARE"] == "1" and env["CUDA_VISIBLE_DEVICES"] == "0,1"


def test_pick_step_fails_with_too_few_gpus(workflow, tmp_path, monkeypatch):
    with pytest.raises(SystemExit, match="needs 2 CUDA devices; torch sees 1"):
        _run_pick(_pick_script(workflow), tmp_path, monkeypatch, gpus=2, name="NVIDIA H200", count=1)


# --- gates, report, artifacts ------------------------------------------------------------------------


def _uploads(inst: Instance) -> list[dict]:
    return [s for _, s in inst.steps if s.get("uses", "").startswith("actions/upload-artifact@")]


def _covered(path: str, upload_paths: list[str]) -> bool:
    return any(path == p or (p.endswith("/") and path.startswith(p)) for p in upload_paths)


def test_gates_and_report_run_on_every_saved_json_and_are_uploaded(insts, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    for inst in {id(r.instance): r.instance for r in perf_runs(insts)}.values():
        (run,) = [r for r in pytest_runs(inst) if r.option("--perf-profile")]
        saved = run.option("--benchmark-json")
        steps = dict(inst.steps)
        clis = {m: (c, args) for c, m, args in python_modules(inst) if m.startswith("cs336_systems.")}
        gates_cmd, gates_args = clis["cs336_systems.gates"]
        report_cmd, report_args = clis["cs336_systems.report"]
        assert gates_args == [saved], f"{inst.job_id}: the gates must check {saved}"
        for cmd in (gates_cmd, report_cmd):
            assert cmd.step_index > run.command.step_index
            # They also run after a failed pytest step: the table says which gate or case failed.
            assert "cancelled()" in str(steps[cmd.step_index].get("if")), steps[cmd.step_index].get("name")
        report_out = report_args[report_args.index("-o") + 1]
        # The exact argv the workflow passes, against a saved run of that name (shell globs expanded).
        shutil.rmtree(tmp_path / "out", ignore_errors=True)
        Path(saved).parent.mkdir(parents=True, exist_ok=True)
        Path(saved).write_text(json.dumps({"machine_info": {"cs336_systems": H100}, "benchmarks": [], "oom": []}))
        assert importlib.import_module("cs336_systems.gates").main(gates_args) == 0
        expanded = [p for a in report_args for p in (sorted(glob.glob(a)) if "*" in a else [a])]
        assert saved in expanded, f"{inst.job_id}: the report reads {report_args}, not {saved}"
        assert importlib.import_module("cs336_systems.report").main(expanded) == 0
        assert Path(report_out).read_text().startswith("# Benchmark report")
        (upload,) = _uploads(inst)
        assert str(upload.get("if")).strip() in ("always()", "${{ always() }}"), inst.job_id
        paths = upload["with"]["path"].split()
        assert _covered(saved, paths) and _covered(report_out, paths), (inst.job_id, paths)
        if "--plots" in report_args:
            assert _covered(report_args[report_args.index("--plots") + 1] + "/", paths), (inst.job_id, paths)


def test_every_job_uploads_under_a_distinct_name(insts):
    names = [u["with"]["name"] for inst in insts for u in _uploads(inst)]
    assert names and all("${{" not in n for n in names)
    assert len(names) == len(set(names)), "upload-artifact v4 refuses a second artifact of one name"
    for inst in insts:
        for upload in _uploads(inst):
            assert str(upload.get("if")).strip() in ("always()", "${{ always() }}"), inst.job_id


def test_report_job_merges_every_perf_artifact(insts, tmp_path):
    downloads = "actions/download-artifact@"
    (report,) = [i for i in insts if any(s.get("uses", "").startswith(downloads) for _, s in i.steps)]
    perf_jobs = {r.instance.job_id for r in perf_runs(insts)}
    assert perf_jobs <= set(report.job["needs"]), "the report waits for every perf job"
    assert "!cancelled()" in report.job["if"], "a failed group still gets its numbers into the report"
    (download,) = [s for _, s in report.steps if s.get("uses", "").startswith("actions/download-artifact@")]
    pattern, target = download["with"]["pattern"], download["with"]["path"].rstrip("/")
    perf_artifacts = {
        Path(r.option("--benchmark-json")).stem: _uploads(r.instance)[0]["with"]["name"] for r in perf_runs(insts)
    }
    others = [u["with"]["name"] for i in insts for u in _uploads(i) if i.job_id not in perf_jobs]
    assert all(fnmatch.fnmatch(n, pattern) for n in perf_artifacts.values())
    assert not any(fnmatch.fnmatch(n, pattern) for n in others), "only perf artifacts are merged"
    # download-artifact puts each artifact (the contents of its out/) under <path>/<artifact name>/.
    for stem, name in perf_artifacts.items():
        (tmp_path / target / name).mkdir(parents=True)
        (tmp_path / target / name / f"{stem}.json").write_text(
            json.dumps({"machine_info": {"cs336_systems": H100}, "benchmarks": [], "oom": []})
        )
        (tmp_path / target / name / "report.md").write_text("# one group\n")
    (render,) = [s for _, s in report.steps if "cs336_systems.report" in s.get("run", "")]
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "python").symlink_to(sys.executable)
    subprocess.run(["bash", "-e", "-o", "pipefail", "-c", render["run"]], cwd=tmp_path, check=True, timeout=120,
                   env={**os.environ, "PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}"})
    merged = sorted(p.name for p in (tmp_path / "out").glob("*.json"))
    assert merged == sorted(f"{stem}.json" for stem in perf_artifacts)
    assert (tmp_path / "out" / "report.md").read_text().startswith("# Benchmark report")
    (upload,) = _uploads(report)
    assert _covered("out/report.md", upload["with"]["path"].split())


def test_cpu_ci_keeps_running_the_cpu_profile_and_the_gates():
    script = (ROOT / ".ci" / "run").read_text()
    assert "pytest perf/ --perf-profile=cpu" in script
    assert "python -m cs336_systems.gates" in script
