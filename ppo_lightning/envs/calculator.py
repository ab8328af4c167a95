"""A safe calculator tool: arithmetic parsed with ``ast``, never ``eval``.

Only numbers, ``+ - * / // % **``, unary signs and parentheses are accepted; anything else (names,
calls, attributes, strings) is refused. Exponents and results are bounded, so a policy cannot make
the tool spend minutes or gigabytes (``9 ** 9 ** 9``): an exponent's magnitude at most
``MAX_EXPONENT``, every intermediate result at most ``MAX_DIGITS`` digits.
"""

from __future__ import annotations

import ast
import math
import operator

MAX_EXPONENT = 100
MAX_DIGITS = 100
MAX_LENGTH = 200  # characters of an expression

_BINARY = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.Div: operator.truediv,
    ast.FloorDiv: operator.floordiv,
    ast.Mod: operator.mod,
    ast.Pow: operator.pow,
}
_UNARY = {ast.UAdd: operator.pos, ast.USub: operator.neg}


def calculator(expression: str) -> str:
    """Evaluate an arithmetic expression and return its value.

    Args:
        expression: Numbers with + - * / // % ** and parentheses, e.g. "347 * 26 + 18".

    Returns:
        The value, as an integer when it is one.
    """
    if not isinstance(expression, str):
        raise ValueError(f"expression must be a string, got {type(expression).__name__}")
    if len(expression) > MAX_LENGTH:
        raise ValueError(f"expression longer than {MAX_LENGTH} characters")
    try:
        tree = ast.parse(expression.strip(), mode="eval")
    except SyntaxError:
        raise ValueError(f"cannot parse {expression!r} as arithmetic") from None
    return _format(_eval(tree.body))


def _eval(node: ast.AST) -> int | float:
    if isinstance(node, ast.Constant) and type(node.value) in (int, float):
        return _bounded(node.value)
    if isinstance(node, ast.UnaryOp) and type(node.op) in _UNARY:
        return _UNARY[type(node.op)](_eval(node.operand))
    if isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
        left, right = _eval(node.left), _eval(node.right)
        if isinstance(node.op, ast.Pow) and abs(right) > MAX_EXPONENT:
            raise ValueError(f"exponent {right} is larger than {MAX_EXPONENT}")
        if isinstance(node.op, (ast.Div, ast.FloorDiv, ast.Mod)) and right == 0:
            raise ValueError("division by zero")
        try:
            return _bounded(_BINARY[type(node.op)](left, right))
        except OverflowError:
            raise ValueError(f"the result has more than {MAX_DIGITS} digits") from None
    raise ValueError(f"only numbers and + - * / // % ** ( ) are allowed, not {ast.unparse(node)!r}")


def _bounded(x: int | float | complex) -> int | float:
    if isinstance(x, complex):
        raise ValueError("the result is not a real number")
    if isinstance(x, float) and not math.isfinite(x):
        raise ValueError("the result is not finite")
    if abs(x) >= 10**MAX_DIGITS:
        raise ValueError(f"the result has more than {MAX_DIGITS} digits")
    return x


def _format(x: int | float) -> str:
    if isinstance(x, float) and x.is_integer() and abs(x) < 1e15:
        return str(int(x))
    return str(x) if isinstance(x, int) else f"{x:.12g}"
