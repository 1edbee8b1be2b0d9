"""Turn user choices (paths, dtype, device) into a ready target, drafter and tokenizer.

It owns the defaults: the default target model, the shipped drafter when one exists, and
`auto` dtype selection. It knows nothing about decoding.
"""

import json
import warnings
from copy import deepcopy
from dataclasses import dataclass
from pathlib import Path

import torch

from engine.default_model import MASK_TOKEN_ID, resolve_model_path
from engine.drafter import Drafter, DrafterConfig, check_drafter_fits, load_drafter
from engine.model import SUPPORTED_MODEL_TYPES, Linear, load_target, pack_linears, read_hf_config

CHECKPOINTS = Path(__file__).resolve().parent.parent / "checkpoints"
DEFAULT_DRAFTER = CHECKPOINTS / "smollm2-135m-dflash"
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def cpu_has_fast_bf16() -> bool:
    try:
        flags = Path("/proc/cpuinfo").read_text()
    except OSError:
        return False
    return "amx_bf16" in flags or "avx512_bf16" in flags


def pick_dtype(name: str, device: str) -> torch.dtype:
    """`auto` is bf16 on CUDA and on CPUs with native bf16 (AVX512-BF16/AMX), else float32."""
    if name == "auto":
        fast = device.startswith("cuda") or cpu_has_fast_bf16()
        return torch.bfloat16 if fast else torch.float32
    if name not in DTYPES:
        raise ValueError(f"--dtype must be one of auto, {', '.join(DTYPES)}; got {name!r}")
    return DTYPES[name]


def check_device(device: str):
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise ValueError(f"--device {device}: CUDA is not available on this machine")
    if not (device == "cpu" or device.startswith("cuda")):
        raise ValueError(f"--device must be cpu or cuda[:N], got {device!r}")


def random_drafter(target_config, seed=0, num_layers=1, block_size=16) -> Drafter:
    """An untrained drafter shaped for the target (stand-in until a trained one exists)."""
    torch.manual_seed(seed)
    return Drafter(DrafterConfig.for_target(target_config, num_layers, MASK_TOKEN_ID, block_size))


def quantize_int8(drafter: Drafter, copy: bool = False) -> Drafter:
    """Dynamic int8 quantisation of the drafter's linear layers (CPU, float32 activations).
    `copy`: quantise a copy and leave `drafter` as it is."""
    if copy:  # oneDNN-packed weights cannot be deep-copied; the copy's are dropped below anyway
        drafter = deepcopy(drafter, {id(m.packed): None for m in drafter.modules() if getattr(m, "packed", None) is not None})
    drafter = drafter.float()
    for m in drafter.modules():
        if isinstance(m, Linear):
            m.__class__, m.packed = torch.nn.Linear, None  # quantize_dynamic replaces exact nn.Linear types only
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return torch.ao.quantization.quantize_dynamic(drafter, {torch.nn.Linear}, dtype=torch.qint8)


@dataclass
class Loaded:
    target: torch.nn.Module
    drafter: Drafter | None
    tokenizer: object
    target_path: Path
    drafter_name: str  # a path, "random" or "none"
    dtype: torch.dtype


def load_tokenizer(path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(path), local_files_only=True)


def stop_token_ids(path) -> tuple[int, ...]:
    """End-of-turn ids from config.json and generation_config.json."""
    ids = set()
    for name in ("config.json", "generation_config.json"):
        f = Path(path) / name
        eos = json.loads(f.read_text()).get("eos_token_id") if f.exists() else None
        ids.update(eos if isinstance(eos, list) else [] if eos is None else [eos])
    return tuple(sorted(ids))


def load(target=None, draft="default", dtype="auto", device="cpu", int8_drafter=False) -> Loaded:
    """Load the target (default model if None), a drafter (`default`, a path, `random` or `none`)."""
    check_device(device)
    torch_dtype = pick_dtype(dtype, device)
    target_path = resolve_model_path(target)
    model_type = read_hf_config(target_path).get("model_type")
    if model_type in SUPPORTED_MODEL_TYPES:
        target_model = load_target(target_path, torch_dtype, device)
    else:
        from engine.hf_target import load_hf_target

        target_model = load_hf_target(target_path, torch_dtype, device)
    drafter, name = None, "none"
    if draft == "default":
        draft = str(DEFAULT_DRAFTER) if DEFAULT_DRAFTER.exists() else "random"
    if draft == "random":
        drafter, name = random_drafter(target_model.config), "random"
    elif draft != "none":
        if not (Path(draft) / "config.json").exists():
            raise FileNotFoundError(f"--draft {draft}: no drafter checkpoint (config.json) there")
        drafter, name = load_drafter(draft), str(draft)
    if drafter is not None:
        check_drafter_fits(drafter.config, target_model.config)
        drafter = quantize_int8(drafter) if int8_drafter else pack_linears(drafter.to(device=device, dtype=torch_dtype).eval())
    tokenizer = load_tokenizer(target_path)
    return Loaded(target_model, drafter, tokenizer, target_path, name, torch_dtype)
