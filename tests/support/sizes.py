"""Size and count tables shared by the tests (elements unless named bytes)."""

from __future__ import annotations

# Counts every algorithm check covers: empty, one element, odd, and one over a 64 KiB CCL
# buffer (the executor slices it, or Channels pipeline it) at 4-byte elements.
KIT_COUNTS = (0, 1, 7, 1000, 20_000)
# Link conformance: transfers of 0 and 1 bytes, odd, and one larger than the CCL buffer.
LINK_BUFFER_BYTES = 1 << 16
LINK_SIZES = (0, 1, 63, 4096, 3 * LINK_BUFFER_BYTES)
