"""Export: transformers loads the directory and reproduces the trainer's logits."""

import dataclasses

import numpy as np
import torch
from trainer_helpers import make_learner, mesh_of, rollout_batch
from transformers import AutoModelForCausalLM, AutoTokenizer

from splitrl.config import OptimizerConfig
from splitrl.tokenizer import train_char_tokenizer
from trainer_service.learning.export import export_hf


def test_exported_directory_loads_in_transformers_with_the_trainers_logits(tmp_path):
    source = train_char_tokenizer(["1+2=3", "4+4=8"], tmp_path / "source")
    learner = make_learner(mesh_of(2), optimizer=OptimizerConfig(lr=1e-2))
    batch = rollout_batch(0)
    learner.train_step(dataclasses.replace(batch, sampler_logprobs=learner.logprobs(batch)))

    out = export_hf(learner.model(), tmp_path / "export", source_dir=source)

    tokens = np.random.default_rng(0).integers(0, 32, size=(2, 7))
    ours, _ = learner.model()(tokens)
    hf = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    with torch.no_grad():
        theirs = hf(torch.tensor(tokens)).logits.numpy()
    np.testing.assert_allclose(theirs, np.asarray(ours), atol=1e-4, rtol=0)

    tok = AutoTokenizer.from_pretrained(out, local_files_only=True)
    assert tok.chat_template and "<|im_start|>" in tok.chat_template
    assert tok.eos_token == "<|endoftext|>"
