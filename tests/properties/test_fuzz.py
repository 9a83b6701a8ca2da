"""Property-based fuzzing of every user-controlled input this package parses: config
overrides, --set strings, YAML files, the data loaders and answer extraction.

The property is the same everywhere: an input ends in a value or in the project's own
error (an MlmtError, which the CLI prints as one ``error:`` line with exit 2), never in
another exception and never in a hang (each example has a deadline). Runs are
derandomized, so a failure reproduces; the whole module takes well under a minute.
"""

from __future__ import annotations

import atexit
import json
import shutil
import tempfile
from datetime import timedelta
from pathlib import Path

import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tosca_mlmt.config import Config, describe_fields, load_config, parse_override
from tosca_mlmt.errors import ConfigError, DataError, MlmtError

FUZZ = settings(max_examples=300, deadline=timedelta(seconds=10), derandomize=True, database=None,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])

# Characters of every category, lone surrogates included (argv bytes that are not UTF-8 and
# JSON's \udXXX escapes both produce them).
ANY_TEXT = st.text(st.one_of(st.characters(codec=None, exclude_categories=()), st.characters(categories=["Cs"])),
                   max_size=30)
FIELDS = [name for name, *_ in describe_fields()]
SECTIONS = sorted({f.rsplit(".", 1)[0] for f in FIELDS if "." in f})

SCALARS = st.one_of(
    st.none(), st.booleans(), st.integers(), st.integers(-(2**80), 2**80), st.floats(), ANY_TEXT,
    st.sampled_from(["nan", "inf", "-1", "0", "1e-4", "true", "", " ", "[", "{a: 1}", "hf", "vllm", "all-linear",
                     "\x00", "9" * 5000, "a" * 5000, "configs", "/dev/zero", "configs/deepspeed/zero2.json"]),
)
VALUES = st.recursive(SCALARS, lambda kids: st.lists(kids, max_size=4) | st.dictionaries(ANY_TEXT, kids, max_size=4),
                      max_leaves=12)
NAMES = st.one_of(st.sampled_from(FIELDS), st.sampled_from(SECTIONS), ANY_TEXT,
                  st.sampled_from(FIELDS).map(lambda f: f + ".x"))

_TMP = Path(tempfile.mkdtemp(prefix="tosca-fuzz-"))
atexit.register(shutil.rmtree, _TMP, True)


def _config_or_error(**kw) -> Config | None:
    try:
        cfg = load_config(**kw)
    except ConfigError:
        return None
    # What loads must also print (mlmt config) and reload to itself (run folders keep config.yaml).
    path = _TMP / "roundtrip.yaml"
    path.write_text(yaml.safe_dump(cfg.to_dict(), sort_keys=False))
    assert load_config(path).to_dict() == cfg.to_dict()
    return cfg


# ---------------------------------------------------------------- config


@FUZZ
@given(st.dictionaries(NAMES, VALUES, max_size=4))
def test_overrides_end_in_a_config_or_a_config_error(overrides):
    _config_or_error(overrides=overrides)


@FUZZ
@given(st.one_of(ANY_TEXT, st.builds("{}={}".format, st.sampled_from(FIELDS), ANY_TEXT),
                 st.builds("{}={}".format, st.sampled_from(FIELDS), VALUES.map(lambda v: yaml.safe_dump(v)))))
def test_set_strings_end_in_a_config_or_a_config_error(text):
    try:
        overrides = dict([parse_override(text)])
    except ConfigError:
        return
    _config_or_error(overrides=overrides)


def _nested(overrides: dict) -> dict:
    tree: dict = {}
    for dotted, value in overrides.items():
        node = tree
        *head, last = dotted.split(".")
        for k in head:
            node = node.setdefault(k, {}) if isinstance(node.get(k, {}), dict) else {}
        node[last] = value
    return tree


YAML_TEXTS = st.one_of(
    ANY_TEXT,
    st.binary(max_size=200),
    # plausible configs, then damaged at a random point
    st.builds(lambda tree, cut, junk: (lambda t: t[:cut] + junk + t[cut:])(yaml.safe_dump(tree)),
              st.dictionaries(st.sampled_from(FIELDS), VALUES, max_size=4).map(_nested),
              st.integers(0, 200), st.sampled_from(["", "*a", "&a ", "\n  x: [", "\t", ": :", "{", "include: x\n",
                                                    "\nseed: 1\nseed: 2\n", "!!python/object:os.system\n"])),
    st.builds(lambda inc: yaml.safe_dump({"include": inc, "seed": 1}), VALUES),
)


@FUZZ
@given(YAML_TEXTS)
def test_yaml_files_end_in_a_config_or_a_config_error(text):
    path = _TMP / "fuzz.yaml"
    if isinstance(text, bytes):
        path.write_bytes(text)
    else:
        path.write_bytes(text.encode("utf-8", "surrogatepass"))
    _config_or_error(path=path)


# ---------------------------------------------------------------- data loaders


def _row_texts(kind: str):
    good = {
        "gsm8k": st.builds(lambda q, n: {"question": q, "answer": f"steps\n#### {n}"}, ANY_TEXT, st.integers()),
        "math500": st.builds(lambda q, a: {"question": q, "answer": f"so \\boxed{{{a}}}"}, ANY_TEXT, ANY_TEXT),
        "mbpp": st.builds(lambda i, t, c, tests: {"task_id": i, "text": t, "code": c, "test_list": tests},
                          st.integers(0, 1000), ANY_TEXT, ANY_TEXT, st.lists(ANY_TEXT, max_size=3)),
        "jsonl": st.builds(lambda q, a, extra: {"question": q, "answer": a, "extra": extra}, ANY_TEXT,
                           st.one_of(ANY_TEXT, st.integers()), VALUES),
    }[kind]
    return st.one_of(
        good.map(lambda r: json.dumps(r).encode()),
        good.map(lambda r: json.dumps(r, ensure_ascii=False).encode("utf-8", "surrogatepass")),
        st.dictionaries(st.sampled_from(["question", "answer", "task_id", "text", "code", "test_list",
                                         "test_setup_code"]), VALUES, max_size=6)
        .map(lambda r: json.dumps(r, default=str).encode()),
        st.binary(max_size=60),
        ANY_TEXT.map(lambda t: t.encode("utf-8", "surrogatepass")),
        st.integers(1, 5000).map(lambda n: b"[" * n + b"]" * n),
        st.integers(4000, 6000).map(lambda n: b'{"task_id": ' + b"9" * n + b"}"),
    )


def _load(kind: str, lines: list[bytes], split: str, skip: bool):
    from tosca_mlmt.tasks.math_tasks import GSM8KTask, Math500Task
    from tosca_mlmt.tasks.generic import JsonlTask
    from tosca_mlmt.tasks.mbpp import MBPPTask

    root = Path(tempfile.mkdtemp(dir=_TMP))
    file = {"gsm8k": f"gsm8k/{split}.jsonl", "math500": "math500/test.jsonl", "mbpp": "mbpp/mbpp.jsonl",
            "jsonl": "mine.jsonl"}[kind]
    (root / file).parent.mkdir(parents=True, exist_ok=True)
    (root / file).write_bytes(b"\n".join(lines))
    task = (JsonlTask(str(root / file)) if kind == "jsonl" else
            {"gsm8k": GSM8KTask, "math500": Math500Task, "mbpp": MBPPTask}[kind](str(root)))
    try:
        res = task.load(split, None, skip)
    except MlmtError as e:
        # Under --skip-bad-rows a bad row is never an error; only "nothing left" is.
        assert not skip or (isinstance(e, DataError) and "no problems" in str(e)), e
        return
    assert res.problems, "an empty result must be an error, not a 0-episode run"
    for p in res.problems:
        (p.question + p.answer).encode("utf-8")  # nothing the tokenizer cannot encode gets through
        task.instruction(p)
        p.meta_json()  # snapshots store it
    assert len({p.id for p in res.problems}) == len(res.problems)


@FUZZ
@given(st.sampled_from(["gsm8k", "math500", "mbpp", "jsonl"]).flatmap(
    lambda kind: st.tuples(st.just(kind), st.lists(_row_texts(kind), max_size=6))),
    st.sampled_from(["train", "test"]), st.booleans())
def test_data_loaders_end_in_problems_or_a_data_error(kind_lines, split, skip):
    kind, lines = kind_lines
    _load(kind, lines, split, skip)


@FUZZ
@given(st.integers(-2, 7), st.integers(0, 40), st.sampled_from(["train", "test", "validation"]))
def test_arith_loader_ends_in_problems_or_a_config_error(level, limit, split):
    from tosca_mlmt.tasks.arith import ArithTask

    try:
        res = ArithTask(level).load(split, limit or None)
    except ConfigError:
        return
    assert res.problems and len({p.id for p in res.problems}) == len(res.problems)


# ---------------------------------------------------------------- answer extraction

FRAGMENTS = ["\\boxed{", "\\boxed ", "\\fbox{", "{", "}", "\\{", "\\", "$", ".", "The answer is: ", "the answer is",
             "####", "\\text{", "\\textbf{", "\\frac{1}{2}", "\\dfrac", "1,234", "-", "/", " ", "\n", "3.5", "%",
             " dollars", "\\%", "\\left(", "\\right)", "^\\circ", "x", "2i", "\\sqrt{", "9" * 400, "1e400", "nan"]
ANSWERS = st.one_of(
    ANY_TEXT,
    st.lists(st.sampled_from(FRAGMENTS), max_size=30).map("".join),
    st.integers(-(10**500), 10**500).map(str),
    st.floats().map(repr),
    st.builds(lambda n, k: "\\boxed{" * n + "5" + "}" * k, st.integers(0, 3000), st.integers(0, 3000)),
    st.builds(lambda n: "The answer is " + ".$" * n, st.integers(0, 20000)),
    st.builds(lambda n: "\\text{" * n + "5" + "}" * n, st.integers(0, 3000)),
)


@FUZZ
@given(ANSWERS)
def test_answer_extraction_returns_a_value_or_none(text):
    from tosca_mlmt.tasks.mathverify import _to_float, extract_answer, extract_gold, last_boxed, normalize_string

    for out in (extract_answer(text), last_boxed(text)):
        assert out is None or isinstance(out, str)
    assert isinstance(normalize_string(text), str)
    assert _to_float(text) is None or isinstance(_to_float(text), float)
    try:
        assert extract_gold(text)
    except ValueError as e:  # documented: no final answer in a gold field (the loaders make it a DataError)
        assert "no final answer" in str(e)


SHORT = st.one_of(st.text(max_size=12), st.lists(st.sampled_from(FRAGMENTS[:-3]), max_size=6).map("".join),
                  st.integers(-(10**30), 10**30).map(str))


@settings(FUZZ, max_examples=40, deadline=timedelta(seconds=30))
@given(SHORT, SHORT)
def test_equivalence_and_verify_never_raise(pred, gold):
    from tosca_mlmt.tasks.arith import ArithTask
    from tosca_mlmt.tasks.base import Problem
    from tosca_mlmt.tasks.mathverify import match_method

    assert match_method(pred, gold) in (None, "string", "numeric", "math_verify")
    v = ArithTask(1).verify(Problem("arith", "arith-x", "q", gold or "0", "train"), pred)
    assert v.reward in (0.0, 1.0)
