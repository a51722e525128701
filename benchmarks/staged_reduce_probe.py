"""A reduction in place with an operand just written (a ring all_reduce's ``dst += slot``) against
the calibrated one (three arrays from memory), and copies likewise; one process. The numbers are
``ahcomm-bench calibrate``'s own measurements (``ahcomm._calibrate``: ``local_rates`` and
``slot_rate``, arrays of ``probe_bytes``), printed side by side. docs/sim.md ("Fidelity and
limits") quotes it. GB/s = 1e9 B/s.
Usage: PYTHONPATH=$PWD python benchmarks/staged_reduce_probe.py
"""

from __future__ import annotations

import argparse

from ahcomm._calibrate import local_rates, slot_rate


def main() -> None:
    argparse.ArgumentParser(description=__doc__.split("\n")[0]).parse_args()
    gamma, copy, _ = local_rates()

    def rate(seconds_per_byte: float) -> str:
        return f"{1 / seconds_per_byte / 1e9:.2f} GB/s"

    print(f"reduce, three arrays from memory:   {rate(gamma)}")
    print(f"reduce in place with a fresh slot:  {rate(slot_rate(reduce=True))}")
    print(f"copy, from memory:                  {rate(copy)}")
    print(f"copy out of a fresh slot:           {rate(slot_rate(reduce=False))}")


if __name__ == "__main__":
    main()
