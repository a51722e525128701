"""Host staging buffers for device tensors, reused across calls and communicators (a leaf).

torch is never imported here: a buffer is asked for only once a torch tensor exists, so
the program has imported torch already.
"""

from __future__ import annotations

import sys
import threading
from collections import OrderedDict
from typing import Any

__all__ = ["POOL", "StagingPool"]


def _torch_dtype_name(dtype: Any) -> str:
    return str(dtype).removeprefix("torch.")


class StagingPool:
    """Host staging buffers, reused: one free list per (device, dtype, bytes).

    A buffer is a flat torch tensor on the CPU, pinned (page-locked) when it stages an
    accelerator's tensor, so copies to and from the device run on the copy engines without
    a bounce. A buffer given back with an event (a copy out of it still in flight) is handed
    out again only after that event has completed. At most ``max_bytes`` are kept idle; the
    least recently returned go first.
    """

    def __init__(self, max_bytes: int = 2 << 30) -> None:
        self.max_bytes = max_bytes
        self.allocations = 0  # buffers created (a warm loop of calls adds none)
        # idle buffers: token -> (key, buffer, event), oldest first; and the tokens per key
        self._free: OrderedDict[int, tuple[tuple[str, str, int], Any, Any]] = OrderedDict()
        self._by_key: dict[tuple[str, str, int], list[int]] = {}
        self._idle_bytes = 0
        self._lock = threading.Lock()

    def acquire(self, device: Any, dtype: Any, numel: int) -> Any:
        """A flat CPU tensor of ``numel`` elements of ``dtype`` to stage a tensor of ``device``."""
        torch = sys.modules["torch"]
        nbytes = numel * int(dtype.itemsize)
        key = (str(device), _torch_dtype_name(dtype), nbytes)
        buf = event = None
        with self._lock:
            tokens = self._by_key.get(key)
            if tokens:
                _, buf, event = self._free.pop(tokens.pop())  # the most recently returned: warm in cache
                self._idle_bytes -= nbytes
        if buf is not None:
            if event is not None and not event.query():
                event.synchronize()  # rare: a copy out of this buffer is still in flight
            return buf
        buf = torch.empty(numel, dtype=dtype)
        if torch.device(device).type != "cpu":
            try:  # pinned for the device's copy engines (torch_npu pins for the NPU)
                buf = buf.pin_memory()
            except RuntimeError:  # no driver for pinning: pageable still works, only slower
                pass
        self.allocations += 1
        return buf

    def release(self, device: Any, buf: Any, event: Any = None) -> None:
        """Give ``buf`` back; ``event``: a copy reading it is in flight until that event."""
        nbytes = buf.numel() * buf.element_size()
        key = (str(device), _torch_dtype_name(buf.dtype), nbytes)
        with self._lock:
            token = id(buf)
            if token in self._free:  # given back twice: keep one entry
                return
            self._free[token] = (key, buf, event)
            self._by_key.setdefault(key, []).append(token)
            self._idle_bytes += nbytes
            while self._idle_bytes > self.max_bytes and self._free:  # drop the least recently returned
                old, (k, _, ev) = self._free.popitem(last=False)
                self._by_key[k].remove(old)
                if ev is not None:
                    ev.synchronize()
                self._idle_bytes -= k[2]

    def idle(self) -> int:
        """How many buffers wait in the free lists."""
        with self._lock:
            return len(self._free)

    def clear(self) -> None:
        with self._lock:
            for _, _, ev in self._free.values():
                if ev is not None:
                    ev.synchronize()
            self._free.clear()
            self._by_key.clear()
            self._idle_bytes = 0


#: the process's pool (staging buffers outlive calls and communicators)
POOL = StagingPool()
