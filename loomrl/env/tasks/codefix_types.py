"""The record of one SWE-style codefix task: a small repository with a bug, the issue a user filed,
hidden tests, and the golden patch that makes them pass."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True, slots=True, kw_only=True)
class CodefixTask:
    task_id: str  # unique, e.g. "codefix-clamp-1"
    family: str  # the bug template it comes from, e.g. "clamp"
    issue: str  # what the agent is told: the symptom, as a user would report it (never the fix)
    files: dict[str, str]  # repository: relative path -> content (the buggy state)
    golden_patch: dict[str, str]  # relative path -> the fixed file's whole content
    hidden_tests: dict[str, str]  # relative path -> content; unittest files, run as `python3 -m unittest`
    # Declared perturbations for diversity, any of:
    #   {"env": {"NAME": "value"}}              environment variables set for every command
    #   {"disable_tools": ["bash"]}             tools the agent does not get
    #   {"layout": "src"}                      the repository lives under src/ instead of the workdir root
    #   {"broken_dependency": "module_name"}   an importable module of that name that raises when imported
    perturbations: dict = field(default_factory=dict)
