"""The model card's Evaluation and Prompt format sections, from the metadata (``tosca_mlmt.json``).

Held-out evals (``held_out_evals``, added by ``mlmt export``) are the model's numbers; what a stage
recorded while training (``eval``: a sampled training batch, an off-policy estimate) is labelled as
that and never shown as the model's accuracy. The prompt format (``prompt_format``) is rendered by
pipelines/model_card.py from the code that builds training's prompts; this module only lays it out.
"""

from __future__ import annotations

TURN_LABEL = {"t1": "Acc@t1 (first answer, before any feedback)", "final": "Acc@final (after {rounds})"}
ROLE_NUMBERS = {"solver": "training-batch", "writer": "training-time estimate"}


def _rounds(n) -> str:
    return "the feedback rounds" if not isinstance(n, int) else f"{n} feedback round{'s' if n != 1 else ''}"


def _iv(d: dict) -> str:
    return f"[{d['lo']:.3f}, {d['hi']:.3f}]"


def evaluation_lines(meta: dict, merged: bool) -> list[str]:
    role = meta.get("role", "solver")
    held, train = meta.get("held_out_evals") or [], meta.get("eval") or {}
    lines = ["## Evaluation", ""]
    for rec in held:
        lines += held_out_lines(rec, role, meta.get("evals_given", True)) + [""]
    label = ROLE_NUMBERS.get(role, "training-time")
    source = meta.get("eval_source") or "the training run"
    how = "was given to `mlmt export` or found beside the run" if merged else "is recorded with this folder"
    if train and held:
        lines += [f"For reference only, not held-out: the {label} numbers recorded while training, from {source}.", ""]
    elif train:
        lines += [f"**No held-out eval of these weights {how}.** The only numbers recorded are {label} numbers, from "
                  f"{source}. They are not this model's accuracy.", ""]
    if train:
        lines += [f"| metric ({label}, not held-out) | value |", "|---|---|"]
        lines += [f"| {k} | {_fmt(v)} |" for k, v in train.items()] + [""]
    if not held:
        lines += [("Measure that" if train else "No evaluation is recorded with this folder; measure one")
                  + " with `mlmt eval --run RUN --out EVAL` (greedy, on held-out problems); "
                  "`mlmt export --run RUN --eval EVAL` then reports it in the exported model's card.", ""]
    return lines


def held_out_lines(rec: dict, role: str, given: bool) -> list[str]:
    task = f"`{rec.get('task')}`" + (f" (level {rec['level']})" if rec.get("level") is not None else "")
    temps = rec.get("temperature") or {}
    if temps and all(t == 0 for t in temps.values()):
        decoding = "greedy decoding (temperature 0)"
    else:
        decoding = "decoding at temperature " + ", ".join(f"{r} {t}" for r, t in temps.items())
    how = "given to `mlmt export --eval`" if given else "found beside the run"
    lines = [f"### Held-out eval `{rec['name']}`", "",
             f"`mlmt eval`, {how}, on task {task}, split `{rec.get('split')}`: {rec['problems']} problems, "
             f"{decoding}, {_rounds(rec.get('rounds'))}, strategies chosen by `{rec.get('strategy_selection')}`.", ""]
    fp = (rec.get("models") or {}).get(role) or {}
    if rec.get("matches") is True:
        lines.append(f"It ran exactly the exported weights: its snapshot fingerprints the {role} adapter "
                     f"`{fp.get('adapter_sha')}` on base weights `{fp.get('base_sha')}`, as exported.")
    elif rec.get("matches") is False:
        lines.append(f"**This eval ran other weights than the exported ones** ({'; '.join(rec['differences'])}): "
                     "its numbers are not this model's.")
    else:
        lines.append("Its snapshot does not fingerprint the weights it ran: it could not be checked against this model.")
    partner = rec.get("partner") or {}
    if partner.get("adapter_sha"):
        whose = f" (this run's `{partner['role']}/`)" if partner.get("this_run") else ""
        what = "the feedback came from" if role == "solver" else "the answers came from"
        lines.append(f"In it, {what} the {partner['role']} adapter `{partner['adapter_sha']}`{whose}.")
    if str(rec.get("environment", "honest")).startswith("privileged"):  # honest:tool is honest
        lines.append(f"**Environment {rec['environment']}**: privileged, a sanity check, not a result.")
    lines += ["", "| turn | accuracy | 95 % interval (Wilson) | problems |", "|---|---|---|---|"]
    for k in ("t1", "final"):
        a = rec[f"acc_{k}"]
        name = TURN_LABEL[k].format(rounds=_rounds(rec.get("rounds")))
        lines.append(f"| {name} | {a['mean']:.3f} ({a['correct']}/{rec['problems']}) | {_iv(a)} | {rec['problems']} |")
    c = rec.get("compared_to") or {}
    if all(f"{w}_acc_{k}" in c for w in ("before", "after") for k in ("t1", "final")):
        d, m = c.get("final_difference") or {}, c.get("final_mcnemar") or {}
        lines += ["", f"Before/after (`mlmt eval --compare-to`): against the eval `{c.get('eval')}` on the same "
                      f"{c.get('problems')} problems, Acc@t1 {c['before_acc_t1']['mean']:.3f} -> "
                      f"{c['after_acc_t1']['mean']:.3f}, Acc@final {c['before_acc_final']['mean']:.3f} "
                      f"{_iv(c['before_acc_final'])} -> {c['after_acc_final']['mean']:.3f} {_iv(c['after_acc_final'])}; "
                      f"Acc@final after - before {d.get('mean', 0):+.3f} [{d.get('lo', 0):+.3f}, {d.get('hi', 0):+.3f}] "
                      f"(paired bootstrap), McNemar p = {m.get('p', float('nan')):.3g} ({m.get('a_only')} fixed, "
                      f"{m.get('b_only')} lost)."]
    return lines


def _fmt(v) -> str:
    return f"{v:.4g}" if isinstance(v, float) else str(v)


# ---------------------------------------------------------------------- prompt format


def prompt_lines(pf: dict) -> list[str]:
    """The Prompt format section of a merged model's card, and a runnable transformers snippet."""
    role, turns = pf["role"], {t["name"]: t for t in pf["turns"]}
    kwargs = ", ".join(f"{k}={v!r}" for k, v in pf["template_kwargs"].items())
    lines = ["## Prompt format", "",
             f"The {role} was trained on task `{pf['task']}` with the prompts below, which tosca-mlmt builds in "
             "`tosca_mlmt/prompts.py` and renders with this folder's chat template: "
             f"`tokenizer.apply_chat_template(messages, add_generation_prompt=True{', ' + kwargs if kwargs else ''})`."]
    if not pf.get("config_known"):
        lines.append(f"The config it trained with is not beside the adapter, so the prompts are shown for the default "
                     f"config's task (`{pf['task']}`): its turn-1 message may not be the one this model learned.")
    lines.append("")
    if role == "solver":
        lines += _solver_text(turns)
    else:
        lines += _writer_text(turns["feedback"])
    if pf.get("notes"):
        lines += ["What else shaped the prompts in training:", ""] + [f"- {n}" for n in pf["notes"]] + [""]
    example = "the first held-out problem" if pf.get("example_is_real") else "a stand-in problem"
    lines += [f"The exact prompt text for {example}, as training's token ids decode (placeholders in square "
              "brackets stand for the model's and the writer's text):", ""]
    for t in pf["turns"]:
        checks = ("tokenizing it gives the very ids training built" if t["same_ids"] else
                  "**tokenizing it gives other ids than training's at a join of two pieces**, which training "
                  "encodes one by one")
        checks += ("; the chat template over the messages renders this same text" if t["chat_template_matches"] else
                   "; **the chat template over the plain messages renders another text**: feed this text instead")
        lines += [f"`{t['name']}` ({checks}):", "", "```text", t["text"], "```", ""]
    lines += ["### Run it with transformers", ""] + snippet(pf, turns)
    return lines


def _solver_text(turns: dict) -> list[str]:
    solve, refine = turns["solve"], turns["refine"]
    how = (", `{question}` being the problem's text:" if solve["user"] else
           ": the task builds it from more than the question (example below).")
    out = ["**Turn 1 (solve)**: one user message" + how, ""]
    if solve["user"]:
        out += ["```text", solve["user"], "```", ""]
    out += ["**Refine**: the conversation goes on with the model's answer as the assistant message, then this user "
            "message with the feedback:", "", "```text", refine["user"], "```", ""]
    return out


def _writer_text(t: dict) -> list[str]:
    where = ("the start of the user message (the chat template has no system turn), then two newlines"
             if t["system_in_user"] else "a system message")
    out = [f"**Feedback**: the system text in {where}:", "", "```text", t["system"], "```", "",
           "then one user message, `{attempt}` being the solver's answer and `{instruction}` the chosen strategy's:",
           "", "```text", t["user"], "```", "", "Strategies (the Q head, `q_head.safetensors`, chooses one under "
           "tosca-mlmt; with transformers alone, pick one):", ""]
    return out + [f"- `{s['name']}`: {s['instruction']}" for s in t["strategies"]] + [""]


def snippet(pf: dict, turns: dict) -> list[str]:
    head = ["```python", "from transformers import AutoModelForCausalLM, AutoTokenizer", "",
            'model = AutoModelForCausalLM.from_pretrained("THIS_FOLDER")',
            'tokenizer = AutoTokenizer.from_pretrained("THIS_FOLDER")',
            f"TEMPLATE_VARS = {pf['template_kwargs']!r}  # what training rendered the chat template with",
            "MAX_NEW_TOKENS = 256"]
    reply = ["", "", "def reply(messages):",
             '    enc = tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt",',
             "                                        return_dict=True, **TEMPLATE_VARS)",
             "    out = model.generate(**enc, max_new_tokens=MAX_NEW_TOKENS, do_sample=False)  # greedy, as mlmt eval",
             '    return tokenizer.decode(out[0, enc["input_ids"].shape[1]:], skip_special_tokens=True)', "", ""]
    question = repr(pf["example_question"])
    if pf["role"] == "solver":
        solve, refine = turns["solve"], turns["refine"]
        first = (f'SOLVE.replace("{{question}}", question)' if solve["user"] else repr(solve["messages"][0]["content"]))
        consts = [f"SOLVE = {solve['user']!r}" if solve["user"] else "# this task's turn-1 message is built from more "
                  "than the question: the example problem's is used below", f"REFINE = {refine['user']!r}"]
        body = [f"question = {question}",
                f'messages = [{{"role": "user", "content": {first}}}]',
                "answer = reply(messages)",
                "feedback = \"Check each step of your working.\"  # the writer's, a person's or a checker's",
                'messages += [{"role": "assistant", "content": answer},',
                '             {"role": "user", "content": REFINE.replace("{feedback}", feedback).replace("{question}", '
                'question)}]',
                "print(reply(messages))"]
    else:
        t = turns["feedback"]
        consts = [f"SYSTEM = {t['system']!r}", f"FEEDBACK = {t['user']!r}",
                  f"STRATEGIES = {({s['name']: s['instruction'] for s in t['strategies']})!r}"]
        user = ('FEEDBACK.replace("{question}", question).replace("{attempt}", attempt)'
                '.replace("{instruction}", STRATEGIES[strategy])')
        msgs = (f'[{{"role": "user", "content": SYSTEM + "\\n\\n" + {user}}}]' if t["system_in_user"] else
                f'[{{"role": "system", "content": SYSTEM}}, {{"role": "user", "content": {user}}}]')
        body = [f"question = {question}", "attempt = \"The answer is: 7\"  # the solver's answer",
                f"strategy = {t['strategies'][0]['name']!r}", f"messages = {msgs}", "print(reply(messages))"]
    return head + consts + reply + body + ["```", ""]
