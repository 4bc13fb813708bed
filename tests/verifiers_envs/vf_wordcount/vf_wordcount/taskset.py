"""The taskset, its tool and its protocol, written as any verifiers 0.4.0 environment is (`import verifiers.v1`).

- data: a dozen sentences, the task asks how many words one has (`answer` is the count);
- tool: `wordcount_count(text)` (a vf.Toolset served over MCP by verifiers; loomrl calls it in process), which also
  counts its calls in the rollout's state;
- protocol (WordcountEnv.run): the task's prompt opens; when the reply carries no <answer> tag, the env asks once
  more (a scripted user turn); a @vf.stop caps the model's turns at 4;
- rubric: `correct` (1 for <answer>N</answer> with the right N), `used_tool` (weight 0.1: read from the state the tool
  wrote) and `concise` (weight 0.01: shorter last replies score more).
"""

from __future__ import annotations

import re

import verifiers.v1 as vf

SENTENCES = [
    "the cat sat on the mat",
    "a quick brown fox jumps",
    "rain falls softly on quiet roofs",
    "we counted every word twice",
    "small models learn slowly",
    "seven lamps lit the long hall",
    "bread rises in a warm oven",
    "the river bends around the hill",
    "birds sing",
    "one two three four five six seven eight",
    "the old clock stopped at noon",
    "tools help agents answer",
]
FOLLOW_UP = "Give your final answer as <answer>NUMBER</answer>."
_ANSWER = re.compile(r"<answer>\s*(\d+)\s*</answer>")


class WordcountState(vf.State):
    tool_calls: int = 0


class WordcountToolset(vf.Toolset[vf.ToolsetConfig, WordcountState]):
    TOOL_PREFIX = "wordcount"

    @vf.tool
    def count(self, text: str) -> int:
        """Count the words of a text (separated by spaces)."""
        self.state.tool_calls += 1
        return len(text.split())


class WordcountData(vf.TaskData):
    answer: str


class WordcountTaskConfig(vf.TaskConfig):
    tools: vf.ToolsetConfig = vf.ToolsetConfig()


class WordcountTask(vf.Task[WordcountData, WordcountState, WordcountTaskConfig]):
    @classmethod
    def toolsets(cls, config: WordcountTaskConfig) -> list[vf.Toolset]:
        return [WordcountToolset(config.tools)]

    @vf.stop
    async def enough(self, trace: vf.Trace) -> bool:
        return trace.num_turns >= 4

    @vf.reward(weight=1.0)
    async def correct(self, trace: vf.Trace) -> float:
        found = _ANSWER.findall(trace.last_reply)
        return float(bool(found) and found[-1] == self.data.answer)

    @vf.reward(weight=0.1)
    async def used_tool(self, trace: vf.Trace) -> float:
        return float(trace.state.tool_calls > 0)

    @vf.reward(weight=0.01)
    async def concise(self, trace: vf.Trace) -> float:
        # a little shaping: it also gives a random policy's groups (the tests' tiny model) a reward to tell apart
        return 1.0 / (1 + len(trace.last_reply.split()))


class WordcountConfig(vf.TasksetConfig):
    task: WordcountTaskConfig = WordcountTaskConfig()
    repeat: int = 1
    """How many times the sentences are listed (more tasks, same content)."""


class WordcountTaskset(vf.Taskset[WordcountTask, WordcountConfig]):
    def load(self) -> list[WordcountTask]:
        sentences = SENTENCES * self.config.repeat
        return [
            WordcountTask(
                WordcountData(
                    prompt=f'How many words are in "{s}"? Call the wordcount_count tool, then answer with '
                    "<answer>NUMBER</answer>.",
                    system_prompt="You count words. Use the tool when you can.",
                    answer=str(len(s.split())),
                ),
                self.config.task,
            )
            for s in sentences
        ]


class WordcountEnv(vf.SingleAgentEnv):
    """One seat; the env asks once more when the reply has no <answer> tag."""

    async def run(self, task, agents):
        async with agents.agent.interaction(task) as chat:
            segment = await chat.turn()
            if not segment.terminated and not _ANSWER.search(segment.last_reply):
                await chat.turn(FOLLOW_UP)


async def needs_runtime(task, trace, runtime) -> float:
    """A reward that reads the rollout's box: the tests plug it in (taskset.task.rewards) to see it refused."""
    result = await runtime.run(["true"], {})
    return float(result.exit_code == 0)
