"""A Sampler gRPC service with scripted behaviour, for the trainer's orchestration tests.

It speaks the real protocol on 127.0.0.1 through the project's own server (auth interceptor,
health), so the dispatcher and the sampler pool are exercised over real gRPC. What it cannot
do is generate: completions are fixed tokens and the reward is 1 for prompts whose text ends
in "+0=" (so tests can make groups with or without signal). The failure modes real samplers
show are scripted: die after k groups, stall, report older weights, refuse invalid prompts,
or find the reward service down. (The real sampler is tested in tests/sampler_service and end
to end in tests/e2e; this double exists to make each failure happen on cue.)
"""

from __future__ import annotations

import threading
import time
import uuid
from dataclasses import dataclass, field

import grpc

from splitrl.error_cause import Cause, abort
from splitrl.serving import start_server
from splitrl.v1 import common_pb2, sampler_pb2, sampler_pb2_grpc


@dataclass
class Script:
    version: int = 0
    capacity: int = 64
    fail_after: int | None = None  # abort with UNAVAILABLE after this many groups (once)
    stall_s: float = 0.0  # the first request answers nothing this long (or until cancelled)
    behind: bool = False  # answer FAILED_PRECONDITION (weights older than asked)
    reward_down: int = 0  # answer UNAVAILABLE, cause REWARD_UNAVAILABLE, this many times
    broken: bool = False  # answer INTERNAL (every generation step fails), yet answer GetInfo
    refuse_text: str = "BAD"  # INVALID_ARGUMENT for a request holding a prompt with this
    flat: bool = False  # every completion of a group gets the same reward
    architecture: str = "ScriptedForCausalLM"
    shapes: dict = field(default_factory=lambda: {"model.embed_tokens.weight": (16, 8)})
    agreed: dict = field(default_factory=dict)  # GetInfo.agreed (splitrl.agreement)


@dataclass
class ScriptedSampler(sampler_pb2_grpc.SamplerServicer):
    name: str
    script: Script = field(default_factory=Script)
    requests: list[sampler_pb2.RolloutRequest] = field(default_factory=list)
    instance_id: str = field(default_factory=lambda: uuid.uuid4().hex)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def start(self, address: str = "127.0.0.1:0"):
        """Serve at ``address`` (a free port by default; a stopped one's: its restart)."""
        self.server = start_server(
            lambda s: sampler_pb2_grpc.add_SamplerServicer_to_server(self, s),
            address, service_names=["splitrl.v1.Sampler"])
        self.address = self.server.address
        return self

    def stop(self) -> None:
        self.server.stop(0)

    def GetInfo(self, request, context):
        params = [sampler_pb2.ParamInfo(name=n, dtype="float32", shape=list(s))
                  for n, s in self.script.shapes.items()]
        return sampler_pb2.SamplerInfo(sampler_id=self.name, weight_version=self.script.version,
                                       max_batch_size=self.script.capacity,
                                       max_sequence_length=64, max_chunk_bytes=1 << 20,
                                       architecture=self.script.architecture, params=params,
                                       instance_id=self.instance_id, agreed=self.script.agreed)

    def Rollout(self, request, context):
        script = self.script
        with self.lock:
            self.requests.append(request)
            down = script.reward_down > 0
            script.reward_down -= int(down)
            stall_s, script.stall_s = script.stall_s, 0.0
        until = time.monotonic() + stall_s
        while context.is_active() and time.monotonic() < until:
            time.sleep(0.01)
        if script.behind or request.min_version > script.version:
            context.abort(grpc.StatusCode.FAILED_PRECONDITION,
                          f"min_version is {request.min_version} but this sampler serves "
                          f"weight version {script.version}")
        if down:
            abort(context, grpc.StatusCode.UNAVAILABLE, "scoring is down", Cause.REWARD_UNAVAILABLE)
        if script.broken:
            context.abort(grpc.StatusCode.INTERNAL, "rollout failed: ValueError('Expected 2 "
                          "per-device arrays')")
        for i, prompt in enumerate(request.prompts):
            if script.refuse_text in prompt.text:
                context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                              f"prompts[{i}]: prompt of 99 tokens + max_new_tokens 2 exceeds "
                              "the sampler's max_sequence_length 64")
        for sent, prompt in enumerate(request.prompts):
            if script.fail_after is not None and sent == script.fail_after:
                script.fail_after = None
                context.abort(grpc.StatusCode.UNAVAILABLE, "sampler process died")
            correct = 1.0 if prompt.text.endswith("+0=") else 0.0
            completions = [
                common_pb2.Completion(
                    token_ids=[3, 2], logprobs=[-0.5, -0.1], text="x", finish_reason="stop",
                    rewards={"acc": correct if script.flat or j == 0 else 0.0},
                    total_reward=correct if script.flat or j == 0 else 0.0,
                    weight_versions=[script.version])
                for j in range(request.group_size)]
            yield sampler_pb2.ScoredGroup(
                request_id=request.request_id, prompt_id=prompt.prompt_id,
                prompt_token_ids=[5, 6], completions=completions,
                weight_version=script.version, sampler_id=self.name)
