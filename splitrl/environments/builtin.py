"""Built-in environments: ``calculator`` (GSM8K-style arithmetic), ``python`` (a sandboxed
interpreter) and ``lookup`` (the tiny learnable tool task: a hidden value per episode)."""

from __future__ import annotations

import ast
import operator
import os
import subprocess
import sys
from collections.abc import Callable
from decimal import Decimal
from fractions import Fraction
from typing import TypedDict

from splitrl.environments.api import register_environment

# ----------------------------------------------------------------------------- calculator

_BINARY: dict[type[ast.operator], Callable[[Fraction, Fraction | int], Fraction]] = {
    ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul,
    ast.Div: operator.truediv, ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod,
    ast.Pow: operator.pow}
_UNARY: dict[type[ast.unaryop], Callable[[Fraction], Fraction]] = {
    ast.UAdd: operator.pos, ast.USub: operator.neg}
MAX_EXPRESSION_CHARS = 200
MAX_EXPONENT = 64
MAX_MAGNITUDE = Fraction(10) ** 30


def evaluate_arithmetic(expression: str) -> Fraction:
    """The exact value of an arithmetic expression: numbers, + - * / // % **, parentheses.

    Anything else (names, calls, attributes) is refused, and so are values past 1e30 and
    exponents past 64, so an expression can neither run code nor take long. Raises ValueError
    saying why."""
    text = expression.replace(",", "").replace("^", "**").strip()
    if len(text) > MAX_EXPRESSION_CHARS:
        raise ValueError(f"expression longer than {MAX_EXPRESSION_CHARS} characters")
    try:
        tree = ast.parse(text, mode="eval")
    except SyntaxError:
        raise ValueError(f"not an arithmetic expression: {expression!r}") from None
    return _eval(tree.body)


def _eval(node: ast.AST) -> Fraction:
    if isinstance(node, ast.Constant) and type(node.value) in (int, float):
        value = Fraction(Decimal(str(node.value)))
    elif isinstance(node, ast.UnaryOp) and type(node.op) in _UNARY:
        value = _UNARY[type(node.op)](_eval(node.operand))
    elif isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
        right: Fraction | int
        left, right = _eval(node.left), _eval(node.right)
        if isinstance(node.op, ast.Pow):
            if right.denominator != 1 or abs(right) > MAX_EXPONENT:
                raise ValueError(f"exponents must be integers up to {MAX_EXPONENT}")
            right = int(right)
        try:
            value = _BINARY[type(node.op)](left, right)
        except ZeroDivisionError:
            raise ValueError("division by zero") from None
    else:
        raise ValueError(f"not allowed in an arithmetic expression: {type(node).__name__}")
    if abs(value) > MAX_MAGNITUDE:
        raise ValueError("value too large")
    return value


def format_number(value: Fraction) -> str:
    """An integer as itself, anything else as a decimal of up to 6 places."""
    if value.denominator == 1:
        return str(value.numerator)
    return f"{float(value):.6f}".rstrip("0").rstrip(".")


@register_environment("calculator", "A calculator tool for word problems (GSM8K): "
                      "calculate(expression) evaluates + - * / // % ** and parentheses exactly.")
class Calculator:
    def reset(self, **columns) -> None:
        return None

    def calculate(self, expression: str) -> str:
        """Evaluate an arithmetic expression exactly.

        Args:
            expression: numbers with + - * / // % ** and parentheses, e.g. "(3 + 4) * 12 / 7"
        """
        return format_number(evaluate_arithmetic(expression))


# ----------------------------------------------------------------------------- python

# Runs in the child before the user's code: no sockets, no new processes (Python-level audit
# events; the process limits below hold for anything else).
_PRELUDE = """
import sys
def _deny(event, args):
    if event.startswith(("socket.", "subprocess.", "os.system", "os.exec", "os.posix_spawn",
                         "os.fork", "os.spawn", "pty.")):
        raise PermissionError(f"not allowed in this sandbox: {event}")
sys.addaudithook(_deny)
del _deny
source = sys.stdin.read()
exec(compile(source, "<tool>", "exec"), {"__name__": "__main__"})
"""


def _limits(cpu_s: int, memory_mb: int):
    def apply() -> None:
        import resource

        resource.setrlimit(resource.RLIMIT_CPU, (cpu_s, cpu_s))
        limit = memory_mb * 1024 * 1024
        resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
        resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
        resource.setrlimit(resource.RLIMIT_FSIZE, (1 << 20, 1 << 20))
        os.setsid()

    return apply


def run_python(code: str, *, timeout_s: float = 5.0, memory_mb: int = 512,
               max_output_chars: int = 2000) -> str:
    """Run ``code`` in a fresh isolated interpreter (``python -I``, empty environment, a
    scratch working directory) under CPU, memory, file-size and wall-clock limits, with
    sockets and process creation refused; its stdout and stderr, and a line for a non-zero
    exit or a time-out."""
    import tempfile

    with tempfile.TemporaryDirectory(prefix="splitrl-py-") as scratch:
        try:
            done = subprocess.run(
                [sys.executable, "-I", "-c", _PRELUDE], input=code, capture_output=True,
                text=True, timeout=timeout_s, cwd=scratch, env={"PATH": "/usr/bin:/bin"},
                preexec_fn=_limits(max(1, int(timeout_s) + 1), memory_mb))
        except subprocess.TimeoutExpired as e:
            out = (e.stdout or b"").decode() if isinstance(e.stdout, bytes) else e.stdout or ""
            return _cut(out + f"\n[timed out after {timeout_s:g} s]", max_output_chars)
    out = done.stdout + done.stderr
    if done.returncode != 0:
        out += f"\n[exit code {done.returncode}]"
    return _cut(out, max_output_chars)


def _cut(text: str, limit: int) -> str:
    return text if len(text) <= limit else text[: limit - 3] + "..."


class _SandboxLimits(TypedDict):
    timeout_s: float
    memory_mb: int
    max_output_chars: int


@register_environment("python", "A Python interpreter tool: python(code) runs a program in an "
                      "isolated process (time and memory limits, no network) and returns its "
                      "output.")
class PythonSandbox:
    def __init__(self, timeout_s: float = 5.0, memory_mb: int = 512,
                 max_output_chars: int = 2000):
        self._limits = _SandboxLimits(timeout_s=timeout_s, memory_mb=memory_mb,
                            max_output_chars=max_output_chars)

    def reset(self, **columns) -> None:
        return None

    def python(self, code: str) -> str:
        """Run a Python program and return what it prints.

        Args:
            code: the program's source; print() what you want to see
        """
        return run_python(code, **self._limits)


# ----------------------------------------------------------------------------- lookup


@register_environment("lookup", "The tiny learnable tool task: each episode hides a value "
                      "(the row's `secret` column, never in the prompt); lookup() reveals it.")
class Lookup:
    """``call_reward`` is the environment's reward when lookup() was called exactly once (0 by
    default): a small bonus that gives a random model a first signal to call the tool at all,
    and none for calling it again and again instead of answering."""

    def __init__(self, call_reward: float = 0.0):
        self._call_reward = call_reward
        self._secret = ""
        self._calls = 0
        self.reward = 0.0

    def reset(self, secret, **columns) -> None:
        self._secret = str(secret)
        self._calls = 0
        self.reward = 0.0
        return None

    def lookup(self) -> str:
        """The value hidden in this episode's table entry."""
        self._calls += 1
        self.reward = self._call_reward if self._calls == 1 else 0.0
        return self._secret
