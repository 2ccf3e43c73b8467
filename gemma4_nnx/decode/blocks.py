"""The block pool's bookkeeping: which blocks of the paged KV cache each row holds.

The device holds the pools (`gemma4_nnx.model.cache.PagedCache`: every global donor layer's K/V in
blocks of `block_size` slots) and one block table [rows, width]; this module decides its entries on
the host (vLLM's block manager). A row holds the blocks of its positions [0, length) in table order;
blocks are taken from the free list as a row grows and go back when the last holder lets go. Holders
are counted per block: a row, and each prefix-cache snapshot that keeps the block (`hold`), so a
shared system prompt is stored once. A row may write only into blocks it alone holds: whoever shares
a partly filled block copies it first (`Decoder.restore`).
"""

from __future__ import annotations

import numpy as np

__all__ = ["BLOCK_SIZE", "BlockPool", "blocks_for"]

#: Slots per block. Small enough that a row wastes little (< 32 slots) and a shared prefix shares
#: nearly all of itself; large enough that a table row stays short (4,096 entries at 128K tokens) and
#: XLA's key blocks gather few pieces (`attention.KEY_BLOCK` / 32 blocks each).
BLOCK_SIZE = 32


def blocks_for(length: int, block_size: int) -> int:
    """Blocks that hold positions [0, length)."""
    return -(-max(length, 0) // block_size)


class BlockPool:
    """`blocks` blocks of `block_size` slots shared by `rows` rows of at most `width` blocks each.

    `table` [rows, width] int32 is what the device's `KVCache.table` is set from (an entry of
    `blocks`: none); `changed` says it differs from what was last pushed (`pushed()`)."""

    def __init__(self, blocks: int, block_size: int, rows: int, width: int):
        if blocks < 1:
            raise ValueError(f"a block pool needs at least one block, got {blocks}")
        self.blocks, self.block_size, self.rows, self.width = blocks, block_size, rows, width
        self.table = np.full((rows, width), blocks, np.int32)
        self.held = np.zeros(rows, np.int64)  # blocks each row holds (its table's first entries)
        self.refs = np.zeros(blocks, np.int32)
        self._free = list(range(blocks - 1, -1, -1))  # pop() takes the lowest free block
        self.changed = True

    @property
    def free(self) -> int:
        return len(self._free)

    @property
    def used(self) -> int:
        return self.blocks - len(self._free)

    def grow(self, row: int, length: int) -> bool:
        """Give `row` blocks for positions [0, length); False (and nothing taken) when too few are
        free. Raises ValueError past the table's width (a longer sequence than the cache holds)."""
        n = blocks_for(length, self.block_size)
        if n > self.width:
            raise ValueError(f"{length} positions need {n} blocks; a row holds at most {self.width}")
        need = n - int(self.held[row])
        if need <= 0:
            return True
        if need > len(self._free):
            return False
        for j in range(int(self.held[row]), n):
            b = self._free.pop()
            self.refs[b] = 1
            self.table[row, j] = b
        self.held[row] = n
        self.changed = True
        return True

    def release(self, row: int) -> None:
        """`row` lets go of all its blocks."""
        self.drop(self.table[row, : self.held[row]].tolist())
        self.table[row] = self.blocks
        self.held[row] = 0
        self.changed = True

    def blocks_of(self, row: int, length: int) -> tuple[int, ...]:
        """The blocks holding `row`'s positions [0, length)."""
        n = blocks_for(length, self.block_size)
        if n > self.held[row]:
            raise ValueError(f"row {row} holds {self.held[row]} blocks, not the {n} of {length} positions")
        return tuple(self.table[row, :n].tolist())

    def hold(self, ids) -> None:
        """One more holder (a snapshot, a row sharing them) of each block in `ids`."""
        for b in ids:
            if self.refs[b] < 1:
                raise ValueError(f"block {b} is free: nothing to share")
            self.refs[b] += 1

    def drop(self, ids) -> None:
        """One holder fewer of each block in `ids`; a block nobody holds goes back to the free list."""
        for b in ids:
            if self.refs[b] < 1:
                raise ValueError(f"block {b} is already free")
            self.refs[b] -= 1
            if self.refs[b] == 0:
                self._free.append(b)
        # lowest first again (deterministic placement, whatever order blocks came back in)
        self._free.sort(reverse=True)

    def share(self, row: int, ids) -> None:
        """An empty `row` starts with these (held) blocks as its first ones."""
        if self.held[row]:
            raise ValueError(f"row {row} already holds blocks")
        ids = list(ids)
        self.hold(ids)
        self.table[row, : len(ids)] = ids
        self.held[row] = len(ids)
        self.changed = True

    def replace(self, row: int, j: int) -> tuple[int, int] | None:
        """Give `row` a block of its own for table entry j instead of a shared one: (old, new) to
        copy on the device, or None when no block is free."""
        if not self._free:
            return None
        old, new = int(self.table[row, j]), self._free.pop()
        self.refs[new] = 1
        self.table[row, j] = new
        self.drop([old])
        self.changed = True
        return old, new

    def check(self) -> None:
        """The counts agree with the table and the free list (tests: no block leaks)."""
        counted = np.zeros(self.blocks, np.int64)
        for r in range(self.rows):
            np.add.at(counted, self.table[r, : self.held[r]], 1)
        if np.any(counted > self.refs):
            raise AssertionError("a block is in more rows than it has holders")
        free = set(self._free)
        if len(free) != len(self._free) or any(self.refs[b] != 0 for b in free):
            raise AssertionError("the free list holds a block in use (or twice)")
        if len(free) + int(np.sum(self.refs > 0)) != self.blocks:
            raise AssertionError("a block is neither free nor held")
