"""Weight push throughput: trainer-side fsdp shards -> tensor-parallel samplers, over gRPC.

For a ~24M-parameter checkpoint (f32) and a ~500M-parameter synthetic model (bf16), this
pushes the weights from this process (4 emulated devices, fsdp) to 1 and to 2 sampler
processes (2 emulated devices each, tensor parallel) and prints MB/s beside a raw loopback TCP
stream of the same number of bytes measured in the same run. For the small model it also
measures the longest pause generation sees during a swap: Generate calls run back to back
while pushes go on, and their longest latency is compared with the same calls without a push
(and with the time the swap itself held the weights lock, reported by the sampler).

    python bench/weight_push.py            # both sizes (several minutes, ~8 GB of memory)
    python bench/weight_push.py --quick    # the small model only
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=4")
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402
import numpy as np  # noqa: E402
import yaml  # noqa: E402

from splitrl.config import MeshConfig  # noqa: E402
from splitrl.mesh import build_mesh, param_shardings  # noqa: E402
from splitrl.models import TransformerConfig, init_random, save_pretrained  # noqa: E402
from splitrl.serving import make_channel  # noqa: E402
from splitrl.v1 import common_pb2, sampler_pb2, sampler_pb2_grpc  # noqa: E402
from splitrl.wire import iter_push_messages, layouts_from_info  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
CHUNK = 4 * 1024 * 1024 - 64 * 1024


def model_config(size: str) -> TransformerConfig:
    if size == "small":  # ~24M parameters
        return TransformerConfig(family="qwen2", vocab_size=8192, hidden_size=512,
                                 intermediate_size=2048, num_layers=4, num_heads=8,
                                 num_kv_heads=4, head_dim=64, attention_bias=True,
                                 tie_word_embeddings=False, eos_token_id=1, pad_token_id=0)
    # ~500M parameters
    return TransformerConfig(family="qwen2", vocab_size=8192, hidden_size=1536,
                             intermediate_size=4096, num_layers=18, num_heads=12,
                             num_kv_heads=4, head_dim=128, attention_bias=True,
                             tie_word_embeddings=True, eos_token_id=1, pad_token_id=0)


def start_sampler(model_dir: Path, work: Path, index: int, dtype: str) -> tuple:
    cfg = {
        "model": {"path": str(model_dir), "dtype": dtype},
        "sampler": {"max_batch_size": 16, "max_sequence_length": 64,
                    "mesh": {"axes": {"tensor": 2}, "strategy": "tp"},
                    "register_with_trainer": False},
        "services": {"sampler_port": 0, "reward_address": ""},
    }
    path = work / f"sampler-{index}.yaml"
    path.write_text(yaml.safe_dump(cfg))
    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=2",
               JAX_PLATFORMS="cpu", HF_HUB_OFFLINE="1")
    log = (work / f"sampler-{index}.log").open("w")
    proc = subprocess.Popen([sys.executable, "-m", "sampler_service", "--config", str(path)],
                            stdout=subprocess.PIPE, stderr=log, env=env, text=True)
    for line in proc.stdout:
        if line.startswith("{") and '"listening"' in line:
            return proc, f"127.0.0.1:{json.loads(line)['port']}"
    raise RuntimeError(f"sampler {index} did not start; see {work}/sampler-{index}.log")


def raw_tcp_mb_s(total_bytes: int) -> float:
    """Loopback TCP: one sender streams ``total_bytes`` in 1 MiB writes to a draining reader."""
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(1)
    port = server.getsockname()[1]

    def drain():
        conn, _ = server.accept()
        got = 0
        while got < total_bytes:
            data = conn.recv(1 << 20)
            if not data:
                break
            got += len(data)
        conn.close()

    reader = threading.Thread(target=drain)
    reader.start()
    block = np.random.default_rng(0).bytes(1 << 20)
    start = time.perf_counter()
    with socket.create_connection(("127.0.0.1", port)) as s:
        sent = 0
        while sent < total_bytes:
            n = min(len(block), total_bytes - sent)
            s.sendall(block[:n])
            sent += n
    reader.join()
    server.close()
    return total_bytes / (time.perf_counter() - start) / 1e6


def push(stub, params, version, info) -> tuple[float, sampler_pb2.PushWeightsReply]:
    start = time.perf_counter()
    reply = stub.PushWeights(iter_push_messages(
        params, version, max_chunk_bytes=CHUNK, target_shardings=layouts_from_info(info)))
    return time.perf_counter() - start, reply


def generate_latencies(stub, stop: threading.Event, out: list[float]) -> None:
    request = sampler_pb2.GenerateRequest(
        prompts=[common_pb2.Prompt(prompt_id="p", token_ids=[3, 4, 5, 6])],
        sampling=common_pb2.SamplingParams(greedy=True, max_new_tokens=8))
    while not stop.is_set():
        t = time.perf_counter()
        stub.Generate(request)
        out.append(time.perf_counter() - t)


def wait_for_calls(latencies: list[float], n: int, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while len(latencies) < n and time.monotonic() < deadline:
        time.sleep(0.1)


def bench_size(size: str, work: Path, rounds: int, measure_pause: bool) -> list[dict]:
    cfg = model_config(size)
    dtype = "float32" if size == "small" else "bfloat16"
    jdtype = jax.numpy.float32 if dtype == "float32" else jax.numpy.bfloat16
    model_dir = work / f"model-{size}"
    print(f"[{size}] writing a random checkpoint...", flush=True)
    model = init_random(cfg, seed=0, dtype=jdtype)
    save_pretrained(model, model_dir)
    from flax import nnx

    from splitrl.models import hf_from_state

    flat = hf_from_state(nnx.state(model, nnx.Param))
    del model
    mesh = build_mesh(MeshConfig(axes={"fsdp": 4}))
    params = jax.device_put(flat, param_shardings(mesh, flat, "fsdp"))
    del flat
    n_params = sum(int(np.prod(v.shape)) for v in params.values())
    nbytes = sum(v.nbytes for v in params.values())
    procs, stubs, infos = [], [], []
    try:
        for i in range(2):
            proc, address = start_sampler(model_dir, work, i, dtype)
            procs.append(proc)
            channel = make_channel(address, max_message_bytes=CHUNK + (1 << 20))
            stub = sampler_pb2_grpc.SamplerStub(channel)
            stubs.append(stub)
            infos.append(stub.GetInfo(sampler_pb2.GetInfoRequest(), timeout=120))
        rows = []
        version = 1
        for n in (1, 2):
            times = []
            for _ in range(rounds):
                threads, results = [], [None] * n
                start = time.perf_counter()
                for k in range(n):
                    def run(k=k, v=version, results=results):
                        results[k] = push(stubs[k], params, v, infos[k])
                    threads.append(threading.Thread(target=run))
                    threads[-1].start()
                for t in threads:
                    t.join()
                times.append(time.perf_counter() - start)
                version += 1
            best = min(times)
            rows.append({"size": size, "params_M": n_params / 1e6, "MB": nbytes / 1e6,
                         "samplers": n, "seconds": best,
                         "MB_per_s": n * nbytes / best / 1e6,
                         "swap_lock_ms": max(r[1].swap_seconds for r in results) * 1e3})
        tcp = raw_tcp_mb_s(nbytes)
        for row in rows:
            row["raw_tcp_MB_per_s"] = tcp
            row["ratio_vs_tcp"] = row["MB_per_s"] / tcp
        if measure_pause:
            idle: list[float] = []
            stop = threading.Event()
            t = threading.Thread(target=generate_latencies, args=(stubs[0], stop, idle))
            t.start()
            wait_for_calls(idle, 30, timeout_s=300)
            stop.set()
            t.join()
            during: list[float] = []
            stop = threading.Event()
            t = threading.Thread(target=generate_latencies, args=(stubs[0], stop, during))
            t.start()
            for _ in range(3):
                push(stubs[0], params, version, infos[0])
                version += 1
            stop.set()
            t.join()
            idle = idle[5:]  # the first calls compile the generation programs
            rows[0]["generate_ms_idle_max"] = max(idle) * 1e3
            rows[0]["generate_ms_idle_median"] = float(np.median(idle)) * 1e3
            rows[0]["generate_ms_during_push_max"] = max(during) * 1e3
        return rows
    finally:
        for proc in procs:
            proc.terminate()
        for proc in procs:
            proc.wait(timeout=60)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="only the ~24M model")
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        rows += bench_size("small", work, args.rounds, measure_pause=True)
        if not args.quick:
            rows += bench_size("large", work, max(1, args.rounds - 1), measure_pause=False)
    print()
    print(f"{'model':>6} {'params':>8} {'MB':>8} {'samplers':>8} {'push MB/s':>10} "
          f"{'raw TCP MB/s':>13} {'ratio':>6} {'swap lock ms':>13}")
    for r in rows:
        print(f"{r['size']:>6} {r['params_M']:>7.0f}M {r['MB']:>8.0f} {r['samplers']:>8} "
              f"{r['MB_per_s']:>10.0f} {r['raw_tcp_MB_per_s']:>13.0f} "
              f"{r['ratio_vs_tcp']:>6.2f} {r['swap_lock_ms']:>13.2f}")
    small = rows[0]
    print(f"\ngeneration pause during swaps (small model): longest Generate call "
          f"{small['generate_ms_during_push_max']:.0f} ms while pushing vs "
          f"{small['generate_ms_idle_max']:.0f} ms max / "
          f"{small['generate_ms_idle_median']:.0f} ms median idle; the swap itself held the "
          f"weights lock {small['swap_lock_ms']:.2f} ms")
    print(json.dumps(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
