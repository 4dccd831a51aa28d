"""Generative test models (issue 37) made in code, by the real exporters, cached and reproducible.

A recipe (:data:`MODELS`, :data:`ENCODERS`) makes a Hugging Face folder offline (llm_hf,
llm_encoder: trained tokenizer, configs, seeded weights), and each exporter turns it into the
folder users download: optimum-onnx's ``model.onnx``, onnxruntime-genai's model builder (fp32 and
int4), optimum-intel's stateful OpenVINO IR, and for encoders optimum's ONNX with the
sentence-transformers files. transformers' own f32 greedy answers (ids, logprobs) to
:data:`PROMPTS` and sentence-transformers' embeddings are computed in the exporters' venvs and
saved as JSON beside the folders, so tests compare token for token without torch in process.

Each exporter runs in a virtual environment of its own (tests/support/venvs.py; they pin
different transformers), with torch pinned to the CPU wheel. Everything lives under
``venvs.ROOT / "llm"``: ``<model>-<key>/`` per recipe, ``hf/`` in it, each export in
``<export>-<key>/`` beside it, the references as ``reference-<key>.json``; a key hashes what
decides the files (the recipe, :data:`FORMAT`, the tokenizers version, the exporter's packages
and arguments), so a changed recipe makes new folders and an unchanged one is never rebuilt.
Folders are written to a scratch name and renamed, under a per-model lock, so concurrent runs
(CI's background ``prepare`` and the tests) never see half a folder.

A build that fails is remembered for an hour (``.failed-*``) so a test run does not retry a
broken exporter in every test; :class:`Unavailable` carries the reason and the install line.

Command line (the docs' way to make the same folders by hand)::

    python tests/support/llm.py prepare               # venvs, tiny models, exports, references
    python tests/support/llm.py prepare bench-llama   # the benchmark model (~169 M parameters)
    python tests/support/llm.py path tiny-llama optimum-onnx
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

from llm_encoder import EncoderSpec
from llm_encoder import write as write_encoder
from llm_hf import DecoderSpec
from llm_hf import write as write_decoder
from venvs import ROOT, cached_venv

#: bumped when a change to this package changes the files a recipe makes
FORMAT = 2
SCRIPTS = Path(__file__).parent / "llm_scripts"
CACHE = ROOT / "llm"
#: how long a failed build is believed before it is tried again
FAILED_FOR_S = 3600
#: pip's time to make one exporter venv: 3-6 minutes alone on 2 cores, over 15 when three
#: are made at once while the machine's load average is 12
VENV_TIMEOUT_S = 2400

MODELS: dict[str, DecoderSpec] = {
    # ~0.4 M parameters, 1.5 MB: GQA 4:2, untied head, BOS added by the tokenizer
    "tiny-llama": DecoderSpec(
        family="llama",
        hidden=64,
        layers=2,
        heads=4,
        kv_heads=2,
        intermediate=192,
        vocab=2048,
        context=512,
        corpus_lines=5000,
        eos_gain=1.6,
        sampling=(("temperature", 0.6), ("top_p", 0.9)),
    ),
    # ~0.44 M parameters: GQA 6:2, biased q/k/v, tied head, ChatML, no BOS
    "tiny-qwen2": DecoderSpec(
        family="qwen2",
        hidden=96,
        layers=3,
        heads=6,
        kv_heads=2,
        intermediate=256,
        vocab=1536,
        context=512,
        corpus_lines=5000,
        residual_gain=10.0,
        eos_gain=1.6,
    ),
    # ~22 M parameters (90 MB of f32 weights): big enough that a reload's kept weights show
    # in the server's memory (tests/server/test_reload_memory.py, slow; built when it runs)
    "reload-llama": DecoderSpec(
        family="llama",
        hidden=512,
        layers=6,
        heads=8,
        kv_heads=4,
        intermediate=1536,
        vocab=2048,
        context=256,
        corpus_lines=2000,
    ),
    # ~169 M parameters, 4096 context: for benchmarks (compute matters), never built by tests
    "bench-llama": DecoderSpec(
        family="llama",
        hidden=1024,
        layers=12,
        heads=16,
        kv_heads=4,
        intermediate=2816,
        vocab=16384,
        context=4096,
        corpus_lines=20000,
    ),
}

ENCODERS: dict[str, EncoderSpec] = {
    # mean pooling then Normalize, as all-MiniLM-L6-v2
    "tiny-bert-mean": EncoderSpec(pooling="mean", normalize=True),
    # CLS pooling, no Normalize module, as a BGE-style model without it
    "tiny-bert-cls": EncoderSpec(pooling="cls", normalize=False, seed=1),
}

#: the prompts every reference answers: raw ones (completions) and chats (chat completions)
PROMPTS: list[dict] = [
    {"name": "hello", "prompt": "Hello, my name is"},
    {"name": "capital", "prompt": "The capital of France is"},
    {"name": "code", "prompt": "def fibonacci(n):"},
    {"name": "story", "prompt": "Once upon a time"},
    {"name": "unicode", "prompt": "Café naïve 東京 ☕ —"},
    {
        "name": "long",
        "prompt": (
            "Please write a short story about the sea. There are 42 apples in the quiet box. "
            "What is 17 plus 25? 17 + 25 = 42. My name is Alice and I live in Oslo, a cold "
            "town. Once upon a time, the moon and a robot met in Kalomira. Here is a list: "
            'apples, books, birds. {"name": "Bob", "age": 31, "city": "Rome"} '
            "def add(a, b):\n    return a + b\nCan you explain the answer for me?"
        ),
    },
    {"name": "chat", "messages": [{"role": "user", "content": "What is the capital of France?"}]},
    {
        "name": "chat-system",
        "messages": [
            {"role": "system", "content": "You are a helpful assistant."},
            {"role": "user", "content": "Please write a short poem about the sea."},
        ],
    },
    {
        "name": "chat-turns",
        "messages": [
            {"role": "user", "content": "Hello!"},
            {"role": "assistant", "content": "Hi! How can I help you today?"},
            {"role": "user", "content": "Can you count the apples?"},
        ],
    },
]

#: the sentences whose embeddings sentence-transformers gives as the encoders' reference
SENTENCES = [
    "What is the capital of France?",
    "The capital of France is Paris.",
    "Please write a short poem about the sea.",
    "A quick test",
    "Café naïve ☕",
]


@dataclass(frozen=True)
class Tool:
    """An exporter's virtual environment: its packages (torch pinned to the CPU wheel), and
    what must be removed after (a declared dependency that breaks it here)."""

    venv: str
    packages: tuple[str, ...]
    uninstall: tuple[str, ...] = ()

    def install_line(self) -> str:
        line = f"python -m venv VENV && VENV/bin/pip install {' '.join(map(repr, self.packages))}"
        if self.uninstall:
            line += f" && VENV/bin/pip uninstall -y {' '.join(self.uninstall)}"
        return line

    def python(self) -> Path:
        """The venv's python, made first if needed (several minutes); :class:`Unavailable`
        when it cannot be made."""

        def make() -> Path:
            venv = cached_venv(self.venv, list(self.packages), self.uninstall, VENV_TIMEOUT_S)
            return venv / "bin" / "python"

        return _attempt(f"venv-{self.venv}", make, self.install_line())


# torch pinned in every exporter venv: pip takes the CPU wheel on disk; unpinned, an exporter's
# dependency on torch pulls a multi-GB CUDA build
TORCH = "torch==2.13.0"

#: optimum-onnx 0.1.0 pins transformers 4.57; sentence-transformers 5.7 (the last for 4.x)
#: computes the encoders' reference embeddings; onnxruntime checks optimum's exports
OPTIMUM = Tool(
    "llm-optimum-onnx-0.1.0",
    (
        TORCH,
        "optimum-onnx==0.1.0",
        "transformers==4.57.6",
        "onnxruntime==1.32.0",
        "sentence-transformers==5.7.0",
    ),
)
#: onnxruntime-genai 0.18.0's model builder needs transformers 5.x, onnx and onnx-ir
#: (undeclared by the wheel); the wheel also runs the folders (onnxruntime_genai)
GENAI = Tool(
    "llm-genai-0.18.0",
    (TORCH, "onnxruntime-genai==0.18.0", "transformers==5.5.4", "onnx==1.23.2", "onnx-ir==1.1.0"),
)
#: optimum-intel 2.2.0 declares torchvision, whose PyPI wheel fails to import beside the CPU
#: torch 2.13.0 ('operator torchvision::nms does not exist') and so breaks transformers'
#: imports: it is removed (and datasets, which older releases pulled and which breaks it too)
OPENVINO = Tool(
    "llm-openvino-2.2.0",
    (
        TORCH,
        "optimum-intel[openvino]==2.2.0",
        "transformers==5.5.4",
        "openvino==2026.4.1",
        "openvino-tokenizers==2026.4.1",
        "openvino-genai==2026.4.1",
    ),
    uninstall=("torchvision", "datasets"),
)
TOOLS = {"optimum": OPTIMUM, "genai": GENAI, "openvino": OPENVINO}


@dataclass(frozen=True)
class Export:
    """One exporter run: the tool, the arguments after the input and output folders (a
    callable of them), and the HF files it does not carry over that users' folders have."""

    tool: Tool
    command: Callable[[Path, Path, Path], list[str]]  # (python, hf folder, out) -> argv
    extra_files: tuple[str, ...] = ()
    #: the models it is made for (empty: every model)
    only: tuple[str, ...] = ()

    def key(self, name: str) -> str:
        argv = self.command(Path("PY"), Path("IN"), Path("OUT"))
        return _hash({"packages": self.tool.packages, "argv": argv, "name": name})


def _optimum_cli(py: Path, hf: Path, out: Path) -> list[str]:
    return [
        str(py.parent / "optimum-cli"),
        "export",
        "onnx",
        "--model",
        str(hf),
        "--task",
        "text-generation-with-past",
        str(out),
    ]


def _builder(precision: str, *options: str) -> Callable[[Path, Path, Path], list[str]]:
    """The model builder's command line; ``options`` are its ``--extra_options`` (key=value)."""

    def argv(py: Path, hf: Path, out: Path) -> list[str]:
        cache = out.parent / f"{out.name}.builder-cache"
        extra = ["--extra_options", *options] if options else []
        return [
            str(py),
            "-m",
            "onnxruntime_genai.models.builder",
            "-i",
            str(hf),
            "-o",
            str(out),
            "-p",
            precision,
            "-e",
            "cpu",
            "-c",
            str(cache),
            *extra,
        ]

    return argv


def _openvino_cli(py: Path, hf: Path, out: Path) -> list[str]:
    return [
        str(py.parent / "optimum-cli"),
        "export",
        "openvino",
        "--model",
        str(hf),
        "--task",
        "text-generation-with-past",
        "--weight-format",
        "fp32",
        str(out),
    ]


HF_EXTRAS = ("config.json", "generation_config.json", "special_tokens_map.json")
EXPORTS: dict[str, Export] = {
    "optimum-onnx": Export(OPTIMUM, _optimum_cli),
    # the builder writes genai_config.json and the tokenizer files but no config.json
    "genai-fp32": Export(GENAI, _builder("fp32"), HF_EXTRAS),
    "genai-int4": Export(GENAI, _builder("int4"), HF_EXTRAS),
    # int4 whose MatMulNBits onnxruntime computes in float32 (its CPU default, accuracy_level
    # 4, rounds the activations to int8), so NUMPY's kernels compare with it exactly
    "genai-int4-exact": Export(GENAI, _builder("int4", "accuracy_level=1"), HF_EXTRAS),
    # the builder's other quantized forms, for the untied model: zero points (uint4), the
    # embedding table quantized too (GatherBlockQuantized of uint4) and an int8 head. For a
    # tied model builder 0.18.0 writes graphs onnxruntime refuses with any of these (a Reshape
    # typed float over the head's uint8 bytes; a weight read but never stored)
    "genai-int4-asym": Export(
        GENAI,
        _builder(
            "int4",
            "accuracy_level=1",
            "is_symmetric=false",
            "op_types_to_quantize=MatMul/Gather",
            "matmul_mixed_precision=last_matmul:int8",
        ),
        HF_EXTRAS,
        only=("tiny-llama",),
    ),
    "openvino": Export(OPENVINO, _openvino_cli, ("special_tokens_map.json",)),
}


class Unavailable(RuntimeError):
    """A folder cannot be made on this machine: the reason, and the line that installs what
    it needs (tests skip with it)."""


# ---------------------------------------------------------------------------------------------
# public API


def hf_folder(name: str) -> Path:
    """The HF model folder of decoder ``name`` (no torch needed to make it)."""
    spec = MODELS[name]
    base = _base(name, spec.recipe())
    return _build(base / "hf", lambda out: write_decoder(spec, out), base)


def export(name: str, kind: str) -> Path:
    """Decoder ``name`` exported by ``kind`` (a key of :data:`EXPORTS`)."""
    how = EXPORTS[kind]
    if how.only and name not in how.only:
        raise ValueError(f"export {kind!r} is made for {', '.join(how.only)}, not {name!r}")
    hf = hf_folder(name)
    base = hf.parent
    target = base / f"{kind}-{how.key(name)}"
    if target.exists():
        return target

    def make(out: Path) -> None:
        python = how.tool.python()
        _run(how.command(python, hf, out), timeout=_timeout(name), what=f"{kind} of {name}")
        for file in how.extra_files:
            if not (out / file).exists():
                shutil.copy2(hf / file, out / file)

    return _build(target, make, base, install=how.tool.install_line())


def reference_path(name: str) -> Path:
    """transformers' f32 greedy answers of decoder ``name`` to :data:`PROMPTS` (JSON: see
    llm_scripts/reference.py for the fields)."""
    hf = hf_folder(name)
    max_new = 32 if name.startswith("tiny") else 16
    key = _hash({"packages": OPTIMUM.packages, "prompts": PROMPTS, "max_new": max_new})
    target = hf.parent / f"reference-{key}.json"
    if target.exists():
        return target

    def make(out: Path) -> None:
        python = OPTIMUM.python()
        prompts = out.with_suffix(".prompts.json")
        prompts.write_text(json.dumps(PROMPTS))
        try:
            _run(
                [
                    str(python),
                    str(SCRIPTS / "reference.py"),
                    str(hf),
                    str(prompts),
                    str(max_new),
                    str(out),
                ],
                timeout=_timeout(name),
                what=f"reference of {name}",
            )
        finally:
            prompts.unlink(missing_ok=True)

    return _build(target, make, hf.parent, install=OPTIMUM.install_line(), is_file=True)


def reference(name: str) -> dict:
    return json.loads(reference_path(name).read_text())


def encoder_folder(name: str) -> Path:
    """The HF + sentence-transformers folder of encoder ``name`` (no torch needed)."""
    spec = ENCODERS[name]
    base = _base(name, spec.recipe())
    return _build(base / "hf", lambda out: write_encoder(spec, out), base)


def encoder_onnx(name: str) -> Path:
    """Encoder ``name`` as the sentence-transformers hub repositories lay it out: the HF and
    sentence-transformers files at the top, optimum's feature-extraction export (output
    ``last_hidden_state``; the pooling is the server's, from ``1_Pooling/config.json``) as
    ``onnx/model.onnx``."""
    hf = encoder_folder(name)
    argv = ["export", "onnx", "--task", "feature-extraction", "--library-name", "transformers"]
    target = hf.parent / f"optimum-onnx-{_hash({'packages': OPTIMUM.packages, 'argv': argv})}"
    if target.exists():
        return target

    def make(out: Path) -> None:
        python = OPTIMUM.python()
        onnx_dir = out / "onnx"
        _run(
            [
                str(python.parent / "optimum-cli"),
                *argv[:2],
                "--model",
                str(hf),
                *argv[2:],
                str(onnx_dir),
            ],
            timeout=600,
            what=f"onnx export of {name}",
        )
        for item in hf.iterdir():
            if item.name == "model.safetensors":
                continue
            dest = out / item.name
            if item.is_dir():
                shutil.copytree(item, dest)
            else:
                shutil.copy2(item, dest)
        # optimum writes its own copy of the tokenizer and config beside the graph; the
        # hub layout has them once, at the top
        for item in list(onnx_dir.iterdir()):
            if item.suffix not in (".onnx", ".onnx_data") and not item.name.endswith(".data"):
                item.unlink()

    return _build(target, make, hf.parent, install=OPTIMUM.install_line())


def embeddings_path(name: str) -> Path:
    """sentence-transformers' embeddings of :data:`SENTENCES` by encoder ``name`` (JSON:
    ``sentences``, ``embeddings``, ``pooling``, ``normalize``, versions)."""
    hf = encoder_folder(name)
    key = _hash({"packages": OPTIMUM.packages, "sentences": SENTENCES})
    target = hf.parent / f"embeddings-{key}.json"
    if target.exists():
        return target

    def make(out: Path) -> None:
        python = OPTIMUM.python()
        _run(
            [str(python), str(SCRIPTS / "embeddings.py"), str(hf), json.dumps(SENTENCES), str(out)],
            timeout=600,
            what=f"embeddings of {name}",
        )

    return _build(target, make, hf.parent, install=OPTIMUM.install_line(), is_file=True)


def embeddings(name: str) -> dict:
    return json.loads(embeddings_path(name).read_text())


def run_script(tool: Tool, script: str, *args: str, timeout: float = 600) -> dict:
    """Run ``llm_scripts/<script>`` in ``tool``'s venv; its last stdout line is JSON."""
    python = tool.python()
    out = _run([str(python), str(SCRIPTS / script), *args], timeout=timeout, what=script)
    return json.loads(out.strip().splitlines()[-1])


# ---------------------------------------------------------------------------------------------
# cache machinery


def _hash(obj: object) -> str:
    return hashlib.sha256(json.dumps(obj, sort_keys=True).encode()).hexdigest()[:12]


def _base(name: str, recipe: dict) -> Path:
    import tokenizers

    key = _hash({"format": FORMAT, "recipe": recipe, "tokenizers": tokenizers.__version__})
    return CACHE / f"{name}-{key}"


def _timeout(name: str) -> float:
    return 600 if name.startswith("tiny") else 3600


@contextlib.contextmanager
def _locked(base: Path) -> Iterator[None]:
    base.parent.mkdir(parents=True, exist_ok=True)
    with open(base.parent / f".{base.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        yield


def _failed_marker(what: str) -> Path:
    return CACHE / f".failed-{what}"


def _attempt(what: str, make: Callable[[], Path], install: str) -> Path:
    """``make()``, or :class:`Unavailable` with the reason; a failure is remembered for
    FAILED_FOR_S so every test of a run does not try again."""
    marker = _failed_marker(what)
    if marker.exists() and time.time() - marker.stat().st_mtime < FAILED_FOR_S:
        raise Unavailable(f"{marker.read_text()} (remembered in {marker}; delete to retry)")
    try:
        return make()
    except (subprocess.SubprocessError, OSError, RuntimeError) as error:
        if isinstance(error, Unavailable):
            raise
        reason = f"{what} failed: {_describe(error)}; install: {install}"
        CACHE.mkdir(parents=True, exist_ok=True)
        marker.write_text(reason)
        raise Unavailable(reason) from error


def _describe(error: BaseException) -> str:
    if isinstance(error, subprocess.CalledProcessError):
        tail = (error.stderr or error.output or "") if isinstance(error.stderr, str) else ""
        return f"exit {error.returncode}: {tail[-600:]}"
    return f"{type(error).__name__}: {error}"[:800]


def _build(
    target: Path,
    make: Callable[[Path], None],
    base: Path,
    install: str = "",
    is_file: bool = False,
) -> Path:
    """``target`` made by ``make(scratch)`` under ``base``'s lock, then renamed into place."""
    if target.exists():
        return target

    def locked_make() -> Path:
        with _locked(base):
            if target.exists():
                return target
            target.parent.mkdir(parents=True, exist_ok=True)
            scratch_dir = Path(tempfile.mkdtemp(prefix=f".{target.name}-", dir=target.parent))
            scratch = scratch_dir / target.name
            try:
                make(scratch)
                scratch.rename(target)
            finally:
                shutil.rmtree(scratch_dir, ignore_errors=True)
            return target

    what = f"{base.name}-{target.name}"
    return _attempt(what, locked_make, install or "pip install -e '.[test]'")


def _run(argv: list[str], timeout: float, what: str) -> str:
    """Run an exporter offline (no hub), its temporary files and caches in a folder of its
    own that is removed after; stdout returned, a failure raised with the output's tail."""
    scratch = Path(tempfile.mkdtemp(prefix="llm-export-", dir=CACHE))
    env = {
        **os.environ,
        "HF_HUB_OFFLINE": "1",
        "TRANSFORMERS_OFFLINE": "1",
        "HF_HOME": str(scratch / "hf"),
        "TMPDIR": str(scratch),
        "TOKENIZERS_PARALLELISM": "false",
        "PYTHONWARNINGS": "ignore",
    }
    env.pop("PYTHONPATH", None)
    started = time.monotonic()
    try:
        done = subprocess.run(
            argv, env=env, capture_output=True, text=True, timeout=timeout, cwd=scratch
        )
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    if done.returncode:
        raise subprocess.CalledProcessError(
            done.returncode, argv, output=done.stdout, stderr=f"{what}: {done.stderr[-2000:]}"
        )
    log = os.environ.get("PLUGSERVE_LLM_LOG")
    if log:
        with open(log, "a") as f:
            f.write(f"{what}: {time.monotonic() - started:.1f} s\n")
    return done.stdout


# ---------------------------------------------------------------------------------------------
# command line


def prepare(names: list[str]) -> int:
    """Make the exporters' venvs (at once: each is mostly pip unpacking torch) and then each
    named model's folder, exports and references, printing the time of each step; returns
    the number of steps that failed (their tests skip with the reason)."""
    from concurrent.futures import ThreadPoolExecutor

    failed: list[str] = []

    def step(label: str, make: Callable[[], object]) -> None:
        started = time.monotonic()
        try:
            result = make()
            print(f"{label}: {time.monotonic() - started:.1f} s  {result}", flush=True)
        except Unavailable as error:
            failed.append(label)
            print(f"{label}: FAILED after {time.monotonic() - started:.1f} s: {error}", flush=True)

    with ThreadPoolExecutor(len(TOOLS)) as pool:
        venvs = [pool.submit(step, f"venv {t.venv}", t.python) for t in TOOLS.values()]
        for future in venvs:
            future.result()

    def model(name: str) -> None:
        if name in ENCODERS:
            step(f"{name} hf", lambda: encoder_folder(name))
            step(f"{name} onnx", lambda: encoder_onnx(name))
            step(f"{name} embeddings", lambda: embeddings_path(name))
            return
        step(f"{name} hf", lambda: hf_folder(name))
        step(f"{name} reference", lambda: reference_path(name))
        for kind in [k for k, e in EXPORTS.items() if not e.only or name in e.only]:
            step(f"{name} {kind}", lambda k=kind: export(name, k))

    # two models at a time: an export is one busy process (tracing, saving) on two cores
    with ThreadPoolExecutor(2) as pool:
        for future in [pool.submit(model, name) for name in names]:
            future.result()
    return len(failed)


def main(argv: list[str]) -> int:
    import argparse

    parser = argparse.ArgumentParser(prog="llm.py", description=__doc__.split("\n\n")[0])
    verbs = parser.add_subparsers(dest="verb", required=True)
    made = verbs.add_parser("prepare", help="make venvs, folders, exports and references")
    made.add_argument("names", nargs="*", help="models (default: every tiny one and encoder)")
    path = verbs.add_parser("path", help="print one folder or reference file (made if needed)")
    path.add_argument("name", choices=[*MODELS, *ENCODERS])
    path.add_argument("kind", choices=["hf", "reference", "onnx", "embeddings", *EXPORTS])
    args = parser.parse_args(argv)
    if args.verb == "prepare":
        default = [n for n in [*MODELS, *ENCODERS] if n.startswith("tiny")]
        unknown = set(args.names) - set(MODELS) - set(ENCODERS)
        if unknown:
            parser.error(f"unknown models {sorted(unknown)}: choose from {[*MODELS, *ENCODERS]}")
        return 1 if prepare(args.names or default) else 0
    name, kind = args.name, args.kind
    try:
        if kind == "hf":
            print(hf_folder(name) if name in MODELS else encoder_folder(name))
        elif kind == "reference":
            print(reference_path(name))
        elif kind == "onnx":
            print(encoder_onnx(name))
        elif kind == "embeddings":
            print(embeddings_path(name))
        else:
            print(export(name, kind))
    except Unavailable as error:
        print(error, file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
