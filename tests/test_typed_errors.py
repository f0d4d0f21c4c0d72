"""Services exchange typed errors (status codes, fields), never English to match.

A static scan of the shipped packages: no decision may read an error's message. It flags a
comparison or containment test (``==``, ``!=``, ``in``, ``not in``) or a ``startswith`` /
``endswith`` whose subject is a gRPC error's ``.details()``, an exception's ``str(e)`` or a
variable named like a message (``details``, ``message``, ``msg``, ``error``, ``err``,
``reason``). A cause
the status code cannot tell apart travels as trailing metadata (``splitrl.error_cause``).
"""

from __future__ import annotations

import ast
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PACKAGES = ("splitrl", "sampler_service", "trainer_service", "reward_service", "splitrl_app")
# A reward function's reason ("timeout", "error: ...") is a message too: its outcome is typed.
MESSAGE_NAMES = frozenset({"details", "message", "msg", "error", "err", "reason", "reasons"})

# Where a message is read, each with why.
ALLOWED = {
    # Not a decision: pydantic's message for a config error is reworded for people, without
    # repeating the key it already starts with.
    ("splitrl/config_base.py", "_one"),
    # Not a decision on the words: a reason equal to the last one reported is not logged (or
    # health not flipped) again.
    ("trainer_service/orchestration/membership.py", "_refuse"),
    ("trainer_service/server.py", "_loop"),
}


def _is_message(node: ast.AST) -> bool:
    if isinstance(node, ast.Call):
        func = node.func
        if isinstance(func, ast.Attribute) and func.attr == "details" and not node.args:
            return True  # grpc.RpcError.details()
        if (isinstance(func, ast.Name) and func.id == "str" and len(node.args) == 1
                and isinstance(node.args[0], ast.Name)):
            return True  # str(e)
        if isinstance(func, ast.Attribute) and func.attr in ("lower", "strip"):
            return _is_message(func.value)
    if isinstance(node, ast.Name):
        return node.id in MESSAGE_NAMES
    if isinstance(node, ast.Attribute):
        return node.attr in MESSAGE_NAMES
    return False


def _matches_text(node: ast.AST) -> bool:
    if isinstance(node, ast.Compare) and any(
            isinstance(op, (ast.In, ast.NotIn, ast.Eq, ast.NotEq)) for op in node.ops):
        return any(_is_message(side) for side in [node.left, *node.comparators])
    if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
            and node.func.attr in ("startswith", "endswith")):
        return _is_message(node.func.value)
    return False


def _findings(source: str, rel: str) -> list[str]:
    tree = ast.parse(source, filename=rel)
    out = []
    for function in ast.walk(tree):
        if not isinstance(function, (ast.FunctionDef, ast.AsyncFunctionDef)):
            continue
        if (rel, function.name) in ALLOWED:
            continue
        for node in ast.walk(function):
            if _matches_text(node):
                out.append(f"{rel}:{node.lineno} in {function.name}: {ast.unparse(node)}")
    return sorted(set(out))


def test_no_decision_reads_an_error_message():
    files = [p for package in PACKAGES for p in sorted((REPO / package).rglob("*.py"))
             if "/v1/" not in p.as_posix()]  # generated protobuf modules
    assert len(files) > 50
    findings = [f for path in files
                for f in _findings(path.read_text(), path.relative_to(REPO).as_posix())]
    assert not findings, "branch on a status code or a typed field instead:\n" + "\n".join(
        findings)


def test_the_scan_flags_what_the_trainer_used_to_do():
    # The dispatcher's old reward-outage check, a prefix check and str(e): all found.
    sample = ("def classify(e, code, UNAVAILABLE):\n"
              "    details = e.details() or ''\n"
              "    if code == UNAVAILABLE and 'reward service' in details:\n"
              "        return 1\n"
              "    if 'DEADLINE' in str(e):\n"
              "        return 2\n"
              "    return e.details().startswith('INCOMPATIBLE')\n")
    assert len(_findings(sample, "sample.py")) == 3
    # The trainer's old reading of reward reasons (splitrl.reward_protocol.classify_reason).
    sample = ("def classify_reason(reason):\n"
              "    if reason == 'timeout':\n"
              "        return 'timeout'\n"
              "    if reason.startswith(('error: ', 'non-finite score: ')):\n"
              "        return 'error'\n")
    assert len(_findings(sample, "sample.py")) == 2
