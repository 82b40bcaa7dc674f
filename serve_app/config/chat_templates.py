"""A model's chat template and tool-call format, when its checkpoint's own will not do.

Two profile keys (``serve_app.config.profile.ModelProfile``) change what ``mlx_lm.load`` makes of a
checkpoint's tokenizer, through mlx-lm's public ``tokenizer_config`` (the keyword arguments
of ``AutoTokenizer.from_pretrained``: nothing private is set):

- ``chat_template``: a builtin name (``BUILTIN_TEMPLATES``) or a Jinja file; it replaces the
  checkpoint's template. mlx-lm infers the tool-call format from the template it ends up
  with (``<tool_call>`` and ``tool_call.name`` in it: ``json_tools``).
- ``tool_call_format``: the name of an mlx-lm tool parser (a module of
  ``mlx_lm.tool_parsers``: ``json_tools``, ``qwen3_coder``, ``pythonic``, ...), whatever the
  template says. mlx-lm takes the markers and the parser from that module.

SmolLM2-135M-Instruct's template (from its GGUF) has no tools, so the embedded
``smollm2-135m`` models are served with ``smollm2-tools`` and ``json_tools`` unless their
profile says otherwise (``serve_app.config.catalog.profile_defaults``).

This module imports neither MLX nor mlx-lm: the ingress and ``serve-app check`` validate
profiles without them (the parser names are read from mlx-lm's package directory).
"""

from __future__ import annotations

import importlib.util
import re
from pathlib import Path

# SmolLM2-135M-Instruct's system prompt when a chat has none (its own template's).
SMOLLM2_SYSTEM = "You are a helpful AI assistant named SmolLM, trained by Hugging Face"

# ChatML with Hermes/Qwen2.5-style tools: the tools as JSON lines in a "# Tools" section of
# the system message, calls as <tool_call> JSON blocks in assistant turns, results as
# <tool_response> blocks in user turns (consecutive tool messages in one turn). A first
# ``system`` (or ``developer``) message is the system prompt; without one, the prompt is
# ``default_system`` (none when it is None). Without tools a chat renders as plain ChatML,
# exactly as SmolLM2's own template renders it (for the same default system prompt).
_CHATML_TOOLS = r"""{%- if messages and messages[0].role in ('system', 'developer') %}
    {%- set system_message = messages[0].content if messages[0].content is string else '' %}
    {%- set loop_messages = messages[1:] %}
{%- else %}
    {%- set system_message = default_system %}
    {%- set loop_messages = messages %}
{%- endif %}
{%- if tools %}
    {{- '<|im_start|>system\n' }}
    {%- if system_message %}
        {{- system_message + '\n\n' }}
    {%- endif %}
    {{- "# Tools\n\nYou may call one or more functions to assist with the user query.\n\nYou are provided with function signatures within <tools></tools> XML tags:\n<tools>" }}
    {%- for tool in tools %}
        {{- "\n" }}
        {{- tool | tojson }}
    {%- endfor %}
    {{- "\n</tools>\n\nFor each function call, return a json object with function name and arguments within <tool_call></tool_call> XML tags:\n<tool_call>\n{\"name\": <function-name>, \"arguments\": <args-json-object>}\n</tool_call><|im_end|>\n" }}
{%- elif system_message is not none %}
    {{- '<|im_start|>system\n' + system_message + '<|im_end|>\n' }}
{%- endif %}
{%- for message in loop_messages %}
    {%- set content = message.content if message.content is string else '' %}
    {%- if message.role == 'assistant' %}
        {{- '<|im_start|>assistant\n' + content }}
        {%- for tool_call in message.tool_calls or [] %}
            {%- if content or not loop.first %}
                {{- '\n' }}
            {%- endif %}
            {%- if tool_call.function %}
                {%- set tool_call = tool_call.function %}
            {%- endif %}
            {{- '<tool_call>\n{"name": "' + tool_call.name + '", "arguments": ' }}
            {%- if tool_call.arguments is string %}
                {{- tool_call.arguments }}
            {%- else %}
                {{- tool_call.arguments | tojson }}
            {%- endif %}
            {{- '}\n</tool_call>' }}
        {%- endfor %}
        {{- '<|im_end|>\n' }}
    {%- elif message.role == 'tool' %}
        {%- if loop.first or loop_messages[loop.index0 - 1].role != 'tool' %}
            {{- '<|im_start|>user' }}
        {%- endif %}
        {{- '\n<tool_response>\n' + content + '\n</tool_response>' }}
        {%- if loop.last or loop_messages[loop.index0 + 1].role != 'tool' %}
            {{- '<|im_end|>\n' }}
        {%- endif %}
    {%- else %}
        {{- '<|im_start|>' + message.role + '\n' + content + '<|im_end|>\n' }}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\n' }}
{%- endif %}"""  # noqa: E501


def _chatml_tools(default_system: str | None) -> str:
    value = "none" if default_system is None else repr(default_system)
    return "{%- set default_system = " + value + " %}\n" + _CHATML_TOOLS


# Builtin templates, by the name a profile's ``chat_template`` gives.
BUILTIN_TEMPLATES: dict[str, str] = {
    "chatml-tools": _chatml_tools(None),
    "smollm2-tools": _chatml_tools(SMOLLM2_SYSTEM),
}
MAX_TEMPLATE_BYTES = 1 << 20
_PARSER_NAME = re.compile(r"^[a-z][a-z0-9_]*$")


def tool_parser_names() -> list[str]:
    """mlx-lm's tool parsers (the modules of ``mlx_lm.tool_parsers``), without importing
    mlx-lm (which loads MLX)."""
    spec = importlib.util.find_spec("mlx_lm")
    if spec is None or not spec.submodule_search_locations:
        return []
    names: set[str] = set()
    for location in spec.submodule_search_locations:
        folder = Path(location) / "tool_parsers"
        names.update(p.stem for p in folder.glob("*.py") if not p.stem.startswith("_"))
    return sorted(names)


def check_tool_call_format(name: str) -> str:
    """``name`` if it is one of mlx-lm's tool parsers; ``ValueError`` naming them if not."""
    known = tool_parser_names()
    if not _PARSER_NAME.match(name) or name not in known:
        raise ValueError(f"unknown tool-call format {name!r}: it must name one of mlx-lm's "
                         f"tool parsers ({', '.join(known) or 'none found'})")
    return name


def check_chat_template(value: str, base_dir: Path | None = None) -> str:
    """A builtin name as it is, or the absolute path of a Jinja template file: a relative
    path is taken from ``base_dir`` (the config file's directory) or else the working
    directory. ``ValueError`` when the file cannot be read or is not a Jinja template."""
    if value in BUILTIN_TEMPLATES:
        return value
    path = Path(value).expanduser()
    if not path.is_absolute():
        path = (base_dir or Path.cwd()) / path
    path = path.resolve()
    hint = f"builtin templates: {', '.join(BUILTIN_TEMPLATES)}"
    if not path.is_file():
        where = "" if Path(value).expanduser().is_absolute() else (
            f" (relative to {'the config file' if base_dir else 'the working directory'})")
        raise ValueError(f"{value!r} is neither a builtin template nor a file: {path} does "
                         f"not exist{where}; {hint}")
    try:
        if path.stat().st_size > MAX_TEMPLATE_BYTES:
            raise ValueError(f"{path}: a chat template must be under {MAX_TEMPLATE_BYTES} bytes")
        text = path.read_text(encoding="utf-8")
    except OSError as exc:
        raise ValueError(f"{path}: cannot read: {exc.strerror}") from None
    except UnicodeDecodeError:
        raise ValueError(f"{path}: not UTF-8 text") from None
    check_jinja(text, str(path))
    return str(path)


def check_jinja(text: str, where: str) -> None:
    """``ValueError`` when ``text`` is not a Jinja template (its syntax only)."""
    import jinja2

    try:
        jinja2.Environment().parse(text)
    except jinja2.TemplateSyntaxError as exc:
        raise ValueError(f"{where}: not a Jinja template: line {exc.lineno}: {exc.message}"
                         ) from None


def template_text(value: str) -> str:
    """The text of a validated ``chat_template`` value (a builtin name or a file)."""
    builtin = BUILTIN_TEMPLATES.get(value)
    return builtin if builtin is not None else Path(value).read_text(encoding="utf-8")


def tokenizer_config(chat_template: str | None, tool_call_format: str | None) -> dict:
    """mlx-lm's ``tokenizer_config`` (``mlx_lm.load``, ``load_tokenizer``) for a model's
    ``chat_template`` and ``tool_call_format``: ``{}`` when neither is set."""
    out: dict = {}
    if chat_template is not None:
        out["chat_template"] = template_text(chat_template)
    if tool_call_format is not None:
        out["tool_parser_type"] = tool_call_format
    return out
