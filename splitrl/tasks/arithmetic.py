"""Single-digit addition, the task a random tiny model learns from scratch on CPU.

Prompts are `a+b=` for every pair of operands in [min_operand, max_operand]; the reference is
the sum as a string (zero-padded to the widest sum with `fixed_width`); the columns `a` and `b`
(ints) reach the reward functions. With the default
operands 0..4 there are 25 prompts whose answers are one digit: a random 2-layer model with a
character vocabulary learns them by GRPO in a few hundred steps (see ENVIRONMENT.md). 0..9 is
not reliably learnable.

The model memorises the table (held-out pairs stay wrong), so the evaluation split is the whole
table. `train_fraction < 1` trains on a `seed`-chosen subset of it.
"""

from __future__ import annotations

import random

from splitrl.tasks.base import Row, Task, make_row, register_task

EVAL_SPLITS = ("test", "eval", "validation")


@register_task("arithmetic")
class ArithmeticTask(Task):
    """Single-digit addition `a+b=` (synthetic; a random tiny model learns it on CPU).
    Columns: a, b."""

    reward_functions = ({"name": "exact_answer", "weight": 1.0, "options": {}},)

    def __init__(self, max_operand: int = 4, min_operand: int = 0, seed: int = 0,
                 train_fraction: float = 1.0, fixed_width: bool = False):
        if not 0 <= min_operand <= max_operand <= 9:
            raise ValueError(f"arithmetic: expected 0 <= min_operand <= max_operand <= 9, got "
                             f"min_operand={min_operand}, max_operand={max_operand}")
        if not 0.0 < train_fraction <= 1.0:
            raise ValueError(f"arithmetic: train_fraction must be in (0, 1], got {train_fraction}")
        self.max_operand = max_operand
        self.min_operand = min_operand
        self.seed = seed
        self.train_fraction = train_fraction
        self.fixed_width = fixed_width
        self.width = len(str(2 * max_operand))
        # Room for the answer and the EOS token.
        self.sampling = {"max_new_tokens": self.width + 1}
        ops = range(min_operand, max_operand + 1)
        self._table = [(a, b) for a in ops for b in ops]

    @property
    def splits(self) -> tuple[str, ...]:
        return ("train", *EVAL_SPLITS)

    def answer(self, a: int, b: int) -> str:
        total = str(a + b)
        return total.zfill(self.width) if self.fixed_width else total

    def rows(self, split: str) -> list[Row]:
        self._check_split(split)
        pairs = self._table
        if split == "train" and self.train_fraction < 1.0:
            k = max(1, round(self.train_fraction * len(pairs)))
            chosen = set(random.Random(self.seed).sample(range(len(pairs)), k))
            pairs = [p for i, p in enumerate(pairs) if i in chosen]
        return [self._row(a, b) for a, b in pairs]

    def _row(self, a: int, b: int) -> Row:
        return make_row(f"arith-{a}+{b}", self.answer(a, b), {"a": a, "b": b},
                        prompt=f"{a}+{b}=")

    def corpus(self):
        """Every digit and operator (so the vocabulary does not depend on the operand range),
        then each line `a+b=sum` of the table."""
        yield "0123456789+="
        for a, b in self._table:
            yield f"{a}+{b}={self.answer(a, b)}"
