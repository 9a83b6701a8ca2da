"""Prompt construction is token-exact and matches the chat template's rendering."""

import pytest

from tosca_mlmt.prompts import ChatFormat


@pytest.fixture(scope="module")
def tok():
    from transformers import AutoTokenizer

    from tosca_mlmt.models.loading import resolve_model

    return AutoTokenizer.from_pretrained(resolve_model("smollm2-135m"))


def test_continuation_decodes_to_the_template_rendering(tok):
    fmt = ChatFormat(tok, [tok.eos_token_id])
    p1 = fmt.first_prompt("What is 2 + 3?")
    reply = fmt.encode("It is 6.") + [tok.eos_token_id]
    ctx = p1 + reply
    cont, cut = fmt.continue_with_user(ctx, ["Feedback: ", fmt.encode("recheck"), " please"])
    assert cont[cut[0]:cut[1]] == fmt.encode("recheck")
    rendered = tok.apply_chat_template(
        [{"role": "user", "content": "What is 2 + 3?"}, {"role": "assistant", "content": "It is 6."},
         {"role": "user", "content": "Feedback: recheck please"}], add_generation_prompt=True, tokenize=False)
    assert tok.decode(ctx + cont) == rendered


def test_truncated_reply_gets_its_turn_closed(tok):
    fmt = ChatFormat(tok, [tok.eos_token_id])
    p1 = fmt.first_prompt("Q")
    reply = fmt.encode("half an ans")  # hit max_new_tokens: no eos
    cont, _ = fmt.continue_with_user(p1 + reply, ["next"])
    assert cont[0] == tok.eos_token_id  # the template's turn close is added, not generated
    rendered = tok.apply_chat_template(
        [{"role": "user", "content": "Q"}, {"role": "assistant", "content": "half an ans"},
         {"role": "user", "content": "next"}], add_generation_prompt=True, tokenize=False)
    assert tok.decode(p1 + reply + cont) == rendered


def test_user_prompt_with_ids_keeps_ids_verbatim_and_reports_cuts(tok):
    fmt = ChatFormat(tok, [tok.eos_token_id])
    odd = [1234, 99, 4567]  # any ids, even ones a re-encode would never produce
    ids, cut = fmt.user_prompt_with_ids("sys", ["Problem: x\n", odd, "\nStrategy: y"])
    start = cut[0]
    assert ids[start:cut[1]] == odd
    assert ids[: cut[0]] == fmt.user_prompt_with_ids("sys", ["Problem: x\n"])[0][: cut[0]]
    assert tok.decode(ids).endswith("<|im_start|>assistant\n")
