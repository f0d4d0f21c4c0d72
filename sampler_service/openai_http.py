"""The OpenAI-compatible HTTP API of a sampler: ``/v1/completions``, ``/v1/chat/completions``,
``/v1/models`` (docs/sampler.md).

What the rest of the ecosystem speaks to a serving engine (the ``openai`` client, judges,
lm-eval-harness's ``local-completions``, agents), served beside the gRPC API on
``sampler.http_port``. A request becomes a ``GenerateRequest`` and goes through the same
``RolloutWorker.generate`` as gRPC ``Generate``: same checks, same engine and continuous batch,
same seeds (a greedy request returns the same tokens on either API). Each choice also carries
its ``token_ids`` (and the response the ``prompt_token_ids``), as vLLM returns them on request,
for callers that train on what was generated.

Auth is the gRPC services' (``splitrl.auth``): with a token configured, every route needs
``Authorization: Bearer <token>``; ``/v1/models`` is open when ``splitrl.v1.Sampler/GetInfo`` is
in ``services.auth.open_methods``, the generating routes when ``splitrl.v1.Sampler/Generate``
is. TLS comes from the same certificate and key. Errors are OpenAI's JSON error object; its
``code`` is the gRPC status name of the same failure (``INVALID_ARGUMENT``...) and ``param``
the request field when the HTTP layer knows it, so clients branch on fields, not words.
Streaming is not supported (``stream: true`` is refused with 400).
"""

from __future__ import annotations

import asyncio
import logging
import socket
import threading
import time
import uuid
from typing import Any

import grpc
from aiohttp import web
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from sampler_service.rollout import RequestError, RolloutWorker
from splitrl.auth import AuthError, CallGuard, ssl_context
from splitrl.v1 import common_pb2, sampler_pb2

log = logging.getLogger(__name__)

GENERATE_METHOD = "splitrl.v1.Sampler/Generate"
INFO_METHOD = "splitrl.v1.Sampler/GetInfo"
# gRPC status -> HTTP status of the same failure.
HTTP_STATUS = {
    grpc.StatusCode.INVALID_ARGUMENT: 400,
    grpc.StatusCode.FAILED_PRECONDITION: 400,
    grpc.StatusCode.OUT_OF_RANGE: 400,
    grpc.StatusCode.UNAUTHENTICATED: 401,
    grpc.StatusCode.PERMISSION_DENIED: 403,
    grpc.StatusCode.NOT_FOUND: 404,
    grpc.StatusCode.RESOURCE_EXHAUSTED: 429,
    grpc.StatusCode.UNAVAILABLE: 503,
    grpc.StatusCode.DEADLINE_EXCEEDED: 504,
}
ERROR_TYPE = {400: "invalid_request_error", 401: "authentication_error",
              403: "permission_error", 404: "not_found_error", 429: "rate_limit_error"}


class HttpError(Exception):
    """A request refused by the HTTP layer: the gRPC status of the same failure and the field."""

    def __init__(self, code: grpc.StatusCode, message: str, param: str | None = None):
        super().__init__(message)
        self.code, self.message, self.param = code, message, param


def error_response(code: grpc.StatusCode, message: str, param: str | None = None
                   ) -> web.Response:
    status = HTTP_STATUS.get(code, 500)
    body = {"error": {"message": message, "type": ERROR_TYPE.get(status, "server_error"),
                      "param": param, "code": code.name}}
    return web.json_response(body, status=status)


class _Sampling(BaseModel):
    """The fields both generating routes share (OpenAI's names and defaults)."""

    model_config = ConfigDict(extra="ignore")  # clients send fields we have no use for

    model: str
    n: int = Field(1, ge=1)
    temperature: float = Field(1.0, ge=0.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    top_k: int = Field(0, ge=0)  # not OpenAI's; vLLM's extension
    seed: int | None = Field(None, ge=0)
    stream: bool = False
    stop: str | list[str] | None = None
    stop_token_ids: list[int] = Field(default_factory=list)  # vLLM's extension
    max_tokens: int | None = Field(None, ge=1)


class CompletionRequest(_Sampling):
    prompt: str | list[str] | list[int] | list[list[int]]
    echo: bool = False


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")

    role: str
    content: str


class ChatCompletionRequest(_Sampling):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1)


def _parse(model: type[BaseModel], body: Any) -> Any:
    try:
        return model.model_validate(body)
    except ValidationError as e:
        first = e.errors()[0]
        field = ".".join(str(p) for p in first["loc"]) or None
        raise HttpError(grpc.StatusCode.INVALID_ARGUMENT, f"{field}: {first['msg']}",
                        field) from None


def _refuse_unsupported(req: _Sampling) -> None:
    if req.stream:
        raise HttpError(grpc.StatusCode.INVALID_ARGUMENT, "stream: streaming is not supported "
                        "by this server; send stream=false", "stream")
    if req.stop:
        raise HttpError(grpc.StatusCode.INVALID_ARGUMENT, "stop: stop strings are the sampler's "
                        "config (sampling.stop_strings); use stop_token_ids per request",
                        "stop")
    if getattr(req, "echo", False):
        raise HttpError(grpc.StatusCode.INVALID_ARGUMENT, "echo: not supported", "echo")


def _sampling(req: _Sampling, max_tokens: int | None) -> common_pb2.SamplingParams:
    return common_pb2.SamplingParams(
        temperature=req.temperature, top_p=req.top_p, top_k=req.top_k,
        max_new_tokens=max_tokens or 0, stop_token_ids=req.stop_token_ids,
        seed=req.seed or 0, has_seed=req.seed is not None)


def completion_prompts(prompt: str | list) -> list[common_pb2.Prompt]:
    """OpenAI's ``prompt``: a string, a list of strings, a list of token ids or a list of lists
    of token ids."""
    if isinstance(prompt, str):
        return [common_pb2.Prompt(text=prompt)]
    if not prompt:
        raise HttpError(grpc.StatusCode.INVALID_ARGUMENT, "prompt: expected at least one prompt",
                        "prompt")
    if all(isinstance(p, int) for p in prompt):
        return [common_pb2.Prompt(token_ids=prompt)]
    return [common_pb2.Prompt(text=p) if isinstance(p, str) else common_pb2.Prompt(token_ids=p)
            for p in prompt]


def _family(host: str) -> socket.AddressFamily:
    return socket.AF_INET6 if ":" in host else socket.AF_INET


class _Cancel:
    """The part of a gRPC context ``RolloutWorker.generate`` uses: cancel on disconnect."""

    def __init__(self):
        self.callbacks: list = []

    def add_callback(self, callback) -> bool:
        self.callbacks.append(callback)
        return True

    def fire(self) -> None:
        for callback in self.callbacks:
            callback()


class OpenAIFront:
    """The aiohttp application over a sampler's ``RolloutWorker``; ``start`` serves it on its
    own event-loop thread."""

    def __init__(self, worker: RolloutWorker, *, model_name: str, auth=None,
                 max_request_bytes: int = 16 * 1024 * 1024):
        self.worker = worker
        self.model_name = model_name
        self.guard = CallGuard(auth)
        self.auth = auth
        self.created = int(time.time())
        self.app = web.Application(middlewares=[self._errors_and_auth],
                                   client_max_size=max_request_bytes)
        self.app.add_routes([
            web.get("/v1/models", self.models),
            web.post("/v1/completions", self.completions),
            web.post("/v1/chat/completions", self.chat_completions),
        ])
        self.port = 0
        self._loop: asyncio.AbstractEventLoop | None = None
        self._runner: web.AppRunner | None = None
        self._thread: threading.Thread | None = None

    # ------------------------------------------------------------------ serving

    def start(self, host: str, port: int) -> int:
        """Serve on ``host:port`` (0: a free port) from a daemon thread; returns the port."""
        ready = threading.Event()
        failure: list[BaseException] = []

        def run() -> None:
            loop = asyncio.new_event_loop()
            self._loop = loop
            try:
                loop.run_until_complete(self._serve(host, port))
            except BaseException as e:  # noqa: BLE001 - reported to start()'s caller
                failure.append(e)
                ready.set()
                return
            ready.set()
            loop.run_forever()

        self._thread = threading.Thread(target=run, name="openai-http", daemon=True)
        self._thread.start()
        ready.wait()
        if failure:
            raise failure[0]
        return self.port

    async def _serve(self, host: str, port: int) -> None:
        # Our own socket, so that port 0 gives a port we can report.
        sock = socket.create_server((host, port), family=_family(host), reuse_port=False)
        self.port = sock.getsockname()[1]
        self._runner = web.AppRunner(self.app, access_log=None, shutdown_timeout=5.0)
        await self._runner.setup()
        await web.SockSite(self._runner, sock,
                           ssl_context=ssl_context(self.auth, server_side=True)).start()

    def stop(self, grace_s: float | None = 5.0) -> None:
        """Close the listener and the connections (a server's ``on_stop`` hook: after the
        gRPC server has stopped, so never raises)."""
        loop, runner = self._loop, self._runner
        if loop is None or runner is None:
            return
        try:
            asyncio.run_coroutine_threadsafe(runner.cleanup(), loop).result(
                timeout=(grace_s or 0.0) + 5)
        except Exception:  # noqa: BLE001 - a slow close must not fail the process's exit
            log.warning("openai http front did not close cleanly", exc_info=True)
        loop.call_soon_threadsafe(loop.stop)
        if self._thread is not None:
            self._thread.join(timeout=5)

    # ------------------------------------------------------------------ routes

    @web.middleware
    async def _errors_and_auth(self, request: web.Request, handler):
        method = INFO_METHOD if request.path == "/v1/models" else GENERATE_METHOD
        try:
            self.guard.check(method, request.headers.items())
            return await handler(request)
        except AuthError as e:
            return error_response(e.code, e.message)
        except HttpError as e:
            return error_response(e.code, e.message, e.param)
        except RequestError as e:
            return error_response(e.code, e.message)
        except web.HTTPException:
            raise
        except Exception as e:  # noqa: BLE001 - never a dropped connection for a bad request
            log.exception("openai http request failed", extra={"path": request.path})
            return error_response(grpc.StatusCode.INTERNAL, f"generation failed: {e!r}")

    async def models(self, request: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [
            {"id": self.model_name, "object": "model", "created": self.created,
             "owned_by": "splitrl"}]})

    async def completions(self, request: web.Request) -> web.Response:
        req = _parse(CompletionRequest, await self._json(request))
        self._check(req)
        reply = await self._generate(completion_prompts(req.prompt), req, req.max_tokens)
        choices: list[dict[str, Any]] = []
        for out in reply.outputs:
            for c in out.completions:
                choices.append({"index": len(choices), "text": c.text, "logprobs": None,
                                "finish_reason": c.finish_reason,
                                "token_ids": list(c.token_ids)})
        return web.json_response(self._body("text_completion", "cmpl", reply, choices))

    async def chat_completions(self, request: web.Request) -> web.Response:
        req = _parse(ChatCompletionRequest, await self._json(request))
        self._check(req)
        prompt = common_pb2.Prompt(messages=[
            common_pb2.ChatMessage(role=m.role, content=m.content) for m in req.messages])
        reply = await self._generate([prompt], req, req.max_completion_tokens or req.max_tokens)
        choices = [{"index": i, "message": {"role": "assistant", "content": c.text},
                    "finish_reason": c.finish_reason, "logprobs": None,
                    "token_ids": list(c.token_ids)}
                   for i, c in enumerate(reply.outputs[0].completions)]
        return web.json_response(self._body("chat.completion", "chatcmpl", reply, choices))

    # ------------------------------------------------------------------ helpers

    @staticmethod
    async def _json(request: web.Request) -> Any:
        try:
            return await request.json()
        except ValueError as e:
            raise HttpError(grpc.StatusCode.INVALID_ARGUMENT,
                            f"body: not a JSON object ({e})") from None

    def _check(self, req: _Sampling) -> None:
        _refuse_unsupported(req)
        if req.model != self.model_name:
            raise HttpError(grpc.StatusCode.NOT_FOUND, f"model: this sampler serves "
                            f"{self.model_name!r}, not {req.model!r} (GET /v1/models)", "model")

    async def _generate(self, prompts: list[common_pb2.Prompt], req: _Sampling,
                        max_tokens: int | None) -> sampler_pb2.GenerateReply:
        grpc_request = sampler_pb2.GenerateRequest(prompts=prompts, n=req.n,
                                                   sampling=_sampling(req, max_tokens))
        cancel = _Cancel()
        loop = asyncio.get_running_loop()
        try:
            return await loop.run_in_executor(None, self.worker.generate, grpc_request, cancel)
        except asyncio.CancelledError:  # the client went away: stop generating for it
            cancel.fire()
            raise

    def _body(self, kind: str, prefix: str, reply: sampler_pb2.GenerateReply,
              choices: list[dict]) -> dict:
        prompt_tokens = sum(len(o.prompt_token_ids) for o in reply.outputs)
        completion_tokens = sum(len(c.token_ids) for o in reply.outputs for c in o.completions)
        return {"id": f"{prefix}-{uuid.uuid4().hex}", "object": kind,
                "created": int(time.time()), "model": self.model_name, "choices": choices,
                "usage": {"prompt_tokens": prompt_tokens,
                          "completion_tokens": completion_tokens,
                          "total_tokens": prompt_tokens + completion_tokens},
                "prompt_token_ids": [list(o.prompt_token_ids) for o in reply.outputs],
                "weight_version": reply.weight_version}
