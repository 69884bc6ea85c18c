"""A service settles its heap once it is up (plumbing.process.settle_heap): what it allocated while starting
leaves the cyclic collector's sight, young collections become rarer, and the collector still frees cycles made
afterwards. Run in a fresh interpreter: gc's state is process-wide."""
from __future__ import annotations

import subprocess
import sys
import textwrap

SCRIPT = textwrap.dedent("""
    import gc, weakref
    from plumbing.process import GEN0_THRESHOLD, settle_heap

    class Node:
        pass

    started = [Node() for _ in range(1000)]  # what start-up allocated, kept for the process's life
    before = gc.get_freeze_count()
    settle_heap()
    print(gc.get_freeze_count() - before >= 1000, gc.get_threshold()[0] == GEN0_THRESHOLD)
    cycle = Node()
    cycle.self = cycle
    alive = weakref.ref(cycle)
    del cycle
    gc.collect()
    print(alive() is None)
""")


def test_settle_heap_freezes_what_start_up_made_and_still_collects_later_cycles():
    out = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, check=True).stdout.split()
    assert out == ["True", "True", "True"]
