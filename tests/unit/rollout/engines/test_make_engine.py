"""make_engine (tosca_mlmt/rollout/engines/__init__.py): which engine a config gets, and the
errors when it cannot have it."""

from __future__ import annotations

import sys
import types

import pytest

from tosca_mlmt.config import load_config
from tosca_mlmt.errors import ConfigError
from tosca_mlmt.rollout.engines import make_engine


def test_a_folder_named_vllm_is_not_taken_for_vllm(monkeypatch, tmp_path):
    # what `import vllm` gives without vLLM installed when a folder of that name is on the path
    # (this test's own folder, tests/unit/rollout/engines/vllm/, is one)
    bare = types.ModuleType("vllm")
    bare.__path__ = [str(tmp_path / "vllm")]
    monkeypatch.setitem(sys.modules, "vllm", bare)
    with pytest.raises(ConfigError, match=r"found only a folder .*vllm"):
        make_engine(load_config(None, {"engine.name": "vllm"}), policies=None)


def test_vllm_missing_names_the_extra(monkeypatch):
    monkeypatch.setitem(sys.modules, "vllm", None)  # import raises ImportError
    with pytest.raises(ConfigError, match=r"needs the vllm extra"):
        make_engine(load_config(None, {"engine.name": "vllm"}), policies=None)
