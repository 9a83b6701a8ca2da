"""Models and artefacts: hub ids from the local HF cache, self-contained saved adapter folders
(tokenizer, card, portable base reference; loadable after the run folder moves) and
``mlmt export`` (merged model == adapter + base, greedily). All on the random debug base."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from conftest import FP32, random_lora_b, run_mlmt
from tosca_mlmt.errors import ModelError

COMMIT = "0123456789abcdef0123456789abcdef01234567"
DEBUG = {**FP32, "model.solver": "tiny-random", "logging.wandb": False, "logging.progress": False}


def _cfg(**overrides):
    from tosca_mlmt.config import load_config

    return load_config(overrides={**DEBUG, **overrides})


def _pair(**overrides):
    from tosca_mlmt.models.policies import PolicyPair

    return PolicyPair(_cfg(**overrides).model, seed=0)


@pytest.fixture
def hub_cache(tmp_path, monkeypatch) -> Path:
    """An HF cache holding ``acme/tiny`` (the debug base, symlinked in as the hub lays out
    blobs) at COMMIT, with refs/main pointing at it; nothing else is searched."""
    from tosca_mlmt.models.loading import resolve_model

    cache = tmp_path / "hf" / "hub"
    snap = cache / "models--acme--tiny" / "snapshots" / COMMIT
    snap.mkdir(parents=True)
    for f in resolve_model("tiny-random").iterdir():
        (snap / f.name).symlink_to(f)
    (cache / "models--acme--tiny" / "refs").mkdir()
    (cache / "models--acme--tiny" / "refs" / "main").write_text(COMMIT)
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf-home"))
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    return cache


def _text_files(folder: Path) -> dict[str, str]:
    return {p.name: p.read_text() for p in folder.rglob("*") if p.suffix in (".json", ".md", ".jinja", ".txt")}


# ---------------------------------------------------------------------- hub ids


def test_hub_id_resolves_from_the_local_cache_at_any_revision_spelling(hub_cache):
    from tosca_mlmt.models.loading import resolve_model

    snap = hub_cache / "models--acme--tiny" / "snapshots" / COMMIT
    for name in ("acme/tiny", "acme/tiny@main", f"acme/tiny@{COMMIT}", f"acme/tiny@{COMMIT[:7]}"):
        assert resolve_model(name) == snap, name


@pytest.mark.parametrize("name", ["acme/absent", "acme/tiny@v2"])
def test_uncached_hub_id_is_one_clear_line_naming_id_and_folders(hub_cache, tmp_path, name):
    from tosca_mlmt.models.loading import resolve_model

    with pytest.raises(ModelError) as e:
        resolve_model(name)
    msg = str(e.value)
    repo = name.split("@")[0].replace("/", "--")
    assert "\n" not in msg and f"'{name}'" in msg and "nothing is downloaded" in msg
    for root in (hub_cache, tmp_path / "hf-home" / "hub", tmp_path / "xdg" / "huggingface" / "hub"):
        assert str(root / f"models--{repo}") in msg


def test_adapter_on_a_hub_base_records_the_id_and_commit(hub_cache, tmp_path):
    pair = _pair(**{"model.solver": "acme/tiny"})
    folder = pair.save_role("solver", tmp_path / "run" / "solver")
    cfg = json.loads((folder / "adapter_config.json").read_text())
    assert (cfg["base_model_name_or_path"], cfg["revision"]) == ("acme/tiny", COMMIT)
    assert "base_model: acme/tiny" in (folder / "README.md").read_text()
    from tosca_mlmt.models.artefacts import resolve_base

    assert resolve_base(folder) == hub_cache / "models--acme--tiny" / "snapshots" / COMMIT


# ---------------------------------------------------------------------- saved folders


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """A run folder with a perturbed solver and writer saved the way the stages save them."""
    pair = _pair()
    for i, role in enumerate(("solver", "writer")):
        random_lora_b(pair, role, seed=i)
    run = tmp_path_factory.mktemp("trained") / "run"
    cfg = _cfg()
    pair.describe("solver", stage="train-lower", config=cfg, snapshots=["snap-aaaa"], eval={"acc_t1": 0.25},
                  eval_source="a test")
    for role in ("solver", "writer"):
        pair.save_role(role, run / role)
    return pair, run


def test_saved_folders_carry_tokenizer_card_and_no_machine_path(trained):
    from tosca_mlmt.models.loading import cache_root, resolve_model

    pair, run = trained
    for role in ("solver", "writer"):
        folder = run / role
        names = {p.name for p in folder.iterdir()}
        assert {"adapter_model.safetensors", "adapter_config.json", "tokenizer.json", "tokenizer_config.json",
                "README.md", "tosca_mlmt.json"} <= names
        assert json.loads((folder / "adapter_config.json").read_text())["base_model_name_or_path"] == "tiny-random"
        meta = json.loads((folder / "tosca_mlmt.json").read_text())
        assert meta["role"] == role and meta["adapter_sha"] == pair.fingerprint(role)["adapter_sha"]
        card = (folder / "README.md").read_text()
        assert f"# tosca-mlmt {role} LoRA adapter" in card and "More Information Needed" not in card
        for name, text in _text_files(folder).items():
            for path in (str(resolve_model("tiny-random")), str(cache_root()), str(run)):
                assert path not in text, f"{role}/{name} holds the machine path {path}"
    card = (run / "solver" / "README.md").read_text()
    assert all(s in card for s in ("train-lower", "snap-aaaa", "| acc_t1 | 0.25 |", "mlmt export", "config hash"))


def test_saved_folders_load_after_the_run_folder_moves(trained, tmp_path):
    pair, run = trained
    moved = tmp_path / "elsewhere" / "run"
    shutil.copytree(run, moved)
    back = _pair(**{"model.solver_adapter": str(moved / "solver"), "model.writer_adapter": str(moved / "writer")})
    for role in ("solver", "writer"):
        want, got = pair.adapter_state(role), back.adapter_state(role)
        assert want.keys() == got.keys() and all(torch.equal(want[k], got[k]) for k in want), role


def test_loading_an_adapter_on_another_named_base_warns(trained, hub_cache):
    _, run = trained  # trained on tiny-random; acme/tiny has the same architecture, so only a check can tell
    with pytest.warns(UserWarning, match="trained on base 'tiny-random' but is loaded on 'acme/tiny'"):
        _pair(**{"model.solver": "acme/tiny", "model.solver_adapter": str(run / "solver")})


def test_a_local_folder_base_is_recorded_relative_and_survives_moving_both(tmp_path):
    from tosca_mlmt.models.artefacts import resolve_base
    from tosca_mlmt.models.loading import resolve_model

    shutil.copytree(resolve_model("tiny-random"), tmp_path / "a" / "models" / "tiny")
    folder = _pair(**{"model.solver": str(tmp_path / "a" / "models" / "tiny")}).save_role(
        "solver", tmp_path / "a" / "run" / "solver")
    assert json.loads((folder / "adapter_config.json").read_text())["base_model_name_or_path"] == "../../models/tiny"
    shutil.move(tmp_path / "a", tmp_path / "b")
    assert resolve_base(tmp_path / "b" / "run" / "solver").resolve() == (tmp_path / "b" / "models" / "tiny").resolve()


def test_an_adapter_on_other_base_weights_in_the_same_folder_warns_on_load_and_export(tmp_path):
    """A local base is not compared by name, but by the weights fingerprint the folder records:
    a base changed in place (another revision, re-saved) warns, naming both fingerprints."""
    import warnings

    from safetensors.torch import load_file, save_file

    from tosca_mlmt.models.export import export_merged
    from tosca_mlmt.models.loading import resolve_model, stored_weights_sha

    base = tmp_path / "base"
    shutil.copytree(resolve_model("tiny-random"), base)
    pair = _pair(**{"model.solver": str(base)})
    random_lora_b(pair, "solver", 0)
    folder = pair.save_role("solver", tmp_path / "solver")
    recorded = json.loads((folder / "tosca_mlmt.json").read_text())["base_sha"]
    assert recorded == stored_weights_sha(base)
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        _pair(**{"model.solver": str(base), "model.solver_adapter": str(folder)})
    assert not [w for w in seen if "trained on base" in str(w.message)]  # the same weights: no warning
    sd = load_file(base / "model.safetensors")
    name = sorted(sd)[0]
    sd[name] = sd[name] + 1e-3
    save_file(sd, base / "model.safetensors", metadata={"format": "pt"})
    changed = stored_weights_sha(base)
    for load in (lambda: _pair(**{"model.solver": str(base), "model.solver_adapter": str(folder)}),
                 lambda: export_merged(folder, tmp_path / "merged")):
        with pytest.warns(UserWarning, match=f"trained on base weights {recorded}, but .* holds weights {changed}"):
            load()


def test_a_base_without_a_chat_template_fails_at_once_or_takes_the_configured_one(tmp_path):
    from tosca_mlmt.errors import ConfigError
    from tosca_mlmt.models.loading import resolve_model

    base = tmp_path / "base"
    shutil.copytree(resolve_model("tiny-random"), base)
    (base / "chat_template.jinja").unlink(missing_ok=True)
    tc = json.loads((base / "tokenizer_config.json").read_text())
    tc.pop("chat_template", None)
    (base / "tokenizer_config.json").write_text(json.dumps(tc))
    with pytest.raises(ModelError, match=f"model.solver '{base}' has no chat template"):
        _pair(**{"model.solver": str(base)})
    with pytest.raises(ConfigError, match="model.chat_template"):
        _cfg(**{"model.chat_template": str(tmp_path / "missing.jinja")})
    template = tmp_path / "mine.jinja"
    template.write_text("{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}{{ eos_token }}{% endfor %}"
                        "{% if add_generation_prompt %}[assistant] {% endif %}")
    pair = _pair(**{"model.solver": str(base), "model.chat_template": str(template)})
    assert pair.tokenizer("solver").chat_template == template.read_text()
    # the saved folder carries it, so the adapter decodes and renders on its own
    from transformers import AutoTokenizer

    folder = pair.save_role("solver", tmp_path / "solver")
    assert AutoTokenizer.from_pretrained(folder).chat_template == template.read_text()


# ---------------------------------------------------------------------- export


def _greedy(model, tok, prompts: list[str]) -> list[list[int]]:
    out = []
    for p in prompts:
        ids = tok.apply_chat_template([{"role": "user", "content": p}], add_generation_prompt=True, return_tensors="pt",
                                      return_dict=True)["input_ids"]
        with torch.no_grad():
            gen = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=16, do_sample=False,
                                 pad_token_id=tok.pad_token_id)
        out.append(gen[0, ids.shape[1]:].tolist())
    return out


def test_export_gives_a_plain_transformers_model_with_the_adapters_greedy_output(trained, tmp_path):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from tosca_mlmt.models.export import export_merged
    from tosca_mlmt.models.loading import resolve_model

    _, run = trained
    out = tmp_path / "merged"
    meta = export_merged(run / "solver", out)
    assert meta["role"] == "solver" and meta["dtype"] == "float32"
    assert {"model.safetensors", "config.json", "tokenizer.json", "README.md"} <= {p.name for p in out.iterdir()}
    assert not (out / "adapter_config.json").exists()
    assert "library_name: transformers" in (out / "README.md").read_text()
    assert str(resolve_model("tiny-random")) not in "".join(_text_files(out).values())

    merged = AutoModelForCausalLM.from_pretrained(out).eval()
    tok = AutoTokenizer.from_pretrained(out)
    base = AutoModelForCausalLM.from_pretrained(resolve_model("tiny-random"), dtype=torch.float32)
    adapted = PeftModel.from_pretrained(base, run / "solver").eval()
    prompts = ["What is 2 + 3?", "Name a prime number.", "Say hello."]
    want = _greedy(adapted, tok, prompts)
    assert _greedy(merged, tok, prompts) == want
    with adapted.disable_adapter():  # the adapter matters: the merge is not the identity
        assert _greedy(adapted, tok, prompts) != want


def test_export_cli_takes_the_writer_of_a_run_folder_and_refuses_a_wrong_role(trained, tmp_path):
    from tosca_mlmt.models.export import export_merged

    _, run = trained
    p = run_mlmt("export", "--adapter", run, "--role", "writer", "--out", tmp_path / "w")
    assert p.returncode == 0, p.stderr
    assert p.stdout.strip().splitlines()[-1] == str(tmp_path / "w")
    assert (tmp_path / "w" / "strategies.json").exists()
    assert "# tosca-mlmt writer model" in (tmp_path / "w" / "README.md").read_text()
    with pytest.raises(ModelError, match="holds a solver adapter"):
        export_merged(run / "solver", tmp_path / "x", role="writer")
    p = run_mlmt("export", "--adapter", run / "solver", "--out", tmp_path / "w")  # not empty: refused
    assert p.returncode == 2 and "not an empty folder" in p.stderr
    assert "Merge a LoRA adapter" in run_mlmt("export", "--help").stdout
