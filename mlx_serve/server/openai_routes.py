"""OpenAI-compatible routes: /v1/chat/completions, /v1/completions, /v1/models (and one model by id)."""

from __future__ import annotations

import time
import uuid
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import replace
from typing import Any

from starlette.concurrency import run_in_threadpool
from starlette.requests import Request
from starlette.responses import JSONResponse, PlainTextResponse, Response

from mlx_serve.adapter_specs import AdapterSpec
from mlx_serve.errors import InvalidRequest
from mlx_serve.grammar import (
    GUIDED_FIELDS,
    grammar_for_guided,
    grammar_for_response_format,
    grammar_for_tool_choice,
)
from mlx_serve.server import openai_format as fmt
from mlx_serve.server.protocol import (
    MAX_CHOICES,
    Job,
    ModelInfo,
    build_requests,
    openai_error_body,
    parse_json_object,
    read_bad_words,
    read_bool,
    read_int,
    read_prompt_logprobs,
    read_prompts,
    read_stream_options,
)
from mlx_serve.server.reasoning import make_reasoning_splitter
from mlx_serve.server.streaming import EventStreamResponse, collect_events, merge_events, sse
from mlx_serve.server.tools import make_splitter, normalize_messages, render_chat, validate_tools


def render_chat_body(body: dict[str, Any], tokenizer: Any) -> tuple[list[int], list[dict[str, Any]] | None]:
    """A chat request's prompt ids (messages, tools, template kwargs) and its tools."""
    tools = None if body.get("tool_choice") == "none" else validate_tools(body.get("tools"))
    kwargs = body.get("chat_template_kwargs")
    if kwargs is not None and not isinstance(kwargs, dict):
        raise InvalidRequest("chat_template_kwargs must be an object", param="chat_template_kwargs")
    # vLLM's extension: a prefilled answer the model continues (the last message is the assistant's, left open)
    continue_final = read_bool(body, "continue_final_message")
    return render_chat(tokenizer, normalize_messages(body.get("messages")), tools, kwargs, continue_final), tools


def parse_chat(body: dict[str, Any], tokenizer: Any, model: ModelInfo) -> Job:
    model.check_name(body.get("model"))
    stream = read_bool(body, "stream")
    prompt, tools = render_chat_body(body, tokenizer)
    want_logprobs = read_bool(body, "logprobs")
    top = read_int(body, "top_logprobs", low=0, high=20)
    if top is not None and not want_logprobs:
        raise InvalidRequest("top_logprobs needs logprobs set to true", param="top_logprobs")
    prompt_top = read_prompt_logprobs(body, stream)
    requests = build_requests(body, prompt, model, logprobs=(top or 0) if want_logprobs else None,
                              max_token_fields=("max_completion_tokens", "max_tokens"),
                              n=read_int(body, "n", 1, low=1, high=MAX_CHOICES),
                              grammar=_grammar(body, tools, tokenizer), prompt_logprobs=prompt_top,
                              bad_words=read_bad_words(body, tokenizer))
    if prompt_top is not None:  # the answer shows one prompt's scores: only the first choice computes them
        requests = requests[:1] + tuple(replace(r, sampling=replace(r.sampling, prompt_logprobs=None))
                                        for r in requests[1:])  # fmt: skip
    return Job(requests, stream, read_stream_options(body, stream), want_logprobs, tools, n=len(requests),
               split_reasoning=model.split_reasoning, prompt_logprobs=prompt_top)


def _grammar(body: dict[str, Any], tools: list[dict[str, Any]] | None = None, tokenizer: Any = None) -> str | None:
    """What the answer must follow: `response_format`, vLLM's guided decoding, or tool calls only for `tool_choice`
    required / named (at most one of them)."""
    parallel = read_bool(body, "parallel_tool_calls", True)
    given = {
        "response_format": grammar_for_response_format(body.get("response_format")),
        "guided decoding": grammar_for_guided(body),
        "tool_choice": grammar_for_tool_choice(body.get("tool_choice"), tools, tokenizer, parallel),
    }
    chosen = [name for name, grammar in given.items() if grammar is not None]
    if len(chosen) > 1:
        guided = next((f for f in (*GUIDED_FIELDS, "structured_outputs") if body.get(f) is not None), "tool_choice")
        param = "tool_choice" if chosen[-1] == "tool_choice" else guided
        raise InvalidRequest(f"{' and '.join(chosen)} cannot both be enforced", param=param)
    return given[chosen[0]] if chosen else None


def parse_completion(body: dict[str, Any], tokenizer: Any, model: ModelInfo) -> Job:
    model.check_name(body.get("model"))
    stream = read_bool(body, "stream")
    if "prompt" not in body:
        raise InvalidRequest("prompt is required", param="prompt")
    prompts = read_prompts(body["prompt"], tokenizer, model.vocab_size)
    top = read_int(body, "logprobs", low=0, high=20)
    n = read_int(body, "n", 1, low=1, high=MAX_CHOICES)
    echo = read_bool(body, "echo")
    # echo with max_tokens 0 scores the prompt alone (lm-eval's loglikelihood): one token is made and dropped
    echo_only = echo and body.get("max_tokens") == 0
    grammar = _grammar(body)
    prompt_top = read_prompt_logprobs(body, stream)
    bad_words = read_bad_words(body, tokenizer)
    # echoed logprobs and vLLM's prompt_logprobs share one scoring of the prompt, at the larger top k
    scored = max((k for k in (top if echo else None, prompt_top) if k is not None), default=None)
    fields = {**body, "max_tokens": 1} if echo_only else body
    requests = tuple(
        request
        for prompt in prompts
        for request in build_requests(fields, prompt.ids, model, logprobs=top, max_token_fields=("max_tokens",), n=n,
                                      prompt_param="prompt", prompt_logprobs=scored, grammar=grammar,
                                      bad_words=bad_words)
    )  # fmt: skip
    if scored is not None and n > 1:  # a prompt's choices share its first choice's scores (`_serve`, the stream)
        requests = tuple(r if i % n == 0 else replace(r, sampling=replace(r.sampling, prompt_logprobs=None))
                         for i, r in enumerate(requests))  # fmt: skip
    # the echo is the prompt as the model read it (`truncate_prompt_tokens` may have cut its head)
    echoed = tuple(p.text if len(r.prompt_ids) == len(p.ids) else tokenizer.decode(list(r.prompt_ids))
                   for p, r in zip((p for p in prompts for _ in range(n)), requests)) if echo else None
    return Job(requests, stream, read_stream_options(body, stream), top is not None, n=n, echo=echoed,
               echo_only=echo_only, echo_top=top or 0, prompt_logprobs=prompt_top)


async def chat_completions(request: Request) -> Response:
    return await _serve(request, parse_chat, "chatcmpl", _chat_stream, fmt.chat_response)


async def completions(request: Request) -> Response:
    return await _serve(request, parse_completion, "cmpl", _completion_stream, fmt.completion_response)


def tokenized(body: dict[str, Any], tokenizer: Any, model: ModelInfo) -> dict[str, Any]:
    """vLLM's /tokenize: a prompt's ids (`prompt`, as /v1/completions reads it; or `messages`, rendered as
    /v1/chat/completions renders them), their count and the context length."""
    model.check_name(body.get("model"))
    if ("messages" in body) == ("prompt" in body):
        raise InvalidRequest("give either prompt or messages", param="prompt")
    if "messages" in body:
        ids = render_chat_body(body, tokenizer)[0]
    else:
        [prompt] = read_prompts(body["prompt"] if isinstance(body["prompt"], str) else [body["prompt"]], tokenizer,
                                model.vocab_size)  # fmt: skip
        ids = prompt.ids
    return {"count": len(ids), "max_model_len": model.context_length, "tokens": ids}


def detokenized(body: dict[str, Any], tokenizer: Any, model: ModelInfo) -> dict[str, Any]:
    """vLLM's /detokenize: the text of `tokens`."""
    model.check_name(body.get("model"))
    tokens = body.get("tokens")
    if not isinstance(tokens, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in tokens):
        raise InvalidRequest("tokens must be a list of token ids", param="tokens")
    outside = [t for t in tokens if not 0 <= t < model.vocab_size]
    if outside:
        raise InvalidRequest(f"tokens outside the vocabulary (0..{model.vocab_size - 1}): {outside[:5]}",
                             param="tokens")
    return {"prompt": tokenizer.decode(tokens)}


async def tokenize(request: Request) -> Response:
    body = parse_json_object(await request.body())
    return JSONResponse(await run_in_threadpool(tokenized, body, request.state.engine.tokenizer, request.state.model))


async def detokenize(request: Request) -> Response:
    body = parse_json_object(await request.body())
    return JSONResponse(await run_in_threadpool(detokenized, body, request.state.engine.tokenizer,
                                                request.state.model))  # fmt: skip


async def load_lora_adapter(request: Request) -> Response:
    """vLLM's: serve the adapter at `lora_path` as `lora_name` (`serve --allow-adapter-loading`)."""
    body = parse_json_object(await request.body())
    name, path = _read_name(body, "lora_name"), _read_name(body, "lora_path")
    await run_in_threadpool(request.state.engine.load_adapter, AdapterSpec(name, path))
    return PlainTextResponse(f"Success: LoRA adapter '{name}' added successfully.")


async def unload_lora_adapter(request: Request) -> Response:
    """vLLM's: stop serving `lora_name` (refused while requests naming it are open)."""
    name = _read_name(parse_json_object(await request.body()), "lora_name")
    await run_in_threadpool(request.state.engine.unload_adapter, name)
    return PlainTextResponse(f"Success: LoRA adapter '{name}' removed successfully.")


def _read_name(body: dict[str, Any], field: str) -> str:
    value = body.get(field)
    if not isinstance(value, str) or not value:
        raise InvalidRequest(f"{field} must be a non-empty string", param=field)
    return value


async def list_models(request: Request) -> Response:
    """The base model, then each adapter served beside it (its `parent` the base, as vLLM lists them)."""
    model: ModelInfo = request.state.model
    return JSONResponse({"object": "list", "data": [_model_object(model, name) for name in (None, *model.adapters)]})


async def retrieve_model(request: Request) -> Response:
    """The served model by its id or an alias, or an adapter (OpenAI's models.retrieve); 404 for any other name."""
    model: ModelInfo = request.state.model
    return JSONResponse(_model_object(model, model.adapter_for(request.path_params["model_id"])))


def _model_object(model: ModelInfo, adapter: str | None = None) -> dict[str, Any]:
    card = {"id": adapter or model.model_id, "object": "model", "created": 0, "owned_by": "mlx_serve",
            "max_model_len": model.context_length}
    return {**card, "parent": model.model_id} if adapter else card


async def _serve(request: Request, parse: Callable[..., Job], prefix: str, stream: Callable[..., Any],
                 respond: Callable[..., dict[str, Any]]) -> Response:
    """Parse, submit one engine request per choice, then stream or answer in one body."""
    engine, model = request.state.engine, request.state.model
    body = parse_json_object(await request.body())
    job = await run_in_threadpool(parse, body, engine.tokenizer, model)
    job_id = f"{prefix}-{uuid.uuid4().hex}"
    requests = [replace(r, request_id=f"{job_id}-{i}") for i, r in enumerate(job.requests)]
    handles = engine.submit_all(requests)
    created = int(time.time())
    served = job.requests[0].adapter or model.model_id  # an adapter answers under its own name
    if job.stream:
        chunks = stream(job, handles, engine.tokenizer, job_id, served, created)
        return EventStreamResponse(chunks, handles)
    choices = choice_states(job, engine.tokenizer)
    for index, events in enumerate(await collect_events(handles, request)):
        if index % job.n:  # a prompt's later choices show its scores, computed once by its first (parse_completion)
            choices[index].prompt_scores = choices[index - index % job.n].prompt_scores
        for event in events:
            choices[index].add(event)
    return JSONResponse(respond(job_id, served, created, choices, job.want_logprobs))


def choice_states(job: Job, tokenizer: Any) -> list[fmt.ChoiceState]:
    """One answer state per request of the job (tool-call and reasoning splitters as the job asks)."""
    return [fmt.ChoiceState(i, tokenizer, job.want_logprobs, make_splitter(tokenizer, job.tools), job.tools,
                            counts_prompt=i % job.n == 0, echo=job.echo[i] if job.echo else None,
                            echo_only=job.echo_only, echo_top=job.echo_top, prompt_top=job.prompt_logprobs,
                            reasoner=make_reasoning_splitter(tokenizer, request.prompt_ids, job.split_reasoning))
            for i, request in enumerate(job.requests)]  # fmt: skip


async def _chat_stream(job: Job, handles: Sequence[Any], tokenizer: Any, job_id: str, model: str,
                       created: int) -> AsyncIterator[bytes]:
    choices = choice_states(job, tokenizer)

    def chunk(index: int, delta: dict[str, Any], finish: str | None = None, logprobs: Any = None) -> bytes:
        return sse(fmt.chat_chunk(job_id, model, created, index, delta, finish, logprobs, job.include_usage))

    for choice in choices:
        yield chunk(choice.index, {"role": "assistant", "content": ""})
    async for index, event in merge_events(handles):
        try:
            delta = choices[index].add(event)
        except fmt.GenerationFailed as exc:
            yield sse(openai_error_body(exc))
            return
        if not delta.empty:
            body: dict[str, Any] = {"content": delta.text} if delta.text else {}
            body.update(fmt.reasoning_fields(delta.reasoning))
            if delta.tool_calls:
                body["tool_calls"] = delta.tool_calls
            yield chunk(index, body, logprobs=delta.logprobs)
        if event.finish_reason is not None:
            yield chunk(index, {}, choices[index].finish_reason)
    if job.include_usage:
        yield sse(fmt.usage_chunk(job_id, model, created, "chat.completion.chunk", choices))
    yield sse("[DONE]")


async def _completion_stream(job: Job, handles: Sequence[Any], tokenizer: Any, job_id: str, model: str,
                             created: int) -> AsyncIterator[bytes]:
    choices = choice_states(job, tokenizer)
    # a prompt's later choices echo the scores its first computes: their events wait for its first event (which
    # carries them)
    waiting: dict[int, list[Any]] = {}
    shares = job.echo is not None and job.want_logprobs and job.n > 1
    heard: set[int] = set()  # first choices that have sent an event
    async for index, event in merge_events(handles):
        first = index - index % job.n
        if shares and index != first and first not in heard:
            waiting.setdefault(first, []).append((index, event))
            continue
        heard.add(index)
        ready = [(index, event), *waiting.pop(index, [])]
        for index, event in ready:
            choice = choices[index]
            choice.prompt_scores = choice.prompt_scores or choices[index - index % job.n].prompt_scores
            offset = choice.entry_chars  # offsets count the entries' token texts, as the whole answer's do
            try:
                delta = choice.add(event)
            except fmt.GenerationFailed as exc:
                yield sse(openai_error_body(exc))
                return
            if not delta.empty or event.finish_reason is not None:
                logprobs = fmt.completion_logprobs(delta.logprobs, offset) if job.want_logprobs else None
                yield sse(fmt.completion_chunk(job_id, model, created, index, delta.text, choice.finish_reason,
                                               logprobs, job.include_usage))
    if job.include_usage:
        yield sse(fmt.usage_chunk(job_id, model, created, "text_completion", choices))
    yield sse("[DONE]")
