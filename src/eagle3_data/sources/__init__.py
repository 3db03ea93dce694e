"""Source-format adapters: one per public dataset format family, looked up by name with :func:`get_adapter`.

==========================  ==========================================================================
format (config ``source.format``)  records
==========================  ==========================================================================
``sharegpt``                ``{id, conversations: [{from, value}]}`` (ShareGPT Vicuna, LLaMA-Factory sharegpt)
``openthoughts``            ``{system, conversations: [{from, value}]}`` (OpenThoughts-114k / 3-1.2M)
``openai_messages``         ``{id?, messages: [{role, content, tool_calls?, tool_call_id?}], tools?}``
``ultrachat``               ``{prompt_id, prompt, messages}`` (HuggingFaceH4/ultrachat_200k)
``mixture_of_thoughts``     ``{messages}`` with ``<think>`` in assistant content (open-r1/Mixture-of-Thoughts)
``swe_smith``               ``{traj_id, messages: JSON text with tool_calls}`` (SWE-smith trajectories)
``nebius_swe_agent``        ``{instance_id, model_name, trajectory: [{role: system|user|ai, text}]}``
``glaive``                  ``{system, chat}`` strings (glaive-function-calling-v2)
``instruction_response``    ``{instruction|problem|input, response|solution|output}`` (Magicoder, OpenCodeInstruct)
``llava``                   ``{id, image, conversations: [{from, value}]}`` with ``<image>`` markers (LLaVA-Instruct,
                            ShareGPT4V, ALLaVA): image prompts, images read from ``options.image_dir``
``pretokenized``            ``{sample_id?, input_ids, loss_mask}`` -> TOKENS rows, skips generation
==========================  ==========================================================================

Reject reason codes: :data:`REJECT_REASONS` (in :mod:`.base`).
"""

from __future__ import annotations

from .base import (
    FORMAT_PROBE_RECORDS,
    REJECT_REASONS,
    Adapter,
    RowReject,
    Sample,
    SourceFormatError,
)
from .glaive import Glaive
from .instruction import InstructionResponse
from .llava import LLaVA
from .openai_messages import MixtureOfThoughts, OpenAIMessages, SWESmith, UltraChat
from .pretokenized import Pretokenized
from .readers import file_kind, iter_records
from .sharegpt import OpenThoughts, ShareGPT
from .swe_agent import NebiusSWEAgent

ADAPTERS: dict[str, type[Adapter]] = {
    cls.name: cls
    for cls in (
        ShareGPT,
        OpenThoughts,
        OpenAIMessages,
        UltraChat,
        MixtureOfThoughts,
        SWESmith,
        NebiusSWEAgent,
        Glaive,
        InstructionResponse,
        LLaVA,
        Pretokenized,
    )
}


def get_adapter(name: str, options: dict | None = None) -> Adapter:
    """The adapter for source format ``name`` configured with ``options`` (adapter-specific keys).

    Raises ValueError for an unknown format (listing the known ones) or an unknown option key.
    """
    try:
        cls = ADAPTERS[name]
    except KeyError:
        raise ValueError(f"unknown source format {name!r}; known formats: {sorted(ADAPTERS)}") from None
    return cls(options)


__all__ = [
    "ADAPTERS",
    "FORMAT_PROBE_RECORDS",
    "REJECT_REASONS",
    "Adapter",
    "RowReject",
    "Sample",
    "SourceFormatError",
    "file_kind",
    "get_adapter",
    "iter_records",
]
