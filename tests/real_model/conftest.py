"""SmolLM2-135M-Instruct (the `smollm2` checkpoint of tests/conftest.py) loaded once per module
in SplitRL and in transformers (the oracle), and GSM8K test questions rendered with its chat
template: what the parity and generation tests share."""

from __future__ import annotations

import json

import pytest

N_PROMPTS = 4


@pytest.fixture(scope="module")
def smollm2_tokenizer(smollm2):
    from splitrl.tokenizer import load_tokenizer

    return load_tokenizer(smollm2)


@pytest.fixture(scope="module")
def hf_smollm2_tokenizer(smollm2):
    """The checkpoint's tokenizer in transformers (the oracle SplitRL's own is checked against)."""
    import transformers

    return transformers.AutoTokenizer.from_pretrained(smollm2)


@pytest.fixture(scope="module")
def hf_smollm2(smollm2):
    """The checkpoint in transformers (float32, eval mode)."""
    import torch
    import transformers

    return transformers.AutoModelForCausalLM.from_pretrained(smollm2,
                                                             dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def gsm8k_questions(shared_data) -> list[str]:
    lines = (shared_data / "gsm8k" / "test.jsonl").read_text().splitlines()[:N_PROMPTS]
    return [json.loads(line)["question"] for line in lines]


@pytest.fixture(scope="module")
def chat_prompts(smollm2_tokenizer, gsm8k_questions) -> list[list[int]]:
    """The questions as the sampler encodes them: one user turn, the chat template, the
    generation prompt."""
    from splitrl.tokenizer import encode_prompt

    return [encode_prompt(smollm2_tokenizer, q, use_chat_template=True) for q in gsm8k_questions]
