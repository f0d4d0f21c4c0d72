"""Reward functions as their users' documentation publishes them, loaded by the tests as
``published_rewards:NAME`` and run through the real reward service.

- ``trl_*``: the examples of TRL's GRPOTrainer guide, section "Using a custom reward function"
  (huggingface/trl, docs/source/grpo_trainer.md), bodies unchanged; each is renamed (the guide
  calls several of them ``reward_func``) so that one module can hold them all. Example 4 calls
  ``check_math_solution`` and ``test_code_solution``, which the guide leaves to the reader: the
  two small helpers below stand in for them.
- ``format_reward`` and ``accuracy_reward``: the two functions of EasyDeL's GRPO tutorial. The
  only change is the one line that reads the gold answers: the tutorial decodes
  ``batch["solution_ids"]`` with its tokenizer, here they are the batch's ``reference`` field.
"""

# ruff: noqa: E501, B905  (the published code, as published)

from __future__ import annotations

import asyncio
import re

from math_verify import LatexExtractionConfig, parse, verify

# --------------------------------------------------------------------------- TRL's guide


def trl_reward_token_count(completions_ids, **kwargs):
    """Reward function that assigns higher scores to longer completions (in terms of token count)."""
    return [float(len(ids)) for ids in completions_ids]


def trl_reward_char_count(completions, **kwargs):
    """Reward function that assigns higher scores to longer completions (in terms of character count)."""
    return [float(len(completion)) for completion in completions]


def trl_format_reward_func(completions, **kwargs):
    """Reward function that checks if the completion has a specific format."""
    pattern = r"^<think>.*?</think><answer>.*?</answer>$"
    completion_contents = [completion[0]["content"] for completion in completions]
    matches = [re.match(pattern, content) for content in completion_contents]
    return [1.0 if match else 0.0 for match in matches]


def trl_reward_ground_truth(completions, ground_truth, **kwargs):
    # Regular expression to capture content inside \boxed{}
    matches = [re.search(r"\\boxed\{(.*?)\}", completion) for completion in completions]
    contents = [match.group(1) if match else "" for match in matches]
    # Reward 1 if the content is the same as the ground truth, 0 otherwise
    return [1.0 if c == gt else 0.0 for c, gt in zip(contents, ground_truth)]


def check_math_solution(prompt, completion):
    """Stand-in for the guide's helper: is the completion the value of 'What is A+B?' / A*B."""
    a, op, b = re.search(r"What is (\d+)([+*])(\d+)\?", prompt).groups()
    value = int(a) + int(b) if op == "+" else int(a) * int(b)
    return completion.strip() == str(value)


def test_code_solution(prompt, completion):
    """Stand-in for the guide's helper: does the completion define a function."""
    return completion.lstrip().startswith("def ")


def trl_math_reward_func(prompts, completions, task, **kwargs):
    rewards = []
    for prompt, completion, t in zip(prompts, completions, task):
        if t == "math":
            # Calculate math-specific reward
            correct = check_math_solution(prompt, completion)
            reward = 1.0 if correct else -1.0
            rewards.append(reward)
        else:
            # Return None for non-math tasks
            rewards.append(None)
    return rewards


def trl_coding_reward_func(prompts, completions, task, **kwargs):
    rewards = []
    for prompt, completion, t in zip(prompts, completions, task):
        if t == "coding":
            # Calculate coding-specific reward
            works = test_code_solution(prompt, completion)
            reward = 1.0 if works else -1.0
            rewards.append(reward)
        else:
            # Return None for non-coding tasks
            rewards.append(None)
    return rewards


async def trl_async_reward_func(prompts, completions, **kwargs):
    # Simulate an I/O-bound call (e.g., HTTP request, database lookup)
    await asyncio.sleep(0.01)
    # Simple toy reward: 1.0 if the completion is non-empty, else 0.0
    return [1.0 if completion else 0.0 for completion in completions]


# --------------------------------------------------------------------------- EasyDeL's tutorial

num_return_sequences = 4  # the tutorial's grpo_config.num_return_sequences: the group size


def format_reward(completions, **kwargs):
    """Reward function that checks if the completion has a specific format."""
    pattern = r"^<think>.*?</think>\s*<answer>.*?</answer>$"
    completion_contents = [completion[0]["content"] for completion in completions]
    matches = [re.match(pattern, content) for content in completion_contents]
    rewards_list = [1.0 if match else 0.0 for match in matches]
    return rewards_list


def accuracy_reward(prompts, completions, batch, **kwargs):
    """Reward function that checks if the completion is the same as the ground truth."""
    # solutions = kwargs["solution"]
    solutions = batch["reference"] * num_return_sequences
    completion_contents = [completion[0]["content"] for completion in completions]
    rewards = []
    for content, solution in zip(completion_contents, solutions, strict=False):
        gold_parsed = parse(
            solution,
            extraction_mode="first_match",
            extraction_config=[LatexExtractionConfig()],
        )
        answer_parsed = parse(
            content,
            extraction_mode="first_match",
            extraction_config=[LatexExtractionConfig()],
        )
        if len(gold_parsed) != 0:
            try:
                rewards.append(float(verify(answer_parsed, gold_parsed)))
            except Exception:
                rewards.append(0.0)
        else:
            rewards.append(1.0)
    return rewards
