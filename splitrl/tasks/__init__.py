"""Prompt tasks by name: `arithmetic` and `lookup` (synthetic), `gsm8k`, `math500`, `files`
(any dataset).

    task = get_task("gsm8k", instruction="boxed")
    rows = task.rows("test")          # [{prompt_id, prompt | messages, reference, columns}]
    task.reward_functions             # the reward config it is meant to be scored with
"""

from splitrl.tasks import arithmetic, files, lookup, math_data  # noqa: F401  (registers them)
from splitrl.tasks.arithmetic import ArithmeticTask
from splitrl.tasks.base import (
    LazyRows,
    Row,
    Task,
    default_data_dir,
    describe_task,
    get_task,
    list_tasks,
    load_split,
    register_task,
)
from splitrl.tasks.files import FilesTask
from splitrl.tasks.lookup import LookupTask
from splitrl.tasks.math_data import GSM8KTask, Math500Task, parse_gsm8k_answer

__all__ = [
    "ArithmeticTask",
    "FilesTask",
    "GSM8KTask",
    "LazyRows",
    "LookupTask",
    "Math500Task",
    "Row",
    "Task",
    "default_data_dir",
    "describe_task",
    "get_task",
    "list_tasks",
    "load_split",
    "parse_gsm8k_answer",
    "register_task",
]
