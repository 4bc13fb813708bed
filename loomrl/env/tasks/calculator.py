"""Calculator task family: arithmetic word problems solved over several turns with a calculator tool.

Tasks are generated from a seed into fixed, disjoint train and held-out splits. The agent calls the
tool as `calc(EXPRESSION)`; the tool runs in a sandboxed subprocess with a timeout; the env answers
`Result: VALUE` and the agent ends with `The answer is NUMBER.`

Families (one or two arithmetic steps, word problems or bare expressions):
  add, sub, mul, div         one-step word problems
  add_sub, add_add, mul_add  two-step word problems
  distract_add/_sub/_mul     one step, with a distracting quantity of another item
  expr                       a bare two-number expression ("What is 37 + 48?")
"""

from __future__ import annotations

import asyncio
import math
import random
import re

from loomrl.config import ConfigError
from loomrl.env.base import Env, EnvCrash, Observation, StepResult, ToolTimeout
from loomrl.env.pool import EnvPool
from loomrl.model.tools import parse_tool_calls
from loomrl.types import Task

ENV_VERSION = "calculator-v1"

SYSTEM_PROMPT = (
    "You are a helpful assistant with a calculator. To use it, reply with only calc(EXPRESSION). "
    "After you get the result, reply with: The answer is NUMBER."
)
# Worked examples shown as earlier chat turns (a 135M model needs them to use the tool at all).
# "word" starts with a one-step word problem, "bare" shows bare expressions only.
FEW_SHOT = {
    "none": [],
    "bare": [("What is 14 + 9?", "14 + 9", "23"), ("What is 6 * 7?", "6 * 7", "42")],
    "word": [("Ben has 14 pens and gets 9 more. How many pens does Ben have now?", "14 + 9", "23"),
             ("What is 6 * 7?", "6 * 7", "42")],
}
TOOLS = {"calc": "expression"}
_ANSWER = re.compile(r"answer is\s*:?\s*\$?\s*(-?[\d,]*\.?\d+)", re.IGNORECASE)

# The tool program: a safe AST evaluator run with the sandbox's python. `--crash` makes it abort and
# `--hang` makes it sleep forever (fault injection: crashes and hangs are recorded, never fatal).
TOOL_SOURCE = r"""
import ast, operator, os, sys, time
if "--crash" in sys.argv:
    os.abort()
if "--hang" in sys.argv:
    time.sleep(10**6)
OPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv,
       ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod, ast.Pow: operator.pow}
def ev(node):
    if isinstance(node, ast.Constant) and isinstance(node.value, (int, float)) and not isinstance(node.value, bool):
        return node.value
    if isinstance(node, ast.BinOp) and type(node.op) in OPS:
        left, right = ev(node.left), ev(node.right)
        if isinstance(node.op, ast.Pow) and abs(right) > 64:
            raise ValueError("exponent too large")
        return OPS[type(node.op)](left, right)
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.USub, ast.UAdd)):
        v = ev(node.operand)
        return -v if isinstance(node.op, ast.USub) else v
    raise ValueError("only numbers and + - * / // % ** ( ) are allowed")
try:
    value = ev(ast.parse(sys.argv[1].replace("x", "*").replace("^", "**"), mode="eval").body)
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    print(round(value, 6) if isinstance(value, float) else value)
except Exception as err:
    print(f"Error: {err}")
"""

_NAMES = ["Tom", "Ana", "Sam", "Lia", "Max", "Eva", "Ben", "Mia", "Leo", "Zoe"]
_ITEMS = ["apples", "pens", "books", "coins", "cards", "stamps", "shells", "marbles", "stickers", "cookies"]


# Each family: the numbers it draws, in order, as (name, low, high) (distract_mul draws a and c twice,
# and the second draw counts), and its (question, expression) templates, one drawn at random if there
# are several; the answer is the expression's value. {n} is a name, {it} an item, {ab} is a * b;
# distract families also draw two different items {i1}, {i2} and ask about {i1}. The draws' order
# fixes the tasks.
FAMILIES: dict[str, tuple[list[tuple[str, int, int]], list[tuple[str, str]]]] = {
    "add": ([("a", 10, 99), ("b", 10, 99)], [
        ("{n} has {a} {it} and gets {b} more. How many {it} does {n} have now?", "{a} + {b}"),
        ("{n} had {a} {it}. A friend gave {n} {b} more {it}. How many {it} does {n} have?", "{a} + {b}")]),
    "sub": ([("a", 40, 99), ("b", 10, 39)], [
        ("{n} has {a} {it} and gives away {b}. How many {it} are left?", "{a} - {b}"),
        ("There are {a} {it} in a box. {n} takes {b} of them. How many {it} are in the box now?", "{a} - {b}")]),
    "mul": ([("a", 3, 19), ("b", 3, 19)], [
        ("{n} buys {a} bags with {b} {it} in each bag. How many {it} does {n} have?", "{a} * {b}"),
        ("A shelf has {a} rows with {b} {it} in each row. How many {it} are on the shelf?", "{a} * {b}")]),
    "div": ([("a", 3, 12), ("b", 3, 19)], [
        ("{n} shares {ab} {it} equally among {a} friends. How many {it} does each friend get?", "{ab} / {a}")]),
    "expr": ([("a", 10, 99), ("b", 10, 99)], [(f"What is {{a}} {op} {{b}}?", f"{{a}} {op} {{b}}") for op in "+-*"]),
    "add_sub": ([("a", 20, 99), ("b", 10, 60), ("c", 5, 19)], [
        ("{n} has {a} {it}, gets {b} more, then gives away {c}. How many {it} does {n} have now?", "{a} + {b} - {c}")]),
    "add_add": ([("a", 10, 99), ("b", 10, 60), ("c", 5, 40)], [
        ("{n} has {a} {it}. {n} gets {b} more, then {c} more. How many {it} does {n} have now?", "{a} + {b} + {c}")]),
    "mul_add": ([("a", 3, 9), ("b", 3, 12), ("c", 5, 40)], [
        ("{n} has {c} {it} and buys {a} bags with {b} {it} in each bag. How many {it} does {n} have now?",
         "{c} + {a} * {b}")]),
    "distract_add": ([("a", 20, 99), ("b", 10, 60), ("c", 5, 19)], [
        ("{n} has {a} {i1} and {b} {i2}. {n} gets {c} more {i1}. How many {i1} does {n} have now?", "{a} + {c}")]),
    "distract_sub": ([("a", 20, 99), ("b", 10, 60), ("c", 5, 19)], [
        ("{n} has {a} {i1} and {b} {i2}. {n} gives away {c} {i1}. How many {i1} are left?", "{a} - {c}")]),
    "distract_mul": ([("a", 20, 99), ("b", 10, 60), ("c", 5, 19), ("a", 3, 12), ("c", 3, 12)], [
        ("{n} has {b} {i2}. {n} buys {a} bags with {c} {i1} in each bag. How many {i1} does {n} have?", "{a} * {c}")]),
}


def _one_step(kind: str, rng: random.Random) -> tuple[str, int, str]:
    """A (question, answer, expression) of family `kind`, drawn from `rng`."""
    draws, templates = FAMILIES[kind]
    values = {"n": rng.choice(_NAMES), "it": rng.choice(_ITEMS)}
    if kind.startswith("distract_"):
        values["i1"], values["i2"] = rng.sample(_ITEMS, 2)
    for name, low, high in draws:
        values[name] = rng.randint(low, high)
    values["ab"] = values["a"] * values["b"]
    # choice() draws even from a list of one: only kinds with several templates may call it.
    question, expr = rng.choice(templates) if len(templates) > 1 else templates[0]
    expr = expr.format(**values)
    return question.format(**values), int(eval(expr)), expr  # every answer is a whole number


def generate_tasks(families: list[str], n: int, seed: int, split: str, exclude: set[str] | None = None) -> list[Task]:
    """`n` tasks cycling through `families`, reproducible from (seed, split); none in `exclude`."""
    unknown = [f for f in families if f not in FAMILIES]
    if unknown:
        raise ConfigError(f"config error: env.families: unknown family {unknown}; choose from {sorted(FAMILIES)}")
    rng = random.Random(f"{seed}:{split}")
    seen = set(exclude or ())  # questions already used, here or in the other split
    tasks: list[Task] = []
    attempts = 0
    while len(tasks) < n:
        attempts += 1
        if attempts > n * 50:
            raise ValueError(f"could not generate {n} distinct {split} tasks for {families}")
        family = families[len(tasks) % len(families)]
        question, answer, expr = _one_step(family, rng)
        if question in seen:
            continue
        seen.add(question)
        tasks.append(Task(task_id=f"calc-{split}-{len(tasks):05d}", prompt=question, answer=str(answer), split=split,
                          family=family, data={"expression": expr}))
    return tasks


def make_splits(families: list[str], heldout_families: list[str], n_train: int, n_heldout: int, seed: int) -> tuple[list[Task], list[Task]]:
    """Fixed train and held-out splits with no question in both."""
    heldout = generate_tasks(heldout_families, n_heldout, seed, "heldout")
    train = generate_tasks(families, n_train, seed, "train", exclude={t.prompt for t in heldout})
    return train, heldout


def parse_final_answer(text: str) -> str | None:
    match = _ANSWER.search(text)
    if not match:
        return None
    value = float(match.group(1).replace(",", ""))  # the pattern admits only valid numbers, commas aside
    return str(int(value)) if value.is_integer() else str(value)


class CalculatorEnv(Env):
    """One episode at a time. The tool is stateless, so each call leases a sandbox from the pool only
    for its own duration (a program thinking or waiting on the engine holds none); a call that
    crashes or times out returns its sandbox as broken, to be destroyed and replaced."""

    version = ENV_VERSION
    tools = TOOLS

    def __init__(self, pool: EnvPool, *, tool_timeout_s: float = 5.0, crash_rate: float = 0.0,
                 hang_rate: float = 0.0, few_shot: str = "word", rng: random.Random | None = None,
                 step_latency_s: float = 0.0, step_latency_sigma: float = 0.5):
        self.pool = pool
        self.step_latency_s = step_latency_s  # simulated env latency per step (mean of a lognormal)
        self.step_latency_sigma = step_latency_sigma
        self.tool_timeout_s = tool_timeout_s
        self.crash_rate = crash_rate
        self.hang_rate = hang_rate
        self.few_shot = few_shot
        self.rng = rng or random.Random()

    async def reset(self, task: Task) -> Observation:
        messages: list[dict] = [{"role": "system", "content": SYSTEM_PROMPT}]
        for question, expr, result in FEW_SHOT[self.few_shot]:
            messages += [{"role": "user", "content": question}, {"role": "assistant", "content": f"calc({expr})"},
                         {"role": "user", "content": f"Result: {result}"},
                         {"role": "assistant", "content": f"The answer is {result}."}]
        messages.append({"role": "user", "content": task.prompt})
        return Observation(messages=messages, tools=None)

    async def run_tool(self, expression: str) -> str:
        fault = []
        if self.crash_rate > 0 and self.rng.random() < self.crash_rate:
            fault = ["--crash"]
        elif self.hang_rate > 0 and self.rng.random() < self.hang_rate:
            fault = ["--hang"]
        async with self.pool.lease() as sandbox:  # an exception below releases it as broken
            result = await sandbox.exec([sandbox.python, "-I", "-c", TOOL_SOURCE, expression, *fault],
                                        timeout=self.tool_timeout_s)
            if result.timed_out:
                raise ToolTimeout(f"calc({expression}) ran past {self.tool_timeout_s}s and was killed")
            if result.returncode != 0:
                raise EnvCrash(f"calc tool exited with status {result.returncode}: {result.stderr.strip()[-300:]}")
            return result.stdout.strip()

    async def step(self, action: str) -> StepResult:
        if self.step_latency_s > 0:  # simulated: a lognormal wait with the configured mean
            sigma = self.step_latency_sigma
            await asyncio.sleep(self.rng.lognormvariate(math.log(self.step_latency_s) - sigma**2 / 2, sigma))
        answer = parse_final_answer(action)
        calls = parse_tool_calls(action, self.tools)
        if calls and (answer is None or action.find("calc(") < action.lower().find("answer is")):
            call = calls[0]
            info = {"tool_calls": [{"name": call.name, "arguments": call.arguments, "error": call.error}]}
            if call.error:
                return StepResult(observation=[{"role": "user", "content": f"Error: {call.error}"}], info=info)
            output = await self.run_tool(call.arguments.get("expression", ""))
            info["tool_output"] = output
            return StepResult(observation=[{"role": "user", "content": f"Result: {output}"}], info=info)
        # A final answer, or neither a call nor an answer: the episode ends either way.
        return StepResult(observation=[], done=True, info={"final_answer": answer})
