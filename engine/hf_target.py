"""A transformers-backed target for architectures that engine.model's lean forward does not cover.

It offers TargetModel's interface (config, embed_tokens, lm_head, new_cache, forward) for one request
per call, over one transformers DynamicCache per slot; it knows nothing about drafting or sampling.
"""

from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn
from transformers import AutoModelForCausalLM, DynamicCache

from engine.kv_cache import SlotTable


@dataclass
class HFTargetConfig:
    """The fields of engine.model.ModelConfig that any transformers causal LM can fill in."""

    vocab_size: int
    hidden_size: int
    num_layers: int
    max_position_embeddings: int = 2048
    model_type: str = ""

    @classmethod
    def from_hf(cls, hf_config) -> "HFTargetConfig":
        text = hf_config.get_text_config(decoder=True)
        return cls(
            vocab_size=text.vocab_size,
            hidden_size=text.hidden_size,
            num_layers=text.num_hidden_layers,
            max_position_embeddings=getattr(text, "max_position_embeddings", None) or 2048,
            model_type=text.model_type,
        )


class HFCache(SlotTable):
    """KVCache's bookkeeping (slots, lengths, crop) over one transformers DynamicCache per slot."""

    def __init__(self, hf_config, num_slots, max_len):
        super().__init__(num_slots, max_len)
        self.hf_config = hf_config
        self.caches: list[DynamicCache | None] = [None] * num_slots

    def allocate(self):
        slot = super().allocate()
        self.caches[slot] = DynamicCache(config=self.hf_config)
        self.caches[slot].activate_past_recording()  # keeps sliding-window layers croppable
        return slot

    def free(self, slot):
        super().free(slot)
        self.caches[slot] = None

    def truncate(self, slot, length):
        """Drop the slot's entries at positions >= length (a rejected block)."""
        cache = self.caches[slot]
        if cache is None:
            raise ValueError(f"KV-cache slot {slot} is not allocated")
        held = cache.get_seq_length()
        if length > held:
            raise ValueError(f"slot {slot} holds {held} positions; cannot write at {length}")
        if held:  # crop(n <= 0) removes -n tokens; on an empty sliding-window layer it crashes
            cache.crop(length - held)


class HFTarget(nn.Module):
    """A local transformers checkpoint behind TargetModel's interface, batch size one."""

    max_batch_size = 1

    def __init__(self, path, dtype=torch.float32, device="cpu", trust_remote_code=False):
        super().__init__()
        if not (Path(path) / "config.json").exists():
            raise FileNotFoundError(f"no config.json in model path {path!s}")
        self.model = AutoModelForCausalLM.from_pretrained(
            path, dtype=dtype, local_files_only=True, trust_remote_code=trust_remote_code
        ).to(device).eval()
        self.config = HFTargetConfig.from_hf(self.model.config)

    @property
    def dtype(self):
        return self.model.dtype

    @property
    def device(self):
        return self.model.device

    @property
    def embed_tokens(self) -> nn.Module:
        return self.model.get_input_embeddings()

    @property
    def lm_head(self) -> nn.Module:
        return self.model.get_output_embeddings()

    def new_cache(self, num_slots, max_len) -> HFCache:
        return HFCache(self.model.config, num_slots, max_len)

    def forward(self, input_ids, positions, cache, slots, kv_len, feature_layers=(), logits_index=None, tree=None):
        """TargetModel.forward for a single request; anything past positions[0, 0] in its slot is dropped.

        input_ids    [1, q] long
        positions    [1, q] long, consecutive, no padding
        slots        [1] long: the request's cache slot
        kv_len       int: unused (the DynamicCache knows its length); kept for the shared interface
        feature_layers: layer ids k whose hidden_states[k + 1] are returned, concatenated on features
                        (for the last layer transformers gives the final-normed state)
        logits_index [1, k] long or None: which of the q positions need logits
        tree         must be None: token trees need the engine's own model (Engine.draft_tree)
        returns logits [1, k or q, vocab] (float32), features [1, q, n * hidden] or None
        """
        if tree is not None:
            raise ValueError("HFTarget verifies chains only, not token trees")
        if input_ids.shape[0] != 1:
            raise ValueError(f"HFTarget runs one request per call, got a batch of {input_ids.shape[0]}")
        start = int(positions[0, 0])
        expected = torch.arange(start, start + positions.shape[1], device=positions.device)
        if start < 0 or not torch.equal(positions[0], expected):
            raise ValueError("HFTarget needs consecutive positions without padding (-1)")
        slot = int(slots[0])
        cache.truncate(slot, start)
        out = self.model(
            input_ids=input_ids,
            position_ids=positions,
            past_key_values=cache.caches[slot],
            use_cache=True,
            output_hidden_states=bool(feature_layers),
            logits_to_keep=0 if logits_index is None else logits_index[0],
        )
        logits = out.logits.float()
        if not feature_layers:
            return logits, None
        return logits, torch.cat([out.hidden_states[k + 1] for k in feature_layers], dim=-1)


def load_hf_target(path, dtype=torch.float32, device="cpu", trust_remote_code=False) -> HFTarget:
    """Load any local transformers causal-LM checkpoint folder as a batch-size-one target."""
    return HFTarget(path, dtype, device, trust_remote_code)
