"""``target.template: auto``: the completion family found from the target's own chat template.

Probe conversations are rendered through the target's template (transformers ``apply_chat_template``, with
``target.chat_template_kwargs``) and tell

- the **generation prompt** (what ``add_generation_prompt=True`` appends: ``<|im_start|>assistant\\n``,
  ``<|start|>assistant``, ``<｜Assistant｜><think>`` ...), which names the candidate family;
- the **reasoning field** the template reads (``reasoning_content``, ``reasoning`` or ``thinking``: the probe
  reasoning shows up in the render of a finished conversation or a pending tool-call turn);
- the **prefix** property: the prompt render (less the think marker it may end with) is a prefix of the render of
  the finished conversation;
- the **end-of-turn token**, **think markers** and **tool-call layout**: the candidate family's completion for the
  probe replies must be the template's own render of them (exactly where the template keeps the final turn's
  reasoning; its answer and end token where it drops it, as Kimi K2-Thinking, DeepSeek-R1/V3.1 do).

:func:`detect_family` refuses (:class:`TemplateError` naming the failed property) when the candidate's layout is
not the template's; a template matching no family becomes ``generic`` when the prefix property holds.
:func:`resolve_template` caches the answer on disk, keyed by the tokenizer files' content hash, the
chat-template kwargs and the versions of transformers / tokenizers / jinja2, so a cache hit (every ``snakemake
-n`` after the first) neither imports transformers nor loads the tokenizer.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
from pathlib import Path

from .formats import FORMATS, TemplateError, completion_format
from .target import TargetTokens

#: bump when the probes change (old cache entries are then not used)
PROBE_VERSION = 1
#: reasoning fields chat templates read, in the order tried
REASONING_FIELDS = ("reasoning_content", "reasoning", "thinking")
#: files of a tokenizer directory whose content decides the render (hashed for the cache key)
TOKENIZER_FILES = (
    "tokenizer_config.json",
    "chat_template.jinja",
    "chat_template.json",
    "tokenizer.json",
    "special_tokens_map.json",
    "tokenizer.model",
    "tiktoken.model",
    "added_tokens.json",
    "vocab.json",
    "merges.txt",
)

_U, _C, _R, _H = "Probe question 1?", "Probe answer 2.", "Probe reasoning 3.", "Probe history 4."
_TOOL = {
    "type": "function",
    "function": {
        "name": "probe_tool",
        "description": "A probe tool.",
        "parameters": {"type": "object", "properties": {"q": {"type": "string", "description": "a query"}}},
    },
}
_CALL = {"id": "call_probe", "type": "function", "function": {"name": "probe_tool", "arguments": '{"q": "x"}'}}


def _candidate(tt: TargetTokens, prompt: str, final: str, tool_final: str) -> str:
    """The family whose generation prompt / role tokens the probe render shows (``generic`` when none)."""
    if prompt.endswith("<|start|>assistant") and "<|channel|>" in final:
        return "gpt-oss"
    if "<｜Assistant｜>" in prompt:
        return "deepseek-r1" if prompt.endswith("<｜Assistant｜><think>\n") else "deepseek-v3.1"
    if "<|im_assistant|>" in prompt:
        tail = prompt[prompt.rfind("<|im_assistant|>") :]
        if "<think>" in tail:
            return "kimi-k25"
        return "kimi-k2-thinking" if "<think>" in final[len(prompt) - len(tail) :] else "kimi-k2"
    if prompt.rfind("<|im_start|>assistant\n") >= len(prompt) - 60 >= 0 or "<|im_start|>assistant\n" in prompt[-60:]:
        if "<function=" in tool_final:
            return "qwen3-coder"
        return "qwen3" if "<think>" in final[prompt.rfind("<|im_start|>") :] else "generic"
    if prompt.endswith("<|assistant|>") or "<|assistant|>\n<think></think>" in prompt[-30:]:
        return "glm45"
    if prompt.endswith("<|start_header_id|>assistant<|end_header_id|>\n\n"):
        return "llama3"
    return "generic"


def _header(tt: TargetTokens, prompt: str) -> str:
    """``prompt`` less the think part it ends with (``<think>``, ``<think>\\n\\n</think>\\n\\n``, ``</think>``)."""
    f = tt.fmt
    if not f.reasoning or not f.think_open:
        return prompt
    start = max((prompt.rfind(n) for n in tt.boundary_names), default=-1)
    tail = prompt[max(start, 0) :]
    pos = [p for p in (tail.find(f.think_open), tail.find(f.think_close)) if p >= 0]
    return prompt[: max(start, 0) + min(pos)] if pos else prompt


def _ours(tt: TargetTokens, msgs, tools, reply, prompt) -> str:
    segs = tt.completion_segments(
        reply.get("reasoning"),
        reply.get("content"),
        reply.get("tool_calls"),
        prompt,
        prior_tool_calls=sum(len(m.get("tool_calls") or []) for m in msgs),
    )
    return "".join(t for t, _ in segs)


def _recipient_args(text: str):
    """gpt-oss: (recipient, arguments) of the tool call in ``text``, wherever the header puts ``to=``."""
    m = re.search(r"to=(functions\.[^\s<]+).*?<\|message\|>(.*?)<\|call\|>", text, re.S)
    return (m.group(1), m.group(2)) if m else None


def _check_probe(tt: TargetTokens, msgs, tools, reply, what: str) -> None:
    """Raise :class:`TemplateError` naming the property when the family's completion for ``reply`` is not the
    template's own render of it."""
    prompt = tt.render(msgs, tools, True)
    final = {"role": "assistant", "content": reply.get("content") or ""}
    if reply.get("reasoning") is not None:
        final["reasoning_content"] = reply["reasoning"]
    if reply.get("tool_calls"):
        final["tool_calls"] = reply["tool_calls"]
    full = tt.render(msgs + [final], tools, False)
    head = _header(tt, prompt)
    if not full.startswith(head):
        i = next((k for k, (a, b) in enumerate(zip(full, head)) if a != b), min(len(full), len(head)))
        raise TemplateError(
            f"template: auto: property 'prefix' failed ({what}): the prompt render is not a prefix "
            f"of the finished conversation's render (char {i}: {head[i : i + 30]!r} vs "
            f"{full[i : i + 30]!r})",
            "template_not_prefix",
        )
    tail = full[len(head) :]
    ours = prompt[len(head) :] + _ours(tt, msgs, tools, reply, prompt)
    if reply.get("tool_calls") and reply["tool_calls"][0]["function"]["name"] not in tail:
        return  # the template renders no tool calls (Kimi K2-Instruct's first release): nothing to compare
    if tt.fmt.layout == "harmony" and reply.get("tool_calls"):
        a, b = _recipient_args(ours), _recipient_args(tail)
        if a is None or b is None or a[0] != b[0] or json.loads(a[1]) != json.loads(b[1]):
            raise TemplateError(
                f"template: auto: property 'tool-call layout' failed ({what}): family gpt-oss writes "
                f"{ours[-80:]!r}, the template {tail[-80:]!r}",
                "template_mismatch",
            )
        return
    eot = tt.eot_name if not reply.get("tool_calls") else tt.tool_eot_name
    variants = {ours, ours + "\n", ours[: -len(eot)] if ours.endswith(eot) else ours}
    kept = reply.get("reasoning") and reply["reasoning"] in tail
    if kept or not reply.get("reasoning"):
        if tail in variants:
            return
    else:  # the template drops the final reasoning: its answer and end token must end ours
        close = tt.fmt.think_close or ""
        rest = tail[tail.rfind(close) + len(close) :] if close and close in tail else tail
        if any(v.endswith(rest) for v in variants) and rest.strip():
            return
    prop = (
        "tool-call layout"
        if reply.get("tool_calls")
        else "end-of-turn token"
        if eot not in tail and not ours.endswith(tail)
        else "think markers"
        if tt.fmt.think_open and (tt.fmt.think_open in tail or tt.fmt.think_close in tail)
        else "completion layout"
    )
    raise TemplateError(
        f"template: auto: property {prop!r} failed ({what}): family {tt.fmt.name!r} writes "
        f"{ours[-120:]!r} after the prompt, the template renders {tail[-120:]!r}",
        "template_mismatch",
    )


def _reasoning_fields(tok, kwargs) -> list[str]:
    """The assistant-message fields whose reasoning the template renders (finished turn or pending tool call)."""
    found = []
    for field_name in REASONING_FIELDS:
        for msgs in (
            [{"role": "user", "content": _U}, {"role": "assistant", "content": _C, field_name: _R}],
            [
                {"role": "user", "content": _U},
                {"role": "assistant", "content": "", field_name: _R, "tool_calls": [_CALL]},
                {"role": "tool", "tool_call_id": "call_probe", "content": "ok"},
            ],
        ):
            try:
                text = tok.apply_chat_template(
                    msgs, tools=[_TOOL], add_generation_prompt=False, tokenize=False, **kwargs
                )
            except Exception:  # a template that rejects the probe's shape (string arguments, roles)
                try:
                    call = dict(_CALL, function={"name": "probe_tool", "arguments": {"q": "x"}})
                    msgs = [dict(m, tool_calls=[call]) if m.get("tool_calls") else m for m in msgs]
                    text = tok.apply_chat_template(
                        msgs, tools=[_TOOL], add_generation_prompt=False, tokenize=False, **kwargs
                    )
                except Exception:
                    continue
            if _R in text:
                found.append(field_name)
                break
    return found


def detect_family(tok, chat_template_kwargs: dict | None = None) -> dict:
    """The completion family of tokenizer ``tok`` (a transformers tokenizer with a chat template), from probe renders.

    Returns ``{"family", "reasoning_field", "generation_prompt", "end_of_turn", "think": [open, close] | None,
    "tool_format", "reasoning_fields_rendered"}``. Raises :class:`TemplateError` naming the property that failed
    (``generation prompt``, ``prefix``, ``reasoning field``, ``end-of-turn token``, ``think markers``,
    ``tool-call layout``) when the template looks like a family but renders otherwise.
    """
    kwargs = dict(chat_template_kwargs or {})
    user = [{"role": "user", "content": _U}]
    generic = TargetTokens(tok, completion_format("generic"), kwargs)
    try:
        prompt = generic.render(user, None, True)
        bare = generic.render(user, None, False)
        final = generic.render(
            user + [{"role": "assistant", "content": _C, "reasoning_content": _R, "thinking": _R}], None, False
        )
    except TemplateError as exc:
        raise TemplateError(f"template: auto: the chat template can't render a probe conversation: {exc}") from exc
    if prompt == bare:
        raise TemplateError(
            "template: auto: property 'generation prompt' failed: add_generation_prompt adds nothing to the render",
            "template_mismatch",
        )
    try:
        tool_final = generic.render(
            user
            + [
                {
                    "role": "assistant",
                    "content": "",
                    "tool_calls": [dict(_CALL, function={"name": "probe_tool", "arguments": {"q": "x"}})],
                }
            ],
            [_TOOL],
            False,
        )
    except TemplateError:
        tool_final = ""
    name = _candidate(generic, prompt, final, tool_final)
    fields = _reasoning_fields(tok, kwargs)
    fmt = completion_format(name)
    try:
        tt = TargetTokens(tok, fmt, kwargs)
    except TemplateError as exc:
        raise TemplateError(
            f"template: auto: property 'think markers' failed: the template looks like family {name!r} but {exc}",
            "template_mismatch",
        ) from exc
    if fmt.reasoning and fields and fmt.reasoning_field not in fields:
        raise TemplateError(
            f"template: auto: property 'reasoning field' failed: the template renders reasoning "
            f"from {fields}, family {name!r} passes it as {fmt.reasoning_field!r}",
            "template_mismatch",
        )
    info = {
        "family": name,
        "reasoning_field": fmt.reasoning_field if fields else None,
        "reasoning_fields_rendered": fields,
        "generation_prompt": prompt[len(bare) :] if prompt.startswith(bare) else prompt[-40:],
        "end_of_turn": tt.eot_name,
        "think": [fmt.think_open, fmt.think_close] if fmt.think_open else None,
        "tool_format": fmt.tool_format,
    }
    if fmt.generic:
        if not final.startswith(prompt) and not final.startswith(bare):
            raise TemplateError(
                "template: auto: property 'prefix' failed: the template matches no family and its "
                "prompt render is not a prefix of the finished conversation's render, so the "
                "generic family can't derive completions either",
                "template_not_prefix",
            )
        return info
    state = tt.think_state(prompt)[0] if fmt.reasoning else "none"
    thinking = bool(fmt.reasoning) and state != "closed" and not (fmt.think_in_prompt and state == "none")
    r = _R if thinking else None
    _check_probe(tt, user, None, {"reasoning": r, "content": _C}, "one user turn")
    history = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": _H},
        {"role": "assistant", "content": _H},
        {"role": "user", "content": _U},
    ]
    _check_probe(tt, history, None, {"reasoning": r, "content": _C}, "multi-turn history")
    if fmt.tool_format != "none" and not fmt.extra.get("tool_calls_unsupported"):
        _check_probe(tt, user, [_TOOL], {"reasoning": r, "content": "", "tool_calls": [_CALL]}, "a tool call")
    return info


# ------------------------------------------------------------------------------------------------ cache
def _versions() -> dict:
    from importlib import metadata

    out = {}
    for dist in ("transformers", "tokenizers", "jinja2", "eagle3-data"):
        try:
            out[dist] = metadata.version(dist)
        except metadata.PackageNotFoundError:
            out[dist] = None
    return out


def cache_key(target: dict) -> str:
    """sha256 over the tokenizer files of ``target["path"]`` (:data:`TOKENIZER_FILES` and any ``*.py`` there),
    ``chat_template_kwargs``, ``trust_remote_code``, library versions and :data:`PROBE_VERSION`."""
    h = hashlib.sha256()
    path = Path(target["path"])
    names = sorted({n for n in TOKENIZER_FILES if (path / n).is_file()} | {p.name for p in path.glob("*.py")})
    for n in names:
        h.update(n.encode() + b"\0")
        with open(path / n, "rb") as f:
            for block in iter(lambda: f.read(1 << 20), b""):
                h.update(block)
    meta = {
        "kwargs": target.get("chat_template_kwargs") or {},
        "trust": bool(target.get("trust_remote_code")),
        "versions": _versions(),
        "probe": PROBE_VERSION,
    }
    h.update(json.dumps(meta, sort_keys=True, default=str).encode())
    return h.hexdigest()


def resolve_template(target: dict, cache_dir: str | os.PathLike | None = None) -> tuple[str, dict]:
    """The family for config slice ``target``: its ``template`` when named (an override), else the one
    :func:`detect_family` finds. Returns ``(family, info)``; ``info["source"]`` is ``named``, ``cache`` or
    ``probed``. With ``cache_dir`` the probe result is stored in ``<cache_dir>/template_family/<key>.json``
    (:func:`cache_key`) and read back without importing transformers. Raises :class:`TemplateError` (the failed
    property, or a missing target directory).
    """
    name = target.get("template") or "auto"
    if name != "auto":
        completion_format(name)
        return name, {"family": name, "source": "named"}
    path = Path(str(target.get("path", "")))
    if not path.is_dir():
        raise TemplateError(
            f"target.template: auto needs the target tokenizer at target.path ({path}), which does "
            "not exist; name the family in target.template"
        )
    key = cache_key(target)
    file = Path(cache_dir) / "template_family" / f"{key}.json" if cache_dir else None
    if file is not None and file.is_file():
        try:
            info = json.loads(file.read_text())
            if info.get("family") in FORMATS:
                return info["family"], {**info, "source": "cache"}
        except (OSError, ValueError):
            pass
    from .shipped import as_shipped

    from transformers import AutoTokenizer

    try:
        tok = AutoTokenizer.from_pretrained(str(path), trust_remote_code=bool(target.get("trust_remote_code")))
    except Exception as exc:
        raise TemplateError(f"{path}: cannot load the target tokenizer for template: auto: {exc}") from exc
    tok = as_shipped(tok, str(path))
    if not getattr(tok, "chat_template", None):
        raise TemplateError(f"{path}: the target tokenizer has no chat template (template: auto)")
    info = detect_family(tok, target.get("chat_template_kwargs") or {})
    if file is not None:
        file.parent.mkdir(parents=True, exist_ok=True)
        tmp = file.with_suffix(f".{os.getpid()}.part")
        tmp.write_text(json.dumps(info, indent=1, ensure_ascii=False))
        os.replace(tmp, file)
    return info["family"], {**info, "source": "probed"}


def describe(info: dict) -> str:
    """One line for the config check: the family chosen and the template properties it rests on."""
    if info.get("source") == "named":
        return f"target.template: {info['family']} (named)"
    think = "/".join(info["think"]) if info.get("think") else "none"
    return (
        f"target.template: auto -> {info['family']} ({info.get('source')}; generation prompt "
        f"{info.get('generation_prompt')!r}, end of turn {info.get('end_of_turn')}, think markers {think}, "
        f"reasoning field {info.get('reasoning_field')}, tool calls {info.get('tool_format')})"
    )
