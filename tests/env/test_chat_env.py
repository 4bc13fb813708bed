"""The chat environment (loomrl/env/tasks/chat.py): final answers read in each form, compared as numbers or text,
and a dataset task's own opening messages kept."""

from __future__ import annotations

import asyncio
import random

import pytest

from loomrl.env.api import EpisodeContext
from loomrl.env.tasks.chat import ChatArgs, ChatEnvironment, answers_match, extract_answer
from loomrl.types import Task, Trajectory


@pytest.mark.parametrize(("form", "text", "answer"), [
    ("last_number", "3 bags of 4 is 12, so 1,200 in all.", "1200"),
    ("last_number", "no number here", None),
    ("hash", "4 + 5 = 9\n#### 9", "9"),
    ("hash", "it is 9", None),
    ("boxed", r"so \boxed{\frac{1}{2}} and \boxed{x^{2}}", "x^{2}"),
    ("answer_is", "I think the answer is: Paris.", "Paris"),
    ("answer_tag", "<think>maybe <answer>3</answer></think>so <answer>4</answer> then <answer> 5 </answer>", "5"),
    ("answer_tag", "it is 5", None),
    ("text", "  <think>hmm</think> Paris \n", "Paris"),
    ("last_number", "<think>maybe 3</think>It is 4", "4"),
])
def test_answers_are_read_in_each_form(form, text, answer):
    assert extract_answer(text, form) == answer


def test_answers_match_as_numbers_or_text():
    assert answers_match("42.0", "42") and answers_match("1,200", "1200") and answers_match("paris", "Paris ")
    assert not answers_match(None, "42") and not answers_match("41", "42") and not answers_match("Rome", "Paris")


def test_a_task_with_its_own_messages_keeps_them_and_is_scored_by_the_environment():
    env = ChatEnvironment(ChatArgs(answer_format="hash", system_prompt="Be brief."))
    episode = env.episode(EpisodeContext(pool=None, rng=random.Random(0), tool_timeout_s=1.0))
    own = Task(task_id="a", prompt="2+2?", answer="4", messages=[{"role": "system", "content": "Data's own."},
                                                                {"role": "user", "content": "2+2?"}])
    plain = Task(task_id="b", prompt="3+3?", answer="6")

    async def go():
        return await episode.reset(own), await episode.reset(plain), await episode.step("2+2=4\n#### 4")

    a, b, step = asyncio.run(go())
    assert a.messages == own.messages
    assert b.messages == [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "3+3?"}]
    assert step.done and step.info["final_answer"] == "4"
    traj = Trajectory(task_id="a", trajectory_id="t", group_id="g", final_answer="4.0")
    assert env.success(traj, own) and env.reward(traj, own) == {"correct": 1.0}
    assert not env.brings_tasks  # its tasks come from a data: section
