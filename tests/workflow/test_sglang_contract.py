"""Contract of the SGLang extraction backend with the pinned SGLang (``sglang_backend.SGLANG_VERSION``).

No GPU and no sglang install: the pinned wheel is downloaded from PyPI and its source parsed with ast (never
imported; ``eagle3_data.testing.sglang_source``). Checked, each against the wheel's own code:

- every ``from sglang... import X`` of the backend names a definition that exists (file:line);
- every call of an SGLang function, class or method binds to its signature (positional count, keywords,
  required arguments);
- every attribute the backend reads or sets on an SGLang object exists on its class;
- every ``ServerArgs`` keyword the backend passes is a server-argument field, and the capture convention it
  names (``EAGLE3``) is one SGLang accepts;
- the per-family layer-id rules (``ARCHITECTURE_ID_RULES``) are what each model's ``set_eagle3_layers_to_capture``
  does, and the capture/final-state semantics the backend relies on are in the logits processor;
- the prefill follows ``sglang/benchmark/one_batch.py`` call for call, and that file is byte-identical to the
  one the backend was adapted to (``UPSTREAM_DRIVER_SHA256``): bumping ``SGLANG_VERSION`` fails here until the
  backend is read against the new release.

``python tests/workflow/test_sglang_contract.py`` prints every SGLang symbol the backend uses with where it was found.
"""

from __future__ import annotations

import ast
import hashlib
import re
import sys
from pathlib import Path

import pytest

from eagle3_data.testing.sglang_source import Source, pinned_source, signature_problems

from eagle3_data.extract import sglang_backend as sx

ROOT = Path(__file__).resolve().parents[2]
BACKEND = Path(sx.__file__)

# The SGLang objects the backend holds, by the expression that holds them -> (module, class). ServerArgs and
# the schedule config bag are checked against the server-argument fields.
MR = ("sglang.srt.model_executor.model_runner", "ModelRunner")
HOLDERS = {
    "runner": MR,
    "self.runner": MR,
    "runner.model_config": ("sglang.srt.configs.model_config", "ModelConfig"),
    "self.runner.model_config": ("sglang.srt.configs.model_config", "ModelConfig"),
    "runner.req_to_token_pool": ("sglang.srt.mem_cache.memory_pool", "ReqToTokenPool"),
    "runner.token_to_kv_pool_allocator": ("sglang.srt.mem_cache.allocator.base", "BaseTokenToKVPoolAllocator"),
    "batch": ("sglang.srt.managers.schedule_batch", "ScheduleBatch"),
    "req": ("sglang.srt.managers.schedule_batch", "Req"),
    "logits_output": ("sglang.srt.layers.logits_processor", "LogitsProcessorOutput"),
    "bench": ("sglang.benchmark.one_batch", "_TorchBenchRunner"),
    "server_args": ("sglang.srt.server_args", "ServerArgs"),
    "sargs": ("sglang.srt.server_args", "ServerArgs"),
    "get_schedule()": ("sglang.srt.arg_groups.fields.schedule", "Schedule"),
}
SERVER_ARGS = ("sglang.srt.server_args", "ServerArgs")


@pytest.fixture(scope="module")
def src() -> Source:
    return Source(pinned_source(sx.SGLANG_VERSION))


def server_arg_fields(src: Source) -> dict:
    """Every ``ServerArgs`` field: the annotated fields of the argument namespaces it is assembled from
    (``sglang/srt/arg_groups/fields/*.py``) and of its own class body."""
    out = {}
    for f in sorted((src.root / "sglang/srt/arg_groups/fields").glob("*.py")):
        mod = "sglang.srt.arg_groups.fields." + f.stem
        for node in src.tree(mod).body:
            if isinstance(node, ast.ClassDef):
                out.update(src.fields(mod, node.name))
    out.update(src.fields(*SERVER_ARGS))
    return out


def backend_imports() -> dict[str, tuple[str, str, int]]:
    """Local name -> (sglang module, name, backend line) of every sglang import in the backend."""
    out = {}
    for node in ast.walk(ast.parse(BACKEND.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] == "sglang":
            for alias in node.names:
                out[alias.asname or alias.name] = (node.module, alias.name, node.lineno)
    return out


def _class_member(src: Source, holder: tuple[str, str], attr: str, fields: dict):
    if holder == SERVER_ARGS:
        return fields.get(attr) or src.method(*SERVER_ARGS, attr)
    return src.attribute(*holder, attr)


def contract(src: Source) -> tuple[list[tuple[str, str]], list[str]]:
    """``(rows, problems)``: every SGLang symbol the backend uses with where the wheel defines it, and every
    mismatch (empty when the backend and the wheel agree)."""
    rows: dict[str, str] = {}
    problems: list[str] = []
    fields = server_arg_fields(src)
    imports = backend_imports()
    defs = {}
    for local, (mod, name, line) in sorted(imports.items(), key=lambda kv: kv[1]):
        try:
            found = src.top_level(mod, name)
        except KeyError as exc:  # the module itself is gone
            problems.append(f"sglang_backend.py:{line}: {exc.args[0]}")
            continue
        if found is None:
            problems.append(f"sglang_backend.py:{line}: {mod}.{name} not found in sglang=={sx.SGLANG_VERSION}")
            continue
        defs[local] = found
        rows[f"{mod}.{name}"] = found.where

    tree = ast.parse(BACKEND.read_text())
    for node in ast.walk(tree):
        # attributes of SGLang objects (and of imported SGLang classes: enum members, class methods)
        if isinstance(node, ast.Attribute):
            base = ast.unparse(node.value)
            holder = HOLDERS.get(base)
            if holder is None and base in defs and isinstance(defs[base].node, ast.ClassDef):
                holder = (defs[base].module, defs[base].node.name)
            if holder is not None:
                found = _class_member(src, holder, node.attr, fields)
                label = f"{holder[1]}.{node.attr}"
                if found is None:
                    problems.append(f"sglang_backend.py:{node.lineno}: {label} ({base}.{node.attr}) not found")
                else:
                    rows[label] = found.where
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "getattr":
            base = ast.unparse(node.args[0])
            if base in HOLDERS and isinstance(node.args[1], ast.Constant):
                attr = node.args[1].value
                found = _class_member(src, HOLDERS[base], attr, fields)
                if found is None:
                    problems.append(f"sglang_backend.py:{node.lineno}: {HOLDERS[base][1]}.{attr} not found")
                else:
                    rows[f"{HOLDERS[base][1]}.{attr}"] = found.where
        if not isinstance(node, ast.Call):
            continue
        # calls: bind them to the wheel's signatures
        n_pos = len(node.args)
        kws = [k.arg for k in node.keywords if k.arg is not None]
        if any(isinstance(a, ast.Starred) for a in node.args):
            problems.append(f"sglang_backend.py:{node.lineno}: *args call cannot be checked")
        fn, bound, label = None, False, ast.unparse(node.func)
        if isinstance(node.func, ast.Name) and node.func.id in defs:
            d = defs[node.func.id]
            if isinstance(d.node, ast.FunctionDef):
                fn = d.node
            elif isinstance(d.node, ast.ClassDef):
                if (d.module, d.node.name) == SERVER_ARGS:
                    star = [k for k in node.keywords if k.arg is None]
                    if kws or n_pos or len(star) != 1:
                        problems.append(
                            f"sglang_backend.py:{node.lineno}: ServerArgs is built from server_args() "
                            "only (checked against its fields)"
                        )
                    continue
                init = src.method(d.module, d.node.name, "__init__")
                if init is not None:
                    fn, bound = init.node, True
                    rows[f"{d.node.name}.__init__"] = init.where
                elif any(ast.unparse(b) == "SimpleNamespace" for b in d.node.bases):
                    continue  # accepts any keyword
                else:  # dataclass / msgspec Struct: keywords are its fields
                    flds = src.fields(d.module, d.node.name)
                    for k in kws:
                        if k not in flds:
                            problems.append(f"sglang_backend.py:{node.lineno}: {d.node.name} has no field {k!r}")
                        else:
                            rows[f"{d.node.name}.{k}"] = flds[k].where
                    continue
        elif isinstance(node.func, ast.Attribute):
            base = ast.unparse(node.func.value)
            holder = HOLDERS.get(base)
            if holder is None and base in defs and isinstance(defs[base].node, ast.ClassDef):
                holder = (defs[base].module, defs[base].node.name)
            if holder is not None:
                m = src.method(*holder, node.func.attr)
                if m is None:
                    if not (holder == SERVER_ARGS and node.func.attr in fields):
                        problems.append(
                            f"sglang_backend.py:{node.lineno}: method {holder[1]}.{node.func.attr} not found"
                        )
                    continue
                decos = {ast.unparse(d) for d in m.node.decorator_list}
                fn, bound = m.node, "staticmethod" not in decos
                label = f"{holder[1]}.{node.func.attr}"
                rows[label] = m.where
        if fn is not None:
            for p in signature_problems(fn, bound=bound, n_positional=n_pos, keywords=kws):
                problems.append(f"sglang_backend.py:{node.lineno}: {label}(...): {p}")

    # ServerArgs keywords: fields of the server arguments
    args = sx.server_args("/m", layer_ids=[1, 2])
    for k in args:
        if k not in fields:
            problems.append(f"server_args(): {k!r} is not a ServerArgs field in sglang=={sx.SGLANG_VERSION}")
        else:
            rows[f"ServerArgs.{k}"] = fields[k].where
    return sorted(rows.items()), list(dict.fromkeys(problems))


def test_pinned_version_and_the_driver_file_it_was_adapted_to(src):
    meta = src.metadata()
    assert re.search(rf"^Version: {re.escape(sx.SGLANG_VERSION)}$", meta, re.M), meta[:300]
    driver = src.root / sx.UPSTREAM_DRIVER
    digest = hashlib.sha256(driver.read_bytes()).hexdigest()
    assert digest == sx.UPSTREAM_DRIVER_SHA256, (
        f"{sx.UPSTREAM_DRIVER} differs from the file the SGLang backend was adapted to: diff it against the "
        "previous release, adapt _Rank / _prefill in eagle3_data/extract/sglang_backend.py, then set "
        f"UPSTREAM_DRIVER_SHA256 = {digest!r}"
    )


def test_every_sglang_symbol_exists_with_the_signature_the_backend_uses(src):
    rows, problems = contract(src)
    assert not problems, "\n".join(problems)
    names = {name for name, _ in rows}
    # the symbols the capture depends on are among those checked (guards the checker itself)
    for must in (
        "sglang.benchmark.one_batch.load_model",
        "ScheduleBatch.init_new",
        "ForwardBatch.init_new",
        "LogitsProcessorOutput.hidden_states",
        "LogitsProcessorOutput.last_hidden_states",
        "Req.full_untruncated_fill_ids",
        "Req.extend_end",
        "_TorchBenchRunner.torch_runner",
        "ModelRunner.max_running_requests",
        "ServerArgs.return_aux_hidden_state_layer_ids",
        "ServerArgs.enable_return_aux_hidden_states",
        "ServerArgs.trust_remote_code",
        "CaptureHiddenMode.FULL",
        "sglang.srt.runtime_context.publish",
    ):
        assert must in names, must
    assert all(re.fullmatch(r"sglang/\S+\.py:\d+", where) for _, where in rows), rows


def test_the_checker_catches_a_wrong_keyword_and_a_missing_attribute(src, tmp_path, monkeypatch):
    text = BACKEND.read_text()
    bad = text.replace("return_hidden_states_before_norm=False", "return_hidden_state_before_norm=False", 1)
    bad = bad.replace("logits_output.last_hidden_states", "logits_output.final_hidden_states", 1)
    assert bad != text
    fake = tmp_path / "sglang_backend.py"
    fake.write_text(bad)
    monkeypatch.setattr(sys.modules[__name__], "BACKEND", fake)
    _, problems = contract(src)
    joined = "\n".join(problems)
    assert "keyword 'return_hidden_state_before_norm' not accepted by init_new" in joined
    assert "required argument 'return_hidden_states_before_norm' of init_new not given" in joined
    assert "LogitsProcessorOutput.final_hidden_states" in joined


def test_server_args_name_the_eagle3_capture_convention(src):
    tree = src.tree("sglang.srt.arg_groups.validation_hook")
    methods = next(
        ast.literal_eval(n.value)
        for n in tree.body
        if isinstance(n, ast.Assign) and ast.unparse(n.targets[0]) == "_AUX_HIDDEN_STATE_CAPTURE_METHODS"
    )
    assert sx.server_args("/m", layer_ids=[1])["speculative_algorithm"] in methods
    hook = src.top_level("sglang.srt.arg_groups.validation_hook", "handle_aux_hidden_state_capture")
    body = ast.unparse(hook.node)
    # the speculative algorithm only names the convention: resolution resets it, so no draft is loaded
    assert "speculative_algorithm=None" in body and "aux_hidden_state_capture=method.lower()" in body
    # the capture-only path takes the layer ids as given and checks them against num_hidden_layers
    cap = src.top_level(
        "sglang.srt.model_executor.model_runner_components.spec_aux_hidden_state",
        "_resolve_capture_only_aux_hidden_state",
    )
    text = ast.unparse(cap.node)
    assert "config.eagle_aux_hidden_state_layer_ids = list(layer_ids)" in text


def test_capture_semantics_the_backend_relies_on(src):
    lp = "sglang.srt.layers.logits_processor"
    cls = "LogitsProcessor"
    last = ast.unparse(src.method(lp, cls, "_get_last_hidden_states_to_store").node)
    # final states: the logits processor's own input (the post-norm state), under full capture with aux states
    assert re.search(
        r"if self\.keep_last_hidden_states and aux_hidden_states is not None and "
        r"logits_metadata\.capture_hidden_mode\.is_full\(\):\s+return hidden_states",
        last,
    ), last
    store = ast.unparse(src.method(lp, cls, "_get_hidden_states_to_store").node)
    # aux states: all tokens, packed, under FULL; replaced by the pre-norm state only when that is asked for
    assert "hidden_states_to_store = pack_aux_hidden_states(aux_hidden_states)" in store
    assert "if hidden_states_to_store_before_norm is not None:" in store
    init = ast.unparse(src.method(lp, cls, "__init__").node)
    assert "self.keep_last_hidden_states = features.aux_hidden_state_capture is not None" in init
    # decoder loops: layer j's INPUT is captured when j is in layers_to_capture, in ascending layer order
    for mod, model_cls in (
        ("sglang.srt.models.llama", "LlamaModel"),
        ("sglang.srt.models.deepseek_v2", "DeepseekV2Model"),
    ):
        fwd = ast.unparse(src.method(mod, model_cls, "forward").node)
        assert re.search(r"for i in range\([\w.]+, [\w.]+\):", fwd), (mod, fwd[:200])
        assert "if i in self.layers_to_capture" in fwd, mod


def _entry_module(src: Source, architecture: str) -> str:
    for f in sorted((src.root / "sglang/srt/models").glob("*.py")):
        mod = "sglang.srt.models." + f.stem
        for node in src.tree(mod).body:
            if (
                isinstance(node, ast.Assign)
                and ast.unparse(node.targets[0]) == "EntryClass"
                and architecture in {n.id for n in ast.walk(node.value) if isinstance(n, ast.Name)}
            ):
                return mod
    raise KeyError(f"no SGLang model file lists {architecture} in its EntryClass")


def id_rule_in_wheel(src: Source, module: str, cls: str, depth: int = 0) -> tuple[str | None, str]:
    """``(rule, where)``: what ``cls``'s ``set_eagle3_layers_to_capture`` does to the ids, following a delegation
    to ``self.<attr>.set_eagle3_layers_to_capture(layer_ids)`` into the class ``__init__`` builds for ``attr``."""
    m = src.method(module, cls, "set_eagle3_layers_to_capture")
    if m is None:
        return None, f"{module}.{cls}: no set_eagle3_layers_to_capture"
    plus_one = first_is_one = False
    delegate = None
    for n in ast.walk(m.node):
        if (
            isinstance(n, ast.ListComp)
            and isinstance(n.elt, ast.BinOp)
            and isinstance(n.elt.op, ast.Add)
            and ast.unparse(n.elt.right) == "1"
            and ast.unparse(n.generators[0].iter) == "layer_ids"
        ):
            plus_one = True
        if isinstance(n, ast.Compare) and ast.unparse(n) == "layer_ids[0] == 1":
            first_is_one = True
        if (
            isinstance(n, ast.Call)
            and isinstance(n.func, ast.Attribute)
            and n.func.attr == "set_eagle3_layers_to_capture"
            and [ast.unparse(a) for a in n.args] == ["layer_ids"]
            and isinstance(n.func.value, ast.Attribute)
            and ast.unparse(n.func.value.value) == "self"
        ):
            delegate = n.func.value.attr
    if plus_one and first_is_one:
        return sx.PLUS_ONE_IF_FIRST_IS_ONE, m.where
    if plus_one:
        return sx.PLUS_ONE, m.where
    if delegate and depth < 3:
        init = src.method(module, cls, "__init__")
        for n in ast.walk(init.node):
            if (
                isinstance(n, ast.Assign)
                and ast.unparse(n.targets[0]) == f"self.{delegate}"
                and isinstance(n.value, ast.Call)
                and isinstance(n.value.func, ast.Name)
            ):
                inner_mod, inner = src.resolve_name(init.module, n.value.func.id)
                rule, where = id_rule_in_wheel(src, inner_mod, inner, depth + 1)
                return rule, f"{m.where} -> {where}"
    return None, m.where


def decoder_classes(src: Source, module: str, cls: str, depth: int = 0) -> list:
    """The classes (with their bases in the wheel) that ``cls`` builds as ``self.model`` / ``self.language_model``:
    where the decoder loop lives."""
    out = []
    init = src.method(module, cls, "__init__")
    for n in ast.walk(init.node) if init else ():
        if not (
            isinstance(n, ast.Assign)
            and ast.unparse(n.targets[0]) in ("self.model", "self.language_model")
            and isinstance(n.value, ast.Call)
        ):
            continue
        built = [(init.module, n.value.func)]
        if isinstance(n.value.func, ast.Attribute) and ast.unparse(n.value.func.value) == "self":  # a factory
            factory = src.method(module, cls, n.value.func.attr)
            built = [
                (factory.module, r.value.func)
                for r in ast.walk(factory.node)
                if isinstance(r, ast.Return) and isinstance(r.value, ast.Call)
            ]
        for mod, func in built:
            if isinstance(func, ast.Name):
                inner_mod, inner = src.resolve_name(mod, func.id)
                out += src.mro(inner_mod, inner)
                if depth < 2:
                    out += decoder_classes(src, inner_mod, inner, depth + 1)
    return out


def test_family_id_rules_match_the_wheel(src):
    found = {}
    for arch, rule in sx.ARCHITECTURE_ID_RULES.items():
        got, where = id_rule_in_wheel(src, _entry_module(src, arch), arch)
        found[arch] = (got, where)
        assert got == rule, f"{arch}: the backend assumes {rule}, sglang=={sx.SGLANG_VERSION} does {got} ({where})"
        # the family's decoder loop captures the input of layer i for i in layers_to_capture (in layer order)
        text = "\n".join(ast.unparse(f.node) for f in decoder_classes(src, _entry_module(src, arch), arch))
        assert "if i in self.layers_to_capture" in text or "if getattr(layer, '_is_layer_to_capture', False)" in text, (
            arch,
            where,
        )
    assert "deepseek_v2.py" in found["KimiK25ForConditionalGeneration"][1]  # Kimi-K2.5 delegates to DeepSeek-V3


def _calls_in_order(fn: ast.AST) -> list[ast.Call]:
    calls = [n for n in ast.walk(fn) if isinstance(n, ast.Call)]
    return sorted(calls, key=lambda c: (c.lineno, c.col_offset))


def test_prefill_follows_the_one_batch_benchmark(src):
    bench = "sglang.benchmark.one_batch"
    ours = {n.name: n for n in ast.walk(ast.parse(BACKEND.read_text())) if isinstance(n, ast.FunctionDef)}

    def names(fn, rename=()):
        out = []
        for c in _calls_in_order(fn):
            s = ast.unparse(c.func)
            for a, b in rename:
                s = s.replace(a, b)
            out.append(s)
        return out

    # the forward: one_batch.extend, call for call, without its sampling step
    up = names(src.top_level(bench, "extend").node, [("model_runner", "runner")])
    mine = names(ours["_prefill"])
    first = mine.index("TreeCacheNamespace")
    assert mine[first : first + len(up) - 1] == [c for c in up if c != "runner.sample"], (up, mine)
    up_kw = {
        ast.unparse(c.func): {k.arg: ast.unparse(k.value) for k in c.keywords}
        for c in _calls_in_order(src.top_level(bench, "extend").node)
    }
    my_kw = {
        ast.unparse(c.func): {k.arg: ast.unparse(k.value) for k in c.keywords}
        for c in _calls_in_order(ours["_prefill"])
    }
    assert set(my_kw["ScheduleBatch.init_new"]) == set(up_kw["ScheduleBatch.init_new"])
    assert my_kw["ForwardBatch.init_new"] == {
        **up_kw["ForwardBatch.init_new"],
        "capture_hidden_mode": "CaptureHiddenMode.FULL",
    }
    # the requests: prepare_synthetic_inputs_for_latency_test's Req fields and settings
    up_req = src.top_level(bench, "prepare_synthetic_inputs_for_latency_test").node

    def sets(fn):
        return sorted(
            ast.unparse(n)
            for n in ast.walk(fn)  # noqa: E731
            if isinstance(n, ast.Assign) and ast.unparse(n.targets[0]).startswith("req.")
        )

    assert sets(ours["_prefill"]) == sets(up_req)

    def req_kw(fn):
        return next(
            sorted(k.arg for k in c.keywords)
            for c in _calls_in_order(fn)  # noqa: E731
            if ast.unparse(c.func) == "Req"
        )

    assert req_kw(ours["_prefill"]) == req_kw(up_req)
    # the pools are emptied before the batch, as _TorchBenchRunner.clear does
    clear = names(src.method(bench, "_TorchBenchRunner", "clear").node, [("self.torch_runner", "runner")])
    assert mine[: len(clear)] == clear
    # the rank set-up: latency_test's publish, global configs and load_model, in that order
    rank_init = next(
        n for n in ast.walk(ast.parse(BACKEND.read_text())) if isinstance(n, ast.ClassDef) and n.name == "_Rank"
    ).body[1]
    up_setup = [
        ast.unparse(c)
        for c in _calls_in_order(src.top_level(bench, "latency_test").node)
        if ast.unparse(c.func) in ("publish", "_init_process_global_configs", "load_model")
    ]
    my_setup = [
        ast.unparse(c)
        for c in _calls_in_order(rank_init)
        if ast.unparse(c.func) in ("publish", "_init_process_global_configs", "load_model")
    ]
    assert my_setup == up_setup
    assert "return (model_runner, tokenizer)" in ast.unparse(src.top_level(bench, "load_model").node)


def test_gpu_env_pins_agree_with_the_backend_and_the_wheel(src):
    reqs = (ROOT / "envs" / "sglang-gpu.txt").read_text()
    assert re.search(rf"^sglang=={re.escape(sx.SGLANG_VERSION)}\s*$", reqs, re.M), reqs
    overrides = (ROOT / "envs" / "sglang-gpu-overrides.txt").read_text()
    torch_pin = re.search(r"^Requires-Dist: torch==(\S+)\s*$", src.metadata(), re.M).group(1)
    assert re.search(rf"^torch=={re.escape(torch_pin)}\s*$", overrides, re.M), (torch_pin, overrides)


if __name__ == "__main__":  # the symbol table of the closing note
    rows, problems = contract(Source(pinned_source(sx.SGLANG_VERSION)))
    source = Source(pinned_source(sx.SGLANG_VERSION))
    for name, where in rows:
        print(f"{name:62s} {where}")
    facts = [  # the behaviour relied on, checked by the tests above
        ("sglang.srt.layers.logits_processor", "LogitsProcessor", "__init__"),
        ("sglang.srt.layers.logits_processor", "LogitsProcessor", "_get_hidden_states_to_store"),
        ("sglang.srt.layers.logits_processor", "LogitsProcessor", "_get_last_hidden_states_to_store"),
        ("sglang.srt.models.llama", "LlamaModel", "forward"),
        ("sglang.srt.models.deepseek_v2", "DeepseekV2Model", "forward"),
        ("sglang.benchmark.one_batch", "_TorchBenchRunner", "clear"),
    ]
    for mod, cls, meth in facts:
        print(f"{cls + '.' + meth:62s} {source.method(mod, cls, meth).where}")
    for mod, name in (
        ("sglang.srt.arg_groups.validation_hook", "_AUX_HIDDEN_STATE_CAPTURE_METHODS"),
        ("sglang.srt.arg_groups.validation_hook", "handle_aux_hidden_state_capture"),
        (
            "sglang.srt.model_executor.model_runner_components.spec_aux_hidden_state",
            "_resolve_capture_only_aux_hidden_state",
        ),
        ("sglang.benchmark.one_batch", "extend"),
        ("sglang.benchmark.one_batch", "prepare_synthetic_inputs_for_latency_test"),
        ("sglang.benchmark.one_batch", "latency_test"),
    ):
        print(f"{name:62s} {source.top_level(mod, name).where}")
    for arch in sx.ARCHITECTURE_ID_RULES:
        rule, where = id_rule_in_wheel(source, _entry_module(source, arch), arch)
        print(f"{arch + '.set_eagle3_layers_to_capture (' + str(rule) + ')':62s} {where}")
    print("\n".join(problems) or f"no problems (sglang=={sx.SGLANG_VERSION})")
