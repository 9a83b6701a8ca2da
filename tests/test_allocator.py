"""engine.mmap_threshold_kb: the fixed glibc mmap threshold that keeps freed activations off the heap.

Each check runs in a fresh interpreter: the threshold is process-wide and the test process's
own heap history must not decide the outcome.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

from tosca_mlmt import runtime
from tosca_mlmt.config import load_config
from tosca_mlmt.errors import ConfigError

pytestmark = pytest.mark.skipif(runtime._glibc() is None or not hasattr(runtime._glibc(), "mallinfo2"),
                                reason="glibc's mallopt, and mallinfo2 (glibc >= 2.33) to observe it")

# After freeing a 16 MiB mapping glibc's adaptive threshold rises to 16 MiB, so a later 1 MiB block comes
# from the heap (no new mapping); with the threshold fixed it gets a mapping of its own, which free()
# unmaps. mallinfo2().hblks counts the live mappings.
PROBE = textwrap.dedent("""
    import ctypes, sys
    from tosca_mlmt import runtime

    class MallInfo2(ctypes.Structure):
        _fields_ = [(n, ctypes.c_size_t) for n in ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks",
                                                   "fsmblks", "uordblks", "fordblks", "keepcost")]

    libc = ctypes.CDLL("libc.so.6")
    libc.mallinfo2.restype = MallInfo2
    libc.malloc.restype = ctypes.c_void_p
    libc.free.argtypes = [ctypes.c_void_p]
    applied = runtime.configure_allocator(int(sys.argv[1]))
    libc.free(libc.malloc(16 << 20))  # raises glibc's adaptive threshold to 16 MiB
    before = libc.mallinfo2().hblks
    p = libc.malloc(1 << 20)
    during = libc.mallinfo2().hblks
    libc.free(p)
    print(applied, during - before, libc.mallinfo2().hblks - before)
""")


def _probe(threshold_kb: int) -> list[str]:
    out = subprocess.run([sys.executable, "-c", PROBE, str(threshold_kb)], capture_output=True, text=True,
                         timeout=120, check=True)
    return out.stdout.split()


def test_fixed_threshold_maps_a_block_the_adaptive_one_keeps_in_the_heap():
    applied, mapped, left = _probe(64)
    assert applied == "True"
    assert mapped == "1"  # its own mapping ...
    assert left == "0"  # ... given back on free
    applied, mapped, _ = _probe(0)
    assert applied == "False"
    assert mapped == "0"  # the adaptive threshold (16 MiB by then) served it from the heap


def test_setup_applies_the_configured_threshold(monkeypatch):
    seen = []
    monkeypatch.setattr(runtime, "configure_allocator", lambda kb: seen.append(kb) or True)
    runtime.setup(load_config(None, {"engine.mmap_threshold_kb": 256}))
    assert seen == [256]


@pytest.mark.parametrize("value", [-1, 32769])
def test_threshold_outside_glibcs_range_names_the_field(value):
    with pytest.raises(ConfigError, match="engine.mmap_threshold_kb"):
        load_config(None, {"engine.mmap_threshold_kb": value})
