"""The self-hosted GPU workflow (.github/workflows/perf-gpu.yml), checked where it cannot run: by actionlint
(syntax, ``${{ }}`` expression types, runner labels, action inputs), then for what only this project knows:
perf groups vs benchmarks.json, gate pairs within one session, the CLIs, pytest options, markers and inline
imports it uses, and the report job's artifacts.  Read with PyYAML, each job expanded per matrix combination.
"""

from __future__ import annotations

import ast
import json
import contextlib
import fnmatch
import functools
import importlib
import io
import itertools
import os
import re
import shlex
import shutil
import subprocess
import sys
import types
from dataclasses import dataclass
from pathlib import Path
from typing import NamedTuple

import pytest
import yaml

from cs336_systems.bench import affected, matrix

ROOT = Path(__file__).resolve().parent.parent
WORKFLOW = ROOT / ".github" / "workflows" / "perf-gpu.yml"
RUNNER_LABELS = ["gpu", "single-gpu", "multi-gpu"]  # the self-hosted runners' labels (the workflow's header)
# No shellcheck or pyflakes: actionlint takes them from PATH when there, so the verdict would depend on the
# machine (pyflakes only reads `shell: python` steps, which this workflow has none of).  Ignored: Node 20
# runtime deprecation, advisory and reported by some actionlint builds only (actions/*@v4 declare node20).
ACTIONLINT_FLAGS = ["-no-color", "-oneline", "-shellcheck=", "-pyflakes=", "-ignore", 'runtime "node20" is deprecated']
MATRIX_REF = re.compile(r"\$\{\{\s*matrix\.([\w-]+)\s*\}\}")
HEREDOC = re.compile(r"<<-?\s*'?(\w+)'?\n(.*?)\n\1$", re.DOTALL | re.MULTILINE)


def run_actionlint(workflow: Path, tmp_path: Path) -> subprocess.CompletedProcess:
    exe = shutil.which("actionlint", path=os.path.dirname(sys.executable))  # a venv's bin, active or not
    assert exe, f"no actionlint beside {sys.executable}: install the dev extra (pip install -e '.[dev]')"
    config = tmp_path / "actionlint.yaml"
    config.write_text(yaml.safe_dump({"self-hosted-runner": {"labels": RUNNER_LABELS}}))
    command = [exe, *ACTIONLINT_FLAGS, "-config-file", str(config), str(workflow)]
    return subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=120, check=False)


def test_actionlint_accepts_the_workflow(tmp_path):
    result = run_actionlint(WORKFLOW, tmp_path)
    assert result.returncode == 0, result.stdout + result.stderr


BREAKAGES = [("needs.plan.outputs.single)", "needs.plan.outputs.singel)", "[expression]"), ("timeout-minutes:", "timeout:", "[syntax-check]")]


@pytest.mark.parametrize(("old", "new", "rule"), BREAKAGES)
def test_actionlint_fails_a_broken_workflow(tmp_path, old, new, rule):
    broken = tmp_path / "perf-gpu.yml"
    broken.write_text(WORKFLOW.read_text().replace(old, new, 1))
    result = run_actionlint(broken, tmp_path)
    assert result.returncode == 1 and rule in result.stdout, result.stdout + result.stderr


@dataclass
class Job:  # one job with one combination of its matrix
    id: str
    spec: dict
    steps: list[dict]  # the steps this combination runs, ${{ matrix.* }} substituted

    def commands(self) -> list[list[str]]:
        return [argv for step in self.steps for argv in commands(step["run"])]

    def uploads(self) -> list[dict]:
        return [s["with"] for s in self.steps if s.get("uses", "").startswith("actions/upload-artifact@")]


PLAN_OUTPUT = re.compile(r"\$\{\{\s*fromJSON\(needs\.plan\.outputs\.(\w+)\)\s*\}\}")


def planned(value):
    """A matrix value the plan job fills (``${{ fromJSON(needs.plan.outputs.X) }}``): the planner's output
    for the nightly run, every job; other values as they are."""
    match = PLAN_OUTPUT.fullmatch(str(value))
    return affected.plan(None)[match[1]] if match else value


def combinations(spec: dict) -> list[dict]:
    """The product of the matrix axes, or the include list (what this workflow uses; refuse the rest)."""
    axes = {key: planned(value) for key, value in ((spec.get("strategy") or {}).get("matrix") or {}).items()}
    include = axes.pop("include", [])
    assert not (axes and include) and "exclude" not in axes, "extend combinations() for this matrix"
    return include or [dict(zip(axes, values)) for values in itertools.product(*axes.values())]


def substituted(step: dict, combo: dict) -> dict | None:
    """The step for this combination, or None when its ``if: matrix.KEY == 'value'`` leaves it out."""
    cond = re.fullmatch(r"(?:\$\{\{)?\s*matrix\.([\w-]+)\s*==\s*'([^']*)'\s*(?:\}\})?", str(step.get("if", "")))
    if cond and str(combo.get(cond[1])) != cond[2]:
        return None
    sub = functools.partial(MATRIX_REF.sub, lambda m: str(combo[m[1]]))
    return {**step, "run": sub(step.get("run", "")), "with": {k: sub(str(v)) for k, v in step.get("with", {}).items()}}


@functools.cache
def jobs() -> list[Job]:
    workflow = yaml.safe_load(WORKFLOW.read_text())
    return [
        Job(job_id, spec, [s for s in (substituted(step, combo) for step in spec["steps"]) if s])
        for job_id, spec in workflow["jobs"].items()
        for combo in combinations(spec)
    ]


def commands(script: str) -> list[list[str]]:
    """The argv of each line of a shell script: continuations joined, heredocs and VAR=value prefixes dropped."""
    env_prefix = re.compile(r"[A-Z_][A-Z0-9_]*=\S*").fullmatch
    lines = HEREDOC.sub("", script.replace("\\\n", " ")).splitlines()
    return [argv for line in lines if (argv := list(itertools.dropwhile(env_prefix, shlex.split(line))))]


def pytest_args(argv: list[str]) -> list[str] | None:
    """pytest's arguments if argv runs pytest (directly, with ``python -m`` or ``torchrun -m``)."""
    starts = [i for i, word in enumerate(argv) if word == "pytest" and (i == 0 or argv[i - 1] == "-m")]
    return argv[starts[0] + 1 :] if starts else None


def option(args: list[str], name: str) -> str | None:
    """The value of ``name=value`` or ``name value`` in args."""
    values = [v for a, v in itertools.pairwise(args) if a == name]
    values += [a.split("=", 1)[1] for a in args if a.startswith(f"{name}=")]
    return values[0] if values else None


class PerfRun(NamedTuple):  # one pytest session of the perf suite
    job: Job
    args: list[str]  # pytest's
    profile: str
    groups: set[str]


def perf_runs() -> list[PerfRun]:
    runs = []
    for job in jobs():
        for argv in job.commands():
            args = pytest_args(argv) or []
            if any(a.startswith("--perf-") for a in args):
                profile, groups = option(args, "--perf-profile"), option(args, "--perf-group")
                assert profile and groups, f"job {job.id}: {argv} must name --perf-profile and --perf-group"
                runs.append(PerfRun(job, args, profile, set(groups.split(","))))
    return runs


@pytest.fixture(scope="module")
def bench() -> matrix.Matrix:
    return matrix.load(ROOT / "benchmarks.json")


def test_perf_groups_are_exactly_the_groups_of_their_profile(bench):
    for profile in {r.profile for r in perf_runs()}:
        ran = [g for r in perf_runs() if r.profile == profile for g in r.groups]
        known = {c.get("group") for suite in bench.suites for c in bench.cases(suite, profile)}
        assert sorted(set(ran) - known) == [], f"--perf-group names these, not groups of the {profile} profile"
        assert sorted(known - set(ran), key=str) == [], f"no job runs these groups of the {profile} profile"
        assert len(ran) == len(set(ran)), f"a {profile} group runs twice: {sorted(ran)}"


def test_every_gate_pair_is_measured_within_one_session(bench):
    # A gate divides two cases of one saved run: a pair split over two sessions is "not measured" for ever.
    from cs336_systems.reporting import gates

    def measured(groups: set[str]) -> set[tuple[str, str]]:
        stats = {"median": 1.0, "mean": 1.0, "min": 1.0}
        # every case measured: its times and the results a gate may bound instead (peak memory)
        entries = [{**c, "suite": s, "stats": stats, **{k: 1.0 for k in gates.RESULT_STATISTICS}}
                   for s in bench.suites for c in bench.cases(s, "gpu", groups)]
        checks = gates.evaluate(bench.gates, entries, gates.case_fields_of(bench))
        return {(c.gate, c.case) for c in checks if c.ratio is not None}

    sessions = [r.groups for r in perf_runs() if r.profile == "gpu"]
    everything = measured(set().union(*sessions))
    assert everything, "no gate has a pair in the gpu profile"
    assert sorted(everything - set().union(*map(measured, sessions))) == [], "gate pairs split over sessions"


_SEPARATOR = "----- end of pytest's output -----"


@functools.cache
def pytest_outputs(*flags: str) -> list[str]:
    """What ``python -m pytest <flag> -p no:cacheprovider`` prints for each flag, from one process (one
    torch import, not one per flag): the project's pytest, configured from its root, as CI starts it."""
    script = ("import pytest\n"
              f"for flag in {flags!r}:\n"
              "    if pytest.main([flag, '-p', 'no:cacheprovider']) != 0:\n"
              "        raise SystemExit(f'pytest {flag} failed')\n"
              f"    print({_SEPARATOR!r}, flush=True)\n")
    out = subprocess.run([sys.executable, "-c", script], cwd=ROOT, capture_output=True, text=True, check=True).stdout
    *outputs, rest = out.split(_SEPARATOR + "\n")
    assert len(outputs) == len(flags) and not rest, out[-2000:]
    return outputs


@functools.cache
def cli_help(module: str) -> str:
    """What ``python -m <module> --help`` prints, read in this process (no interpreter and torch import per
    CLI): the project's CLI modules run their ``main(argv)``, and torchrun's ``main`` parses with
    ``parse_args(argv)`` first (its ``main`` would also install torchelastic's error handler here)."""
    loaded = importlib.import_module(module)
    parse = loaded.parse_args if module == "torch.distributed.run" else loaded.main
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed), pytest.raises(SystemExit) as exited:
        parse(["--help"])
    assert exited.value.code == 0, f"python -m {module} --help exited with {exited.value.code}"
    return printed.getvalue()


def assert_documented(args: list[str], help_text: str, where: str) -> None:
    for opt in {a.split("=", 1)[0] for a in args if re.match(r"-[-\w]", a)}:
        assert re.search(rf"(^|[\s,\[]){re.escape(opt)}([\s=,\]]|$)", help_text, re.MULTILINE), f"{where} has no {opt}"


def test_project_clis_and_torchrun_accept_their_options():
    called = set()
    for argv in (argv for job in jobs() for argv in job.commands()):
        for i, word in enumerate(argv[:-1]):
            if word == "-m" and argv[i + 1].startswith("cs336_systems"):
                called.add(argv[i + 1])
                assert_documented(argv[i + 2 :], cli_help(argv[i + 1]), f"python -m {argv[i + 1]}")
        if os.path.basename(argv[0]) == "torchrun":
            assert_documented(argv[1 : argv.index("-m")], cli_help("torch.distributed.run"), "torchrun")
    assert {"cs336_systems.gates", "cs336_systems.report"} <= called, called


@pytest.mark.slow  # two pytest subprocesses, each importing the project and torch (~6 s)
def test_pytest_options_and_markers_exist():
    help_text, markers = pytest_outputs("--help", "--markers")
    for job in jobs():
        for step in job.steps:
            runs = [args for argv in commands(step["run"]) if (args := pytest_args(argv)) is not None]
            # Flags kept in a bash array and passed as "${name[@]}" (the baseline comparison's).
            arrays = [shlex.split(body) for body in re.findall(r"\w+=\(([^)]*)\)", step["run"])] if runs else []
            for args in runs + arrays:
                assert_documented(args, help_text, f"pytest (job {job.id})")
            for expr in filter(None, (option(args, "-m") for args in runs)):
                for name in set(re.findall(r"\w+", expr)) - {"and", "or", "not"}:
                    assert re.search(rf"^@pytest\.mark\.{name}[(:]", markers, re.MULTILINE), f"no marker {name}"


def test_inline_python_imports_what_exists():
    # The `python - <<'PY'` scripts run only on GPU runners, where a moved module or renamed function
    # would break every perf job: their imports must work here, and the module attributes they use exist.
    scripts = {body for job in jobs() for step in job.steps for _, body in HEREDOC.findall(step["run"])}
    assert scripts
    for tree in map(ast.parse, scripts):
        imports = ast.Module([n for n in tree.body if isinstance(n, (ast.Import, ast.ImportFrom))], [])
        namespace: dict = {}
        exec(compile(imports, "<inline script's imports>", "exec"), namespace)  # noqa: S102 (the workflow's own)
        for node in (n for n in ast.walk(tree) if isinstance(n, ast.Attribute) and isinstance(n.value, ast.Name)):
            if isinstance(module := namespace.get(node.value.id), types.ModuleType):
                assert hasattr(module, node.attr), f"inline script: {node.value.id} has no {node.attr}"


def test_report_job_merges_every_perf_artifact_and_only_those():
    names = [u["name"] for job in jobs() for u in job.uploads()]
    assert len(names) == len(set(names)), f"upload-artifact@v4 refuses a second artifact of one name: {names}"
    perf_jobs = {run.job.id for run in perf_runs()}
    for run in perf_runs():
        saved, (upload,) = option(run.args, "--benchmark-json"), run.job.uploads()
        assert saved and saved.startswith(upload["path"].rstrip("/") + "/"), f"{saved} is not uploaded"
        gated = [[x for x in a[a.index("cs336_systems.gates") + 1 :] if x != "--allow-empty"]
                 for a in run.job.commands() if "cs336_systems.gates" in a]
        assert gated == [[saved]], f"job {run.job.id}: the gates must check {saved}"
    downloads = [(j, s["with"]) for j in jobs() for s in j.steps if s.get("uses", "").startswith("actions/download-")]
    ((report, download),) = downloads
    assert perf_jobs <= set(report.spec["needs"]), "the report waits for every perf job"
    for job in jobs():
        for upload in job.uploads():
            merged = fnmatch.fnmatchcase(upload["name"], download["pattern"])
            assert merged == (job.id in perf_jobs), f"{upload['name']}: merged into the report is {merged}"
    # Several artifacts download to <path>/<artifact name>/ unless merge-multiple is set.
    wanted = f"{download['path'].rstrip('/')}/*/*.json"
    assert not download.get("merge-multiple") and wanted in "".join(s["run"] for s in report.steps), wanted


# --- triggers and the plan -------------------------------------------------------------------------------

GATED_PATHS = ["cs336_systems/**", "perf/**", "benchmarks.json", "pyproject.toml", "conftest.py",
               ".github/workflows/perf-gpu.yml"]


def test_library_changes_are_gated_on_pull_requests_and_pushes():
    triggers = yaml.safe_load(WORKFLOW.read_text())[True]  # PyYAML reads the key `on` as True
    assert triggers["pull_request"]["paths"] == GATED_PATHS
    assert triggers["push"] == {"branches": ["main"], "paths": GATED_PATHS}
    assert "schedule" in triggers and "workflow_dispatch" in triggers
    for path in ("cs336_systems/attention/kernels/hopper/backward.py", "cs336_systems/model.py", "perf/test_e2e.py",
                 "benchmarks.json", "pyproject.toml"):
        assert any(fnmatch.fnmatch(path, pattern) for pattern in GATED_PATHS), path


def test_the_plan_job_feeds_the_perf_matrices_and_perf_runs_use_the_statistical_gate():
    workflow = yaml.safe_load(WORKFLOW.read_text())["jobs"]
    assert workflow["plan"]["runs-on"] == "ubuntu-latest"
    assert "head.repo.full_name == github.repository" in workflow["plan"]["if"]
    assert workflow["perf"]["strategy"]["matrix"]["group"] == "${{ fromJSON(needs.plan.outputs.single) }}"
    assert workflow["perf-multi-gpu"]["strategy"]["matrix"]["include"] == "${{ fromJSON(needs.plan.outputs.multi) }}"
    for run in perf_runs():
        arrays = [shlex.split(body) for step in run.job.steps for body in re.findall(r"compare=\(([^)]*)\)", step["run"])]
        assert ["--benchmark-compare", "--perf-gate"] in arrays, run.job.id


@pytest.mark.parametrize("changed, single, multi", [
    (["cs336_systems/attention/kernels/hopper/backward.py"], {"leaderboard", "flash-bf16-graph", "e2e-flash-attention"},
     set()),
    (["cs336_systems/parallel/ddp.py"], set(), {"data-parallel-bf16", "data-parallel-fp32", "allreduce-nccl"}),
    (["cs336_systems/optim/adamw_master.py"], {"e2e-hf", "e2e-2.7B"}, set()),
    (["docs/flash-attention.md", "README.md", "results/h200/leaderboard.json", "tests/test_model.py"], set(), set()),
    (["cs336_systems/reporting/significance.py"], {"leaderboard"}, set()),
])
def test_the_plan_maps_changed_paths_to_the_groups_they_can_move(changed, single, multi):
    chosen = affected.plan(changed)
    assert single <= set(chosen["single"]) and (single or not chosen["single"]), chosen
    assert {job["name"] for job in chosen["multi"]} >= multi and (multi or not chosen["multi"]), chosen
    if "cs336_systems/attention/kernels/hopper/backward.py" in changed:
        assert not {"e2e-hf", "warmup", "checkpointing-xl"} & set(chosen["single"])  # not what attention moves


def test_an_unmapped_library_path_and_the_suite_itself_run_everything():
    everything = affected.plan(None)
    for path in ("cs336_systems/new_module.py", "perf/conftest.py", "benchmarks.json", "conftest.py"):
        assert affected.plan([path])["single"] == everything["single"], path
        assert affected.plan([path])["multi"] == everything["multi"], path
    # every single-GPU group of the gpu profile is planned on the nightly run, as the perf matrix needs
    bench = matrix.load(ROOT / "benchmarks.json")
    singles = {c.get("group") for suite in bench.suites if suite not in affected.MULTI_GPU_SUITES
               for c in bench.cases(suite, "gpu")}
    assert set(everything["single"]) == singles


def test_the_planner_runs_with_the_standard_library_alone():
    result = subprocess.run([sys.executable, "-I", "-S", str(ROOT / "cs336_systems" / "bench" / "affected.py"),
                             "cs336_systems/parallel/fsdp.py"], capture_output=True, text=True, timeout=60, cwd="/")
    assert result.returncode == 0, result.stderr
    assert [job["name"] for job in json.loads(result.stdout)["multi"]][:1] == ["allreduce-nccl"]
