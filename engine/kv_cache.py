"""A preallocated KV cache with one slot per request, shared by the target and the drafter.

It owns the key/value tensors and which slots are in use; it knows nothing about tokens or
sampling. Invariant: slot s holds the keys/values of positions 0..lengths[s]-1 of the request
that owns it. Entries past a slot's length are stale and simply overwritten later (a rejected
draft is `crop`, never a copy). Column `max_len` is a trash column where padded rows write.
"""

import heapq

import torch


class SlotTable:
    """Which slots are in use and how many positions each holds (the bookkeeping every cache shares).

    A new request gets the lowest free slot, so the slots in use stay packed at the bottom and a batch
    taken in slot order is usually a run of consecutive slots: the model then reads its keys and values
    as a view of the cache, not a gathered copy (at batch 16 the copy cost ~0.7 ms a layer, docs/design.md).
    """

    def __init__(self, num_slots, max_len):
        self.max_len = max_len
        self.lengths = [0] * num_slots
        self._free = list(range(num_slots))  # a heap

    @property
    def num_slots(self):
        return len(self.lengths)

    @property
    def num_used(self):
        return self.num_slots - len(self._free)

    def allocate(self):
        if not self._free:
            raise RuntimeError(f"all {self.num_slots} KV-cache slots are in use")
        slot = heapq.heappop(self._free)
        self.lengths[slot] = 0
        return slot

    def free(self, slot):
        if slot in self._free:
            raise ValueError(f"KV-cache slot {slot} is already free")
        self.lengths[slot] = 0
        heapq.heappush(self._free, slot)

    def crop(self, slot, length):
        self.lengths[slot] = length


class KVCache(SlotTable):
    def __init__(self, num_layers, num_slots, max_len, num_kv_heads, head_dim, dtype, device):
        super().__init__(num_slots, max_len)
        shape = (num_layers, num_slots, num_kv_heads, max_len + 1, head_dim)
        self.k = torch.zeros(shape, dtype=dtype, device=device)
        self.v = torch.zeros(shape, dtype=dtype, device=device)

    def batch_index(self, slots):
        """Index forms of a batch's slots (host ints): a [batch, 1] tensor for writes, and for reads
        a slice (a view, no copy) when the slots are consecutive, else a [batch] tensor."""
        slots = [int(s) for s in slots]
        ids = torch.tensor(slots, device=self.k.device)
        consecutive = slots == list(range(slots[0], slots[0] + len(slots)))
        return ids[:, None], slice(slots[0], slots[0] + len(slots)) if consecutive else ids

    def write(self, layer, slot_ids, write_pos, k, v):
        """slot_ids [batch, 1] long; write_pos [batch, q] long (max_len for padding); k, v [batch, heads, q, dim]."""
        self.k[layer][slot_ids, :, write_pos] = k.transpose(1, 2)
        self.v[layer][slot_ids, :, write_pos] = v.transpose(1, 2)

    def copy_prefix(self, src, dst, length):
        """Give slot dst the keys and values of slot src's positions 0..length-1 (src unchanged)."""
        if src != dst:
            self.k[:, dst, :, :length] = self.k[:, src, :, :length]
            self.v[:, dst, :, :length] = self.v[:, src, :, :length]
        self.lengths[dst] = length

    def keep(self, slot, start, offsets):
        """Move positions start + offsets[k] to start + k (offsets increasing, offsets[k] >= k): a token
        tree's accepted path becomes the slot's next positions; crop the rest as usual."""
        src = torch.tensor(offsets, device=self.k.device) + start
        dst = torch.arange(len(offsets), device=self.k.device) + start
        for cache in (self.k, self.v):
            view = cache[:, slot]  # [layers, heads, max_len + 1, dim]
            view[:, :, dst] = view[:, :, src]

    def read(self, layer, read_index, kv_len):
        """Keys and values of positions 0..kv_len-1 of each slot: two [batch, heads, kv_len, dim]."""
        return self.k[layer][read_index, :, :kv_len], self.v[layer][read_index, :, :kv_len]
