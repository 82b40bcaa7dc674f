"""The embedded models' chat templates and special tokens, as the real checkpoints they
stand for write them (Qwen3's, Qwen3.5's, and both with image parts)."""

from __future__ import annotations

# Qwen3's chat template (as in Qwen/Qwen3-8B's tokenizer_config.json): tools as JSON
# lines in a "# Tools" system section, calls as <tool_call> JSON blocks, results as
# <tool_response> blocks in user turns, and Qwen3's <think> handling. mlx-lm infers its
# "json_tools" tool parser from it, as for a real Qwen3 checkpoint.
CHAT_TEMPLATE = r"""{%- if tools %}
    {{- '<|im_start|>system\n' }}
    {%- if messages[0].role == 'system' %}
        {{- messages[0].content + '\n\n' }}
    {%- endif %}
    {{- "# Tools\n\nYou may call one or more functions to assist with the user query.\n\nYou are provided with function signatures within <tools></tools> XML tags:\n<tools>" }}
    {%- for tool in tools %}
        {{- "\n" }}
        {{- tool | tojson }}
    {%- endfor %}
    {{- "\n</tools>\n\nFor each function call, return a json object with function name and arguments within <tool_call></tool_call> XML tags:\n<tool_call>\n{\"name\": <function-name>, \"arguments\": <args-json-object>}\n</tool_call><|im_end|>\n" }}
{%- else %}
    {%- if messages[0].role == 'system' %}
        {{- '<|im_start|>system\n' + messages[0].content + '<|im_end|>\n' }}
    {%- endif %}
{%- endif %}
{%- set ns = namespace(multi_step_tool=true, last_query_index=messages|length - 1) %}
{%- for message in messages[::-1] %}
    {%- set index = (messages|length - 1) - loop.index0 %}
    {%- if ns.multi_step_tool and message.role == "user" and message.content is string and not(message.content.startswith('<tool_response>') and message.content.endswith('</tool_response>')) %}
        {%- set ns.multi_step_tool = false %}
        {%- set ns.last_query_index = index %}
    {%- endif %}
{%- endfor %}
{%- for message in messages %}
    {%- if message.content is string %}
        {%- set content = message.content %}
    {%- else %}
        {%- set content = '' %}
    {%- endif %}
    {%- if (message.role == "user") or (message.role == "system" and not loop.first) %}
        {{- '<|im_start|>' + message.role + '\n' + content + '<|im_end|>' + '\n' }}
    {%- elif message.role == "assistant" %}
        {%- set reasoning_content = '' %}
        {%- if message.reasoning_content is string %}
            {%- set reasoning_content = message.reasoning_content %}
        {%- else %}
            {%- if '</think>' in content %}
                {%- set reasoning_content = content.split('</think>')[0].rstrip('\n').split('<think>')[-1].lstrip('\n') %}
                {%- set content = content.split('</think>')[-1].lstrip('\n') %}
            {%- endif %}
        {%- endif %}
        {%- if loop.index0 > ns.last_query_index %}
            {%- if loop.last or (not loop.last and reasoning_content) %}
                {{- '<|im_start|>' + message.role + '\n<think>\n' + reasoning_content.strip('\n') + '\n</think>\n\n' + content.lstrip('\n') }}
            {%- else %}
                {{- '<|im_start|>' + message.role + '\n' + content }}
            {%- endif %}
        {%- else %}
            {{- '<|im_start|>' + message.role + '\n' + content }}
        {%- endif %}
        {%- if message.tool_calls %}
            {%- for tool_call in message.tool_calls %}
                {%- if (loop.first and content) or (not loop.first) %}
                    {{- '\n' }}
                {%- endif %}
                {%- if tool_call.function %}
                    {%- set tool_call = tool_call.function %}
                {%- endif %}
                {{- '<tool_call>\n{"name": "' }}
                {{- tool_call.name }}
                {{- '", "arguments": ' }}
                {%- if tool_call.arguments is string %}
                    {{- tool_call.arguments }}
                {%- else %}
                    {{- tool_call.arguments | tojson }}
                {%- endif %}
                {{- '}\n</tool_call>' }}
            {%- endfor %}
        {%- endif %}
        {{- '<|im_end|>\n' }}
    {%- elif message.role == "tool" %}
        {%- if loop.first or (messages[loop.index0 - 1].role != "tool") %}
            {{- '<|im_start|>user' }}
        {%- endif %}
        {{- '\n<tool_response>\n' }}
        {{- content }}
        {{- '\n</tool_response>' }}
        {%- if loop.last or (messages[loop.index0 + 1].role != "tool") %}
            {{- '<|im_end|>\n' }}
        {%- endif %}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\n' }}
    {%- if enable_thinking is defined and enable_thinking is false %}
        {{- '<think>\n\n</think>\n\n' }}
    {%- endif %}
{%- endif %}"""  # noqa: E501
# Qwen3.5's: the generation prompt opens the thought (closed and empty with thinking off),
# so the output starts inside it. The Qwen3.5 hybrid (tiny-hybrid-mtp) has this one.
QWEN35_CHAT_TEMPLATE = CHAT_TEMPLATE.replace(
    """        {{- '<think>\\n\\n</think>\\n\\n' }}
    {%- endif %}
{%- endif %}""",
    """        {{- '<think>\\n\\n</think>\\n\\n' }}
    {%- else %}
        {{- '<think>\\n' }}
    {%- endif %}
{%- endif %}""")
assert QWEN35_CHAT_TEMPLATE != CHAT_TEMPLATE
# The vision models': a template with a message's content parts (text, and images as
# Qwen's <|vision_start|><|image_pad|><|vision_end|>) as the real templates render them.
IMAGE_MARKUP = "<|vision_start|><|image_pad|><|vision_end|>"


def _with_image_parts(template: str) -> str:
    out = template.replace(
        """message.role == "user" and message.content is string and not(""",
        """message.role == "user" and not(message.content is string and """).replace(
        """    {%- else %}
        {%- set content = '' %}
    {%- endif %}""",
        """    {%- elif message.content %}
        {%- set parts = namespace(text='') %}
        {%- for part in message.content %}
            {%- if part.type == 'text' %}
                {%- set parts.text = parts.text + part.text %}
            {%- elif part.type in ('image', 'image_url') %}
                {%- set parts.text = parts.text + '""" + IMAGE_MARKUP + """' %}
            {%- endif %}
        {%- endfor %}
        {%- set content = parts.text %}
    {%- else %}
        {%- set content = '' %}
    {%- endif %}""")
    assert out.count(IMAGE_MARKUP) == 1
    return out


QWEN35_VL_CHAT_TEMPLATE = _with_image_parts(QWEN35_CHAT_TEMPLATE)  # tiny-vl (Qwen3.5)
QWEN_VL_CHAT_TEMPLATE = _with_image_parts(CHAT_TEMPLATE)  # tiny-qwen25-vl (thought closed)
# Appended only: the ids of earlier tokens never change. Tool-call and thinking markers are
# single special tokens, as in Qwen3's vocabulary (mlx-lm finds <think> by its token).
SPECIAL_TOKENS = [
    "<|endoftext|>", "<|im_start|>", "<|im_end|>",
    "<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>", "<think>", "</think>",
]
EOS_TOKEN = "<|im_end|>"
VISION_TOKENS = ["<|vision_start|>", "<|vision_end|>", "<|image_pad|>"]  # the VLM's, after
