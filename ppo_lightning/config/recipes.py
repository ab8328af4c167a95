"""Where a task's code is and where its build is cached: ``recipe=<name>``, ``${recipe_dir:<name>}``.

A task is one folder with a ``task.py`` (``jobs.task.Task``). ``recipe=arithmetic`` names a folder
of the package (``ppo_lightning/tasks/arithmetic/``, the choices in ``choices.RECIPES``);
``recipe=my_pkg.countdown`` names a package of your own, a copy of one of those folders anywhere
on the Python path. Nothing here imports a task: its folder is found on disk (``find_spec`` of
the top-level package only), so the config layer stays below the tasks.

A build is cached under ``<paths.cache_dir>/<leaf>-<key>``, the key a hash of everything that
decides what the build writes: the task folder's source files, the shared task code
(``tasks/common.py``, ``tasks/tokenizers.py``) and the seed. An edited task or another seed
builds anew; an unchanged one finds its build.
"""

from __future__ import annotations

import hashlib
import importlib.util
from pathlib import Path

from ppo_lightning.config import choices
from ppo_lightning.config.errors import ConfigError

SHARED_SOURCES = tuple(choices.TASKS_DIR / f for f in ("common.py", "tokenizers.py"))
"""The task code every build runs besides its own folder's (part of every cache key)."""


def task_module(name: str) -> str:
    """The module that implements task ``name``: ``ppo_lightning.tasks.<name>.task`` for a folder
    of the package, ``<name>.task`` for a dotted package path."""
    return f"{name}.task" if "." in name else f"ppo_lightning.tasks.{name}.task"


def task_dir(name: str) -> Path:
    """The folder of task ``name``; a name that is neither a folder of ``ppo_lightning/tasks`` nor
    a package holding a ``task.py`` fails, naming the choices."""
    if "." not in name:
        if name in choices.RECIPES:
            return choices.TASKS_DIR / name
        raise ConfigError(
            f"recipe={name!r}: choose one of {list(choices.RECIPES)}, a package of your own that holds a "
            "task.py (recipe=my_pkg.my_task: a copy of ppo_lightning/tasks/arithmetic), or null"
        )
    top, *rest = name.split(".")
    spec = importlib.util.find_spec(top)
    locations = list(spec.submodule_search_locations or []) if spec is not None else []
    for location in locations:
        folder = Path(location).joinpath(*rest)
        if (folder / "task.py").is_file():
            return folder
    raise ConfigError(
        f"recipe={name!r}: no {'/'.join(name.split('.'))}/task.py on the Python path "
        f"(searched {locations or 'nothing: no package ' + repr(top)}); a task is a package that holds a "
        "task.py (copy ppo_lightning/tasks/arithmetic)"
    )


def _source_digest(folder: Path) -> str:
    h = hashlib.sha256()
    for path in sorted(folder.rglob("*.py")) + list(SHARED_SOURCES):
        if "__pycache__" not in path.parts:
            h.update(path.name.encode() + b"\0" + path.read_bytes() + b"\0")
    return h.hexdigest()


def recipe_root(cache_dir: str | Path, name: str, seed: int) -> Path:
    """Where task ``name`` builds its models and prompts for ``seed``: keyed by the task's sources
    and the seed (the module docstring), so no run reuses a build that another code or seed made."""
    digest = hashlib.sha256(f"{_source_digest(task_dir(name))}:seed={seed}".encode()).hexdigest()
    return Path(cache_dir) / f"{name.rsplit('.', 1)[-1]}-{digest[:12]}"
