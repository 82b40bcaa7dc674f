"""Requests to prompt tokens: the chat template, context checks, sampling defaults.

``Preparer`` needs only the tokenizer and the model's profile, so the replica
(``ModelService``) and the ingress share it: where replicas are routed by their
cached prefixes, the ingress prepares each request itself (the router needs its
tokens), and the replica takes the ``PreparedRequest`` as it is.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import Any

from serve_app.cache.prefix import branch_points_in_text, common_prefix, find_branch_points
from serve_app.config.profile import ModelProfile
from serve_app.models.compat import wrapped_hf_tokenizer
from serve_app.multimodal.images import ImageError
from serve_app.multimodal.processor import ProcessedImage
from serve_app.multimodal.prompt import ImagePrompts, VisionPrompt
from serve_app.reasoning.ahead import History, next_turn_prefix
from serve_app.reasoning.markers import markers_of
from serve_app.reasoning.plan import ThinkingPlan, budget_of, plan_thinking
from serve_app.serving.normalize import Normalized, normalize, rules_named
from serve_app.serving.request import (
    ApiError,
    Caller,
    ChatCompletionRequest,
    CompletionRequest,
    NamedToolChoice,
    check_prompt_size,
)
from serve_app.serving.sampling import SamplingParams
from serve_app.serving.structured import (
    Grammar,
    StructuredOutputError,
    compile_response_format,
    compile_tool_choice,
)
from serve_app.serving.tool_rules import forces_call
from serve_app.serving.tools import ToolCall, canonical_tools, tool_support

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class Prompt:
    """A prompt's tokens and, when one rendering gave both, its text and the end offset
    of each token in that text (where the branch points are found)."""

    tokens: list[int]
    text: str | None = None
    token_ends: list[int] | None = None


@dataclass(frozen=True)
class Rendered:
    """A chat request's messages (normalized) and tools as the chat template takes them."""

    messages: list[dict]
    tools: list[dict] | None
    normalized: tuple[str, ...] = ()  # the normalization rules that changed the messages


@dataclass
class PreparedRequest:
    """What the engine needs for one request, after validation."""

    prompt: list[int]
    params: SamplingParams
    stops: list[str]
    salt: str | None = None
    api_key_digest: str | None = None  # set only when the profile isolates by API key
    # Where the conversation may branch: the end of the system prompt, the start of
    # the last message (prompt positions; a tail of the cache is captured there).
    branch_points: tuple[int, ...] = ()
    prepare_seconds: float = 0.0  # templating and tokenizing, for the phase metrics
    normalized: tuple[str, ...] = ()  # normalization rules that changed the prompt
    logprobs: int | None = None  # None: none; k: each token's logprob and k alternatives
    response_format: dict | None = None  # as the request sent it (validated)
    # Tools the model may call (canonical form) and the choice; None: none offered.
    tools: list[dict] | None = None
    tool_choice: str | dict | None = None
    parallel_tool_calls: bool = True
    # A thinking model's chat request: its output splits into thought and answer.
    thinking: ThinkingPlan | None = None
    # Its conversation, kept to prefill the next turn's prefix ahead (a thinking chat with
    # the prefix cache on; ``serve_app.reasoning.ahead``).
    history: History | None = None
    # Its images (then ``prompt`` holds their keys: ``serve_app.multimodal.prompt``).
    vision: VisionPrompt | None = None
    # Tokens a lost replica generated for it: the answer goes on after them (``resumed``).
    resume: tuple[int, ...] = ()

    @property
    def forced_tool_choice(self) -> bool:
        return self.tools is not None and forces_call(self.tool_choice)


class Preparer:
    """Validation and templating for one model's requests (no engine, no Ray)."""

    def __init__(self, profile: ModelProfile, tokenizer, branch_points: bool = True,
                 images: ImagePrompts | None = None) -> None:
        self.profile = profile
        self.images = images  # a vision model's image side (None: it takes no images)
        self.tokenizer = tokenizer
        self.find_branches = branch_points  # only worth it where a prefix cache keeps tails
        self._tool_support = _UNKNOWN  # looked up on first use (tool_support)
        self.rules = rules_named(profile.normalize)
        # A fast tokenizer's call with offsets: the prompt and its branch points from one
        # rendering (None: the tokenizer cannot, so branch points cost renderings).
        hf = wrapped_hf_tokenizer(tokenizer) or tokenizer
        self._offsets: Callable[..., Any] | None = hf if getattr(hf, "is_fast", False) else None
        self._offsets_checked = False
        self.renders_saved = 0  # requests whose branch points cost no rendering
        self._generation_prompts: dict[str, list[int]] = {}  # by template arguments
        # A thinking model's markers (None: the output is all answer); a parser the
        # tokenizer cannot serve fails the load, naming the key.
        try:
            self.markers = markers_of(tokenizer, profile.reasoning_parser)
        except ValueError as exc:
            raise ValueError(f"models[{profile.name}].reasoning_parser: {exc}") from None

    def template_input(self, request: ChatCompletionRequest) -> Rendered:
        """The messages and tools as the chat template takes them: built once per request
        (client quirks normalized, tool definitions canonicalized, call arguments parsed)
        for every rendering."""
        normalized: Normalized = normalize(request.messages, self.rules)
        return Rendered(normalized.messages, self.template_tools(request), normalized.applied)

    def prompt_tokens(self, request: ChatCompletionRequest | CompletionRequest,
                      rendered: Rendered | None = None) -> list[int]:
        return self._prompt(request, rendered).tokens

    def _prompt(self, request: ChatCompletionRequest | CompletionRequest,
                rendered: Rendered | None = None, with_text: bool = False) -> Prompt:
        """The prompt's tokens; ``with_text``: also its rendered text and each token's end
        offset in it, where the tokenizer can say (one rendering serves the prompt and
        its branch points)."""
        if isinstance(request, ChatCompletionRequest):
            rendered = rendered or self.template_input(request)
            messages, tools = rendered.messages, rendered.tools
            continue_final = request.continue_final_message
            if continue_final and messages[-1]["role"] != "assistant":
                raise ApiError(400, "continue_final_message needs a final assistant message",
                               param="messages")

            extra = request.template_kwargs()

            def render(tokenize: bool) -> Any:
                return self.tokenizer.apply_chat_template(
                    messages, tools=tools, tokenize=tokenize,
                    add_generation_prompt=not continue_final,
                    continue_final_message=continue_final, **extra)

            try:
                if with_text and self._offsets is not None:
                    return self._with_offsets(render)
                return Prompt(list(render(True)))
            except Exception as exc:  # templates raise on bad role orders etc.
                raise ApiError(400, f"chat template failed: {exc}", param="messages") from None
        return Prompt(self._completion_tokens(request))

    def _with_offsets(self, render: Callable[[bool], Any]) -> Prompt:
        """One rendering to text, tokenized once with offsets. The first time, the tokens
        are checked against the template's own tokenization; if they differ, this
        tokenizer never takes this path again."""
        text = render(False)
        assert self._offsets is not None
        encoded = self._offsets(text, add_special_tokens=False, return_offsets_mapping=True)
        tokens = list(encoded["input_ids"])
        if not self._offsets_checked:
            expected = list(render(True))
            self._offsets_checked = True
            if tokens != expected:
                logger.warning("model %s: the chat template's text tokenizes differently "
                               "from its own tokenization: branch points cost renderings",
                               self.profile.name)
                self._offsets = None
                return Prompt(expected)
        return Prompt(tokens, text, [end for _, end in encoded["offset_mapping"]])

    def _completion_tokens(self, request: CompletionRequest) -> list[int]:
        prompt = request.prompt
        if isinstance(prompt, list):
            prompt = prompt[0] if isinstance(prompt[0], (str, list)) else prompt
        if isinstance(prompt, str):
            return list(self.tokenizer.encode(prompt, add_special_tokens=False))
        vocab = self.tokenizer.vocab_size
        bad = [t for t in prompt if not 0 <= t < max(vocab, len(self.tokenizer))]
        if bad:
            raise ApiError(400, f"prompt has token ids outside the vocabulary (0 to "
                                f"{max(vocab, len(self.tokenizer)) - 1}): {bad[:5]}",
                           param="prompt")
        return list(prompt)

    def template_tools(self, request: ChatCompletionRequest) -> list[dict] | None:
        """The request's tools as the chat template renders them, in a canonical order:
        the same tools always give the same tokens, so they hit the prefix cache."""
        if not request.tools:
            return None
        return canonical_tools([t.to_template() for t in request.tools])

    def check_tools(self, request: ChatCompletionRequest | CompletionRequest) -> None:
        """400 for tools offered to a model that cannot call them."""
        if isinstance(request, ChatCompletionRequest) and request.wants_tools() \
                and self.tool_support is None:
            raise ApiError(400, f"model {self.profile.name!r} cannot call tools (its chat "
                                "template and tokenizer define no tool-call format)",
                           param="tools", code="tools_not_supported")

    def grammar(self, prepared: PreparedRequest) -> Grammar | None:
        """The grammar a request decodes under: its ``response_format``, else its forced
        tool call; 400 for one that does not compile. Compiled grammars are cached, so
        validating here (``prepare``) and building the processor later compile once."""
        try:
            if prepared.response_format is not None:
                grammar = compile_response_format(prepared.response_format, self.tokenizer)
                if grammar is not None:
                    return grammar
            if prepared.forced_tool_choice:
                return compile_tool_choice(prepared.tools, prepared.tool_choice,
                                           self.tokenizer, self.tool_support,
                                           parallel=prepared.parallel_tool_calls)
        except StructuredOutputError as exc:
            raise ApiError(400, str(exc), param=exc.param) from None
        return None

    @property
    def tool_support(self):
        if self._tool_support is _UNKNOWN:
            self._tool_support = tool_support(self.tokenizer)
        return self._tool_support

    def count(self, request: ChatCompletionRequest | CompletionRequest) -> int:
        """The prompt's tokens as it would be served (a token count, nothing compiled)."""
        check_prompt_size(request, self.profile.prompt_char_limit(), self.profile.context_length,
                          self.profile.max_messages)
        self.check_tools(request)  # the same 400 a generation would get
        return len(self.prompt_tokens(request))

    def prepare(self, request: ChatCompletionRequest | CompletionRequest,
                caller: Caller | None = None) -> PreparedRequest:
        """Prompt tokens and sampling for a request the ingress validated.

        Runs on a worker thread: templating and tokenizing a long prompt must not
        stall an event loop. ``caller`` comes from the ingress's view of the
        headers, never from the body.
        """
        tic = time.perf_counter()
        check_prompt_size(request, self.profile.prompt_char_limit(), self.profile.context_length,
                          self.profile.max_messages)
        chat = request if isinstance(request, ChatCompletionRequest) else None
        rendered = self.template_input(chat) if chat is not None else None
        images: list[tuple[str, str]] = [(u.url, u.detail) for m in chat.messages
                                         for u in m.images()] if chat else []
        found = self._prompt(request, rendered, with_text=self.find_branches and not images)
        prompt = found.tokens
        vision = self._vision(prompt, images) if images else None
        if vision is not None:
            prompt = vision.keys
        if not prompt:
            raise ApiError(400, "the prompt is empty after tokenization", param="prompt")
        limit = self.profile.context_length
        if len(prompt) >= limit:
            raise ApiError(
                400,
                f"this model's maximum context length is {limit} tokens, but the prompt "
                f"has {len(prompt)} tokens (at least one token must remain to generate)",
                param="messages" if isinstance(request, ChatCompletionRequest) else "prompt",
                code="context_length_exceeded",
            )
        wanted = request.requested_max_tokens() or self.profile.max_tokens
        max_tokens = min(wanted, self.profile.max_tokens, limit - len(prompt))
        defaults = self.profile.sampling
        temperature = request.temperature
        params = SamplingParams(
            max_tokens=max_tokens,
            temperature=defaults.temperature if temperature is None else temperature,
            top_p=defaults.top_p if request.top_p is None else request.top_p,
            seed=request.seed,
        )
        self.check_tools(request)
        offered = chat is not None and rendered is not None and chat.wants_tools()
        isolate = self.profile.cache.isolate_by_api_key
        prepared = PreparedRequest(
            prompt=prompt, params=params, stops=request.stop_list(), salt=request.cache_salt,
            api_key_digest=caller.api_key_digest if isolate and caller is not None else None,
            logprobs=request.top_logprobs_wanted(),
            response_format=chat.response_format if chat is not None else None,
            tools=rendered.tools if offered and rendered is not None else None,
            tool_choice=_choice(chat) if offered and chat is not None else None,
            parallel_tool_calls=chat is None or chat.parallel_tool_calls is not False)
        if chat is not None:
            reasoning = self.profile.reasoning
            prepared.thinking = plan_thinking(self.markers, self._answer_start(
                chat, rendered, prompt), budget_of(
                tokens=chat._thinking_budget, effort=chat.reasoning_effort,
                default=reasoning.budget_tokens, efforts=reasoning.effort_budgets))
            if (prepared.thinking is not None and rendered is not None and self.find_branches
                    and reasoning.prefill_next_turn and not chat.continue_final_message):
                prepared.history = History(tuple(rendered.messages), rendered.tools,
                                           chat.template_kwargs())
        self.grammar(prepared)  # a schema or tool choice that does not compile: 400 now
        prepared.normalized = rendered.normalized if rendered else ()
        prepared.vision = vision
        if vision is None:  # image tokens shift a rendering's offsets: no branch points
            prepared.branch_points = self.branch_points(request, prompt, rendered, found)
        prepared.resume = checked_resume(request._resume_tokens, max_tokens)
        prepared.prepare_seconds = time.perf_counter() - tic
        return prepared

    def _vision(self, tokens: list[int], images: list[tuple[str, str]]) -> VisionPrompt:
        """400 for images sent to a model without vision, or images it cannot take."""
        if self.images is None:
            raise ApiError(400, f"model {self.profile.name!r} does not take images",
                           param="messages", code="images_not_supported")
        try:
            return self.images.prompt(tokens, images)
        except ImageError as exc:
            raise ApiError(400, str(exc), param="messages", code="invalid_image") from None

    def _answer_start(self, request: ChatCompletionRequest, rendered: Rendered | None,
                      prompt: list[int]) -> list[int]:
        """The prompt's tokens after its conversation: the generation prompt the template
        adds (the same for every conversation with the same template arguments, so one
        rendering per argument set), or a continued final message's own tokens."""
        if self.markers is None or rendered is None:
            return []
        if request.continue_final_message:  # the client's own last message: its text
            return prompt[-64:]
        kwargs = request.template_kwargs()
        key = repr(sorted(kwargs.items()))
        suffix = self._generation_prompts.get(key)
        if suffix is None:
            probe = [{"role": "user", "content": "x"}]
            try:
                with_prompt, without = (list(self.tokenizer.apply_chat_template(
                    probe, add_generation_prompt=add, tokenize=True, **kwargs))
                    for add in (True, False))
            except Exception:  # a template that refuses the probe: no generation prompt
                with_prompt, without = [], []
            n = len(without)
            suffix = with_prompt[n:] if with_prompt[:n] == without else []
            if len(self._generation_prompts) < 64:
                self._generation_prompts[key] = suffix
        return suffix if suffix and prompt[-len(suffix):] == suffix else []

    def next_turn_prefix(self, history: History, answer: str, calls: Sequence[ToolCall],
                         images: Sequence[ProcessedImage] = ()) -> list[int]:
        """The tokens the conversation's next request starts with, once this turn
        answered ``answer`` (and ``calls``), as a client sends the turn back
        (``ChatMessage.to_template``'s shape); its ``images`` (the turn's, in order) keyed
        as the cache keys them."""
        assistant: dict[str, Any] = {"role": "assistant", "content": answer}
        if calls:
            assistant["tool_calls"] = [
                {"id": c.id, "type": "function",
                 "function": {"name": c.name, "arguments": _arguments(c.arguments)}}
                for c in calls]

        def render(messages: list[dict[str, Any]]) -> list[int]:
            return list(self.tokenizer.apply_chat_template(
                messages, tools=history.tools, add_generation_prompt=False, tokenize=True,
                **history.template_kwargs))

        tokens = next_turn_prefix(render, history, assistant)
        if images and self.images is not None:
            return self.images.keys_of(tokens, list(images))
        return tokens

    def branch_points(self, request: ChatCompletionRequest | CompletionRequest,
                      prompt: list[int], rendered: Rendered | None = None,
                      found: Prompt | None = None) -> tuple[int, ...]:
        """Prompt positions where another conversation is likely to branch off this one
        (see ``find_branch_points``). Only chat requests have them. From the prompt's own
        rendered text when ``found`` carries it (``branch_points_in_text``: no rendering
        more), else by rendering shorter conversations."""
        if not self.find_branches or not isinstance(request, ChatCompletionRequest):
            return ()
        rendered = rendered or self.template_input(request)
        messages, tools = rendered.messages, rendered.tools

        extra = request.template_kwargs()

        def render(conversation: list[dict]) -> list[int]:
            return self.tokenizer.apply_chat_template(
                conversation, tools=tools, add_generation_prompt=False, tokenize=True,
                **extra)

        in_text = None
        if found is not None and found.text is not None and found.token_ends is not None:
            in_text = branch_points_in_text(messages, found.text, found.token_ends)
        self.renders_saved += in_text is not None
        points = set(in_text if in_text is not None
                     else find_branch_points(messages, prompt, render))
        for n in request._cache_points:  # a client's own hint (cache_control)
            if 0 < n <= len(messages):
                try:
                    common = common_prefix(render(messages[:n]), prompt)
                except Exception:  # a template that refuses the shorter form
                    continue
                if 0 < common < len(prompt) - 1:
                    points.add(common)
        return tuple(sorted(points))


_UNKNOWN = object()


def checked_resume(tokens: Sequence[int], max_tokens: int) -> tuple[int, ...]:
    """A resumed request's tokens generated so far; 400 when they leave nothing to
    generate (the lost replica would have finished it) or are not token ids."""
    resume = tuple(tokens)
    if len(resume) >= max_tokens:
        raise ApiError(400, f"cannot resume after {len(resume)} tokens: the request "
                            f"generates at most {max_tokens}", code="invalid_resume")
    if any(isinstance(t, bool) or not isinstance(t, int) or t < 0 for t in resume):
        raise ApiError(400, "cannot resume: the tokens generated so far are not token ids",
                       code="invalid_resume")
    return resume


def resumed(prepared: PreparedRequest, images: ImagePrompts | None) -> PreparedRequest:
    """What the engine runs for a resumed request: its prompt followed by the tokens
    generated before (prefilled, restored from the cache where it holds them), the rest of
    its token budget, its seeded sampler at the position it had reached; its images'
    positions over the longer prompt. ``prepared`` itself still describes the request
    (its prompt, for usage; its stream replays the tokens: ``RequestStream.replay``)."""
    n = len(prepared.resume)
    run = replace(prepared, prompt=[*prepared.prompt, *prepared.resume],
                  params=replace(prepared.params, max_tokens=prepared.params.max_tokens - n,
                                 first_index=prepared.params.first_index + n))
    if prepared.vision is not None and images is not None:
        run.vision = images.from_keys(run.prompt, [s.image for s in prepared.vision.spans])
    return run


def _choice(request: ChatCompletionRequest) -> str | dict | None:
    choice = request.tool_choice
    return choice.model_dump() if isinstance(choice, NamedToolChoice) else choice


def _arguments(text: str) -> Any:
    """A call's arguments as templates take them: the object, else the text."""
    try:
        return json.loads(text)
    except ValueError:
        return text
