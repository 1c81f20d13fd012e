"""The HTTP API agents talk to: OpenAI's chat completions, completions and Responses
API, and Anthropic's Messages API.

Owns: the routes and what each does in order (auth, limits, sampling parameters,
generating, decoding and stop strings, tool-call parsing, answering as JSON or as
server-sent events when each choice is done) and recording every choice on its
session. Does not own the prompt (prompts.py: chat template, tokenizing), the response
bodies (responses.py: choices, logprobs, SSE encoding), the request bodies
(schemas.py), the error format (errors.py), sampling (the engine) or when sessions open
and close (the caller, through the SessionStore).

Routes, each also at plain `/v1/...` without auth or recording when `sessionless`:
    POST /sessions/{id}/v1/chat/completions
    POST /sessions/{id}/v1/completions
    POST /sessions/{id}/v1/responses              (openai_responses.py)
    POST /sessions/{id}/v1/messages               (anthropic_messages.py)
    POST /sessions/{id}/v1/messages/count_tokens
    GET  /sessions/{id}/v1/models
    POST /sessions/{id}/reward
         {"reward": 1.0} | {"rewards": {cid: 1.0}} | {"completion_id": cid, "reward": 1.0}
    GET  /health
Session routes need the session's `api_key`, the reward route its `reward_key`
(keys.py checks them; sessions.py says why two).

What one request may ask is bounded (gateway.limits, limits.py): body size (413), JSON
nesting, text that is not Unicode (a lone surrogate, in any field), messages, stop
strings, and n x max_tokens; a prompt longer in characters than the model's context
can hold as tokens is refused before it is tokenized (prompts.py). `top_k` at or beyond the
vocabulary means no truncation; a temperature below 1e-5 samples greedily (as vLLM).
A request's own fault is a 4xx naming the field; only the engine's get a 503.

Prompts are built (template, tokenizer) in worker threads, large bodies in a lane of
their own (prompt_lanes.py), so the event loop the engine and every other call share
never waits on them. A call stops, streamed or not, when its client goes away or its
session closes: its generation leaves the engine's batch, a prompt not yet started
leaves its lane's queue; a closed session's call is answered 404 (a stream ends with
that error as its last event), a gone client's nothing.

The Responses and Messages routes (agent_apis.py) answer as chat requests through
`Gateway.plan`: a conversation is the same tokens over any of the three APIs, recorded
under the API's own ids (`resp_...`, `msg_...`); errors come in the API's own shape.

Where it departs from OpenAI:
- `model` may be any name: agents hardcode model names and there is one policy to
  serve. Responses report the served name.
- Sampling fields: a session's `sampling_overrides` win over the request, which wins
  over `default_sampling` (the run's config). `top_k` is accepted, as vLLM does.
  `max_tokens` is clamped to the room the model's context leaves after the prompt.
- The engine returns whole generations, so a stream sends each choice's text in one
  delta as soon as that choice is done.
- The n choices are sampled independently; with `seed`, choice i uses `seed + i`.
- A message's text parts are joined with "\\n", as vLLM does.
- Responses also carry `prompt_token_ids` and per-choice `token_ids`, as vLLM does.
- Tool calls (`tools`, `tool_choice`, `parallel_tool_calls`; tools.py says how they
  are rendered and parsed) come back with finish_reason "tool_calls"; a streamed choice
  sends its calls whole in one delta. Output that looks like a call but does not parse
  is returned as content and counted (`/health` shows `tool_call_errors`).
- `developer` messages are treated as `system` ones.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any, TypeVar

from fastapi import APIRouter, Depends, FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse
from transformers import PreTrainedTokenizerBase

from looprl.config import LimitsConfig, SamplingConfig
from looprl.engines.base import Engine, EngineError
from looprl.gateway import agent_apis, prompts
from looprl.gateway import limits as limits_lib
from looprl.gateway import tools as tools_lib
from looprl.gateway.anthropic_messages import CountTokensRequest, MessagesRequest
from looprl.gateway.errors import APIError, ClientGone, engine_failed, install_error_handlers
from looprl.gateway.keys import Keys
from looprl.gateway.openai_responses import ResponsesRequest
from looprl.gateway.prompt_lanes import PromptLanes
from looprl.gateway.responses import (
    SSE_DONE,
    Call,
    ChoiceFn,
    ChunksFn,
    Plan,
    chat_choice,
    chat_chunks,
    chat_logprobs,
    completion_choice,
    completion_logprobs,
    sse,
)
from looprl.gateway.schemas import (
    AnthropicMessage,
    ChatCompletion,
    ChatRequest,
    Completion,
    CompletionRequest,
    ModelList,
    ResponseObject,
    RewardRequest,
    RewardResponse,
    SamplingRequest,
    TokenCount,
    documented,
)
from looprl.gateway.sessions import Session, SessionStore, sampling_fields
from looprl.types import Generation, Interaction, SamplingParams

log = logging.getLogger(__name__)

DISCONNECT_POLL_S = 0.25  # how often a waiting call checks for a gone client or closed session
T = TypeVar("T")

# ---- the app -----------------------------------------------------------------------


def create_app(
    engine: Engine,
    tokenizer: PreTrainedTokenizerBase,
    *,
    model_name: str,
    store: SessionStore,
    sessionless: bool = False,
    default_sampling: SamplingConfig | None = None,
    max_model_len: int | None = None,
    engine_health: Callable[[], dict[str, Any]] | None = None,
    limits: LimitsConfig | None = None,
    sessionless_api_key: str | None = None,
) -> FastAPI:
    """The gateway app; `store` is also reachable as `app.state.store`.

    `default_sampling` applies where a request leaves a field out (SamplingConfig's
    defaults when None). `max_model_len` (prompt + output tokens) turns too-long
    prompts into a 400 naming the field; without it the engine decides. `sessionless`
    adds `/v1/...` routes that need no key and record nothing (`looprl serve`).
    `engine_health`, when given, reports the engine in /health (a pool: its replicas).
    `limits` bound what one request may ask (LimitsConfig's defaults when None).
    `sessionless_api_key`, when given, is required on the `/v1/...` routes.
    """
    defaults = (default_sampling or SamplingConfig()).model_dump()
    limits = limits or LimitsConfig()
    gateway = Gateway(engine, tokenizer, model_name, defaults, max_model_len, limits)
    app = FastAPI(title="looprl gateway")
    app.state.store = store
    app.add_middleware(
        limits_lib.RequestLimits,
        max_request_bytes=limits.max_request_bytes,
        max_json_depth=limits.max_json_depth,
    )
    install_error_handlers(app)

    keys = Keys(store, sessionless_api_key)
    app.include_router(gateway.router(keys.session_for), prefix="/sessions/{session_id}/v1")
    if sessionless:
        app.include_router(gateway.router(keys.sessionless), prefix="/v1")

    @app.post("/sessions/{session_id}/reward", responses=documented(RewardResponse, 400, 401, 413))
    async def post_reward(
        body: RewardRequest, session: Session = Depends(keys.reward_session_for)
    ) -> dict:
        try:
            session.post_reward(body.value())
        except ValueError as e:
            raise APIError(400, str(e), "completion_id") from None
        return {"session_id": session.id, "reward": session.reward}

    @app.get("/health")
    async def health() -> dict:
        report = {
            "status": "ok",
            "model": model_name,
            "open_sessions": len(store),
            "tool_call_errors": gateway.tool_call_errors,
        }
        if engine_health is not None:
            report["engine"] = engine_health()
        return report

    return app


class Gateway:
    """Request handling shared by the session routes and the sessionless ones."""

    def __init__(
        self,
        engine: Engine,
        tokenizer: PreTrainedTokenizerBase,
        model_name: str,
        defaults: dict[str, Any],
        max_model_len: int | None,
        limits: LimitsConfig,
    ):
        self.engine = engine
        self.tokenizer = tokenizer
        self.model_name = model_name
        self.defaults = defaults
        self.max_model_len = max_model_len
        self.limits = limits
        self.vocab_size = len(tokenizer)
        self.max_prompt_chars = prompts.max_prompt_chars(tokenizer, max_model_len)
        self.lanes = PromptLanes.shared()
        self.native_tools = tools_lib.template_renders_tools(tokenizer.chat_template)
        self.tool_call_errors = 0  # outputs that looked like a tool call but did not parse
        # The last conversations answered over /v1/responses without a session (`looprl
        # serve`), for previous_response_id; a session keeps its own.
        self.stored_responses: dict[str, list[dict]] = {}

    def router(self, get_session: Callable[..., Session | None]) -> APIRouter:
        router = APIRouter()
        session_dep = Depends(get_session)

        @router.post(
            "/chat/completions",
            responses=documented(ChatCompletion, 400, 401, 404, 413, 503, stream=True),
        )
        async def chat(request: Request, req: ChatRequest, session: Session | None = session_dep):
            return await self.chat(request, req, session)

        @router.post(
            "/completions",
            responses=documented(Completion, 400, 401, 404, 413, 503, stream=True),
        )
        async def completions(
            request: Request, req: CompletionRequest, session: Session | None = session_dep
        ):
            return await self.complete(request, req, session)

        @router.post(
            "/responses", responses=documented(ResponseObject, 400, 401, 404, 413, 503, stream=True)
        )
        async def responses(
            request: Request, req: ResponsesRequest, session: Session | None = session_dep
        ):
            return await agent_apis.responses(self, request, req, session)

        @router.post(
            "/messages",
            responses=documented(AnthropicMessage, 400, 401, 404, 413, 503, stream=True),
        )
        async def messages(
            request: Request, req: MessagesRequest, session: Session | None = session_dep
        ):
            return await agent_apis.messages(self, request, req, session)

        @router.post("/messages/count_tokens", responses=documented(TokenCount, 400, 401, 413))
        async def count_tokens(
            request: Request, req: CountTokensRequest, session: Session | None = session_dep
        ):
            return await agent_apis.count_tokens(self, request, req, session)

        @router.get("/models", responses=documented(ModelList, 401))
        async def models(_: Session | None = session_dep) -> dict:
            card = {
                "id": self.model_name,
                "object": "model",
                "created": 0,
                "owned_by": "looprl",
                "max_model_len": self.max_model_len,
            }
            return {"object": "list", "data": [card]}

        return router

    # ---- chat ----------------------------------------------------------------------

    async def chat(self, request: Request, req: ChatRequest, session: Session | None):
        plan = await self.plan(request, req, session, f"chatcmpl-{uuid.uuid4().hex}")
        call = plan.call
        call.object, call.chunk_object = "chat.completion", "chat.completion.chunk"

        def logprobs(gen: Generation) -> dict | None:
            return {"content": chat_logprobs(self.tokenizer, gen)} if req.logprobs else None

        def choice(index: int, gen: Generation, text: str, finish: str) -> dict:
            msg, finish = plan.message(index, text, finish)
            return chat_choice(index, gen, msg, finish, logprobs(gen))

        def chunks(index: int, gen: Generation, text: str, finish: str) -> list[dict]:
            delta, finish = plan.message(index, text, finish)
            return chat_chunks(index, gen, delta, finish, logprobs(gen))

        return await self._respond(request, call, req, plan.sampling, session, choice, chunks)

    async def plan(
        self, request: Request, req: ChatRequest, session: Session | None, call_id: str
    ) -> Plan:
        """What answering `req` takes: its prompt, sampling and how a choice's text
        becomes an assistant message. Every API's request goes through here as a chat
        request, so a conversation gives the same tokens whichever API carries it."""
        limits_lib.check_messages(req.messages, self.limits)
        prompt_ids, tools, prefix = await self.prompt(
            request,
            session,
            lambda: prompts.request_prompt(
                self.tokenizer,
                req,
                session,
                native_tools=self.native_tools,
                max_chars=self.max_prompt_chars,
            ),
        )
        max_tokens = req.max_completion_tokens or req.max_tokens
        top = (req.top_logprobs or 0) if req.logprobs else 0
        sampling = self._sampling(req, prompt_ids, "messages", max_tokens, top, session)
        messages = [m.model_dump(exclude_none=True) for m in req.messages]
        call = Call(call_id, "", "", prompt_ids, messages=messages)
        call.max_tokens, call.requested_max_tokens = sampling[0].max_new_tokens, max_tokens
        tool_names = {t["function"]["name"] for t in tools}
        parallel = req.parallel_tool_calls is not False

        def message(index: int, text: str, finish: str) -> tuple[dict, str]:
            """Choice `index`'s assistant message, its calls parsed out when tools are on
            (and kept on the call for the recording)."""
            if not tools:
                return {"role": "assistant", "content": text}, finish
            parsed = tools_lib.parse_tool_calls(
                prefix + text, tool_names, parallel, self.limits.max_json_depth
            )
            if parsed.error:
                self._count_tool_call_error(parsed.error, session)
            call.tool_calls[index] = parsed.tool_calls
            if not parsed.tool_calls:
                return {"role": "assistant", "content": parsed.content}, finish
            if session is not None:
                for tool_call in parsed.tool_calls:
                    session.sampled_texts[tool_call["id"]] = prefix + text
            content = {"role": "assistant", "content": parsed.content}
            return {**content, "tool_calls": parsed.tool_calls}, "tool_calls"

        return Plan(call, sampling, message)

    def _count_tool_call_error(self, error: str, session: Session | None) -> None:
        """Unparseable calls are answered as plain content, counted, and logged once."""
        if session is not None:
            session.tool_call_errors += 1
        if not self.tool_call_errors:
            log.warning(
                "The model's output held a tool call the gateway could not parse; it was "
                "returned as plain content (later ones are only counted): %s",
                error,
            )
        self.tool_call_errors += 1

    # ---- text completions ----------------------------------------------------------

    async def complete(self, request: Request, req: CompletionRequest, session: Session | None):
        if isinstance(req.prompt, str):
            text = req.prompt

            def tokenized() -> list[int]:
                prompts.check_length(self.tokenizer, text, self.max_prompt_chars, "prompt")
                return prompts.tokenize(self.tokenizer, text)

            prompt_ids = await self.prompt(request, session, tokenized)
        else:
            prompt_ids = req.prompt
            vocab = len(self.tokenizer)
            bad = next((i for i, t in enumerate(prompt_ids) if t >= vocab), None)
            if bad is not None:
                raise APIError(
                    400,
                    f"prompt[{bad}]: {prompt_ids[bad]} is not a token id "
                    f"(the vocabulary has {vocab})",
                    f"prompt[{bad}]",
                )
        top = req.logprobs or 0
        sampling = self._sampling(req, prompt_ids, "prompt", req.max_tokens, top, session)
        call = Call(f"cmpl-{uuid.uuid4().hex}", "text_completion", "text_completion", prompt_ids)
        call.max_tokens, call.requested_max_tokens = sampling[0].max_new_tokens, req.max_tokens

        def choice(index: int, gen: Generation, text: str, finish: str) -> dict:
            logprobs = None
            if req.logprobs is not None:
                logprobs = completion_logprobs(self.tokenizer, gen)
            return completion_choice(index, gen, text, finish, logprobs)

        def chunks(index: int, gen: Generation, text: str, finish: str) -> list[dict]:
            return [choice(index, gen, text, finish)]

        return await self._respond(request, call, req, sampling, session, choice, chunks)

    # ---- shared --------------------------------------------------------------------

    async def prompt(self, request: Request, session: Session | None, job: Callable[[], T]) -> T:
        """`job()` (prompt work, prompts.py) in the lane the request's size picks, while
        the request is still wanted (`while_wanted`)."""
        body_bytes = len(await request.body())  # read already: FastAPI parsed it
        job_done = self.lanes.run(body_bytes, job)
        return await self.while_wanted(request, session, job_done, "building its prompt")

    async def while_wanted(
        self, request: Request, session: Session | None, work: Awaitable[T], doing: str
    ) -> T:
        """`work`'s result, unless the client goes away first (ClientGone) or the session
        closes first (its rollout ended: the 404); checked every DISCONNECT_POLL_S.
        Either way `work` is cancelled: a generation leaves the engine's batch at its
        next step, a prompt job not yet started leaves its lane."""
        task = asyncio.ensure_future(work)
        try:
            while not (await asyncio.wait([task], timeout=DISCONNECT_POLL_S))[0]:
                if session is not None and session.closed:
                    raise APIError(
                        404,
                        f"session {session.id!r} was closed while this call was {doing}",
                        type="not_found_error",
                    )
                if await request.is_disconnected():
                    raise ClientGone
            return task.result()
        finally:
            task.cancel()

    def _sampling(
        self,
        req: SamplingRequest,
        prompt_ids: list[int],
        prompt_field: str,
        max_tokens: int | None,
        top_logprobs: int,
        session: Session | None,
    ) -> list[SamplingParams]:
        """One SamplingParams per choice: session overrides > request > defaults."""
        if not prompt_ids:
            raise APIError(400, f"{prompt_field}: the prompt has no tokens", prompt_field)
        limits_lib.check_stop(req.stop, self.limits)
        requested = {
            "temperature": req.temperature,
            "top_p": req.top_p,
            "top_k": req.top_k,
            "max_tokens": max_tokens,
            "stop": req.stop,
            "seed": req.seed,
        }
        overrides = session.sampling_overrides if session else {}
        fields = {
            **self.defaults,
            **sampling_fields(requested, "request"),
            **sampling_fields(overrides, "session.sampling_overrides"),
        }
        seed = fields.pop("seed", None)
        if self.max_model_len is not None:
            room = self.max_model_len - len(prompt_ids)
            if room < 1:
                raise APIError(
                    400,
                    f"{prompt_field}: the prompt is {len(prompt_ids)} tokens and "
                    f"the model's context is {self.max_model_len}, leaving no room "
                    "for output; shorten it",
                    prompt_field,
                )
            fields["max_new_tokens"] = min(fields["max_new_tokens"], room)
        if fields["top_k"] >= self.vocab_size:  # keeps every token: the same as no top-k
            fields["top_k"] = 0
        limits_lib.check_token_budget(req.n or 1, fields["max_new_tokens"], self.limits)
        return [
            SamplingParams(
                **fields, top_logprobs=top_logprobs, seed=None if seed is None else seed + i
            )
            for i in range(req.n or 1)
        ]

    async def _respond(
        self,
        request: Request,
        call: Call,
        req: SamplingRequest,
        sampling: list[SamplingParams],
        session: Session | None,
        choice: ChoiceFn,
        chunks: ChunksFn,
    ):
        if req.stream:
            include_usage = bool(req.stream_options and req.stream_options.include_usage)
            events = self._events(request, call, sampling, session, chunks, include_usage)
            return StreamingResponse(events, media_type="text/event-stream")
        try:
            gens = await self.generate(request, call, sampling, session)
        except EngineError as e:
            raise engine_failed(e) from None
        finished = [self.finish(gen, s) for gen, s in zip(gens, sampling, strict=True)]
        choices = [choice(i, gen, *finished[i]) for i, gen in enumerate(gens)]
        self.record(session, call, gens, finished)  # after the choices: their tool calls
        return JSONResponse(call.body(self.model_name, choices, gens))

    async def generate(
        self,
        request: Request,
        call: Call,
        sampling: list[SamplingParams],
        session: Session | None,
    ) -> list[Generation]:
        """Every choice, while the call is wanted (`while_wanted`: ClientGone, or the 404
        when the session closes; then the engine drops the generations)."""

        # The session id lets an engine pool keep its calls on one replica (prefix reuse).
        routing = session.id if session is not None else None

        async def generate_all() -> list[Generation]:
            return list(
                await asyncio.gather(
                    *(self.engine.generate(call.prompt_ids, s, session=routing) for s in sampling)
                )
            )

        return await self.while_wanted(request, session, generate_all(), "generating")

    async def _events(
        self,
        request: Request,
        call: Call,
        sampling: list[SamplingParams],
        session: Session | None,
        chunks: ChunksFn,
        include_usage: bool,
    ) -> AsyncIterator[str]:
        """Server-sent events: each choice's chunks as soon as it is done, then usage, [DONE].

        Stops every generation still running when the client goes away, or when the
        session closes (its last event then the 404's error body).
        """

        routing = session.id if session is not None else None

        async def indexed(i: int) -> tuple[int, Generation]:
            return i, await self.engine.generate(call.prompt_ids, sampling[i], session=routing)

        tasks = [asyncio.ensure_future(indexed(i)) for i in range(len(sampling))]
        header = call.header(self.model_name, chunk=True)
        if include_usage:
            header["usage"] = None
        gens: list[Generation] = [None] * len(sampling)  # type: ignore[list-item]
        finished: list[tuple[str, str]] = [("", "")] * len(sampling)
        first = {"prompt_token_ids": call.prompt_ids}
        pending: set[asyncio.Future] = set(tasks)
        try:
            while pending:
                next_done = asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
                done, pending = await self.while_wanted(request, session, next_done, "generating")
                for task in done:
                    i, gens[i] = task.result()
                    finished[i] = self.finish(gens[i], sampling[i])
                    for piece in chunks(i, gens[i], *finished[i]):
                        yield sse({**header, **first, "choices": [piece]})
                        first = {}
            self.record(session, call, gens, finished)
            if include_usage:
                yield sse({**header, "choices": [], "usage": call.usage(gens)})
            yield SSE_DONE
        except EngineError as e:
            yield sse(engine_failed(e).body())
        except APIError as e:  # the session closed
            yield sse(e.body())
        except ClientGone:
            pass
        finally:
            for task in tasks:
                if task.done() and not task.cancelled():
                    task.exception()  # retrieved: one engine error was reported for all
                task.cancel()

    def finish(self, gen: Generation, sampling: SamplingParams) -> tuple[str, str]:
        """The text a client sees (special tokens dropped, cut at a stop string) and why
        the choice ended."""
        text = self.tokenizer.decode(gen.output_ids, skip_special_tokens=True)
        cuts = [i for stop in sampling.stop if (i := text.find(stop)) >= 0]
        if cuts:
            return text[: min(cuts)], "stop"
        return text, gen.finish_reason

    def record(
        self,
        session: Session | None,
        call: Call,
        gens: list[Generation],
        finished: list[tuple[str, str]],
    ) -> None:
        """Record each choice, unless the session closed while it was generating."""
        if session is None or session.closed:
            return
        ended_s = time.time()
        session.interactions.extend(
            Interaction.from_generation(
                call.id,
                gen,
                text,
                messages=call.messages,
                tool_calls=call.tool_calls.get(i),
                started_s=call.started_s,
                ended_s=ended_s,
                max_tokens=call.max_tokens,
                requested_max_tokens=call.requested_max_tokens,
            )
            for i, (gen, (text, _)) in enumerate(zip(gens, finished, strict=True))
        )
