"""codefix: SWE-style tasks. A small Python repository with a bug, the issue a user filed, and hidden
tests; the agent works in a sandbox over many turns with shell and file-edit tools; the reward is
whether the hidden tests pass.

Episode: `reset` leases a sandbox from the pool for the whole episode (its workdir restored to empty by
the pool), writes the repository, applies the task's declared perturbations, and shows the issue.
Each turn the agent calls one tool (Hermes `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`,
or `bash(COMMAND)` for the shell); a turn without a tool call, or `submit`, ends the episode, and only
then are the hidden tests written into the sandbox and run (`python3 -m unittest discover -s
tests_hidden -t .` from the repository root). While the agent acts, the tests exist only in this
process's memory: nothing in the sandbox (and no leftover process, since none outlives a command)
can read them. A command that times out marks the sandbox broken: the pool destroys it afterwards.

Perturbations (declared per task, see CodefixTask): extra environment variables for every command,
tools withheld, the repository under src/, a broken module planted next to the package.
"""

from __future__ import annotations

import asyncio
import dataclasses
import hashlib
import json
import logging
import os
import random
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from loomrl.cache_dir import cache_root
from loomrl.config import ConfigError
from loomrl.env.api import Environment, EpisodeContext, TaskSetup
from loomrl.env.base import Env, Observation, StepResult
from loomrl.env.pool import EnvPool, Leases, pool_size_for
from loomrl.env.sandbox import Sandbox, SandboxError
from loomrl.env.tasks.codefix_types import CodefixTask
from loomrl.model.tools import parse_tool_calls
from loomrl.types import Task

log = logging.getLogger(__name__)

ENV_VERSION = "codefix-v1"
TEST_DIR = "tests_hidden"
TEST_COMMAND = ["/usr/bin/python3", "-m", "unittest", "discover", "-s", TEST_DIR, "-t", "."]

SYSTEM_PROMPT = (
    "You are a software engineer. A Python repository with a reported bug is in your working directory. "
    "Find the bug and fix it with the tools. Call exactly one tool per reply, as "
    '<tool_call>{"name": TOOL, "arguments": {...}}</tool_call>. When the fix is done, call submit.'
)


def _tool(name: str, description: str, **params: str) -> dict[str, Any]:
    return {"type": "function", "function": {
        "name": name, "description": description,
        "parameters": {"type": "object", "properties": {k: {"type": "string", "description": v} for k, v in params.items()},
                       "required": list(params)}}}


TOOLS: list[dict[str, Any]] = [
    _tool("bash", "Run a shell command in the repository (no network); returns exit code and output.",
          command="the command line"),
    _tool("read_file", "Read a file of the repository.", path="path relative to the repository root"),
    _tool("write_file", "Create or overwrite a file.", path="path relative to the repository root",
          content="the whole new content"),
    _tool("str_replace", "Replace the one occurrence of old_str in a file by new_str.",
          path="path relative to the repository root", old_str="exact text to replace (must occur once)",
          new_str="replacement text"),
    _tool("submit", "Finish: the fix is done."),
]


def describe_tools(tools: list[dict[str, Any]]) -> str:
    fns = [t["function"] for t in tools]
    return "\n".join(f"- {f['name']}({', '.join(f['parameters']['properties'])}): {f['description']}" for f in fns)


# Single-argument tools also accept the plain call form, e.g. bash(ls -la).
_PLAIN_FORMS = {"bash": "command", "read_file": "path"}


PASSED, FAILED = "tests_passed", "tests_failed"  # the episode's "final answer"; a task's answer is PASSED


def verdict_label(passed: bool) -> str:
    return PASSED if passed else FAILED


@dataclass(slots=True)
class TestVerdict:
    passed: bool
    output: str  # tail of the test run's output
    killed: str | None = None


class CodefixEnv(Env):
    """One episode at a time over a sandbox leased from `pool` for the whole episode."""

    version = ENV_VERSION

    def __init__(self, pool: Leases, specs: dict[str, CodefixTask], *, command_timeout_s: float = 10.0,
                 test_timeout_s: float = 60.0, max_output_chars: int = 2000):
        self.pool = pool
        self.specs = specs
        self.command_timeout_s = command_timeout_s
        self.test_timeout_s = test_timeout_s
        self.max_output_chars = max_output_chars
        self.sandbox: Sandbox | None = None
        self.spec: CodefixTask | None = None
        self.root = ""
        self.env_vars: dict[str, str] = {}
        self.tools: list[dict[str, Any]] = []
        self.broken = False
        self.verdict: TestVerdict | None = None

    # -- episode --------------------------------------------------------------------------------------
    async def reset(self, task: Task) -> Observation:
        spec = self.specs.get(task.task_id)
        if spec is None:
            raise KeyError(f"codefix: unknown task {task.task_id!r}")
        self.spec, self.verdict = spec, None
        self.sandbox = await self.pool.acquire()
        p = spec.perturbations
        self.root = "src/" if p.get("layout") == "src" else ""
        self.env_vars = {str(k): str(v) for k, v in p.get("env", {}).items()}
        files = {self.root + path: content for path, content in spec.files.items()}
        if name := p.get("broken_dependency"):
            files[f"{self.root}{name}.py"] = (f'raise ImportError("{name} is broken in this environment '
                                              '(a declared perturbation)")\n')
        try:
            await lay_out(self.sandbox, files)
        except BaseException:
            # Cancelled (episode deadline) while the writes go on in their thread: never reuse it.
            self.broken = True
            raise
        disabled = set(p.get("disable_tools", []))
        self.tools = [t for t in TOOLS if t["function"]["name"] not in disabled]
        listing = "\n".join(sorted(f"  {path}" for path in spec.files))
        where = "the src/ folder of your working directory" if self.root else "your working directory"
        user = f"Issue:\n{spec.issue}\n\nThe repository is in {where}. Its files:\n{listing}"
        # Many chat templates (SmolLM2's among them) do not render tool schemas: describe them in text too.
        system = f"{SYSTEM_PROMPT}\nTools:\n{describe_tools(self.tools)}"
        return Observation(messages=[{"role": "system", "content": system}, {"role": "user", "content": user}],
                           tools=self.tools)

    async def step(self, action: str) -> StepResult:
        try:
            return await self._step(action)
        except BaseException:
            # cancelled mid-command or mid-write (trajectory deadline; a write in its thread may still
            # land) or the sandbox failed: the pool destroys it instead of resetting it
            self.broken = True
            raise

    async def _step(self, action: str) -> StepResult:
        allowed = {t["function"]["name"] for t in self.tools}
        calls = parse_tool_calls(action, {k: v for k, v in _PLAIN_FORMS.items() if k in allowed})
        if not calls or calls[0].name == "submit":
            return await self._finish(submitted=bool(calls))
        call = calls[0]
        info: dict[str, Any] = {"tool_calls": [{"name": call.name, "arguments": call.arguments, "error": call.error}]}
        if call.error:
            output = f"Error: {call.error}"
        elif call.name not in allowed:
            output = f"Error: unknown tool {call.name!r}; available: {', '.join(sorted(allowed))}"
        else:
            output = await self._run_tool(call.name, call.arguments)
        if not call.error and output.startswith("Error:"):  # well formed, but the tool could not carry it out
            info["tool_calls"][0]["tool_error"] = output
        info["tool_output"] = output
        return StepResult(observation=[{"role": "tool", "content": output}], info=info)

    async def _run_tool(self, name: str, args: dict[str, Any]) -> str:
        assert self.sandbox is not None
        try:
            if name == "bash":
                cmd = str(args.get("command", ""))
                if self.root:
                    cmd = f"cd {self.root} && {cmd}"
                res = await self.sandbox.exec(["/bin/sh", "-c", cmd], timeout=self.command_timeout_s, env=self.env_vars)
                if res.killed:
                    self.broken = True  # never reuse an instance whose command had to be killed
                    return f"Error: the command was killed ({res.killed}, limit {self.command_timeout_s}s)"
                return self._clip(f"exit code {res.returncode}\n{res.stdout}{res.stderr}")
            path = self.root + str(args.get("path", "")).lstrip("/")
            # File operations run off the event loop: on a remote sandbox (Ray env actors) each is a call.
            if name == "read_file":
                return self._clip(await asyncio.to_thread(self.sandbox.read_file, path))
            if name == "write_file":
                await asyncio.to_thread(self.sandbox.write_file, path, str(args.get("content", "")))
                return f"wrote {args.get('path')}"
            if name == "str_replace":
                text = await asyncio.to_thread(self.sandbox.read_file, path)
                old, new = str(args.get("old_str", "")), str(args.get("new_str", ""))
                count = text.count(old) if old else 0
                if count != 1:
                    return f"Error: old_str occurs {count} times in {args.get('path')}; it must occur exactly once"
                await asyncio.to_thread(self.sandbox.write_file, path, text.replace(old, new))
                return f"edited {args.get('path')}"
        except SandboxError as err:
            return f"Error: {err}"
        return f"Error: unknown tool {name!r}"

    def _clip(self, text: str) -> str:
        if len(text) <= self.max_output_chars:
            return text
        half = self.max_output_chars // 2
        return f"{text[:half]}\n[... {len(text) - 2 * half} characters cut ...]\n{text[-half:]}"

    async def _finish(self, *, submitted: bool) -> StepResult:
        assert self.sandbox is not None and self.spec is not None
        self.verdict = await run_hidden_tests(self.sandbox, self.spec, self.root, timeout=self.test_timeout_s,
                                              env=self.env_vars)
        if self.verdict.killed:
            self.broken = True
        return StepResult(observation=[], reward=float(self.verdict.passed), done=True, info={
            "final_answer": verdict_label(self.verdict.passed), "submitted": submitted,
            "tests_passed": self.verdict.passed, "test_output": self.verdict.output})

    async def finalize(self) -> str | None:
        """For an episode cut short (turn or context budget): judge the repository as the agent left it."""
        if self.verdict is None and self.sandbox is not None:
            await self._finish(submitted=False)
        return verdict_label(self.verdict.passed) if self.verdict is not None else None

    async def close(self) -> None:
        if self.sandbox is not None:
            sandbox, self.sandbox = self.sandbox, None
            await asyncio.shield(self.pool.release(sandbox, broken=self.broken))


async def lay_out(sandbox: Sandbox, files: dict[str, str], root: str = "") -> None:
    """Write `files` under `root`, off the event loop (file writes block; remote ones are calls)."""

    def write_all() -> None:
        for path, content in files.items():
            sandbox.write_file(root + path, content)

    await asyncio.to_thread(write_all)


async def run_hidden_tests(sandbox: Sandbox, spec: CodefixTask, root: str = "", *, timeout: float = 60.0,
                           env: dict[str, str] | None = None) -> TestVerdict:
    """Put the hidden tests in (only now) and run them from the repository root."""
    await lay_out(sandbox, spec.hidden_tests, root)
    argv = ["/bin/sh", "-c", f"cd {root} && exec \"$@\"", "sh", *TEST_COMMAND] if root else TEST_COMMAND
    res = await sandbox.exec(argv, timeout=timeout, env=env)
    tail = (res.stdout + res.stderr)[-1500:]
    return TestVerdict(passed=res.returncode == 0 and res.killed is None, output=tail, killed=res.killed)


# -- task validation ---------------------------------------------------------------------------------
@dataclass(slots=True)
class TaskValidation:
    task_id: str
    golden_passes: bool
    noop_fails: bool
    detail: str = ""

    @property
    def valid(self) -> bool:
        return self.golden_passes and self.noop_fails


async def validate_task(pool: EnvPool, spec: CodefixTask, timeout: float = 60.0) -> TaskValidation:
    """Ground truth: the golden patch passes every hidden test. No-op: the untouched repository fails."""
    results = []
    for patched in (True, False):
        async with pool.lease() as sandbox:
            files = {**spec.files, **spec.golden_patch} if patched else spec.files
            await lay_out(sandbox, files)
            results.append(await run_hidden_tests(sandbox, spec, timeout=timeout))
    golden, noop = results
    detail = []
    if not golden.passed:
        detail.append(f"golden patch fails its tests: {golden.output[-300:]}")
    if noop.passed:
        detail.append("the untouched repository already passes its tests")
    missing = sorted(set(spec.golden_patch) - set(spec.files))
    if missing:
        detail.append(f"golden patch creates files not in the repository: {missing}")
    return TaskValidation(spec.task_id, golden.passed and not missing, not noop.passed, "; ".join(detail))


async def validate_tasks(specs: list[CodefixTask], pool: EnvPool, progress=None) -> list[TaskValidation]:
    async def one(spec: CodefixTask) -> TaskValidation:
        result = await validate_task(pool, spec)
        if progress is not None:
            progress.update(1)
        return result

    return list(await asyncio.gather(*[one(s) for s in specs]))


# -- tasks and reward --------------------------------------------------------------------------------
def codefix_specs(families: list[str] | None = None) -> dict[str, CodefixTask]:
    """The shipped corpus (optionally only some families), by task id."""
    from loomrl.env.tasks.codefix_corpus import codefix_tasks

    specs = codefix_tasks()
    known = sorted({s.family for s in specs})
    unknown = sorted(set(families or []) - set(known))
    if unknown:
        raise ConfigError(f"config error: env.families: unknown codefix family {unknown}; choose from {known}")
    return {s.task_id: s for s in specs if not families or s.family in families}


def as_task(spec: CodefixTask, split: str) -> Task:
    return Task(task_id=spec.task_id, prompt=spec.issue, answer=PASSED, split=split, family=spec.family)


def codefix_splits(specs: dict[str, CodefixTask], n_heldout: int, seed: int) -> tuple[list[Task], list[Task]]:
    """Disjoint train and held-out task lists: a seeded shuffle, at most a third held out."""
    ids = sorted(specs)
    random.Random(f"{seed}:codefix").shuffle(ids)
    k = min(n_heldout, len(ids) // 3)
    held = set(ids[:k])
    return ([as_task(specs[i], "train") for i in sorted(ids) if i not in held],
            [as_task(specs[i], "heldout") for i in sorted(held)])


def codefix_reward(traj, task: Task) -> dict[str, float]:
    """1 when the hidden tests passed at the end of the episode, else 0."""
    return {"tests_pass": 1.0 if traj.final_answer == PASSED else 0.0}


# -- validation in sandboxes (before a run, and `loomrl validate-tasks`) --------------------------------------------
async def validate_codefix(specs: list[CodefixTask], backend: str = "auto", limits: dict[str, int] | None = None,
                           progress=None) -> list[dict[str, Any]]:
    """Validate codefix tasks in real sandboxes: one record per task (task_id, valid, golden_passes,
    noop_fails, detail)."""
    from loomrl.env.sandbox import make_sandbox

    pool = await EnvPool(lambda: make_sandbox(backend, limits=limits), size=pool_size_for(4), prewarm=4).start()
    try:
        results = await validate_tasks(specs, pool, progress=progress)
    finally:
        await pool.close()
    return [{"task_id": r.task_id, "valid": r.valid, **dataclasses.asdict(r)} for r in results]


def validation_key(specs: dict[str, CodefixTask], sandbox: str, limits: dict[str, int]) -> str:
    """What decides a validation: the tasks' contents, the environment's version, the sandbox backend this machine
    picks for `sandbox` (auto resolved) and its limits."""
    from loomrl.env.sandbox.factory import resolve_backend

    digest = hashlib.sha256()
    payload = {"env": ENV_VERSION, "backend": resolve_backend(sandbox), "limits": sorted(limits.items()),
               "tasks": [dataclasses.asdict(specs[k]) for k in sorted(specs)]}
    digest.update(json.dumps(payload, sort_keys=True, default=str).encode())
    return digest.hexdigest()[:16]


def read_cached_report(path: Path) -> list[dict[str, Any]] | None:
    """A validation report written by write_validation_report, or None when there is none (or it cannot be read: it
    is made again)."""
    try:
        return json.loads(path.read_text())["tasks"]
    except (OSError, ValueError, KeyError):
        return None


def write_validation_report(report: list[dict[str, Any]], path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    valid = sum(r["valid"] for r in report)
    draft = path.with_name(f"{path.name}.{os.getpid()}.tmp")  # whole or not at all: rollout actors may write at once
    draft.write_text(json.dumps({"valid": valid, "invalid": len(report) - valid, "tasks": report}, indent=2))
    os.replace(draft, path)


# -- the environment, on the public API (env/api.py) --------------------------------------------------------------
class CodefixEnvironment(Environment):
    """SWE-style bug fixing; an episode holds one pool sandbox throughout. Tasks are validated (golden patch passes,
    untouched repository fails) before a run; invalid ones are left out with a warning."""

    version = ENV_VERSION
    sandbox = "episode"

    def __init__(self) -> None:
        self._validated: dict[str, set[str]] = {}  # validation key -> the valid task ids
        self._specs: dict[str, CodefixTask] | None = None  # every shipped task, by id (made on first use)

    def check(self, setup: TaskSetup) -> None:
        codefix_specs(setup.families)

    async def start(self, setup: TaskSetup) -> None:
        """Validate the tasks in sandboxes (golden patch passes, untouched repository fails), or read the result from
        loomrl's cache folder, where it is kept by what decides it: the tasks' contents, the sandbox backend this
        machine picks and its limits."""
        specs = codefix_specs(setup.families)
        key = validation_key(specs, setup.sandbox, setup.sandbox_limits)
        if key in self._validated:
            return
        path = cache_root() / "codefix-validation" / f"{key}.json"
        report = read_cached_report(path)
        if report is None:
            report = await validate_codefix(list(specs.values()), setup.sandbox, setup.sandbox_limits)
            write_validation_report(report, path)
        else:
            log.info("codefix: task validation read from %s", path)
        self._validated[key] = {r["task_id"] for r in report if r["valid"]}
        bad = [r for r in report if not r["valid"]]
        if bad:
            log.warning("codefix: %d invalid task(s) left out: %s", len(bad),
                        "; ".join(f"{r['task_id']}: {r['detail']}" for r in bad))

    def tasks(self, setup: TaskSetup) -> tuple[list[Task], list[Task]]:
        specs = codefix_specs(setup.families)
        key = validation_key(specs, setup.sandbox, setup.sandbox_limits)
        if key not in self._validated:
            raise RuntimeError("CodefixEnvironment.tasks before start(): the tasks are validated in start "
                               "(env/registry.py prepared_tasks runs it)")
        valid = {k: v for k, v in specs.items() if k in self._validated[key]}
        return codefix_splits(valid, setup.n_heldout, setup.seed)

    def episode(self, ctx: EpisodeContext) -> Env:
        assert ctx.pool is not None, "sandbox = 'episode': the run gives a pool"
        # every shipped task: an episode is only ever given one of the valid tasks tasks() returned
        if self._specs is None:
            self._specs = codefix_specs(None)
        return CodefixEnv(ctx.pool, self._specs, command_timeout_s=ctx.tool_timeout_s)

    def reward(self, traj, task: Task) -> dict[str, float]:
        return codefix_reward(traj, task)
