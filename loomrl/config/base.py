"""What every section shares: ConfigError, the Section base (unknown fields refused, assignments validated) and the device type."""

from __future__ import annotations

import re
from typing import Annotated

from pydantic import AfterValidator, BaseModel, ConfigDict


class ConfigError(ValueError):
    """A bad recipe or override; the message is meant to be shown to the user as it is."""


class Section(BaseModel):
    # attribute docstrings: each field's docstring is its description (docs/configuration.md is made from them)
    model_config = ConfigDict(extra="forbid", validate_assignment=True, use_attribute_docstrings=True)


def device_name(value: str) -> str:
    if value in ("auto", "cpu", "cuda") or re.fullmatch(r"cuda:\d+", value):
        return value
    raise ValueError(f"{value!r} is not a device; use auto, cpu, cuda or cuda:N (N: the GPU's index)")


# auto (cuda when torch.cuda.is_available(), else cpu), cpu, cuda, cuda:N; whether this machine has it is checked
# when the config is loaded (local runs) and where the model is loaded (loomrl/devices.py)
Device = Annotated[str, AfterValidator(device_name)]
