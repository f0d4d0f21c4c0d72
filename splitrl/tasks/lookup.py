"""The tiny learnable tool task: the answer is a hidden value only a tool call can reveal.

Every prompt is the same text, ``?``; each row hides a digit in its ``secret`` column, which
reaches the ``lookup`` environment (``reset(secret=...)``) and the reward functions but never the
prompt. No mapping from prompt to answer exists, so a model that does not call the tool is
right one time in ten at best; one that calls ``lookup()`` (in the tiny format: ``!``, then the
end of its turn), reads the observation ``=7`` and answers ``7`` is always right.

The tiny tool models' chat template (`CHAT_TEMPLATE`) is the shortest that still renders every
role: user text as is, an assistant turn then ``<|im_end|>``, a tool result as ``=`` and its
content, no generation prompt. With the character vocabulary of `corpus` (13 characters and the
special tokens) a random 2-layer model finds the call and the copy by chance often enough for
GRPO (see tests/e2e/test_tools.py).
"""

from __future__ import annotations

import random

from splitrl.tasks.arithmetic import EVAL_SPLITS
from splitrl.tasks.base import Row, Task, make_row, register_task

CHAT_TEMPLATE = (
    "{%- for message in messages %}"
    "{%- if message['role'] == 'tool' %}{{- '=' + message['content'] }}"
    "{%- elif message['role'] == 'assistant' %}{{- message['content'] + '<|im_end|>' }}"
    "{%- else %}{{- message['content'] }}{%- endif %}"
    "{%- endfor %}"
)


@register_task("lookup")
class LookupTask(Task):
    """A hidden digit per row that only the `lookup` environment's tool reveals (synthetic;
    a random tiny model learns to call it on CPU). Columns: secret."""

    reward_functions = ({"name": "exact_answer", "weight": 1.0, "options": {}},)
    sampling = {"max_new_tokens": 2}  # a call (`!`) or a digit, then the end of the turn
    chat_template = CHAT_TEMPLATE

    def __init__(self, size: int = 256, eval_size: int = 100, seed: int = 0):
        if size < 1 or eval_size < 1:
            raise ValueError(f"lookup: expected size >= 1 and eval_size >= 1, got size={size}, "
                             f"eval_size={eval_size}")
        self.size, self.eval_size, self.seed = size, eval_size, seed

    @property
    def splits(self) -> tuple[str, ...]:
        return ("train", *EVAL_SPLITS)

    def rows(self, split: str) -> list[Row]:
        self._check_split(split)
        n = self.size if split == "train" else self.eval_size
        rng = random.Random(f"{self.seed}-{'train' if split == 'train' else 'eval'}")
        secrets = [rng.randrange(10) for _ in range(n)]
        return [make_row(f"lookup-{split}-{i}", str(s), {"secret": s}, prompt="?")
                for i, s in enumerate(secrets)]

    def corpus(self):
        """The prompt, the tiny call and result markers, and every digit."""
        yield "?!=0123456789"
