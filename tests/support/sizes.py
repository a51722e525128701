"""Size and count tables shared by the tests (elements unless named bytes)."""

from __future__ import annotations

# Counts every algorithm check covers: empty, one element, odd, and one over a 64 KiB CCL
# buffer (the executor slices it, or Channels pipeline it) at 4-byte elements.
KIT_COUNTS = (0, 1, 7, 1000, 20_000)
# Link conformance: puts of 0 and 1 bytes, odd, one larger than the default 64 KiB test CCL
# buffer, and one over three rdma frames (4 MiB each).
LINK_SIZES = (0, 1, 63, 3 << 16, (12 << 20) + 5)
