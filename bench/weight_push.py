"""Weight push throughput and fan-out: trainer fsdp shards -> tensor-parallel sampler processes.

For a ~24M-parameter checkpoint (f32) and a ~466M-parameter synthetic model (bf16), this process
(4 emulated devices, fsdp) pushes the weights with the trainer's own publisher
(``trainer_service.orchestration.publisher``, full pushes: deltas are measured by
``bench/delta_push.py``) to 1, 2 and 4 sampler processes (2 emulated devices each, tensor
parallel), and prints, beside a raw loopback TCP stream of the same bytes measured in the same
run:

- ``ratio push/raw-TCP``: one sampler over the bulk data plane (and the gRPC ``PushWeights``
  path for comparison), steady state: the best of ``--rounds`` pushes against the best of as
  many raw TCP streams, one measured just before each push (the best of more draws would be
  a higher bar: on a shared machine single streams range over 3x), after the first pushes into
  every sampler (printed apart: those fault in the sampler's staging buffers, once per
  sampler). The raw stream keeps both ends in the cache (the transport alone);
- ``ratio push/raw-TCP memory to memory``: the same against raw TCP of the model's bytes from
  main memory into a buffer of their size, as a push must move them (no checksums, checks or
  bookkeeping): what the protocol costs beyond moving those bytes;
- the CPU seconds one push to one sampler costs the trainer (this process) and the sampler
  process, beside those of the raw TCP stream (both ends): on a shared machine the wall-clock
  ratio moves with the load, the CPU cost much less;
- wall time and trainer egress bytes for 1, 2 and 4 samplers (one relay chain), and
  ``fan-out trainer egress 4/1``;
- for the small model, the longest pause generation sees during a swap: Generate calls run back
  to back while pushes go on, compared with the same calls without a push;
- for the small model, an adapter push (LoRA rank 16 on every attention and MLP projection):
  its bytes against the full push's (``lora push bytes / full push bytes``), its wall time, and
  whether the sampler then serves exactly the trainer's merged weights (GetInfo digests).

    python bench/weight_push.py            # both sizes (several minutes, ~14 GB of memory)
    python bench/weight_push.py --quick    # the small model only
"""

from __future__ import annotations

import argparse
import json
import os
import resource
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

from splitrl.config import MeshConfig, PushConfig, ServicesConfig  # noqa: E402
from splitrl.mesh import build_mesh, param_shardings  # noqa: E402
from splitrl.models import TransformerConfig, init_random, save_pretrained  # noqa: E402
from splitrl.v1 import common_pb2, sampler_pb2  # noqa: E402
from trainer_service.orchestration.membership import SamplerPool  # noqa: E402
from trainer_service.orchestration.publisher import WeightPublisher  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
CHUNK = 4 * 1024 * 1024 - 64 * 1024
SAMPLERS = (1, 2, 4)


def model_config(size: str) -> TransformerConfig:
    if size == "small":  # ~24M parameters
        return TransformerConfig(family="qwen2", vocab_size=8192, hidden_size=512,
                                 intermediate_size=2048, num_layers=4, num_heads=8,
                                 num_kv_heads=4, head_dim=64, attention_bias=True,
                                 tie_word_embeddings=False, eos_token_id=1, pad_token_id=0)
    # ~466M parameters
    return TransformerConfig(family="qwen2", vocab_size=8192, hidden_size=1536,
                             intermediate_size=4096, num_layers=18, num_heads=12,
                             num_kv_heads=4, head_dim=128, attention_bias=True,
                             tie_word_embeddings=True, eos_token_id=1, pad_token_id=0)


LORA_RANK = 16


def start_sampler(model_dir: Path, work: Path, index: int, dtype: str, lora: bool) -> tuple:
    cfg = {
        "model": {"path": str(model_dir), "dtype": dtype,
                  **({"lora": {"rank": LORA_RANK}} if lora else {})},
        "sampler": {"max_batch_size": 16, "max_sequence_length": 64, "max_chunk_bytes": CHUNK,
                    "mesh": {"axes": {"tensor": 2}, "strategy": "tp"},
                    "register_with_trainer": False},
        "services": {"sampler_port": 0, "reward_address": ""},
        "trainer": {"steps": 1_000_000},
    }
    path = work / f"sampler-{index}.yaml"
    path.write_text(yaml.safe_dump(cfg))
    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=2",
               JAX_PLATFORMS="cpu", HF_HUB_OFFLINE="1")
    log = (work / f"sampler-{index}.log").open("w")
    proc = subprocess.Popen([sys.executable, "-m", "sampler_service", "--config", str(path)],
                            stdout=subprocess.PIPE, stderr=log, env=env, text=True, cwd=REPO)
    for line in proc.stdout:
        if line.startswith("{") and '"listening"' in line:
            return proc, f"127.0.0.1:{json.loads(line)['port']}"
    raise RuntimeError(f"sampler {index} did not start; see {work}/sampler-{index}.log")


def raw_tcp_mb_s(total_bytes: int, source: np.ndarray | None = None,
                 dest: np.ndarray | None = None) -> float:
    """Loopback TCP of ``total_bytes`` from this process to a reader thread.

    Default: one 1 MiB block written over and over, drained in 1 MiB reads: both ends stay in
    the cache, so this is the transport alone. With ``source`` and ``dest`` (flat uint8 arrays
    of ``total_bytes``): the bytes of ``source`` (the model's, in main memory) written in
    chunk-sized pieces and received in place into ``dest`` (faulted in beforehand): memory to
    memory, as a push must move them, without its checksums, checks and bookkeeping."""
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(1)
    port = server.getsockname()[1]

    def drain():
        conn, _ = server.accept()
        got = 0
        while got < total_bytes:
            if dest is None:
                n = len(conn.recv(1 << 20))
            else:
                n = conn.recv_into(memoryview(dest)[got : got + CHUNK], 0, socket.MSG_WAITALL)
            if not n:
                break
            got += n
        conn.close()

    reader = threading.Thread(target=drain)
    reader.start()
    block = memoryview(np.random.default_rng(0).bytes(1 << 20) if source is None else source)
    start = time.perf_counter()
    with socket.create_connection(("127.0.0.1", port)) as s:
        sent = 0
        while sent < total_bytes:
            n = min(total_bytes - sent, len(block) if source is None else CHUNK)
            s.sendall(block[:n] if source is None else block[sent : sent + n])
            sent += n
    reader.join()
    server.close()
    return total_bytes / (time.perf_counter() - start) / 1e6


def cpu_seconds(pid: int | None = None) -> float:
    """User + system CPU seconds of this process (all threads) or of process ``pid``."""
    if pid is None:
        usage = resource.getrusage(resource.RUSAGE_SELF)
        return usage.ru_utime + usage.ru_stime
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


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


class Pusher:
    """The trainer's publisher over a pool of the sampler processes (full pushes)."""

    def __init__(self, addresses: list[str], transport: str, lora=None, base_fingerprint=None):
        services = ServicesConfig(sampler_addresses=addresses, sampler_timeout_s=600)
        self.pool = SamplerPool(services, max_message_bytes=2 * CHUNK + (1 << 20))
        self.pool.refresh()
        by_address = {h.address: h for h in self.pool.all()}
        self.handles = [by_address[a] for a in addresses]
        self.publisher = WeightPublisher(
            self.pool, push=PushConfig(transport=transport, delta=False, timeout_s=600),
            lora=lora, base_fingerprint=base_fingerprint)

    def push(self, params, version: int, n: int) -> tuple[float, int, list]:
        start = time.perf_counter()
        results = self.publisher.push_all(params, version, handles=self.handles[:n])
        seconds = time.perf_counter() - start
        failed = [r for r in results if not r.ok]
        if failed:
            raise RuntimeError(f"push failed: {failed}")
        return seconds, sum(r.egress_bytes for r in results), results

    def close(self) -> None:
        self.publisher.close()
        self.pool.stop()


def bench_size(size: str, work: Path, rounds: int, measure_pause: bool) -> dict:
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
    procs, addresses = [], []
    out = {"size": size, "params_M": n_params / 1e6, "MB": nbytes / 1e6, "dtype": dtype}
    try:
        for i in range(max(SAMPLERS)):
            proc, address = start_sampler(model_dir, work, i, dtype, lora=measure_pause)
            procs.append(proc)
            addresses.append(address)
        bulk, grpc_ = Pusher(addresses, "bulk"), Pusher(addresses, "grpc")
        version = 1
        # The first pushes into a fresh sampler fault in its staging buffers (two sets on
        # XLA:CPU: the first set serves after the first swap) and warm its code paths; a run
        # pays that once per sampler. Reported apart; every figure below is steady state.
        out["first_push_s"] = []
        for n in (1, 1, max(SAMPLERS), max(SAMPLERS)):
            seconds, _, _ = bulk.push(params, version, n)
            version += 1
            if n == 1:
                out["first_push_s"].append(seconds)
        # The model's bytes in main memory, and a faulted-in buffer of the same size to land
        # them in: the memory-to-memory reference (raw_tcp_mb_s).
        source = np.concatenate([np.asarray(v).reshape(-1).view(np.uint8)
                                 for v in params.values()])
        dest = np.zeros_like(source)
        tcp, memory = [], []
        out["bulk"] = {}
        cpu = {"raw_tcp": [], "raw_tcp_memory": [], "trainer": [], "sampler": []}
        for n in SAMPLERS:
            times, egress = [], []
            for _ in range(rounds):
                if n == 1:  # each reference beside each push it is compared with, as often
                    start = cpu_seconds()
                    memory.append(raw_tcp_mb_s(nbytes, source, dest))
                    mid = cpu_seconds()
                    tcp.append(raw_tcp_mb_s(nbytes))
                    cpu["raw_tcp_memory"].append(mid - start)
                    cpu["raw_tcp"].append(cpu_seconds() - mid)
                start, sampler = cpu_seconds(), cpu_seconds(procs[0].pid)
                seconds, sent, _ = bulk.push(params, version, n)
                if n == 1:
                    cpu["trainer"].append(cpu_seconds() - start)
                    cpu["sampler"].append(cpu_seconds(procs[0].pid) - sampler)
                version += 1
                times.append(seconds)
                egress.append(sent)
            out["bulk"][n] = {"seconds": min(times), "egress_MB": max(egress) / 1e6,
                              "MB_per_s_all": [round(nbytes / t / 1e6) for t in times]}
        out["cpu_s"] = {k: min(v) for k, v in cpu.items()}
        seconds, _, _ = grpc_.push(params, version, 1)
        version += 1
        out["grpc_seconds"] = seconds
        out["raw_tcp_MB_per_s"] = max(tcp)
        out["raw_tcp_MB_per_s_all"] = [round(t) for t in tcp]
        out["raw_tcp_memory_MB_per_s"] = max(memory)
        out["raw_tcp_memory_MB_per_s_all"] = [round(t) for t in memory]
        del source, dest
        one = out["bulk"][1]["seconds"]
        out["push_MB_per_s"] = nbytes / one / 1e6
        out["ratio"] = out["push_MB_per_s"] / out["raw_tcp_MB_per_s"]
        out["ratio_memory"] = out["push_MB_per_s"] / out["raw_tcp_memory_MB_per_s"]
        out["grpc_ratio"] = nbytes / seconds / 1e6 / out["raw_tcp_MB_per_s"]
        out["egress_4_over_1"] = out["bulk"][4]["egress_MB"] / out["bulk"][1]["egress_MB"]
        if measure_pause:
            stub = bulk.handles[0].stub
            idle: list[float] = []
            stop = threading.Event()
            t = threading.Thread(target=generate_latencies, args=(stub, stop, idle))
            t.start()
            wait_for_calls(idle, 30, timeout_s=300)
            stop.set()
            t.join()
            during: list[float] = []
            stop = threading.Event()
            t = threading.Thread(target=generate_latencies, args=(stub, stop, during))
            t.start()
            for _ in range(3):
                bulk.push(params, version, 1)
                version += 1
            stop.set()
            t.join()
            idle = idle[5:]  # the first calls compile the generation programs
            out["generate_ms_idle_max"] = max(idle) * 1e3
            out["generate_ms_idle_median"] = float(np.median(idle)) * 1e3
            out["generate_ms_during_push_max"] = max(during) * 1e3
            _, _, full = bulk.push(params, version, 1)
            version += 1
            out["lora"] = bench_lora(cfg, model_dir, addresses[:1], params, version,
                                     full[0].bytes, rounds)
        bulk.close()
        grpc_.close()
        return out
    finally:
        for proc in procs:
            proc.terminate()
        for proc in procs:
            proc.wait(timeout=60)


def bench_lora(cfg: TransformerConfig, model_dir: Path, addresses: list[str], params,
               version: int, full_bytes: int, rounds: int) -> dict:
    """Adapter pushes to one sampler: bytes vs a full push, time, and bitwise serving."""
    from splitrl import wire
    from splitrl.models import lora as lora_lib
    from splitrl.models.hf_io import checkpoint_fingerprint

    spec = lora_lib.LoraSpec(LORA_RANK, 2.0 * LORA_RANK,
                             lora_lib.resolve_targets(cfg, lora_lib.ALL_PROJECTIONS))
    rng = np.random.default_rng(0)
    adapters = {n: (0.01 * rng.standard_normal(a.shape)).astype(np.float32)
                for n, a in lora_lib.init_adapters(cfg, spec).items()}  # B != 0: a trained one
    adapters = jax.device_put(adapters, param_shardings(params[next(iter(params))].sharding.mesh,
                                                        adapters, "fsdp"))
    pusher = Pusher(addresses, "bulk", lora=spec,
                    base_fingerprint=checkpoint_fingerprint(model_dir))
    try:
        times = []
        for _ in range(rounds):
            seconds, _, results = pusher.push(adapters, version, 1)
            version += 1
            times.append(seconds)
        info = pusher.handles[0].stub.GetInfo(sampler_pb2.GetInfoRequest(include_digests=True))
    finally:
        pusher.close()
    merged = lora_lib.merge(params, adapters, spec)
    want = {n: wire.array_digest(np.asarray(a)) for n, a in merged.items()}
    served = {p.name: p.digest for p in info.params}
    return {"targets": len(spec.targets), "bytes": results[0].bytes, "full_bytes": full_bytes,
            "ratio": results[0].bytes / full_bytes, "seconds": min(times),
            "bitwise": served == want}


def report(row: dict) -> None:
    size = row["size"]
    print(f"\n[{size}] {row['params_M']:.0f}M parameters, {row['MB']:.0f} MB ({row['dtype']}); "
          f"raw loopback TCP {row['raw_tcp_MB_per_s']:.0f} MB/s (best of "
          f"{row['raw_tcp_MB_per_s_all']})")
    print(f"{'samplers':>8} {'wall s':>8} {'MB/s per sampler':>17} {'egress MB':>10}")
    for n, r in row["bulk"].items():
        print(f"{n:>8} {r['seconds']:>8.3f} {row['MB'] / r['seconds']:>17.0f} "
              f"{r['egress_MB']:>10.1f}")
    print(f"[{size}] gRPC PushWeights, 1 sampler: {row['MB'] / row['grpc_seconds']:.0f} MB/s "
          f"(ratio {row['grpc_ratio']:.2f})")
    first = row["first_push_s"]
    print(f"[{size}] first two pushes into a fresh sampler (once per sampler, not in the ratio): "
          f"{first[0]:.3f} s, {first[1]:.3f} s ({row['MB'] / first[0]:.0f} and "
          f"{row['MB'] / first[1]:.0f} MB/s)")
    print(f"[{size}] ratio push/raw-TCP: {row['ratio']:.2f}")
    pushes = row["bulk"][1]["MB_per_s_all"]
    print(f"[{size}] pushes to 1 sampler: {pushes} MB/s; median push / median raw TCP: "
          f"{np.median(pushes) / np.median(row['raw_tcp_MB_per_s_all']):.2f}, memory to "
          f"memory {np.median(pushes) / np.median(row['raw_tcp_memory_MB_per_s_all']):.2f}")
    print(f"[{size}] raw loopback TCP of the model's bytes, memory to memory: "
          f"{row['raw_tcp_memory_MB_per_s']:.0f} MB/s (best of "
          f"{row['raw_tcp_memory_MB_per_s_all']}), CPU (both ends) "
          f"{row['cpu_s']['raw_tcp_memory']:.3f} s; ratio push/raw-TCP memory to memory: "
          f"{row['ratio_memory']:.2f}")
    cpu = row["cpu_s"]
    print(f"[{size}] CPU seconds per push to 1 sampler: trainer {cpu['trainer']:.3f}, sampler "
          f"{cpu['sampler']:.3f}; raw TCP of the same bytes (both ends) {cpu['raw_tcp']:.3f} "
          f"(ratio {cpu['raw_tcp'] / (cpu['trainer'] + cpu['sampler']):.2f})")
    print(f"[{size}] fan-out trainer egress 4/1: {row['egress_4_over_1']:.2f}")
    if "generate_ms_during_push_max" in row:
        print(f"[{size}] generation pause during swaps: longest Generate call "
              f"{row['generate_ms_during_push_max']:.0f} ms while pushing vs "
              f"{row['generate_ms_idle_max']:.0f} ms max / "
              f"{row['generate_ms_idle_median']:.0f} ms median idle")
    if "lora" in row:
        lora = row["lora"]
        print(f"[{size}] LoRA rank {LORA_RANK} on {lora['targets']} projections: adapter push "
              f"{lora['bytes'] / 1e6:.2f} MB vs full push {lora['full_bytes'] / 1e6:.1f} MB; "
              f"lora push bytes / full push bytes: {lora['ratio']:.3f}; "
              f"{lora['seconds']:.3f} s (merge on the sampler included); sampler serves the "
              f"trainer's merge bitwise: {lora['bitwise']}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="only the ~24M model")
    parser.add_argument("--rounds", type=int, default=5,
                        help="pushes per sampler count (and raw TCP streams beside the pushes "
                             "to one sampler)")
    args = parser.parse_args()
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        rows.append(bench_size("small", work, args.rounds, measure_pause=True))
        if not args.quick:
            rows.append(bench_size("large", work, args.rounds, measure_pause=False))
    print(f"\nload average: {os.getloadavg()}")
    for row in rows:
        report(row)
    print(json.dumps(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
