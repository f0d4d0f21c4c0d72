"""Metrics of multi-turn episodes (docs/environments.md), from the completions that came back.

Pure functions over `Completion` records: turns and tool calls per trajectory, tool-call
outcomes by status and by tool, observation tokens, and how episodes ended. Single-turn
completions (no turns recorded) give no episode metrics.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence

from trainer_service.orchestration.rollouts import Completion


def episode_metrics(completions: Sequence[Completion], prefix: str = "episodes/"
                    ) -> dict[str, float]:
    """Per trajectory means (turns, tool_calls, observation_tokens, model_tokens), the
    fraction of tool calls per status (``tool_status/<status>``) and per tool and status
    (``tool/<name>/<status>``, as counts per trajectory), and the fraction of episodes per end
    (``end/<why>``)."""
    episodes = [c for c in completions if c.turns]
    if not episodes:
        return {}
    n = len(episodes)
    calls = [call for c in episodes for t in c.turns for call in t["tool_calls"]]
    out = {
        "turns": sum(len(c.turns) for c in episodes) / n,
        "tool_calls": len(calls) / n,
        "observation_tokens": sum(t["observation"] for c in episodes for t in c.turns) / n,
        "model_tokens": sum(t["generated"] for c in episodes for t in c.turns) / n,
    }
    for status, count in Counter(status for _, status in calls).items():
        out[f"tool_status/{status}"] = count / len(calls)
    for (name, status), count in Counter(calls).items():
        out[f"tool/{name or '?'}/{status}"] = count / n
    for end, count in Counter(c.episode_end for c in episodes).items():
        out[f"end/{end}"] = count / n
    return {prefix + k: float(v) for k, v in sorted(out.items())}
