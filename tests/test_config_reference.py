"""docs/configuration.md is made from the config package's field docstrings (scripts/config_reference.py): every field
has one, and the file in the repository is the one the code makes now."""

from __future__ import annotations

import importlib.util
from pathlib import Path

from pydantic import BaseModel, ConfigDict

from loomrl.config import RunConfig

ROOT = Path(__file__).resolve().parents[1]


def _generator():
    spec = importlib.util.spec_from_file_location("config_reference", ROOT / "scripts" / "config_reference.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def undocumented(model: type[BaseModel], prefix: str = "") -> list[str]:
    out = []
    for name, field in model.model_fields.items():
        sub, _, _ = _generator().model_of(field.annotation)
        if sub is not None:
            out += undocumented(sub, f"{prefix}{name}.")
        elif not field.description:
            out.append(f"{prefix}{name}")
    return out


class Partly(BaseModel):
    model_config = ConfigDict(use_attribute_docstrings=True)

    documented: int = 0
    """what it does"""
    bare: int = 1


def test_every_field_of_a_recipe_is_documented():
    assert undocumented(RunConfig) == []

    assert undocumented(Partly) == ["bare"]  # the check can fail


def test_the_configuration_reference_is_current():
    made = _generator().reference()
    assert (ROOT / "docs" / "configuration.md").read_text() == made, (
        "docs/configuration.md is stale: run python scripts/config_reference.py")
