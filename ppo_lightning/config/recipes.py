"""Where a recipe's code is and where its build is cached: ``recipe=<name>``, ``${recipe_dir:<name>}``.

A recipe is one folder with a ``recipe.py`` (``jobs.recipe.Recipe``). ``recipe=arithmetic`` names
a folder of the package (``ppo_lightning/recipes/arithmetic/``, the choices in
``choices.RECIPES``); ``recipe=my_pkg.countdown`` names a package of your own, a copy of one of
those folders anywhere on the Python path. Nothing here imports a recipe: its folder is found on
disk (``find_spec`` of the top-level package only), so the config layer stays below the recipes.

A build is cached under ``<paths.cache_dir>/<leaf>-<key>``, the key a hash of everything that
decides what the build writes: the recipe folder's source files, the shared recipe code
(``recipes/common.py``, ``recipes/tokenizers.py``) and the seed. An edited recipe or another seed
builds anew; an unchanged one finds its build.
"""

from __future__ import annotations

import hashlib
import importlib.util
from pathlib import Path

from ppo_lightning.config import choices
from ppo_lightning.config.errors import ConfigError

SHARED_SOURCES = tuple(choices.RECIPES_DIR / f for f in ("common.py", "tokenizers.py"))
"""The recipe code every build runs besides its own folder's (part of every cache key)."""

OLD_MODULE = "task.py"
"""What a recipe's module was called before ``recipe.py``: a folder that still holds it is named
in the error, with the new name."""


def recipe_module(name: str) -> str:
    """The module that implements recipe ``name``: ``ppo_lightning.recipes.<name>.recipe`` for a
    folder of the package, ``<name>.recipe`` for a dotted package path."""
    return f"{name}.recipe" if "." in name else f"ppo_lightning.recipes.{name}.recipe"


def recipe_folder(name: str) -> Path:
    """The folder of recipe ``name``; a name that is neither a folder of ``ppo_lightning/recipes``
    nor a package holding a ``recipe.py`` fails, naming the choices (or the ``task.py`` to
    rename)."""
    if "." not in name:
        if name in choices.RECIPES:
            return choices.RECIPES_DIR / name
        _refuse_old_module(name, choices.RECIPES_DIR / name)
        raise ConfigError(
            f"recipe={name!r}: choose one of {list(choices.RECIPES)}, a package of your own that holds a "
            "recipe.py (recipe=my_pkg.my_recipe: a copy of ppo_lightning/recipes/arithmetic), or null"
        )
    top, *rest = name.split(".")
    spec = importlib.util.find_spec(top)
    locations = list(spec.submodule_search_locations or []) if spec is not None else []
    for location in locations:
        folder = Path(location).joinpath(*rest)
        if (folder / "recipe.py").is_file():
            return folder
        _refuse_old_module(name, folder)
    raise ConfigError(
        f"recipe={name!r}: no {'/'.join(name.split('.'))}/recipe.py on the Python path "
        f"(searched {locations or 'nothing: no package ' + repr(top)}); a recipe is a package that holds a "
        "recipe.py (copy ppo_lightning/recipes/arithmetic)"
    )


def _refuse_old_module(name: str, folder: Path) -> None:
    if (folder / OLD_MODULE).is_file():
        raise ConfigError(
            f"recipe={name!r}: {folder / OLD_MODULE} is a recipe's module under its old name; rename it recipe.py"
        )


def _source_digest(folder: Path) -> str:
    h = hashlib.sha256()
    for path in sorted(folder.rglob("*.py")) + list(SHARED_SOURCES):
        if "__pycache__" not in path.parts:
            h.update(path.name.encode() + b"\0" + path.read_bytes() + b"\0")
    return h.hexdigest()


def recipe_root(cache_dir: str | Path, name: str, seed: int) -> Path:
    """Where recipe ``name`` builds its models and prompts for ``seed``: keyed by the recipe's
    sources and the seed (the module docstring), so no run reuses a build that another code or seed
    made."""
    digest = hashlib.sha256(f"{_source_digest(recipe_folder(name))}:seed={seed}".encode()).hexdigest()
    return Path(cache_dir) / f"{name.rsplit('.', 1)[-1]}-{digest[:12]}"
