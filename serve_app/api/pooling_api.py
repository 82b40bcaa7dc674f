"""``/v1/embeddings`` (OpenAI's shape), ``/v1/rerank`` (the shape Cohere, Jina and vLLM
share; also at ``/rerank`` and ``/v2/rerank``) and ``/v1/score`` (vLLM's pairs) for the
models whose profile task is ``embed`` or ``rerank``. Requests are validated here; the
inputs go to the model's replica as a typed call (``serve_app.pooling.calls``)."""

from __future__ import annotations

import asyncio
import base64
import time
import uuid
from typing import Annotated, Any, Literal

from fastapi import Request
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictInt, StrictStr

from serve_app.api.http import OpenAIIngress, api, not_ready_error, replica_lost_error
from serve_app.pooling.calls import EmbedCall, PoolingAnswer, ScoreCall
from serve_app.serving.errors import queue_full_error
from serve_app.serving.events import Failure
from serve_app.serving.request import ApiError, checked, validation_error


class _Pooled(BaseModel):
    model_config = ConfigDict(extra="forbid")
    model: StrictStr
    truncate: StrictBool | None = None  # inputs over the model's limit: cut (else a 400)

    def cut(self) -> bool | None:
        return self.truncate

    def check_supported(self) -> None:
        pass


class EmbeddingRequest(_Pooled):
    input: StrictStr | list[StrictStr] | list[StrictInt] | list[list[StrictInt]]
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: Annotated[StrictInt, Field(ge=1)] | None = None
    user: StrictStr | None = None

    def call(self, max_inputs: int) -> EmbedCall:
        items: list[Any] = [self.input] if isinstance(self.input, str) else list(self.input)
        if not items:
            raise ApiError(400, "input: must not be empty", param="input")
        if all(isinstance(i, int) for i in items):  # one list of token ids
            items = [items]
        _bounded(len(items), max_inputs, "input")
        for n, item in enumerate(items):
            if not item:
                raise ApiError(400, f"input[{n}]: must not be empty", param=f"input[{n}]")
        if isinstance(items[0], str):
            return EmbedCall(texts=tuple(items), dimensions=self.dimensions,
                             truncate=self.cut())
        return EmbedCall(token_lists=tuple(tuple(i) for i in items),
                         dimensions=self.dimensions, truncate=self.cut())

    def response(self, answer: PoolingAnswer, model: str) -> dict:
        data = []
        for n, row in enumerate(answer.values):
            vector: Any = (base64.b64encode(row.astype("<f4").tobytes()).decode()
                           if self.encoding_format == "base64" else row.tolist())
            data.append({"object": "embedding", "index": n, "embedding": vector})
        return {"object": "list", "data": data, "model": model,
                "usage": {"prompt_tokens": answer.tokens, "total_tokens": answer.tokens}}


class _Document(BaseModel):
    model_config = ConfigDict(extra="ignore")  # other fields a client keeps with it
    text: StrictStr


class RerankRequest(_Pooled):
    query: StrictStr
    documents: list[StrictStr | _Document]
    top_n: Annotated[StrictInt, Field(ge=1)] | None = None
    return_documents: StrictBool = True
    # Cohere's, accepted and not used: documents are scored whole (or cut, with truncate)
    max_chunks_per_doc: StrictInt | None = None
    max_tokens_per_doc: StrictInt | None = None
    rank_fields: list[StrictStr] | None = None

    def texts(self) -> list[str]:
        return [d if isinstance(d, str) else d.text for d in self.documents]

    def call(self, max_inputs: int) -> ScoreCall:
        if not self.documents:
            raise ApiError(400, "documents: must not be empty", param="documents")
        _bounded(len(self.documents), max_inputs, "documents")
        return ScoreCall(tuple((self.query, d) for d in self.texts()), self.cut())

    def response(self, answer: PoolingAnswer, model: str) -> dict:
        texts = self.texts()
        order = sorted(range(len(texts)), key=lambda i: -float(answer.values[i]))
        results = []
        for i in order[: self.top_n or len(order)]:
            result: dict[str, Any] = {"index": i, "relevance_score": float(answer.values[i])}
            if self.return_documents:
                result["document"] = {"text": texts[i]}
            results.append(result)
        return {"id": f"rerank-{uuid.uuid4().hex}", "model": model, "results": results,
                "usage": {"total_tokens": answer.tokens}}


class ScoreRequest(_Pooled):
    text_1: StrictStr | list[StrictStr]
    text_2: StrictStr | list[StrictStr]

    def call(self, max_inputs: int) -> ScoreCall:
        one = [self.text_1] if isinstance(self.text_1, str) else self.text_1
        two = [self.text_2] if isinstance(self.text_2, str) else self.text_2
        if not one or not two:
            raise ApiError(400, "text_1 and text_2: must not be empty", param="text_1")
        if len(one) == 1:
            one = one * len(two)
        if len(one) != len(two):
            raise ApiError(400, f"text_1 has {len(one)} texts and text_2 {len(two)}: give "
                                "one text_1 for any number of text_2, or as many of each",
                           param="text_2")
        _bounded(len(two), max_inputs, "text_2")
        return ScoreCall(tuple(zip(one, two, strict=True)), self.cut(), param="text_2")

    def response(self, answer: PoolingAnswer, model: str) -> dict:
        return {"id": f"score-{uuid.uuid4().hex}", "object": "list",
                "created": int(time.time()), "model": model,
                "data": [{"index": i, "object": "score", "score": float(s)}
                         for i, s in enumerate(answer.values)],
                "usage": {"prompt_tokens": answer.tokens, "total_tokens": answer.tokens}}


def _bounded(n: int, limit: int, param: str) -> None:
    if n > limit:
        raise ApiError(400, f"{param}: {n} items, over this model's limit of {limit} a "
                            "request (pooling.max_inputs)", param=param)


_TASKS = {EmbeddingRequest: "embed", RerankRequest: "rerank", ScoreRequest: "rerank"}


class PoolingRoutes(OpenAIIngress):
    """The embedding and rerank routes beside the generation ones."""

    @api.post("/v1/embeddings")
    async def embeddings(self, request: Request) -> JSONResponse:
        return await self._pooled(request, EmbeddingRequest)

    @api.post("/v1/rerank")
    async def rerank(self, request: Request) -> JSONResponse:
        return await self._pooled(request, RerankRequest)

    @api.post("/rerank")
    async def rerank_jina(self, request: Request) -> JSONResponse:
        return await self._pooled(request, RerankRequest)

    @api.post("/v2/rerank")
    async def rerank_cohere(self, request: Request) -> JSONResponse:
        return await self._pooled(request, RerankRequest)

    @api.post("/v1/score")
    async def score(self, request: Request) -> JSONResponse:
        return await self._pooled(request, ScoreRequest)

    async def _pooled(self, request: Request, cls: Any) -> JSONResponse:
        labels = {"model": "unknown", "status": "500"}
        try:
            parsed = await self._body(request, lambda body: checked(cls, body,
                                                                    validation_error))
            m = self.pooling_model(parsed.model, _TASKS[cls])
            labels["model"] = m.name
            call = parsed.call(m.pooling.max_inputs)
            if not await self.backend.model_ready(m.name):
                raise not_ready_error([m.name])
            timeout = self.profile.ingress.request_timeout_s
            try:
                answer = await asyncio.wait_for(self.backend.run_pooling(m.name, call),
                                                timeout)
            except TimeoutError:
                raise ApiError(504, f"model {m.name!r} did not answer in {timeout:g} s",
                               type="timeout_error", code="timeout") from None
            except ApiError:
                raise
            except Exception as exc:
                if type(exc).__name__ == "BackPressureError":  # Ray Serve's queue is full
                    raise queue_full_error(f"model {m.name!r} has "
                                           f"{m.max_queued_requests} requests waiting; retry "
                                           "shortly") from None
                if not self.backend.replica_lost(m.name, exc):
                    raise
                raise replica_lost_error(m.name) from None
            if isinstance(answer, Failure):
                raise ApiError.from_failure(answer)
            labels["status"] = "200"
            return JSONResponse(parsed.response(answer, m.name))
        except ApiError as exc:
            labels["status"] = str(exc.status)
            self._log_error(request, labels, exc)
            raise
        finally:
            self.recorder.inc("serve_app_requests", 1, labels)

    def pooling_model(self, name: str, task: str) -> Any:
        """The profile of model ``name`` when it serves ``task``; 404 or 400 otherwise."""
        m = self.profile.model(name)
        if m is None:
            known = ", ".join(p.name for p in self.profile.models if p.task == task)
            raise ApiError(404, f"model {name!r} does not exist; {task} models served: "
                                f"{known or 'none'}", type="not_found_error", param="model",
                           code="model_not_found")
        if m.task != task:
            raise ApiError(400, f"model {name!r} is a {m.task} model, not a {task} model "
                                f"(models[].task in its profile)", param="model",
                           code="wrong_model_task")
        return m
