"""Shared helpers for benchmarks: model loading, machine description, result printing."""

from __future__ import annotations

import json
import os
import platform
import statistics
import sys
from typing import Any


def machine() -> str:
    cpus = os.cpu_count()
    try:
        import torch

        threads = torch.get_num_threads()
    except ImportError:
        threads = None
    return f"{platform.machine()} {cpus} cpus, torch threads {threads}, python {platform.python_version()}"


def median(xs: list[float]) -> float:
    return statistics.median(xs)


def report(result: dict[str, Any], as_json: bool) -> None:
    """Human-readable lines, then (with --json) one JSON object as the last line."""
    for key, value in result.items():
        if key in ("arms", "details"):
            continue
        print(f"{key}: {value}")
    if "details" in result:
        for line in result["details"]:
            print(line)
    if as_json:
        print(json.dumps(result), flush=True)
    sys.stdout.flush()
