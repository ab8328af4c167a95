"""The house rules of issue 30 ("short functions, short signatures"), read from the source with
``ast``: in ``ppo_lightning/`` no function or method is longer than 60 lines, none takes more than
10 parameters, and no class is longer than 250 lines.

A function's length runs from its ``def`` to its last line (docstring included, decorators not);
a class's from its ``class`` line to its last. Every parameter counts but ``self`` and ``cls``;
``*args`` and ``**kwargs`` count one each. A function that outgrows the rule is split by what it
does (sample, score, reduce), and arguments that travel together become one object.
"""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "ppo_lightning"
MAX_FUNCTION_LINES = 60
MAX_PARAMETERS = 10
MAX_CLASS_LINES = 250


def _parameters(fn: ast.FunctionDef | ast.AsyncFunctionDef) -> int:
    a = fn.args
    named = [p.arg for p in (*a.posonlyargs, *a.args, *a.kwonlyargs) if p.arg not in ("self", "cls")]
    return len(named) + (a.vararg is not None) + (a.kwarg is not None)


def _offences(path: Path, root: Path = PACKAGE) -> list[tuple[str, str]]:
    """``(key, what)`` for each function or class of ``path`` (a file under ``root``) over a limit."""
    rel = path.relative_to(root).as_posix()
    out = []

    def visit(node: ast.AST, scope: str) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                name = f"{scope}.{child.name}" if scope else child.name
                lines = child.end_lineno - child.lineno + 1
                where = f"ppo_lightning/{rel}:{child.lineno} {name}"
                if isinstance(child, ast.ClassDef):
                    if lines > MAX_CLASS_LINES:
                        out.append((f"{rel}:{name}", f"{where}: class of {lines} lines (> {MAX_CLASS_LINES})"))
                else:
                    if lines > MAX_FUNCTION_LINES:
                        out.append((f"{rel}:{name}", f"{where}: {lines} lines (> {MAX_FUNCTION_LINES})"))
                    if (n := _parameters(child)) > MAX_PARAMETERS:
                        out.append((f"{rel}:{name}", f"{where}: {n} parameters (> {MAX_PARAMETERS})"))
                visit(child, name)
            else:
                visit(child, scope)

    visit(ast.parse(path.read_text(encoding="utf-8"), filename=str(path)), "")
    return out


def _all_offences() -> list[tuple[str, str]]:
    return [o for path in sorted(PACKAGE.rglob("*.py")) for o in _offences(path)]


def test_functions_and_classes_are_short_and_take_few_parameters():
    bad = [what for _, what in _all_offences()]
    assert not bad, "over the house limits (split by what the code does):\n" + "\n".join(bad)


def test_the_rules_are_measured_as_written(tmp_path):
    """The counts on a file written for it: 61 lines and 11 parameters offend, 60 and 10 do not;
    self, *args and **kwargs count as the rules say."""
    body = "\n".join(f"    x{i} = {i}" for i in range(59))
    src = (
        f"def long(a):\n{body}\n    return 0\n\n"  # 61 lines
        f"def fits(a):\n{body}\n\n"  # 60 lines
        "class C:\n"
        "    def many(self, a, b, c, d, e, f, g, h, i, *args, **kwargs):\n        pass\n"  # 11
        "    def ten(self, a, b, c, d, e, f, g, h, i, *, j):\n        pass\n"  # 10
    )
    (tmp_path / "m.py").write_text(src)
    names = {key.split(":")[1] for key, _ in _offences(tmp_path / "m.py", root=tmp_path)}
    assert names == {"long", "C.many"}
