"""What a recipe names by "package.module:attribute": a user's reward function, an environment factory.

One lookup for every such setting, so that each fails the same way: a ConfigError of one line saying what failed,
where Python looked, and how to write it. Modules are found on sys.path with the current directory on it (last: a
file there never shadows an installed module; `python -m loomrl` has it there already, the `loomrl` script does not),
then the recipe's folder (`search_beside`: a recipe's code is found where its data files are, whichever folder the run
is started from).
"""

from __future__ import annotations

import importlib
import os
import sys
from typing import Any

from loomrl.config import ConfigError
from loomrl.errors import folded


def _on_sys_path(folder: str) -> None:
    if folder not in {os.path.abspath(p) for p in sys.path}:
        sys.path.append(folder)


def search_beside(recipe: str | os.PathLike[str] | None) -> None:
    """Put the recipe's folder on sys.path after the current directory, and on PYTHONPATH for the run's child
    processes (the trainer process, reward workers, Ray actors: runtime/ray_resources.py forwards it), so that
    `reward.function: my_rewards:score` finds my_rewards.py beside the recipe as data.path finds its files there."""
    if recipe is None:
        return
    folder = os.path.dirname(os.path.abspath(recipe))
    _on_sys_path(os.getcwd())
    _on_sys_path(folder)
    paths = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    if folder not in paths:
        os.environ["PYTHONPATH"] = os.pathsep.join([*paths, folder])


def import_object(spec: str, field: str, example: str, what: str = "attribute") -> Any:
    """The attribute `spec` ("package.module:attribute") names, for the recipe setting `field`; `example` shows a
    correct value (e.g. "reward.function=my_rewards:score for a file my_rewards.py there defining score(...)"); `what` the
    kind of thing named (function, Factory)."""
    cwd = os.getcwd()
    _on_sys_path(cwd)
    module_name, _, attr = spec.partition(":")
    looked = (f"modules are imported with the current directory ({cwd}), then PYTHONPATH "
              f"({os.environ.get('PYTHONPATH') or 'unset'}: `loomrl` adds the recipe's folder) on sys.path; give "
              f"package.module:{what}, e.g. {example}")
    if not module_name or not attr:
        raise ConfigError(f"config error: {field}: expected 'package.module:{what}', got {spec!r}; {looked}")
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as err:
        if err.name is not None and (module_name == err.name or module_name.startswith(f"{err.name}.")):
            raise ConfigError(f"config error: {field}={spec}: no module named {err.name!r}; {looked}") from None
        raise ConfigError(f"config error: {field}={spec}: importing {module_name!r} failed: {err} (an import "
                          f"inside it; install that package)") from None
    except Exception as err:  # its own code failed (a SyntaxError, an exception at import time)
        raise ConfigError(f"config error: {field}={spec}: importing {module_name!r} raised "
                          f"{type(err).__name__}: {folded(str(err))}") from None
    obj: Any = module
    for part in attr.split("."):  # module:Class.factory works too
        try:
            obj = getattr(obj, part)
        except AttributeError:
            where = module.__spec__.origin if module.__spec__ and module.__spec__.origin else "a namespace package"
            raise ConfigError(f"config error: {field}={spec}: module {module_name!r} ({where}) has no "
                              f"attribute {attr!r}; {looked}") from None
    if not callable(obj):
        raise ConfigError(f"config error: {field}={spec}: {attr!r} in {module_name!r} is not callable")
    return obj
