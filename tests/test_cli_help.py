"""`loomrl --help` speaks to a user: no help text cites a document or ticket the user does not have.

The rule, checked on every help, description and epilog of the real parser and of every subcommand's parser:

- no design section: "section" or "sections" followed by a number ("section 4.3"), or a "§";
- no design document called "the seed": "the seed's" / "the seeds'" / "the seeds", "seed doc(ument)", "seeds/"
  (the random seed, "its own seed", `--seed`, is the ordinary word and stays allowed);
- no issue number: "issue 29", "issue #29", "#29";
- no bare acronym in parentheses standing for a source ("(ROLL)": a help says what a flag does instead); the
  formats and protocols a user knows by their acronym (YAML, JSON, HTTP, ...: KNOWN_ACRONYMS) stay allowed.
A recipe's config sections ("the ray sections") are the user's own and stay allowed.
"""

from __future__ import annotations

import argparse
import re

import pytest

from loomrl.cli import _parser

FORBIDDEN = {
    "design section": re.compile(r"\bsections?\s+\d|§", re.IGNORECASE),
    "the seed document": re.compile(r"\bthe seeds?'|\bthe seeds\b|\bseed\s+doc|\bseeds/", re.IGNORECASE),
    "issue number": re.compile(r"\bissues?\s*#?\d+|#\d+", re.IGNORECASE),
}
KNOWN_ACRONYMS = {"YAML", "JSON", "JSONL", "CSV", "HTTP", "URL", "API", "GPU", "CPU", "CUDA", "SSE"}
CITED_ACRONYM = re.compile(r"\(\s*([A-Z]{2,})\s*\)")


def _texts(parser: argparse.ArgumentParser, path: str):
    """(where, text) for the parser's description and epilog and every action's help, subcommands included."""
    yield f"{path} description", parser.description or ""
    yield f"{path} epilog", parser.epilog or ""
    for action in parser._actions:
        name = "/".join(action.option_strings) or action.dest
        yield f"{path} {name}", action.help or ""
        if isinstance(action, argparse._SubParsersAction):
            for choice in action._choices_actions:
                yield f"{path} {choice.dest} (in the command list)", choice.help or ""
            for sub_name, sub_parser in action.choices.items():
                yield from _texts(sub_parser, f"{path} {sub_name}")


def violations(text: str) -> list[str]:
    """The rules a help text breaks, each with the words that break it."""
    found = [f"{rule}: {m.group(0)!r}" for rule, pattern in FORBIDDEN.items() for m in pattern.finditer(text)]
    return found + [f"cited acronym: {m.group(0)!r}" for m in CITED_ACRONYM.finditer(text)
                    if m.group(1) not in KNOWN_ACRONYMS]


def test_no_help_text_cites_a_design_section_the_seed_or_an_issue():
    found = [f"{where}: {v}" for where, text in _texts(_parser(), "loomrl") for v in violations(text)]
    assert not found, "help texts a user cannot follow:\n" + "\n".join(found)


def test_the_walk_reaches_every_subcommand():
    wheres = {where for where, _ in _texts(_parser(), "loomrl")}
    for command in ("train", "eval", "serve", "validate-tasks", "view", "sandbox run", "estimate-cost", "plan",
                    "check-env"):
        assert f"loomrl {command} description" in wheres, command
    assert "loomrl validate-tasks --judge" in wheres


@pytest.mark.parametrize("text", ["as in section 4.3", "see §4", "the seed's week", "the seeds' numbers",
                                  "from the seed doc", "issue 29", "(issue #29)", "see #44", "judges (ROLL)"])
def test_the_rule_catches(text):
    assert violations(text), text


@pytest.mark.parametrize("text", ["each sampling with its own seed", "the random seed", "--seed N",
                                  "the GPUs (ray sections, devices)", "a recipe's section", "(0: no cap)",
                                  "(default: all)", "exit code 1 if any is invalid",
                                  "a recipe (YAML) to read"])
def test_the_rule_allows(text):
    assert not violations(text), text
