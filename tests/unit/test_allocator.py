"""engine.mmap_threshold_kb: the fixed glibc mmap threshold that keeps freed activations off the heap.

Each check runs in a fresh interpreter: the threshold is process-wide and the test process's
own heap history must not decide the outcome.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

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
    # on glibc's own malloc, whatever this process was preloaded with (make test runs on tcmalloc)
    env = {k: v for k, v in os.environ.items() if k != "LD_PRELOAD"}
    out = subprocess.run([sys.executable, "-c", PROBE, str(threshold_kb)], capture_output=True, text=True,
                         timeout=120, check=True, env=env)
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


# --- engine.allocator: the process's malloc (runtime.use_allocator) ---

AUTO, AUTO_LIB = runtime.wanted_allocator("auto")
needs_preload = pytest.mark.skipif(AUTO == "glibc", reason="neither jemalloc nor tcmalloc is installed (make install "
                                                           "adds both on Debian/Ubuntu as root)")

# Prints the malloc it runs on, then asks for argv[1]'s; where that re-executes, the script runs again
# from the top in the same process, so the output holds one line per run.
REEXEC = textwrap.dedent("""
    import os, sys
    from tosca_mlmt import runtime
    print(runtime.allocator_in_use(), runtime.configure_allocator(64), os.environ.get("MLMT_ALLOCATOR_EXEC"),
          flush=True)
    runtime.use_allocator(sys.argv[1])
    print("done", runtime.allocator_in_use(), os.environ.get("MLMT_ALLOCATOR_EXEC"), flush=True)
""")


def _reexec(choice: str, preload: str = "") -> list[str]:
    env = {k: v for k, v in os.environ.items() if k not in ("LD_PRELOAD", "MLMT_ALLOCATOR_EXEC")}
    if preload:
        env["LD_PRELOAD"] = preload
    out = subprocess.run([sys.executable, "-c", REEXEC, choice], capture_output=True, text=True, timeout=120,
                         check=True, env=env)
    return out.stdout.splitlines()


@needs_preload
def test_auto_restarts_the_process_on_its_malloc_once():
    first, second, last = _reexec("auto")
    # glibc at first, where the mmap threshold applies; after the restart the preloaded one, where it does not
    assert first == "glibc True None"
    assert second == f"{AUTO} False 1"  # the re-executed run, marked
    assert last == f"done {AUTO} None"  # no second restart, and the mark is gone for children


@needs_preload
def test_glibc_takes_a_preloaded_malloc_away_and_a_matching_choice_restarts_nothing():
    assert _reexec("glibc", preload=AUTO_LIB) == [f"{AUTO} False None", "glibc True 1", "done glibc None"]
    assert _reexec(AUTO, preload=AUTO_LIB) == [f"{AUTO} False None", f"done {AUTO} None"]


@pytest.mark.parametrize("choice, both, one_each", [("auto", "tcmalloc", ("tcmalloc", "jemalloc")),
                                                   ("lean", "jemalloc", ("tcmalloc", "jemalloc"))])
def test_auto_and_lean_take_the_first_installed_of_their_order(monkeypatch, choice, both, one_each):
    monkeypatch.setattr(sys, "platform", "linux")
    cases = [(("jemalloc", "tcmalloc"), both), (("tcmalloc",), one_each[0]), (("jemalloc",), one_each[1]), ((), "glibc")]
    for installed, picked in cases:
        monkeypatch.setattr(runtime, "allocator_library", lambda name: f"lib{name}.so" if name in installed else None)
        assert runtime.wanted_allocator(choice) == (picked, f"lib{picked}.so" if installed else None)
    monkeypatch.setattr(sys, "platform", "darwin")
    assert runtime.wanted_allocator(choice) == ("system", None)


def test_the_default_is_auto_and_the_demo_asks_for_lean():
    assert load_config(None, {}).engine.allocator == "auto"
    assert load_config(str(Path(__file__).resolve().parents[2] / "configs/demo.yaml"), {}).engine.allocator == "lean"


def test_a_preload_that_does_not_take_warns_instead_of_looping(monkeypatch):
    monkeypatch.setattr(runtime, "wanted_allocator", lambda choice: ("tcmalloc", "libtcmalloc_minimal.so.4"))
    monkeypatch.setattr(runtime, "allocator_in_use", lambda: "glibc")
    monkeypatch.setenv("MLMT_ALLOCATOR_EXEC", "1")
    monkeypatch.setattr(os, "execve", lambda *a: pytest.fail("re-executed a second time"))
    with pytest.warns(UserWarning, match="still runs on glibc"):
        runtime.use_allocator("tcmalloc")
    assert "MLMT_ALLOCATOR_EXEC" not in os.environ


def test_auto_keeps_a_malloc_preloaded_on_purpose_and_an_explicit_choice_replaces_it(monkeypatch):
    monkeypatch.setattr(runtime, "wanted_allocator", lambda choice: ("jemalloc", "libjemalloc.so.2"))
    monkeypatch.setattr(runtime, "allocator_in_use", lambda: "tcmalloc")
    calls = []
    monkeypatch.setattr(os, "execve", lambda exe, argv, env: calls.append(env["LD_PRELOAD"]))
    monkeypatch.setenv("LD_PRELOAD", "/opt/libtcmalloc_minimal.so.4:/opt/libother.so")
    runtime.use_allocator("auto")
    runtime.use_allocator("lean")
    assert calls == []
    runtime.use_allocator("jemalloc")
    assert calls == ["libjemalloc.so.2:/opt/libother.so"]  # the other malloc out, other preloads kept


def test_preload_env_swaps_only_the_malloc_and_glibc_leaves_no_empty_preload():
    env = {"LD_PRELOAD": "/opt/libjemalloc.so.2:/opt/libother.so", "PATH": "/bin"}
    assert runtime.preload_env("libtcmalloc_minimal.so.4", env)["LD_PRELOAD"] == \
        "libtcmalloc_minimal.so.4:/opt/libother.so"
    assert runtime.preload_env(None, env)["LD_PRELOAD"] == "/opt/libother.so"
    bare = runtime.preload_env(None, {"LD_PRELOAD": "/opt/libtcmalloc.so.4", "PATH": "/bin"})
    assert "LD_PRELOAD" not in bare and bare["PATH"] == "/bin"
    assert env["LD_PRELOAD"] == "/opt/libjemalloc.so.2:/opt/libother.so"  # the caller's mapping untouched
    mine = {"TCMALLOC_LARGE_ALLOC_REPORT_THRESHOLD": "1024"}
    assert runtime.preload_env(None, mine)["TCMALLOC_LARGE_ALLOC_REPORT_THRESHOLD"] == "1024"


def test_an_allocator_that_is_not_installed_names_the_field_and_the_package(monkeypatch):
    monkeypatch.setattr(runtime, "allocator_library", lambda name: None)
    monkeypatch.setattr(sys, "platform", "linux")
    with pytest.raises(ConfigError, match=r"engine.allocator=jemalloc: .*libjemalloc2"):
        runtime.wanted_allocator("jemalloc")
    assert runtime.wanted_allocator("auto") == ("glibc", None)  # auto and lean fall back
    assert runtime.wanted_allocator("lean") == ("glibc", None)


def test_only_the_mlmt_process_itself_restarts(monkeypatch):
    from tosca_mlmt.cli import common

    seen = []
    monkeypatch.setattr(runtime, "use_allocator", seen.append)
    common.command_config(None, {"engine.allocator": "glibc"})
    assert seen == []  # a caller of the app (this test, a notebook) keeps its malloc
    monkeypatch.setattr(common, "STANDALONE", True)
    common.command_config(None, {"engine.allocator": "glibc"})
    assert seen == ["glibc"]
    with pytest.raises(ConfigError, match="engine.allocator"):
        load_config(None, {"engine.allocator": "mimalloc"})
