"""Task review by several LLM judges (ROLL's check before tasks enter training): `loomrl validate-tasks --judge`.

Each judge is asked, for each task, whether the task is well-posed and solvable and its reference solution right, and
answers "Verdict: yes" or "Verdict: no". A task passes when a strict majority of the judges say yes; a reply with no
verdict, or no reply at all (JudgeUnavailable), is an abstention, which counts as no yes (so it cannot pass a task),
recorded per judge with the reply. Several judges are several models, or one model sampled with different seeds at
a temperature above 0 (the --judges flag), each one JudgeClient with its own limits.

What is reviewed (ReviewItem): for codefix tasks the issue and the golden patch as a diff (what the hidden tests
accept); for any other environment's tasks the prompt and the answer its verifier checks.
"""

from __future__ import annotations

import asyncio
import difflib
import re
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Any

from loomrl.reward.judge_client import JudgeClient, JudgeUnavailable

if TYPE_CHECKING:  # openai is the judge extra's
    from openai.types.chat import ChatCompletionMessageParam

VERDICT = re.compile(r"verdict\s*[:=]\s*\**\s*(yes|no)\b", re.IGNORECASE)

REVIEW_PROMPT = """Review a task for a training set. Is the task well-posed (clear, with one right outcome) and \
solvable, and is the reference solution right?

Task: {prompt}
Reference solution: {reference}

Reply with one line: "Verdict: yes" or "Verdict: no"."""

# Worked reviews shown first, as earlier turns: a small judge answers in the format only after them
EXAMPLES = (("What is 12 + 30?", "42", "yes"), ("What is the number I am thinking of?", "7", "no"))


@dataclass(slots=True, kw_only=True)
class ReviewItem:
    """One task as the judges see it."""

    task_id: str
    prompt: str
    reference: str


@dataclass(slots=True, kw_only=True)
class JudgeVote:
    judge: int  # its index among the judges
    model: str
    vote: str  # yes, no, or abstain (no verdict in the reply, or no reply)
    reply: str  # the reply, or why there was none


@dataclass(slots=True, kw_only=True)
class TaskReview:
    task_id: str
    passed: bool  # a strict majority of the judges said yes
    yes: int
    no: int
    abstain: int
    votes: list[JudgeVote] = field(default_factory=list)

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def parse_verdict(reply: str) -> str:
    """yes, no, or abstain (the first "Verdict: yes|no" of the reply)."""
    found = VERDICT.search(reply)
    return found.group(1).lower() if found else "abstain"


def review_messages(item: ReviewItem) -> list[ChatCompletionMessageParam]:
    shots: list[ChatCompletionMessageParam] = []
    for prompt, ref, verdict in EXAMPLES:
        shots.extend([{"role": "user", "content": REVIEW_PROMPT.format(prompt=prompt, reference=ref)},
                      {"role": "assistant", "content": f"Verdict: {verdict}"}])
    return [*shots, {"role": "user", "content": REVIEW_PROMPT.format(prompt=item.prompt, reference=item.reference)}]


async def review_tasks(items: Sequence[ReviewItem], judges: Sequence[JudgeClient], *, temperature: float = 0.0,
                       max_tokens: int = 8, progress=None) -> list[TaskReview]:
    """Every task reviewed by every judge (judge i samples with seed i), concurrently within each judge's limits."""

    async def vote(i: int, judge: JudgeClient, item: ReviewItem) -> JudgeVote:
        try:
            reply = await judge.complete(review_messages(item), max_tokens=max_tokens, temperature=temperature, seed=i)
        except JudgeUnavailable as err:
            return JudgeVote(judge=i, model=judge.model, vote="abstain", reply=f"no reply: {err}")
        return JudgeVote(judge=i, model=judge.model, vote=parse_verdict(reply), reply=reply)

    async def one(item: ReviewItem) -> TaskReview:
        votes = list(await asyncio.gather(*(vote(i, j, item) for i, j in enumerate(judges))))
        yes, no = sum(v.vote == "yes" for v in votes), sum(v.vote == "no" for v in votes)
        if progress is not None:
            progress.update(1)
        return TaskReview(task_id=item.task_id, passed=2 * yes > len(votes), yes=yes, no=no,
                          abstain=len(votes) - yes - no, votes=votes)

    return list(await asyncio.gather(*(one(item) for item in items)))


def codefix_items(specs: Sequence[Any]) -> list[ReviewItem]:
    """codefix tasks (CodefixTask) as the judges see them: the issue, and the golden patch as a unified diff."""
    items = []
    for spec in specs:
        diff = "".join(line for path, fixed in sorted(spec.golden_patch.items()) for line in difflib.unified_diff(
            spec.files.get(path, "").splitlines(keepends=True), fixed.splitlines(keepends=True),
            fromfile=f"a/{path}", tofile=f"b/{path}"))
        items.append(ReviewItem(task_id=spec.task_id, prompt=spec.issue, reference=diff))
    return items
