"""Chat templates with the tool-message rules of Qwen2.5-Instruct and Llama 3.1-Instruct, for
tokenizers built here (the hubs are unreachable). Written for these tests after the published
templates' rules for what the observation code reads, not copies of them:

- Qwen2.5: tools listed in a system turn that shows the ``<tool_call>`` format; the tool
  messages that follow an assistant turn are one ``user`` turn holding a ``<tool_response>``
  block per result; turns end ``<|im_end|>\\n``.
- Llama 3.1: ``<|begin_of_text|>``, a system header, the tools in the first user turn; each tool
  message is an ``ipython`` turn whose content is written as JSON (a string too, quoted, as
  the published template's ``is iterable`` test does); turns end ``<|eot_id|>`` with nothing
  after it.
"""

from __future__ import annotations

QWEN25 = (
    "{%- if tools %}{{- '<|im_start|>system\\nYou may call functions.\\n<tools>' }}"
    "{%- for tool in tools %}{{- '\\n' + (tool | tojson) }}{%- endfor %}"
    "{{- '\\n</tools>\\nCall one as <tool_call>JSON of name and arguments</tool_call>."
    "<|im_end|>\\n' }}{%- endif %}"
    "{%- for message in messages %}"
    "{%- if message.role == 'tool' %}"
    "{%- if loop.first or messages[loop.index0 - 1].role != 'tool' %}"
    "{{- '<|im_start|>user' }}{%- endif %}"
    "{{- '\\n<tool_response>\\n' + message.content + '\\n</tool_response>' }}"
    "{%- if loop.last or messages[loop.index0 + 1].role != 'tool' %}"
    "{{- '<|im_end|>\\n' }}{%- endif %}"
    "{%- else %}{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' }}"
    "{%- endif %}{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)
QWEN25_SPECIALS = ("<|im_start|>", "<|im_end|>")

LLAMA31 = (
    "{{- '<|begin_of_text|><|start_header_id|>system<|end_header_id|>\\n\\n"
    "Environment: ipython<|eot_id|>' }}"
    "{%- for message in messages %}"
    "{%- if message.role == 'tool' or message.role == 'ipython' %}"
    "{{- '<|start_header_id|>ipython<|end_header_id|>\\n\\n' + (message.content | tojson)"
    " + '<|eot_id|>' }}"
    "{%- else %}{{- '<|start_header_id|>' + message.role + '<|end_header_id|>\\n\\n' }}"
    "{%- if loop.first and message.role == 'user' and tools %}"
    "{{- 'Given the following functions, reply with a JSON function call.\\n\\n' }}"
    "{%- for tool in tools %}{{- (tool | tojson) + '\\n\\n' }}{%- endfor %}{%- endif %}"
    "{{- message.content + '<|eot_id|>' }}{%- endif %}{%- endfor %}"
    "{%- if add_generation_prompt %}"
    "{{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}{%- endif %}"
)
LLAMA31_SPECIALS = ("<|begin_of_text|>", "<|start_header_id|>", "<|end_header_id|>",
                    "<|eot_id|>", "<|python_tag|>")
