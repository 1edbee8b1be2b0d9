"""Block-size policies: how many positions each request verifies in the next step.

A policy sees the running requests (their acceptance statistics) and each one's cap; it knows
nothing about models or caches.
"""


class BlockPolicy:
    def choose(self, requests, caps: list[int]) -> list[int]:
        raise NotImplementedError


class FixedBlockPolicy(BlockPolicy):
    def __init__(self, block_size: int):
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        self.block_size = block_size

    def choose(self, requests, caps):
        return [min(self.block_size, cap) for cap in caps]
