"""The sampler's gRPC server (GetInfo, PushWeights, Rollout, Generate) and its bulk data plane.

    serve(config) -> (Server, SamplerServicer)     start on services.host:services.sampler_port
    main(config)                                   serve until SIGTERM/SIGINT (``splitrl sampler``)

The model comes from ``model.path`` (a Hugging Face directory; its tokenizer, if present, is
used for text/chat prompts and to decode completions), placed on ``sampler.mesh`` with the
partition rules of ``sampler.mesh.strategy``. It serves weight version 0 until a trainer pushes.
``main`` prints one JSON line ``{"event": "listening", "address": ..., ...}`` on stdout once
the port is bound (port 0 picks a free one), so a parent process can read the address, and
(``sampler.register_with_trainer``) registers with the trainer and heartbeats.

Every RPC needs the shared token when ``services.auth`` configures one (``splitrl.auth``). The gRPC
message limit is raised above ``sampler.max_chunk_bytes`` so an oversized chunk reaches the
weight store and gets a RESOURCE_EXHAUSTED that names the limit. Shutdown marks the health
service NOT_SERVING, lets in-flight calls finish (``sampler.shutdown_grace_s``) and exits.

Weights arrive by either transport: ``PushWeights`` (gRPC), or the bulk data plane on
``sampler.data_port`` (``sampler_service.intake``; advertised as ``GetInfo.data_address``),
which the trainer prefers. Both apply the same checks through the same ``WeightStore``, and both
give up on a sender that goes quiet for ``sampler.push_idle_timeout_s``. The sampler serves in
``sampler.dtype`` (default ``model.dtype``): a trainer with float32 master weights sends bfloat16.
"""

from __future__ import annotations

import json
import logging
import queue
import socket
import sys
import threading
import time
import uuid
from collections.abc import Iterator

import grpc
import jax
from flax import nnx

from sampler_service import metrics
from sampler_service.intake import BulkIntake, record_push
from sampler_service.rollout import RequestError, RewardClient, RolloutWorker
from sampler_service.weights import WeightStore
from splitrl.agreement import DIFFERING_KEYS, agreed_settings
from splitrl.config import Config
from splitrl.dataplane.server import DataServer
from splitrl.error_cause import abort
from splitrl.logs import configure_logging, set_context
from splitrl.mesh import build_mesh
from splitrl.metrics import start_metrics_server
from splitrl.serving import (
    DEFAULT_MAX_MESSAGE_BYTES,
    Server,
    make_channel,
    serve_until_signal,
    start_server,
)
from splitrl.v1 import sampler_pb2, sampler_pb2_grpc, trainer_pb2, trainer_pb2_grpc
from splitrl.wire import WireError

log = logging.getLogger(__name__)

SERVICE_NAME = "splitrl.v1.Sampler"


class SamplerServicer(sampler_pb2_grpc.SamplerServicer):
    def __init__(self, config: Config, weights: WeightStore, worker: RolloutWorker,
                 address: str = ""):
        self.config = config
        self.weights = weights
        self.worker = worker
        self.address = address
        self.data_address = ""
        self.http_port: int | None = None  # the OpenAI-compatible HTTP API's, when served
        self.instance_id = uuid.uuid4().hex  # this process, whatever address reaches it
        # What a trainer must have equal to take this sampler (checked at its registration).
        self.agreed = agreed_settings(config, weights.config, worker.tokenizer)
        metrics.WEIGHT_VERSION.set(weights.version)

    @property
    def sampler_id(self) -> str:
        return self.worker.sampler_id

    def GetInfo(self, request, context):
        mesh = self.weights.mesh
        devices = mesh.devices.reshape(-1)
        model = self.weights.config
        info = sampler_pb2.SamplerInfo(
            sampler_id=self.sampler_id,
            model_fingerprint=self.weights.fingerprint,
            architecture=model.architecture,
            model_config_json=json.dumps(model.to_hf_dict(), sort_keys=True),
            params=self.weights.param_infos(include_digests=request.include_digests),
            mesh=sampler_pb2.MeshInfo(axis_names=list(mesh.axis_names),
                                      axis_sizes=[int(s) for s in mesh.devices.shape],
                                      device_count=int(devices.size),
                                      platform=devices[0].platform),
            weight_version=self.weights.version,
            max_batch_size=self.worker.max_batch_size,
            max_sequence_length=self.worker.max_sequence_length,
            max_chunk_bytes=self.weights.max_chunk_bytes,
            address=self.address,
            instance_id=self.instance_id,
            data_address=self.data_address,
            weights_id=self.weights.weights_id,
            base_fingerprint=self.weights.base_fingerprint,
            agreed=self.agreed,
        )
        metrics.REQUESTS.labels("GetInfo", "OK").inc()
        return info

    def PushWeights(self, request_iterator, context):
        idle_s = self.config.sampler.push_idle_timeout_s

        def sender_alive() -> bool:  # a push its sender gave up on is never applied
            return context.is_active() and context.time_remaining() > 0

        # The call's deadline as this sampler counts it (logged with the push): the sender's
        # timeout as gRPC sent it, rounded up, from when the call arrived here, so a little
        # after the sender's own. A push that ends in between is applied although its sender
        # has already reported a failure; the trainer then treats the sampler's weights as
        # unknown and pushes in full (the data plane's DECISION has no such gap).
        remaining = context.time_remaining()  # ~9.2e18 s for a call without a deadline
        deadline = time.time() + remaining if remaining < _NO_DEADLINE_S else None
        try:
            result = self.weights.apply_push(_paced(request_iterator, idle_s),
                                             sender_alive=sender_alive, deadline=deadline)
        except WireError as e:
            record_push(None, e.code, e.message, self.weights.version)
            context.abort(e.code, e.message)
        except Exception as e:  # a bug or a broken stream: say so, keep the old weights
            if not context.is_active():
                record_push(None, grpc.StatusCode.CANCELLED, repr(e), self.weights.version)
                raise
            metrics.PUSHES.labels("INTERNAL").inc()
            log.exception("weight push failed")
            context.abort(grpc.StatusCode.INTERNAL, f"weight push failed: {e!r}; the "
                          f"serving weights (version {self.weights.version}) are unchanged")
        record_push(result, grpc.StatusCode.OK)
        # The reply goes when this returns: the served form of the new weights is made
        # meanwhile (on the data plane, once the final report is sent).
        self.worker.engine.serve_ahead()
        return sampler_pb2.PushWeightsReply(version=result.version,
                                            bytes_received=result.bytes_received,
                                            seconds=result.seconds,
                                            swap_seconds=result.swap_seconds)

    def Generate(self, request, context):
        try:
            reply = self.worker.generate(request, context)
        except RequestError as e:
            metrics.REQUESTS.labels("Generate", e.code.name).inc()
            abort(context, e.code, e.message, e.cause)
        except Exception as e:
            metrics.REQUESTS.labels("Generate", "INTERNAL").inc()
            log.exception("generate failed")
            context.abort(grpc.StatusCode.INTERNAL, f"generation failed: {e!r}")
        metrics.REQUESTS.labels("Generate", "OK").inc()
        return reply

    def Rollout(self, request, context):
        try:
            yield from self.worker.rollout(request, context)
        except RequestError as e:
            metrics.REQUESTS.labels("Rollout", e.code.name).inc()
            log.warning("rollout failed", extra={"code": e.code.name, "reason": e.message,
                                                 "request_id": request.request_id})
            abort(context, e.code, e.message, e.cause)
        except Exception as e:
            if not context.is_active():
                raise
            metrics.REQUESTS.labels("Rollout", "INTERNAL").inc()
            log.exception("rollout failed", extra={"request_id": request.request_id})
            context.abort(grpc.StatusCode.INTERNAL, f"rollout failed: {e!r}")
        metrics.REQUESTS.labels("Rollout", "OK").inc()


_NO_DEADLINE_S = 1e12


def _paced(messages: Iterator, idle_s: float) -> Iterator:
    """``messages`` (a request stream), ended by DEADLINE_EXCEEDED when the next message takes
    longer than ``idle_s``: a sender that opens a push and goes quiet must not hold the push
    lock. The stream is read on its own thread, so waiting on it can time out."""
    inbox: queue.Queue = queue.Queue(maxsize=2)
    done, stop = object(), threading.Event()

    def pump() -> None:
        try:
            for message in messages:
                while not stop.is_set():
                    try:
                        inbox.put(message, timeout=0.5)
                        break
                    except queue.Full:
                        continue
                if stop.is_set():
                    return
            inbox.put(done)
        except Exception as e:  # the stream broke (or did not decode): the handler says why
            inbox.put(e)

    threading.Thread(target=pump, name="push-stream", daemon=True).start()
    count = 0
    try:
        while True:
            try:
                item = inbox.get(timeout=idle_s)
            except queue.Empty:
                raise WireError(grpc.StatusCode.DEADLINE_EXCEEDED,
                                f"no push message for {idle_s:g}s after message #{count} "
                                "(sampler.push_idle_timeout_s); push abandoned, the serving "
                                "weights are unchanged") from None
            if item is done:
                return
            if isinstance(item, Exception):
                raise item
            count += 1
            yield item
    finally:
        stop.set()


def _load_tokenizer(path: str, tokenizer_class: str | None):
    from splitrl.model_path import local_dir
    from splitrl.tokenizer import has_tokenizer, load_tokenizer

    local = local_dir(path)  # None: a hub id, whose tokenizer comes from the hub (or its cache)
    if local is not None and not has_tokenizer(local):
        log.warning("no tokenizer in model.path: token-id prompts only, no Rollout scoring",
                    extra={"path": path})
        return None
    return load_tokenizer(path, tokenizer_class)


def generation_stop_ids(model_path: str, model_config, tokenizer) -> list[int]:
    """The ids that end a completion: the checkpoint's `generation_config.json` eos ids (what
    `transformers.generate` stops on), then the tokenizer's eos and `<|im_end|>`
    (`splitrl.tokenizer.eos_token_ids`), then config.json's."""
    from splitrl.models.hf_io import generation_eos_ids

    ids = generation_eos_ids(model_path)
    if tokenizer is not None:
        from splitrl.tokenizer import eos_token_ids

        ids += [i for i in eos_token_ids(tokenizer) if i not in ids]
    eos = model_config.eos_token_id
    for i in (eos if isinstance(eos, tuple | list) else [eos]):
        if i is not None and int(i) not in ids:
            ids.append(int(i))
    return ids


def advertised_host(config: Config) -> str:
    services = config.services
    if services.advertise_host:
        return services.advertise_host
    if services.host in ("0.0.0.0", "::", "[::]", ""):
        return socket.gethostname()
    return services.host


def serve(config: Config) -> tuple[Server, SamplerServicer]:
    """Load the model, build mesh, weights, engine and reward client, and start the server."""
    from sampler_service.engine import engine_from_config, serving_dtype
    from splitrl.mesh import param_shardings
    from splitrl.models import from_pretrained, param_shapes
    from splitrl.models import load_config as load_model_config

    sampler = config.sampler
    dtype = serving_dtype(config)
    mesh = build_mesh(sampler.mesh)
    # Each parameter is read straight onto its shards of the mesh (numpy slices it on the
    # host), not onto one device first and resharded there (a small program compiled per
    # tensor shape, in every sampler process).
    shapes = {n: s.shape for n, s in param_shapes(load_model_config(config.model.path)).items()}
    model = from_pretrained(config.model.path, dtype,
                            shardings=param_shardings(mesh, shapes, sampler.mesh.strategy))
    graphdef, state = nnx.split(model)
    weights = WeightStore.from_state(model.config, state, mesh, strategy=sampler.mesh.strategy,
                                     max_chunk_bytes=sampler.max_chunk_bytes)
    del model, state
    if config.model.lora is not None:  # adapter pushes are merged into the checkpoint's weights
        from splitrl.models.hf_io import checkpoint_fingerprint

        weights.keep_base(checkpoint_fingerprint(config.model.path))
    threading.Thread(target=weights.warm_up, name="warm-up", daemon=True).start()
    tokenizer = _load_tokenizer(config.model.path, config.model.tokenizer_class)
    pad = model_pad = weights.config.pad_token_id
    if model_pad is None and tokenizer is not None:
        pad = tokenizer.pad_token_id
    engine = engine_from_config(
        config, weights.config, graphdef, mesh,
        eos_token_ids=generation_stop_ids(config.model.path, weights.config, tokenizer),
        pad_token_id=pad, weights=weights.snapshot)
    metrics.KV_CACHE_BUDGET_BYTES.set(engine.kv_cache_budget_bytes)
    reward = (RewardClient(config.services.reward_address, sampler.reward_timeout_s,
                           auth=config.services.auth)
              if config.services.reward_address else None)
    episodes = None
    if config.environment is not None:
        from sampler_service.episodes import Episodes

        if tokenizer is None:
            raise ValueError("environment: multi-turn episodes need the model's tokenizer and "
                             f"chat template; {config.model.path} has no tokenizer")
        episodes = Episodes(config.environment, tokenizer, engine, sampler.max_sequence_length,
                            stop_token_ids=[*engine.eos_token_ids,
                                            *config.sampling.stop_token_ids])
    worker = RolloutWorker(engine, weights, tokenizer=tokenizer, sampling=config.sampling,
                           reward=reward, sampler_id=sampler.sampler_id, episodes=episodes)
    servicer = SamplerServicer(config, weights, worker)
    max_message = max(DEFAULT_MAX_MESSAGE_BYTES, sampler.max_chunk_bytes + (1 << 20))
    server = start_server(
        lambda s: sampler_pb2_grpc.add_SamplerServicer_to_server(servicer, s),
        f"{config.services.host}:{config.services.sampler_port}",
        service_names=[SERVICE_NAME],
        max_message_bytes=max_message,
        auth=config.services.auth,
    )
    servicer.address = f"{advertised_host(config)}:{server.port}"
    if not worker.sampler_id:
        worker.sampler_id = servicer.address
    if sampler.data_port is not None:
        intake = BulkIntake(weights, auth=config.services.auth,
                            idle_timeout_s=sampler.push_idle_timeout_s,
                            sampler_id=worker.sampler_id, after_swap=engine.serve_ahead)
        data = DataServer(f"{config.services.host}:{sampler.data_port}", intake.handle,
                          auth=config.services.auth,
                          idle_timeout_s=sampler.push_idle_timeout_s).start()
        server.on_stop.append(lambda grace: data.stop(grace))
        intake.data_address = servicer.data_address = f"{advertised_host(config)}:{data.port}"
    if sampler.http_port is not None:
        from sampler_service.openai_http import OpenAIFront

        front = OpenAIFront(worker, model_name=sampler.served_model_name or config.model.path,
                            auth=config.services.auth)
        servicer.http_port = front.start(config.services.host, sampler.http_port)
        server.on_stop.append(lambda grace: front.stop(grace))
    log.info("sampler ready", extra={
        "address": servicer.address, "data_address": servicer.data_address,
        "http_port": servicer.http_port, "sampler_id": worker.sampler_id, "dtype": dtype.name,
        "mesh": dict(zip(mesh.axis_names, (int(s) for s in mesh.devices.shape), strict=True)),
        "devices": jax.device_count(), "params": len(weights.manifest),
        "max_batch_size": engine.max_batch_size, "kv_cache_bytes": engine.kv_cache_budget_bytes,
        "concurrent_batches": len(engine.schedulers),
        "batching": sampler.batching, "update_in_flight": sampler.update_in_flight,
        "fingerprint": weights.fingerprint, "weight_version": weights.version,
        "base_fingerprint": weights.base_fingerprint})
    return server, servicer


class TrainerRegistration:
    """Announces the sampler to the trainer (RegisterSampler), then heartbeats until stopped.

    A trainer that is not up yet, restarts, or forgets the sampler (``known`` false) is handled
    by registering again; failures are logged once per outage, never fatal.
    """

    def __init__(self, config: Config, servicer: SamplerServicer):
        self.address = config.services.trainer_address
        self.auth = config.services.auth
        self.interval_s = config.services.heartbeat_s
        self.servicer = servicer
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="register", daemon=True)

    def start(self) -> TrainerRegistration:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)

    def _run(self) -> None:
        channel = make_channel(self.address, auth=self.auth)
        stub = trainer_pb2_grpc.TrainerStub(channel)
        registered, failing = False, False
        refused: str | None = None  # the differing keys of the last refusal
        me = dict(sampler_id=self.servicer.sampler_id, address=self.servicer.address)
        try:
            while not self._stop.is_set():
                try:
                    if not registered:
                        reply = stub.RegisterSampler(trainer_pb2.RegisterSamplerRequest(**me),
                                                     timeout=5)
                        registered = reply.accepted
                        self.interval_s = reply.heartbeat_interval_s or self.interval_s
                        log.info("registered with the trainer", extra={"trainer": self.address})
                    else:
                        reply = stub.Heartbeat(trainer_pb2.HeartbeatRequest(
                            weight_version=self.servicer.weights.version, **me),
                            timeout=5)
                        registered = reply.known
                    failing, refused = False, None
                except grpc.RpcError as e:
                    registered = False
                    if e.code() == grpc.StatusCode.FAILED_PRECONDITION:  # refused: say why
                        keys = dict(e.trailing_metadata() or ()).get(DIFFERING_KEYS, "")
                        if refused is None or refused != keys:  # once per set of keys
                            log.error("the trainer refused this sampler: %s", e.details(),
                                      extra={"trainer": self.address,
                                             "differing_keys": keys.split(",") if keys else []})
                        refused = keys
                    elif not failing:
                        log.info("trainer not reachable; will retry", extra={
                            "trainer": self.address, "code": e.code().name})
                    failing = True
                self._stop.wait(self.interval_s)
        finally:
            channel.close()


def main(config: Config) -> int:
    """Run a sampler until SIGTERM/SIGINT (``splitrl sampler --config FILE``)."""
    configure_logging("sampler", run_id=config.run_name)
    metrics_port = start_metrics_server(config.services.metrics_port)
    try:
        server, servicer = serve(config)
    except (OSError, ValueError) as e:  # missing/broken checkpoint, bad mesh, port in use
        log.error("sampler failed to start", extra={"error": str(e)})
        print(f"sampler: cannot start: {e}", file=sys.stderr)
        return 2
    set_context(weight_version=servicer.weights.version, sampler_id=servicer.sampler_id)
    print(json.dumps({"event": "listening", "service": "sampler", "address": server.address,
                      "advertised": servicer.address, "port": server.port,
                      "http_port": servicer.http_port, "metrics_port": metrics_port}),
          flush=True)
    registration = None
    if config.sampler.register_with_trainer and config.services.trainer_address:
        registration = TrainerRegistration(config, servicer).start()
    try:
        serve_until_signal(server, grace_s=config.sampler.shutdown_grace_s)
    finally:
        if registration is not None:
            registration.stop()
        servicer.worker.close()
        servicer.worker.engine.close()
    print(json.dumps({"event": "stopped", "service": "sampler"}), file=sys.stdout, flush=True)
    return 0
