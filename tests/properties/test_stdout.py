"""stdout carries a command's result and nothing else (`mlmt eval ... | jq` must parse it): library logs,
warnings, C-level writes and child processes' output land on stderr, and only their errors unless
`mlmt --verbose`, which shows them (still on stderr)."""

from __future__ import annotations

import functools
import json
import re
import subprocess
import sys
import textwrap

import pytest

from conftest import FP32, TINY, VLLM_MARKS, run_mlmt

# one record of vLLM's log format: "(MainProcess pid=1) INFO 12-06 14:52:07 [api_utils.py:286] ..."
VLLM_RECORD = re.compile(r"\b(?:DEBUG|INFO|WARNING)\b \d\d-\d\d [\d:]+ \[[\w./-]+:\d+\]")
# what quiet mode keeps off the terminal, from torch (Python and C++), vLLM's imports and DeepSpeed
LIBRARY_NOISE = ("FutureWarning", "Triton not available", "NUMA binding", "[WARNING]", "Loading weights")
DEBUG = ["--set", "model.solver=tiny-random", *TINY]
VLLM = ["--set", "engine.name=vllm", "--set", "engine.vllm.kv_cache_gb=1", "--set", "engine.vllm.max_model_len=1024",
        "--set", "episode.max_prompt_tokens=768"]


def vllm_test(fn):
    return functools.reduce(lambda f, mark: mark(f), VLLM_MARKS, fn)


def _script(body: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", textwrap.dedent(body)], capture_output=True, text=True, timeout=120)


def test_results_alone_reach_stdout_whatever_else_writes_there():
    """Python prints, a log handler bound to stdout before the command started (as vLLM's and DeepSpeed's
    are, at import), raw writes to fd 1 (C++) and a child process: all on stderr; after the command,
    stdout is the process's own again."""
    p = _script("""
        import logging, os, subprocess, sys
        from tosca_mlmt.cli import common

        log = logging.getLogger("lib")
        log.addHandler(logging.StreamHandler(sys.stdout))

        @common.results_on_stdout
        def command():
            print("python print")
            log.warning("library log")
            os.write(1, b"c level\\n")
            subprocess.run(["sh", "-c", "echo child process"], check=True)
            common.print_result("RESULT")

        command()
        print("after the command")
    """)
    assert p.returncode == 0, p.stderr
    assert p.stdout == "RESULT\nafter the command\n"
    for line in ("python print", "library log", "c level", "child process"):
        assert line in p.stderr


def test_a_process_re_executed_inside_a_command_gets_the_real_stdout():
    """command_config may replace the process (runtime.use_allocator): it must start with fd 1 on stdout."""
    p = _script("""
        import os, sys
        from tosca_mlmt.cli import common

        @common.results_on_stdout
        def command():
            os.write(1, b"before exec\\n")
            with common._real_stdout():
                os.execv(sys.executable, [sys.executable, "-c", "print('the new process')"])

        command()
    """)
    assert p.returncode == 0, p.stderr
    assert (p.stdout, p.stderr) == ("the new process\n", "before exec\n")


@pytest.mark.slow
def test_export_prints_only_its_folder(tmp_path):
    from tosca_mlmt.config import load_config
    from tosca_mlmt.models.policies import PolicyPair

    cfg = load_config(overrides={**FP32, "model.solver": "tiny-random"})
    PolicyPair(cfg.model, seed=0).save_role("solver", tmp_path / "solver")
    p = run_mlmt("export", "--adapter", tmp_path / "solver", "--out", tmp_path / "merged", timeout=300)
    assert p.returncode == 0, p.stderr[-3000:]
    assert p.stdout == f"{tmp_path / 'merged'}\n"
    assert not [n for n in LIBRARY_NOISE if n in p.stderr], p.stderr[-3000:]
    assert "export: solver adapter merged" in p.stderr


@vllm_test
def test_eval_on_vllm_prints_only_its_json_line(tmp_path):
    pytest.importorskip("vllm")
    p = run_mlmt("eval", "--out", tmp_path, "--task", "arith", "--limit", "2", "--no-wandb", "--set", "task.level=1",
                 *DEBUG, *VLLM)
    assert p.returncode == 0, p.stderr[-3000:]
    rep = json.loads((tmp_path / "eval.json").read_text())
    assert json.loads(p.stdout) == {k: rep[k] for k in ("snapshot_id", "acc_t1", "acc_final", "delta")}
    # quiet by default: neither vLLM's records nor the other libraries' notices reach the terminal
    assert not VLLM_RECORD.search(p.stderr), p.stderr[-3000:]
    assert not [n for n in LIBRARY_NOISE if n in p.stderr], p.stderr[-3000:]
    assert "eval on arith/test" in p.stderr and "more metrics in" in p.stderr


@vllm_test
def test_verbose_chat_on_vllm_logs_on_stderr_and_keeps_the_transcript_on_stdout(tmp_path):
    pytest.importorskip("vllm")
    p = run_mlmt("--verbose", "chat", "--problem", "3 + 4 = ?", "--answer", "7", *DEBUG, *VLLM,
                 env={"PYTHONIOENCODING": "utf-8"}, cwd=tmp_path, timeout=300)
    assert p.returncode == 0, p.stderr[-3000:]
    assert len(VLLM_RECORD.findall(p.stderr)) >= 5  # --verbose: vLLM's start-up records, on stderr
    assert not VLLM_RECORD.search(p.stdout), p.stdout[-3000:]
    lines = p.stdout.splitlines()
    assert "3 + 4 = ?" in lines[0] and lines[1].startswith("z (solve): wrong")
    assert "g (feedback, round 1," in p.stdout and "ŷ (refine, round 1)" in p.stdout
