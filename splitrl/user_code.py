"""Where the modules of ``module:function`` names (your reward functions) are imported from.

A reward module usually sits beside the config that names it (``my_rewards.py`` next to
``run.yaml``), but ``splitrl`` is a console script: its ``sys.path`` holds neither that directory
nor the current one, so ``import my_rewards`` failed unless ``PYTHONPATH=.`` was set. Modules are
looked for, in order, in:

1. the directory of each config file given to a ``splitrl`` command (:func:`add_config_dir`;
   kept in ``$SPLITRL_CODE_DIRS``, which the processes a command starts inherit: the services
   ``splitrl up`` launches, the reward service's scoring workers);
2. the current directory;
3. the installed packages (and ``PYTHONPATH``), as Python always does.
"""

from __future__ import annotations

import importlib
import os
import sys
from pathlib import Path
from types import ModuleType

ENV = "SPLITRL_CODE_DIRS"


def add_config_dir(config_path: str | os.PathLike) -> None:
    """Search the directory of ``config_path`` for user modules, in this process and the ones it
    starts (after the directories already there: the config a launcher was given comes before
    the copy it writes into the run directory)."""
    directory = str(Path(config_path).resolve().parent)
    dirs = _env_dirs()
    if directory not in dirs:
        os.environ[ENV] = os.pathsep.join([*dirs, directory])


def _env_dirs() -> list[str]:
    return [d for d in os.environ.get(ENV, "").split(os.pathsep) if d]


def search_dirs() -> list[str]:
    """The directories searched before the installed packages, in order."""
    return list(dict.fromkeys([*_env_dirs(), os.getcwd()]))


def import_user_module(name: str) -> ModuleType:
    """``importlib.import_module(name)`` with :func:`search_dirs` in front of ``sys.path``.

    A module that is nowhere raises ModuleNotFoundError saying where it was looked for (an
    import failing inside the module keeps its own error)."""
    dirs = search_dirs()
    sys.path[:0] = [d for d in dirs if d not in sys.path]
    try:
        return importlib.import_module(name)
    except ModuleNotFoundError as e:
        if e.name is None or not (name == e.name or name.startswith(e.name + ".")):
            raise  # the module was found; something it imports was not
        configs = [d for d in _env_dirs() if d != os.getcwd()]
        where = ([f"{', '.join(configs)} (the config file's directory)"] if configs else [])
        where += [f"{os.getcwd()} (the current directory)", "the installed packages"]
        raise ModuleNotFoundError(f"no module named {e.name!r} in {'; '.join(where)}",
                                  name=e.name) from None
