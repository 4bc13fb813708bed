"""Calculator task family: arithmetic word problems solved over several turns with a calculator tool.

Tasks are generated from a seed into fixed, disjoint train and held-out splits. The agent calls the
tool as `calc(EXPRESSION)`; the tool runs in a sandboxed subprocess with a timeout; the env answers
`Result: VALUE` and the agent ends with `The answer is NUMBER.`

Families (one or two arithmetic steps, word problems or bare expressions):
  add, sub, mul, div         one-step word problems (one or two templates each)
  add_sub, add_add, mul_add  two-step word problems
  distract_add/_sub/_mul     one step with a distracting quantity, 16 templates each
  expr                       a bare two-number expression ("What is 37 + 48?")

Each task records its template (`family/index`); env/registry.template_splits holds a share of each
family's templates out of training. Not covered: word numbers ("fifteen"), answers that need more than
one call, or problems with no distractor in the distract_* families.
"""

from __future__ import annotations

import asyncio
import math
import random
import re
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from loomrl.config import ConfigError
from loomrl.env.api import Environment, EpisodeContext, TaskSetup, opening_messages
from loomrl.env.base import Env, EnvCrash, Observation, StepResult, ToolTimeout
from loomrl.env.pool import Leases
from loomrl.env.registry import template_splits
from loomrl.model.tools import parse_tool_calls
from loomrl.reward.calculator import calculator_reward
from loomrl.types import Task, Trajectory

ENV_VERSION = "calculator-v1"

SYSTEM_PROMPT = (
    "You are a helpful assistant with a calculator. To use it, reply with only calc(EXPRESSION). "
    "After you get the result, reply with: The answer is NUMBER."
)
# Worked examples shown as earlier chat turns (a 135M model needs them to use the tool at all).
# "word" starts with a one-step word problem, "bare" shows bare expressions only, "distract" one word
# problem of each operation with a quantity to leave out, in phrasings no template uses (so that none is
# shown to the model before it is held out).
FEW_SHOT = {
    "none": [],
    "bare": [("What is 14 + 9?", "14 + 9", "23"), ("What is 6 * 7?", "6 * 7", "42")],
    "word": [("Ben has 14 pens and gets 9 more. How many pens does Ben have now?", "14 + 9", "23"),
             ("What is 6 * 7?", "6 * 7", "42")],
    "distract": [
        ("A jar holds 15 red beads and 8 blue beads, and a cup holds 30 beads. How many beads are in the jar?",
         "15 + 8", "23"),
        ("Out of 42 balloons at a party, 17 popped. The party had 9 guests. How many balloons did not pop?",
         "42 - 17", "25"),
        ("A bus is 11 meters long and has 7 rows of 4 seats. How many seats does the bus have?", "7 * 4", "28")],
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

_NAMES = ["Tom", "Ana", "Sam", "Lia", "Max", "Eva", "Ben", "Mia", "Leo", "Zoe", "Raj", "Ines", "Omar", "Yuki",
          "Nora", "Ivan", "Kofi", "Lena", "Pablo", "Hana"]
_ITEMS = ["apples", "pens", "books", "coins", "cards", "stamps", "shells", "marbles", "stickers", "cookies", "pencils",
          "oranges", "eggs", "candles", "buttons", "beads", "rocks", "balloons", "tickets", "cupcakes", "plums",
          "crayons", "postcards", "seeds", "keys", "bottles", "muffins", "blocks", "ribbons", "lemons"]
_BOXES = [("bag", "bags"), ("box", "boxes"), ("jar", "jars"), ("basket", "baskets"), ("crate", "crates"),
          ("pack", "packs"), ("tray", "trays"), ("tin", "tins"), ("bucket", "buckets"), ("carton", "cartons")]

# The distract_* families: one step on {a} and {b}, with a distracting quantity {d} placed before, between or
# after them, or in the question, of another item {y}, of the same item {x} owned by someone else {m}, or of
# another kind (an age, a price, a count of chapters). Many phrasings each, so that a split by template
# (env.heldout_template_share) holds out whole phrasings, not just numbers. Some templates bring their own
# nouns and units (meters, dollars, pages). {n} is a name, {g}/{gs} a container, singular/plural.
_ADD = [
    "{n} has {a} {x} and {d} {y}. {n} gets {b} more {x}. How many {x} does {n} have now?",
    "{n} had {a} {x}. Then {n} found {b} more {x} and {d} {y}. How many {x} does {n} have?",
    "There are {a} {x} and {d} {y} in a box. {n} puts {b} more {x} in the box. How many {x} are in the box?",
    "{n} collected {a} {x} on Monday and {b} {x} on Tuesday. {m} collected {d} {x}. How many {x} did {n} collect "
    "in total?",
    "How many {x} does {n} have after buying {b} more, if {n} started with {a} {x} and {d} {y}?",
    "{m} gives {n} {b} {x}. Before that, {n} had {a} {x}. {m} still has {d} {x}. How many {x} does {n} have now?",
    "A shop had {a} {x} and {d} {y}. A delivery brought {b} more {x}. How many {x} does the shop have now?",
    "{n} is {d} years old and owns {a} {x}. For a birthday, {n} receives {b} {x}. How many {x} does {n} own now?",
    "{n} keeps {a} {x} in one drawer and {b} {x} in another. There are {d} {y} on the desk. How many {x} are in "
    "the two drawers altogether?",
    "{n} and {m} put their {x} together: {n} brings {a} and {m} brings {b}. {m} also brings {d} {y}. How many "
    "{x} do they have together?",
    "{n} had {a} {x} before the fair. At the fair {n} won {b} {x} and {d} {y}. How many {x} does {n} have after "
    "the fair?",
    "A class has {a} {x}. The teacher adds {b} {x}. The class also has {d} {y}. What is the total number of {x} "
    "now?",
    "{n} saved {a} {x} last week, {d} {y} yesterday, and {b} {x} today. How many {x} has {n} saved?",
    "{d} {y} and {a} {x} are on a table. {n} adds {b} {x}. How many {x} are on the table?",
    "A rope is {a} meters long. {n} ties on another {b} meters of rope. A second rope is {d} meters long. How "
    "long is the first rope now, in meters?",
    "{n} paid {a} dollars for a coat and {b} dollars for boots, and has {d} dollars left. How many dollars did "
    "{n} spend?",
]
_SUB = [
    "{n} has {a} {x} and {d} {y}. {n} gives away {b} {x}. How many {x} are left?",
    "There are {a} {x} in a box and {d} {y} next to it. {n} takes {b} {x} out of the box. How many {x} remain "
    "in the box?",
    "{n} had {a} {x}. {n} lost {b} of them and found {d} {y}. How many {x} does {n} have now?",
    "A baker made {a} {x} and {d} {y}. {b} of the {x} were sold. How many {x} were not sold?",
    "How many {x} does {n} have left after using {b}, if {n} had {a} {x} and {d} {y}?",
    "{n} owns {a} {x}. {m} owns {d} {x}. {n} gives {b} {x} to a friend. How many {x} does {n} own now?",
    "{n} is {d} years old. {n} had {a} {x} and sold {b} of them. How many {x} does {n} still have?",
    "A shelf holds {a} {x}. {n} removes {b} {x} and puts {d} {y} on it. How many {x} are on the shelf now?",
    "{n} needs {a} {x} and already has {b}. {n} also has {d} {y}. How many more {x} does {n} need?",
    "Of the {a} {x} in a jar, {b} are taken by {n}. The jar also holds {d} {y}. How many {x} are still in the "
    "jar?",
    "{n} has {a} {x}, more than {m}, who has {b} {x}. {n} also has {d} {y}. How many more {x} does {n} have "
    "than {m}?",
    "{b} of {n}'s {a} {x} were lost. {n} also has {d} {y}. How many {x} does {n} have left?",
    "A library had {a} {x}. It gave {b} {x} to a school and bought {d} {y}. How many {x} does the library have "
    "now?",
    "{n} had {a} {x} and gave {b} of them to {m}. {m} already had {d} {y}. How many {x} does {n} have left?",
    "A tank holds {a} liters of water. {n} pours out {b} liters. A second tank holds {d} liters. How many "
    "liters are in the first tank now?",
    "{n} has {a} dollars and {d} {y}. A game costs {b} dollars. How many dollars will {n} have after buying "
    "the game?",
]
_MUL = [
    "{n} has {d} {y}. {n} buys {a} {gs} with {b} {x} in each {g}. How many {x} does {n} buy?",
    "There are {a} {gs}. Each {g} holds {b} {x}. There are also {d} {y}. How many {x} are in the {gs}?",
    "Each of {a} {gs} has {b} {x}. {n} also keeps {d} {y}. How many {x} are in the {gs}?",
    "{n} packs {b} {x} into each of {a} {gs} and puts {d} {y} aside. How many {x} did {n} pack?",
    "{d} {y} lie on the floor. How many {x} are in {a} {gs} if every {g} contains {b} {x}?",
    "{n} buys {a} {gs} of {x} for {d} dollars. Each {g} contains {b} {x}. How many {x} did {n} buy?",
    "A hall has {a} rows of chairs with {b} chairs in each row, and {d} tables. How many chairs are in the hall?",
    "{n} reads {b} pages every day for {a} days. The book has {d} chapters. How many pages does {n} read?",
    "{n} walks {b} kilometers a day. {n} is {d} years old. How many kilometers does {n} walk in {a} days?",
    "{n} earns {b} dollars an hour and works {a} hours. {n} spends {d} dollars on lunch. How many dollars does "
    "{n} earn?",
    "{n} fills {a} {gs} with {b} {x} each, and {m} fills one {g} with {d} {x}. How many {x} did {n} put in the "
    "{gs}?",
    "{a} friends each bring {b} {x} to a party, and {n} brings {d} {y}. How many {x} do the friends bring?",
    "A farmer plants {a} rows of trees with {b} trees in each row. {d} birds sit on the fence. How many trees "
    "did the farmer plant?",
    "{n} has {a} {gs}. There are {b} {x} in every {g}, and {d} {y} on the shelf. How many {x} does {n} have in "
    "the {gs}?",
    "{b} {x} fit in one {g}. {n} fills {a} {gs} and has {d} {y} left over. How many {x} are in the filled {gs}?",
    "{n} buys {a} packs of {x} at {d} dollars each. Each pack has {b} {x}. How many {x} does {n} get?",
]


# Each family: the numbers it draws, in order, as (name, low, high), and its (question, expression)
# templates; the answer is the expression's value. {n} is a name, {it} an item, {ab} is a * b (old
# families), or as above (distract_*). A task's template is one of those its split allows.
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
    # the distractor {d} overlaps the operands' ranges, so its size does not give it away
    "distract_add": ([("a", 10, 99), ("b", 5, 60), ("d", 5, 60)], [(q, "{a} + {b}") for q in _ADD]),
    "distract_sub": ([("a", 30, 99), ("b", 5, 29), ("d", 5, 60)], [(q, "{a} - {b}") for q in _SUB]),
    "distract_mul": ([("a", 3, 12), ("b", 3, 15), ("d", 3, 30)], [(q, "{a} * {b}") for q in _MUL]),
}


def check_families(families: list[str], field: str = "env.families") -> None:
    """Refuse names that are not calculator families: one line naming `field`, the bad names and the choices."""
    unknown = [f for f in families if f not in FAMILIES]
    if unknown:
        raise ConfigError(f"config error: {field}: unknown calculator family {', '.join(map(repr, unknown))}; "
                          f"choose from {', '.join(sorted(FAMILIES))}")


def template_ids(families: list[str]) -> dict[str, list[str]]:
    """Each family's template ids, `family/index`."""
    check_families(families)
    return {f: [f"{f}/{i}" for i in range(len(FAMILIES[f][1]))] for f in families}


def _one_step(kind: str, template: int, rng: random.Random) -> tuple[str, int, str]:
    """A (question, answer, expression) of family `kind` with its template number `template`, drawn from `rng`."""
    draws, templates = FAMILIES[kind]
    question, expr = templates[template]
    values = {"n": rng.choice(_NAMES), "it": rng.choice(_ITEMS)}
    values["m"] = rng.choice([name for name in _NAMES if name != values["n"]])
    values["x"], values["y"] = rng.sample(_ITEMS, 2)
    values["g"], values["gs"] = rng.choice(_BOXES)
    for name, low, high in draws:
        values[name] = rng.randint(low, high)
    while values.get("d") in (values["a"], values["b"]):  # a distractor equal to an operand would be no distractor
        values["d"] = rng.randint(*next((low, high) for name, low, high in draws if name == "d"))
    values["ab"] = values["a"] * values["b"]
    expr = expr.format(**values)
    return question.format(**values), int(eval(expr)), expr  # every answer is a whole number


def generate_tasks(families: list[str], n: int, seed: int, split: str, exclude: set[str] | None = None,
                   templates: dict[str, list[str]] | None = None) -> list[Task]:
    """`n` tasks cycling through `families`, reproducible from (seed, split); none in `exclude`. `templates`:
    the template ids each family may use (default: all); families with none are left out (all: no tasks)."""
    check_families(families)
    allowed = templates if templates is not None else template_ids(families)
    usable = [f for f in families if allowed.get(f)]
    if not usable:  # only a held-out-templates split can have none (a family keeps a training template)
        return []
    rng = random.Random(f"{seed}:{split}")
    seen = set(exclude or ())  # questions already used, here or in the other split
    tasks: list[Task] = []
    attempts = 0
    while len(tasks) < n:
        attempts += 1
        if attempts > n * 50:
            raise ValueError(f"could not generate {n} distinct {split} tasks for {families}")
        family = usable[len(tasks) % len(usable)]
        template = rng.choice(allowed[family])
        question, answer, expr = _one_step(family, int(template.rsplit("/", 1)[1]), rng)
        if question in seen:
            continue
        seen.add(question)
        tasks.append(Task(task_id=f"calc-{split}-{len(tasks):05d}", prompt=question, answer=str(answer), split=split,
                          family=family, data={"expression": expr, "template": template}))
    return tasks


def make_splits(families: list[str], heldout_families: list[str], n_train: int, n_heldout: int, seed: int,
                heldout_template_share: float = 0.0) -> tuple[list[Task], list[Task]]:
    """Fixed train and held-out splits with no question in both; with `heldout_template_share`, also a
    `heldout_templates` split on templates training never uses (see registry.template_splits)."""
    check_families(families)  # before any lookup by name: an unknown one is the user's typo, not a KeyError
    check_families(heldout_families, "env.args.heldout_families")
    return template_splits(lambda split, n, templates, exclude: generate_tasks(
        families if split == "train" else heldout_families, n, seed, split, exclude, templates),
        template_ids(sorted(set(families) | set(heldout_families))), n_train, n_heldout, seed, heldout_template_share)


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

    def __init__(self, pool: Leases, *, tool_timeout_s: float = 5.0, crash_rate: float = 0.0,
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
        shots: list[dict] = []
        for question, expr, result in FEW_SHOT[self.few_shot]:
            shots += [{"role": "user", "content": question}, {"role": "assistant", "content": f"calc({expr})"},
                      {"role": "user", "content": f"Result: {result}"},
                      {"role": "assistant", "content": f"The answer is {result}."}]
        return Observation(messages=opening_messages(task, SYSTEM_PROMPT, shots), tools=None)

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
            if output.startswith("Error:"):  # a well-formed call the tool could not evaluate
                info["tool_calls"][0]["tool_error"] = output
            return StepResult(observation=[{"role": "user", "content": f"Result: {output}"}], info=info)
        # A final answer, or neither a call nor an answer: the episode ends either way.
        return StepResult(observation=[], done=True, info={"final_answer": answer})


# -- the environment, on the public API (env/api.py) --------------------------------------------------------------
DEFAULT_FAMILIES = ["add", "sub", "mul"]


class CalculatorArgs(BaseModel):
    """env.args of env.name=calculator."""

    model_config = ConfigDict(extra="forbid")
    heldout_families: list[str] | None = None  # default: the same as env.families
    crash_rate: float = Field(0.0, ge=0.0, le=1.0)  # fault injection: a tool call crashes its process
    hang_rate: float = Field(0.0, ge=0.0, le=1.0)  # fault injection: a tool call hangs until its timeout
    # simulated environment latency (benchmarks): every env step first waits a lognormal time with this
    # mean and sigma (of the underlying normal); 0 = none. Declared wherever a result uses it.
    step_latency_s: float = Field(0.0, ge=0.0)
    step_latency_sigma: float = Field(0.5, ge=0.0)
    few_shot: Literal["none", "bare", "word", "distract"] = "word"  # worked examples shown before the task
    correct: float = 1.0  # the reward of a correct final answer
    format_weight: float = Field(0.1, ge=0.0)  # weight of the format term (reward/calculator.py)


class CalculatorEnvironment(Environment):
    """Arithmetic word problems with a calculator tool that runs in a pool sandbox, one lease per call."""

    Args = CalculatorArgs
    version = ENV_VERSION
    sandbox = "call"

    def __init__(self, args: CalculatorArgs):
        self.args = args

    def check(self, setup: TaskSetup) -> None:
        check_families(setup.families or [])
        check_families(self.args.heldout_families or [], "env.args.heldout_families")

    def tasks(self, setup: TaskSetup) -> tuple[list[Task], list[Task]]:
        families = setup.families or DEFAULT_FAMILIES
        return make_splits(families, self.args.heldout_families or families, setup.n_train, setup.n_heldout,
                           setup.seed, setup.heldout_template_share)

    def episode(self, ctx: EpisodeContext) -> Env:
        a = self.args
        assert ctx.pool is not None, "sandbox = 'call': the run gives a pool"
        return CalculatorEnv(ctx.pool, tool_timeout_s=ctx.tool_timeout_s, crash_rate=a.crash_rate,
                             hang_rate=a.hang_rate, few_shot=a.few_shot, rng=ctx.rng, step_latency_s=a.step_latency_s,
                             step_latency_sigma=a.step_latency_sigma)

    def reward(self, traj: Trajectory, task: Task) -> dict[str, float]:
        return calculator_reward(traj, task, correct=self.args.correct, format_weight=self.args.format_weight)

    def answer_of(self, text: str) -> str | None:
        return parse_final_answer(text)
