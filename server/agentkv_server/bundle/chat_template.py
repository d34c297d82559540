"""The chat template agentkv gives its models: ChatML with Hermes-style tools.

Tool signatures go into the system turn inside ``<tools>``, calls come back as
``<tool_call>{"name": ..., "arguments": ...}</tool_call>`` (vLLM's ``hermes`` parser), tool
results go in a ``tool`` turn inside ``<tool_response>``. Every turn's rendering is a prefix of
the next turn's, which is what makes KV reuse across turns possible at all.
"""

from __future__ import annotations

__all__ = ["CHAT_TEMPLATE", "TOOL_CALL_PARSER"]

# vLLM's parser for the `<tool_call>{json}</tool_call>` format the chat template uses.
TOOL_CALL_PARSER = "hermes"

CHAT_TEMPLATE = """\
{%- if tools %}<|im_start|>system
{% if messages[0].role == 'system' %}{{ messages[0].content }}

{% endif %}# Tools
You may call one or more functions. Function signatures are inside <tools></tools>:
<tools>
{% for tool in tools %}{{ tool | tojson }}
{% endfor %}</tools>
To call a function, answer with <tool_call>{"name": <function-name>, \
"arguments": <args-json-object>}</tool_call><|im_end|>
{% elif messages[0].role == 'system' %}<|im_start|>system
{{ messages[0].content }}<|im_end|>
{% endif %}
{%- for message in messages %}
{%- if message.role == 'user' or (message.role == 'system' and not loop.first) %}\
<|im_start|>{{ message.role }}
{{ message.content }}<|im_end|>
{% elif message.role == 'assistant' %}<|im_start|>assistant
{{ message.content or '' }}
{%- for call in message.tool_calls or [] %}
{%- set fn = call.function if call.function is defined else call %}<tool_call>
{"name": "{{ fn.name }}", "arguments": \
{% if fn.arguments is string %}{{ fn.arguments }}{% else %}{{ fn.arguments | tojson }}{% endif %}}
</tool_call>
{%- endfor %}<|im_end|>
{% elif message.role == 'tool' %}<|im_start|>tool
<tool_response>
{{ message.content }}
</tool_response><|im_end|>
{% endif %}
{%- endfor %}
{%- if add_generation_prompt %}<|im_start|>assistant
{% endif %}"""
