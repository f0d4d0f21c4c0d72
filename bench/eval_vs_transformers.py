"""`splitrl eval` against transformers' greedy decoding of the same prompts, same run.

    .venv/bin/python bench/eval_vs_transformers.py [--model DIR] [--limit 50] [--new-tokens 256]

Runs ``splitrl eval`` on the model (default: SmolLM2-135M-Instruct, `splitrl.models.gguf`) over
the first ``--limit`` GSM8K test questions (task gsm8k: the hub dataset, or the copies
$SPLITRL_DATA_DIR points at), greedy, rendered with the chat template, scored by math_accuracy.
Then transformers (float32, `generate` without sampling, the eos ids of the checkpoint's
generation_config.json) decodes the very prompts ``splitrl eval`` wrote to
``eval_completions.jsonl`` (as the model saw them, special tokens included), and the same
math_accuracy scores its completions. Prints both accuracies, how many completions are
identical, and the first that differs, with where.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def parse_args():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=None, help="HF checkpoint directory (default: SmolLM2)")
    ap.add_argument("--limit", type=int, default=50)
    ap.add_argument("--new-tokens", type=int, default=256)
    ap.add_argument("--batch", type=int, default=10,
                    help="prompts per request (splitrl) and per generate call (transformers)")
    ap.add_argument("--out", default=None, help="where splitrl eval writes (default: a temp dir)")
    return ap.parse_args()


def splitrl_eval(model: str, out: Path, limit: int, new_tokens: int, batch: int) -> list[dict]:
    """`splitrl eval` in a subprocess; its samplers take ``batch`` prompts per request (the
    evaluation requests' size is sampler.max_batch_size), so one request stays well within
    the dispatcher's time limit on a slow CPU."""
    cmd = [str(Path(sys.executable).with_name("splitrl")), "eval", model, "--k", "",
           "--limit", str(limit), "--out", str(out),
           "trainer.data.task=gsm8k", "trainer.data.chat_template=true",
           f"sampling.max_new_tokens={new_tokens}",
           f"sampler.max_sequence_length={new_tokens + 320}",
           "services.num_samplers=1", f"sampler.max_batch_size={batch}",
           "reward.functions=[{name: math_accuracy, weight: 1.0}]"]
    subprocess.run(cmd, check=True, cwd=REPO)
    lines = (out / "eval_completions.jsonl").read_text().splitlines()
    return [json.loads(line) for line in lines]


def transformers_greedy(model: str, prompts: list[str], new_tokens: int, batch: int):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig

    tokenizer = AutoTokenizer.from_pretrained(model)
    hf = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32).eval()
    config = GenerationConfig.from_pretrained(model, do_sample=False, max_new_tokens=new_tokens)
    pad = config.pad_token_id if config.pad_token_id is not None else tokenizer.pad_token_id
    eos = {int(i) for i in (config.eos_token_id if isinstance(config.eos_token_id, list)
                            else [config.eos_token_id])}
    texts = []
    for lo in range(0, len(prompts), batch):
        ids = [tokenizer.encode(p, add_special_tokens=False) for p in prompts[lo:lo + batch]]
        width = max(map(len, ids))
        tokens = torch.full((len(ids), width), pad, dtype=torch.long)
        mask = torch.zeros((len(ids), width), dtype=torch.long)
        for i, row in enumerate(ids):
            tokens[i, width - len(row):] = torch.tensor(row)
            mask[i, width - len(row):] = 1
        with torch.no_grad():
            out = hf.generate(tokens, attention_mask=mask, generation_config=config,
                              pad_token_id=pad)[:, width:].tolist()
        for row in out:
            end = next((i + 1 for i, t in enumerate(row) if t in eos), len(row))
            texts.append(tokenizer.decode(row[:end], skip_special_tokens=True))
        print(f"transformers: {len(texts)}/{len(prompts)} prompts", flush=True)
    return texts


def main():
    args = parse_args()
    for key in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE", "TRANSFORMERS_OFFLINE"):
        os.environ.setdefault(key, "1")
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    sys.path.insert(0, str(REPO))
    from reward_service.math_accuracy import make_math_accuracy

    if args.model is None:
        from splitrl.models.gguf import smollm2_checkpoint

        args.model = str(smollm2_checkpoint())
    out = Path(args.out or tempfile.mkdtemp(prefix="eval-vs-transformers-"))
    t0 = time.perf_counter()
    records = splitrl_eval(args.model, out, args.limit, args.new_tokens, args.batch)
    t1 = time.perf_counter()
    prompts = [r["prompt"] for r in records]
    theirs = transformers_greedy(args.model, prompts, args.new_tokens, args.batch)
    t2 = time.perf_counter()
    score = make_math_accuracy()
    references = [r["reference"] for r in records]
    ours = [r["completions"][0]["text"] for r in records]
    our_scores = [float(s) for s in score(prompts, ours, references)]
    their_scores = [float(s) for s in score(prompts, theirs, references)]
    assert our_scores == [r["completions"][0]["score"] for r in records]
    same = sum(a == b for a, b in zip(ours, theirs, strict=True))
    print(f"model {args.model}; {len(records)} GSM8K test prompts, greedy, chat template, "
          f"{args.new_tokens} new tokens at most (load average {os.getloadavg()[0]:.1f})")
    print(f"splitrl eval accuracy      = {sum(our_scores) / len(records):.3f} ({t1 - t0:.0f} s)")
    print(f"transformers greedy accuracy = {sum(their_scores) / len(records):.3f} "
          f"({t2 - t1:.0f} s)")
    print(f"identical completions: {same}/{len(records)}; same score: "
          f"{sum(a == b for a, b in zip(our_scores, their_scores, strict=True))}/{len(records)}")
    for r, a, b in zip(records, ours, theirs, strict=True):
        if a != b:
            k = next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y),
                     min(len(a), len(b)))
            print(f"first divergence: {r['prompt_id']} at character {k}: splitrl "
                  f"{a[max(0, k - 40):k + 40]!r} vs transformers {b[max(0, k - 40):k + 40]!r}")
            break
    (out / "transformers_completions.jsonl").write_text("".join(
        json.dumps({"prompt_id": r["prompt_id"], "text": t, "score": s}) + "\n"
        for r, t, s in zip(records, theirs, their_scores, strict=True)))
    print(f"completions: {out}")


if __name__ == "__main__":
    main()
