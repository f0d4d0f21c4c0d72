"""GSM8K and MATH-500 from the hub datasets users know, or any directory, file or hub name.

Without a `path` they load `openai/gsm8k` (config `main`) and `HuggingFaceH4/MATH-500` with
`datasets` (offline, `HF_DATASETS_OFFLINE=1`: from its cache), unless `$SPLITRL_DATA_DIR` names
a folder holding `gsm8k/` and `math500/` copies (the tests and the demo set it to the copies
shipped beside the repository). When neither is reachable the error names both ways out.

GSM8K's reference is the number after `####` with thousands separators removed (`1,080` ->
`1080`); MATH-500's is its `answer` field. An optional instruction is appended to each problem:
`"hash"`, `"boxed"` or any string of your own.
"""

from __future__ import annotations

import os

from splitrl.tasks.base import (
    DATA_DIR_ENV,
    LazyRows,
    Row,
    Task,
    default_data_dir,
    load_split,
    make_row,
    register_task,
)

INSTRUCTIONS = {
    "hash": "Solve the problem step by step. Write the final answer as a number after '####'.",
    "boxed": "Solve the problem step by step. Put the final answer within \\boxed{}.",
}
MATH_REWARDS = ({"name": "math_accuracy", "weight": 1.0, "options": {}},)


def parse_gsm8k_answer(answer: str) -> str:
    """The final answer of a GSM8K solution: the text after the last `####`, commas removed."""
    if "####" not in answer:
        raise ValueError(f"GSM8K answer has no '####' final answer: {answer[-80:]!r}")
    return answer.rsplit("####", 1)[1].strip().replace(",", "")


def _columns(record: dict, prompt_column: str) -> dict:
    """The record's columns but the prompt's (GSM8K: `answer`, the worked solution; MATH-500:
    `solution`, `answer`, `subject`, `level`, `unique_id`)."""
    return {k: v for k, v in record.items() if k != prompt_column}


def _with_instruction(problem: str, instruction: str | None) -> str:
    if not instruction:
        return problem
    return f"{problem}\n{INSTRUCTIONS.get(instruction, instruction)}"


class _HubTask(Task):
    hub_name = ""  # the hub dataset loaded when no path is given
    hub_subset: str | None = None
    default_dir = ""  # its folder under $SPLITRL_DATA_DIR
    file_splits: tuple[str, ...] = ()
    reward_functions = MATH_REWARDS
    sampling = {"max_new_tokens": 512}

    def __init__(self, path: str | os.PathLike | None = None, instruction: str | None = None,
                 subset: str | None = None):
        data_dir = default_data_dir()
        self.from_hub = path is None and data_dir is None
        if path is not None:
            self.path = str(path)
        elif data_dir is None:
            self.path = self.hub_name
            subset = self.hub_subset if subset is None else subset
        else:
            self.path = str(data_dir / self.default_dir)
        self.instruction = instruction
        self.subset = subset

    @property
    def splits(self) -> tuple[str, ...]:
        return self.file_splits

    def rows(self, split: str) -> LazyRows:
        self._check_split(split)
        try:
            dataset = load_split(self.path, split, subset=self.subset)
        except (ConnectionError, FileNotFoundError) as e:
            if not self.from_hub:
                raise
            subset = f" (config {self.subset!r})" if self.subset else ""
            raise FileNotFoundError(
                f"task {self.name!r}: the hub dataset {self.hub_name}{subset} could not be "
                f"loaded ({e}). Either give a local copy: trainer.data.path (a folder with "
                f"{'/'.join(f'{s}.jsonl' for s in self.file_splits)}, or a file pattern such "
                f"as data/{{split}}.jsonl), or ${DATA_DIR_ENV} (a folder holding "
                f"{self.default_dir}/); or load it once where the hub is reachable, so that "
                "`datasets` has it in its cache (HF_DATASETS_OFFLINE=1 then reads the cache)"
            ) from None
        return LazyRows(dataset, lambda i, rec: self._row(split, i, rec))

    def _row(self, split: str, index: int, record: dict) -> Row:
        raise NotImplementedError


@register_task("gsm8k")
class GSM8KTask(_HubTask):
    """GSM8K grade-school math (hub: openai/gsm8k, config main; or path); the reference is the
    number after `####`. Columns: answer (the worked solution)."""

    hub_name = "openai/gsm8k"
    hub_subset = "main"
    default_dir = "gsm8k"
    file_splits = ("train", "test")

    def _row(self, split: str, index: int, record: dict) -> Row:
        return make_row(f"gsm8k-{split}-{index}", parse_gsm8k_answer(record["answer"]),
                        _columns(record, "question"),
                        prompt=_with_instruction(record["question"], self.instruction))


@register_task("math500")
class Math500Task(_HubTask):
    """MATH-500 competition math (hub: HuggingFaceH4/MATH-500, or path; test split only); the
    reference is the answer field. Columns: solution, answer, subject, level, unique_id."""

    hub_name = "HuggingFaceH4/MATH-500"
    default_dir = "math500"
    file_splits = ("test",)

    def _row(self, split: str, index: int, record: dict) -> Row:
        return make_row(f"math500-{split}-{index}", str(record["answer"]).strip(),
                        _columns(record, "problem"),
                        prompt=_with_instruction(record["problem"], self.instruction))
