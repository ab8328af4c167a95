"""The docs cover the code: every config key and every logged metric is documented."""

from __future__ import annotations

import dataclasses
import importlib.util
from pathlib import Path

from ppo_lightning import config as C
from ppo_lightning.config import TrainConfig
from ppo_lightning.jobs.run import train
from tests.conftest import compose_cfg, read_metrics

DOCS = Path(__file__).resolve().parents[1] / "docs"


def _keys(cls, prefix: str = "") -> list[str]:
    out = []
    for f in dataclasses.fields(cls):
        if C.is_placeholder(f):
            continue
        default = f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default
        if dataclasses.is_dataclass(default):
            out += _keys(type(default), f"{prefix}{f.name}.")
        else:
            out.append(f"{prefix}{f.name}")
    return out


def test_config_md_is_generated_from_the_schema_and_conf():
    """docs/config.md is docs/gen_config.py's output: regenerate it after changing a config field,
    its docstring or check, or a conf/ file (python docs/gen_config.py)."""
    spec = importlib.util.spec_from_file_location("gen_config", DOCS / "gen_config.py")
    gen = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(gen)
    assert (DOCS / "config.md").read_text() == gen.render(), "stale: run python docs/gen_config.py"


def test_every_config_key_has_a_row_in_docs_config_md():
    doc = (DOCS / "config.md").read_text()
    keys = _keys(TrainConfig)
    assert "ppo.fuse_rollout_forward" in keys and "sampling.temperature" in keys and "ppo.temperature" not in keys
    assert [k for k in keys if f"`{k}`" not in doc] == []
    assert "`generation.fast_decode`" in doc  # the hf backend's option, in the generation key's row


def test_every_logged_metric_has_a_row_in_docs_metrics_md(tmp_path, cache_dir):
    cfg = compose_cfg(
        [
            "trainer.max_steps=1",
            "sampling.max_new_tokens=8",
            "callbacks=none",
            "export_dir=null",
            "trainer.enable_progress_bar=false",
            "trainer.enable_model_summary=false",
        ],
        tmp_path,
        cache_dir,
    )
    train(cfg)
    (row,) = read_metrics(tmp_path / "metrics.csv")
    names = [k for k in row if k != "step"]
    assert len(names) > 20
    doc = (DOCS / "metrics.md").read_text()
    assert [k for k in names if f"`{k}`" not in doc] == []


def test_every_code_reference_in_the_docs_names_where_the_code_is():
    """A doc's ```<path>.py:<name>``` points at a file that defines ``name`` (a function, class or
    module-level name): a move or a rename that leaves the docs behind fails here."""
    import ast
    import re

    root = DOCS.parent
    defined: dict[str, set[str]] = {}  # name -> the files (relative to the repo) that define it
    for path in [*root.glob("ppo_lightning/**/*.py"), *root.glob("benchmarks/**/*.py"), *root.glob("*.py")]:
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                names = [node.name]
            elif isinstance(node, (ast.Assign, ast.AnnAssign)):
                targets = node.targets if isinstance(node, ast.Assign) else [node.target]
                names = [t.id for t in targets if isinstance(t, ast.Name)]
            else:
                continue
            for name in names:
                defined.setdefault(name, set()).add(path.relative_to(root).as_posix())
    stale = []
    for doc in [root / "README.md", *DOCS.glob("*.md")]:
        for i, line in enumerate(doc.read_text().splitlines(), 1):
            for file, name in re.findall(r"`([\w/]+\.py):(\w+)", line):
                if file == "file.py":  # the convention's own example
                    continue
                if not any(p == file or p.endswith("/" + file) for p in defined.get(name, ())):
                    stale.append(
                        f"{doc.name}:{i}: {file}:{name} (defined in {sorted(defined.get(name, ())) or 'none'})"
                    )
    assert not stale, "\n".join(stale)
