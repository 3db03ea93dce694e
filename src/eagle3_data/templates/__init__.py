"""Target chat templates: prompt rendering with the target's own template and each family's exact completion format.

The table of what each family supervises is in :mod:`eagle3_data.templates.core`, which also re-exports every name
below; the shared machinery lives in modules named for what they do:

- :mod:`.formats` - :class:`CompletionFormat`, the family table ``FORMATS`` (Kimi / Qwen3 / GLM-4.5 / DeepSeek-R1 /
  generic ...), :func:`register`;
- :mod:`.replies` - reply normalisation (ids, tool calls, finish reasons, think blocks inside the content);
- :mod:`.target` - :class:`TargetTokens`: prompt and completion ids and the loss mask of one sample;
- :mod:`.loading` - :func:`load_target_tokens` / :func:`target_tokens`;
- :mod:`.think_state` - :func:`prompt_think_state` / :func:`split_output_ids` (id-level think-block state).

Families with a layout of their own live in one module each and register themselves on import:

- :mod:`.deepseek_v31` - DeepSeek-V3.1 (thinking and non-thinking, its tool-call section);
- :mod:`.qwen3_coder` - Qwen3-Coder (XML tool calls);
- :mod:`.llama3` - Llama 3.1 / 3.3 (JSON tool calls, ``<|eot_id|>``);
- :mod:`.harmony` - gpt-oss (harmony channels ``analysis`` / ``commentary`` / ``final``);
- :mod:`.auto` - ``target.template: auto``: the family found from the target's own template by probe renders.
"""

from __future__ import annotations

from .core import *  # noqa: F401,F403
from .core import (  # noqa: F401  (names the rest of the package and the tests import)
    DEEPSEEK_R1_NO_TOOLS,
    FINISH_ALIASES,
    FINISH_REASONS,
    FORMATS,
    KIMI_ROLE_MARKERS,
    KIMI_TOOL_TOKENS,
    LAYOUT_WRITERS,
    TOOL_WRITERS,
    CompletionFormat,
    TargetTokens,
    TemplateError,
    as_shipped,
    completion_format,
    count_tool_calls,
    empty_think_block,
    load_target_tokens,
    normalize_finish_reason,
    normalize_ids,
    register,
    request_messages,
    rewrite_kimi_tool_call_ids,
    split_reasoning_from_content,
    target_tokens,
    thinking_enabled,
)
from . import deepseek_v31, harmony, llama3, qwen3_coder  # noqa: E402,F401  (register their families)
