"""SmolLM2-135M-Instruct trained by GRPO on GSM8K through the real services (a reward service,
one sampler and an fsdp trainer, separate processes on 127.0.0.1), with the recipe of
examples/gsm8k-grpo/smollm2-cpu.yaml cut to the smallest run that shows every part: two steps
of one prompt x two completions of at most 16 tokens, one trainer device, no reference model
and no evaluations; once as a full fine-tune, once with LoRA adapters.

Each run: every step's loss is finite; each step's weights are pushed and the second step
trains on completions of the first step's weights; after the run the sampler serves the final
version, and the logprobs of its completions are those of the export in transformers (for LoRA:
of the exported adapter loaded with peft on the base), far from the base model's; and the export
loads in transformers (peft) with logits equal to SplitRL's own forward of it, by the parity
test's measure (tests/real_model/test_smollm2_parity.py: |diff| <= 2e-5 x the logits' scale).

The runs train on real GSM8K training questions, the two that the two steps draw, chosen to
encode to one length with the chat template, the shortest length that two questions share:
every train batch then has the shape the trainer warms up for (the longest prompt plus the
generation budget), so it compiles its 30-layer train step (scanned: `model.layer_loop`) once,
not once per padded length,
the trainer's length check reads two rows, not the whole split, and a train step (the test's
main cost) runs on as few tokens as a real question allows.

At 16 tokens SmolLM2 hardly ever answers, so a group's completions mostly score alike and
carry no policy gradient: the runs add an entropy bonus and a large learning rate, so the
weights move measurably in two steps whatever the rewards. The prints give the run's wall
time (the trainer's first step compiles the 30-layer train step).
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import numpy as np
import pytest

from splitrl.config import load_config
from splitrl_app.launch.supervisor import Launcher
from tests.e2e.harness import (
    adapter_logits,
    gsm8k_train_lines_by,
    log_records,
    tail,
    trained_records,
    wait_exit,
)

pytestmark = pytest.mark.slow

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "gsm8k-grpo" / "smollm2-cpu.yaml"
STEPS = 2
BUDGET = (f"trainer.steps={STEPS}", "trainer.prompts_per_step=1", "algorithm.group_size=2",
          "sampling.max_new_tokens=16", "trainer.micro_batch_size=2", "sampler.max_batch_size=4",
          "trainer.eval_before=false", "trainer.eval_after=false", "trainer.eval_every=null",
          "trainer.mesh.axes={fsdp: 1}", "algorithm.beta=0", "algorithm.entropy_coef=0.01",
          # Two steps are mostly the compile of the 30-layer train step: scanned, it holds one
          # layer body and compiles in about half the CPU of the CPU default (unrolled).
          "model.layer_loop=scan")
MODES = {
    "full": ("trainer.optimizer.lr=1e-4",),
    "lora": ("model.lora.rank=8", "trainer.optimizer.lr=1e-3"),
}
SCANNED = 400  # GSM8K training rows searched for prompts of one length


@pytest.fixture(scope="module")
def one_length_gsm8k(smollm2_tokenizer, shared_data, tmp_path_factory) -> Path:
    """A GSM8K folder whose train.jsonl holds the ``STEPS x prompts_per_step`` questions the
    runs draw: rows of the shipped GSM8K train split that the sampler encodes (the recipe's
    instruction appended, the chat template) to one length, the shortest such length."""
    trainer = load_config(EXAMPLE, list(BUDGET)).trainer
    by_length = gsm8k_train_lines_by(lambda n: n, smollm2_tokenizer, trainer.data,
                                     shared_data / "gsm8k", SCANNED)
    needed = STEPS * trainer.prompts_per_step
    shared = [n for n, rows in by_length.items() if len(rows) >= needed]
    assert shared, {n: len(r) for n, r in by_length.items()}
    chosen = by_length[min(shared)][:needed]
    folder = tmp_path_factory.mktemp("gsm8k-one-length")
    (folder / "train.jsonl").write_text("".join(r + "\n" for r in chosen))
    return folder


@pytest.fixture(scope="module")
def train_prompt(one_length_gsm8k, smollm2_tokenizer) -> list[int]:
    """The runs' first training question as the sampler encodes it (the runs' prompt length)."""
    from splitrl.tasks import get_task
    from splitrl.tokenizer import encode_prompt

    data = load_config(EXAMPLE, list(BUDGET)).trainer.data
    row = get_task(data.task, path=one_length_gsm8k, **data.options).rows("train")[0]
    return encode_prompt(smollm2_tokenizer, row["prompt"], use_chat_template=data.chat_template)


@pytest.mark.timeout(3600)  # a cold start compiles the sampler's and trainer's 30-layer programs
@pytest.mark.parametrize("mode", sorted(MODES))
def test_grpo_on_gsm8k_pushes_serves_and_exports(mode, smollm2, hf_smollm2, train_prompt,
                                                 one_length_gsm8k, tmp_path):
    run_dir = tmp_path / "run"
    cfg = load_config(EXAMPLE, [f"model.path={smollm2}", f"trainer.run_dir={run_dir}",
                                f"trainer.data.path={one_length_gsm8k}",
                                "trainer.data.eval_split=null", *BUDGET, *MODES[mode]])
    launcher = Launcher(cfg)
    started = time.monotonic()
    try:
        launcher.up()
        assert wait_exit(launcher, "trainer", 3600) == 0, tail(launcher.log_dir / "trainer.log")
        trained_s = time.monotonic() - started
        served = _served(launcher.sampler_addresses[0], cfg, train_prompt)
    finally:
        launcher.stop()
    print(f"\n{mode}: GRPO on GSM8K, {STEPS} steps with SmolLM2-135M-Instruct: "
          f"{trained_s:.0f} s from launch to the trainer's exit")

    steps = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in steps if "groups" in r]
    assert [r["step"] for r in steps] == list(range(1, STEPS + 1))
    assert all(np.isfinite(r["loss"]) and np.isfinite(r["grad_norm"]) for r in steps), steps
    assert all(r["push/mb"] > 0 for r in steps)  # every step's weights went out
    if mode == "lora":  # as adapters only
        model_mb = sum(f.stat().st_size for f in smollm2.glob("*.safetensors")) / 2**20
        assert all(r["push/mb"] < 0.05 * model_mb for r in steps), (steps, model_mb)
    records = trained_records(run_dir)  # step 2 trained on what version 1 generated
    assert [set(r["versions"]) for r in records] == [{v} for v in range(STEPS)]
    synced = {r["version"] for r in log_records(launcher.log_dir / "trainer.log")
              if r.get("msg") == "sampler synced" and r.get("ok")}
    assert served.weight_version == STEPS, (served.weight_version, synced)

    completions = served.outputs[0].completions
    assert len(completions) == cfg.algorithm.group_size
    completion = completions[0]
    tokens = train_prompt + list(completion.token_ids)
    export = run_dir / "export"
    if mode == "lora":
        theirs, merged, ours = adapter_logits(smollm2, export, [tokens])
        assert np.abs(merged - theirs).max() <= 2e-5 * np.abs(theirs).max()
    else:
        theirs, ours = _export_logits(export, tokens)
    base = _hf_logits(hf_smollm2, tokens)[0]
    theirs, ours = theirs[0], ours[0]
    diff, scale = float(np.abs(ours - theirs).max()), float(np.abs(theirs).max())
    assert diff <= 2e-5 * scale, (diff, scale)
    assert (ours.argmax(-1) == theirs.argmax(-1)).all()

    # What the sampler served is the export, not the base model.
    n = len(completion.token_ids)
    assert n >= 1
    logprobs = np.asarray(completion.logprobs)
    served_diff = float(np.abs(logprobs - _token_logprobs(theirs, tokens, n)).max())
    base_diff = float(np.abs(logprobs - _token_logprobs(base, tokens, n)).max())
    print(f"{mode}: export logits, SplitRL vs transformers{' + peft' * (mode == 'lora')}: "
          f"max |diff| {diff:.2e} (scale {scale:.1f}); the sampler's logprobs vs the "
          f"export's: {served_diff:.2e}, vs the base model's: {base_diff:.2e}")
    assert served_diff <= 4e-5 * scale
    assert base_diff >= 10 * 4e-5 * scale


def _served(address: str, cfg, prompt: list[int]):
    """The sampler's completions of ``prompt`` (Generate) with the logprobs of their tokens,
    asked with the run's own sampling parameters (as the trainer sends them) and group size for
    a prompt of the runs' length: the programs the rollouts compiled serve it. A greedy request
    is another sampling plan, for which the sampler would compile its 30-layer programs again;
    logprobs of sampled tokens compare with the export's logits all the same."""
    from splitrl.serving import make_channel
    from splitrl.v1 import common_pb2, sampler_pb2, sampler_pb2_grpc
    from trainer_service.orchestration.dispatcher import sampling_params

    request = sampler_pb2.GenerateRequest(
        prompts=[common_pb2.Prompt(prompt_id="served", token_ids=prompt)],
        sampling=sampling_params(cfg.sampling), n=cfg.algorithm.group_size)
    with make_channel(address, auth=cfg.services.auth) as channel:
        return sampler_pb2_grpc.SamplerStub(channel).Generate(request, timeout=600)


def _export_logits(export: Path, tokens: list[int]) -> tuple[np.ndarray, np.ndarray]:
    """Logits [1, T, V] of the export: in transformers, and in SplitRL."""
    import jax.numpy as jnp
    import torch
    import transformers

    from splitrl.models import from_pretrained

    hf = transformers.AutoModelForCausalLM.from_pretrained(export, dtype=torch.float32).eval()
    ours = from_pretrained(export)
    return _hf_logits(hf, tokens), np.asarray(ours(jnp.asarray([tokens]))[0])


def _hf_logits(hf, tokens: list[int]) -> np.ndarray:
    import torch

    with torch.no_grad():
        return hf(torch.tensor([tokens], dtype=torch.long)).logits.numpy()


def _token_logprobs(logits: np.ndarray, tokens: list[int], n: int) -> np.ndarray:
    """log p of the last ``n`` tokens from ``logits`` [T, V] (position t predicts t + 1)."""
    rows = logits[len(tokens) - n - 1: len(tokens) - 1].astype(np.float64)
    top = rows.max(-1, keepdims=True)
    logp = rows - top - np.log(np.exp(rows - top).sum(-1, keepdims=True))
    return logp[np.arange(n), tokens[len(tokens) - n:]]
