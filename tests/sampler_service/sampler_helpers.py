"""Tiny models, sampler processes and push senders for the sampler weight/server tests.

As a script (run in a subprocess with its own emulated device count):

    python sampler_helpers.py push ADDRESS MODEL_DIR VERSION SEED [TOKEN]
        Loads MODEL_DIR's architecture, builds random weights (SEED) on an fsdp mesh over all
        local devices, asks the sampler at ADDRESS for its layout (GetInfo), pushes them
        resharded for it, and prints one JSON line: the reply, the sender's own shardings,
        the sender's per-parameter digests and the push figures.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]

VOCAB = 96


def tiny_config(**overrides):
    from splitrl.models import TransformerConfig

    kw = dict(family="qwen2", vocab_size=VOCAB, hidden_size=32, intermediate_size=64,
              num_layers=2, num_heads=4, num_kv_heads=2, head_dim=8, attention_bias=True,
              eos_token_id=1, pad_token_id=0, bos_token_id=2)
    kw.update(overrides)
    return TransformerConfig(**kw)


def write_model(path: Path, seed: int = 0) -> Path:
    """A tiny random Qwen2 checkpoint (config.json + safetensors) at ``path``; no tokenizer."""
    from splitrl.models import init_random, save_pretrained

    save_pretrained(init_random(tiny_config(), seed=seed, std=0.1), path)
    return path


def subprocess_env(devices: int) -> dict[str, str]:
    env = dict(os.environ)
    env.update(JAX_PLATFORMS="cpu", HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1",
               TOKENIZERS_PARALLELISM="false",
               XLA_FLAGS=f"--xla_force_host_platform_device_count={devices}",
               PYTHONPATH=os.pathsep.join([str(REPO), str(HERE), env.get("PYTHONPATH", "")]))
    return env


class SamplerProcess:
    """``python -m sampler_service --config FILE`` in a subprocess; reads its bound address."""

    def __init__(self, config_path: Path, devices: int, overrides: list[str] = (),
                 timeout_s: float = 120.0):
        cmd = [sys.executable, "-m", "sampler_service", "--config", str(config_path),
               *overrides]
        self.log_path = config_path.with_suffix(".log")
        self._log = open(self.log_path, "w")
        self.proc = subprocess.Popen(cmd, env=subprocess_env(devices), cwd=REPO,
                                     stdout=subprocess.PIPE, stderr=self._log, text=True)
        deadline = time.monotonic() + timeout_s
        self.address = None
        while time.monotonic() < deadline:
            line = self.proc.stdout.readline()
            if not line:
                break
            try:
                event = json.loads(line)
            except json.JSONDecodeError:
                continue
            if event.get("event") == "listening":
                self.address = event["address"]
                self.listening = event
                break
        if self.address is None:
            self.stop()
            raise RuntimeError(f"sampler did not start; log:\n{self.log_path.read_text()[-4000:]}")

    def stop(self, timeout_s: float = 30.0) -> int:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._log.close()
        return self.proc.returncode


def _push_main(address: str, model_dir: str, version: int, seed: int, token: str) -> None:
    import jax
    from flax import nnx

    from splitrl import wire
    from splitrl.config import AuthConfig
    from splitrl.mesh import param_shardings, spec_to_strings
    from splitrl.models import hf_from_state, init_random, load_config
    from splitrl.serving import make_channel
    from splitrl.v1 import sampler_pb2, sampler_pb2_grpc

    config = load_config(model_dir)
    mesh = jax.make_mesh((jax.device_count(),), ("fsdp",))
    flat = hf_from_state(nnx.state(init_random(config, seed=seed, std=0.1)))
    shardings = param_shardings(mesh, {n: a.shape for n, a in flat.items()}, "fsdp")
    params = {n: jax.device_put(a, shardings[n]) for n, a in flat.items()}
    stub = sampler_pb2_grpc.SamplerStub(make_channel(address, auth=AuthConfig(token=token or None)))
    info = stub.GetInfo(sampler_pb2.GetInfoRequest())
    targets = wire.layouts_from_info(info)
    messages = list(wire.iter_push_messages(params, version, max_chunk_bytes=info.max_chunk_bytes,
                                            target_shardings=targets, sender="test-fsdp"))
    regions = sum(1 for m in messages if m.HasField("chunk") and m.chunk.region_shape)
    start = time.perf_counter()
    reply = stub.PushWeights(iter(messages), timeout=60)
    seconds = time.perf_counter() - start
    print(json.dumps({
        "version": reply.version, "bytes": reply.bytes_received, "seconds": seconds,
        "server_seconds": reply.seconds, "swap_seconds": reply.swap_seconds,
        "chunks": len(messages) - 1, "region_chunks": regions, "devices": jax.device_count(),
        "sender_partitions": {n: spec_to_strings(a.sharding.spec, a.ndim)
                              for n, a in params.items()},
        "sender_shards": {n: len(a.addressable_shards) for n, a in params.items()},
        "digests": {n: wire.array_digest(np.asarray(a)) for n, a in params.items()},
    }), flush=True)


if __name__ == "__main__":
    if sys.argv[1] == "push":
        _push_main(sys.argv[2], sys.argv[3], int(sys.argv[4]), int(sys.argv[5]),
                   sys.argv[6] if len(sys.argv) > 6 else "")
    else:
        raise SystemExit(f"unknown command {sys.argv[1]!r}")
