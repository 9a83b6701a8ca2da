"""Prompt construction is token-exact and matches the chat template's rendering."""

import pytest

from factories import TEMPLATES, with_template
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


@pytest.mark.parametrize("name", sorted(TEMPLATES))
def test_a_turn_closed_by_a_later_listed_eos_is_closed_once(tok, name):
    # Llama 3 lists <|end_of_text|> before <|eot_id|>, Gemma <eos> before <end_of_turn>: the template's
    # close is not eos_ids[0], and a reply that stopped on it must not get a second one
    t = with_template(tok, name)
    fmt = ChatFormat(t, [0, 2])
    assert fmt.close_id == 2
    p1 = fmt.first_prompt("What is 2 + 3?")
    ctx = p1 + fmt.encode("It is 6.") + [2]
    cont, cut = fmt.continue_with_user(ctx, ["Feedback: ", fmt.encode("recheck"), " please"])
    rendered = t.apply_chat_template(
        [{"role": "user", "content": "What is 2 + 3?"}, {"role": "assistant", "content": "It is 6."},
         {"role": "user", "content": "Feedback: recheck please"}], add_generation_prompt=True, tokenize=False,
        date_string="26 Jul 2024")
    assert t.decode(ctx + cont) == rendered
    assert (ctx + cont).count(2) == rendered.count("<|im_end|>")  # one close per turn
    # a reply that stopped on the other eos keeps it, and the template's close follows
    other = p1 + fmt.encode("It is 6.") + [0]
    cont, _ = fmt.continue_with_user(other, ["next"])
    assert cont[0] == 2


@pytest.mark.parametrize("name", ["refuses_system", "drops_system"])
def test_system_text_opens_the_user_message_where_the_template_has_no_system_turn(tok, name):
    t = with_template(tok, name)
    fmt = ChatFormat(t, [2])
    assert not fmt.system_role
    folded = t.apply_chat_template([{"role": "user", "content": "Be brief.\n\nWhat is 2 + 3?"}],
                                   add_generation_prompt=True, tokenize=False)
    assert t.decode(fmt.first_prompt("What is 2 + 3?", system="Be brief.")) == folded
    ids, cut = fmt.user_prompt_with_ids("Be brief.", ["What is ", [17, 18], " + 3?"])
    assert ids[cut[0]:cut[1]] == [17, 18]
    assert t.decode(ids) == t.apply_chat_template(
        [{"role": "user", "content": "Be brief.\n\nWhat is " + t.decode([17, 18]) + " + 3?"}],
        add_generation_prompt=True, tokenize=False)


def test_the_system_turn_is_kept_where_the_template_has_one(tok):
    fmt = ChatFormat(tok, [tok.eos_token_id])
    assert fmt.system_role
    assert "<|im_start|>system\nBe brief.<|im_end|>" in tok.decode(fmt.first_prompt("Q", system="Be brief."))


def test_a_dated_template_renders_the_same_prompt_on_any_day(tok):
    fmt = ChatFormat(with_template(tok, "dated"), [2])
    text = fmt.tok.decode(fmt.first_prompt("Q"))
    assert "Today Date: 26 Jul 2024" in text
    assert fmt.user_prompt_with_ids(None, ["Q"])[0] == fmt.first_prompt("Q")


def test_template_variables_reach_every_rendering(tok):
    """model.chat_template_kwargs: turn 1, the writer's prompt and every later turn open the same way."""
    t = with_template(tok, "thinks")
    plain, off = ChatFormat(t, [2]), ChatFormat(t, [2], {"enable_thinking": False})
    empty = "<|im_start|>model\n<think>\n\n</think>\n\n"
    assert not t.decode(plain.first_prompt("Q")).endswith(empty)
    p1 = off.first_prompt("Q")
    cont, _ = off.continue_with_user(p1 + off.encode("A") + [2], ["next"])
    # (the refine's context keeps turn 1's empty block where it was: ids are appended, never re-rendered,
    # although this template, like Qwen3's, would leave it out of a past turn)
    for ids in (p1, p1 + cont, off.user_prompt_with_ids("sys", ["Q"])[0]):
        assert t.decode(ids).endswith(empty)


def test_chatml_for_a_base_model_closes_each_turn_with_its_eos(tok):
    """model.chat_template=chatml: turns end with the tokenizer's own eos (here <|endoftext|>, id 0), so
    a reply that stopped on it has closed its turn and the refine's context reads as the template renders."""
    import copy

    from tosca_mlmt.errors import ModelError
    from tosca_mlmt.prompts import use_chat_template

    t = copy.deepcopy(tok)
    t.chat_template, t.eos_token = None, "<|endoftext|>"
    with pytest.raises(ModelError, match="model.solver 'base' has no chat template.*model.chat_template"):
        use_chat_template(t, "", "model.solver 'base'")
    use_chat_template(t, "chatml", "model.solver 'base'")
    fmt = ChatFormat(t, [0])
    assert fmt.close_id == 0
    p1 = fmt.first_prompt("What is 2 + 3?")
    ctx = p1 + fmt.encode("It is 5.") + [0]
    cont, _ = fmt.continue_with_user(ctx, ["Check it."])
    assert t.decode(ctx + cont) == t.apply_chat_template(
        [{"role": "user", "content": "What is 2 + 3?"}, {"role": "assistant", "content": "It is 5."},
         {"role": "user", "content": "Check it."}], add_generation_prompt=True, tokenize=False)
    assert (ctx + cont).count(0) == 3  # one per turn: the reply's own eos closed it


def _sentencepiece_tokenizer(scheme: str):
    """A Metaspace (SentencePiece-style) BPE as Mistral's: every encoded text starts at a word boundary "▁"."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tk = Tokenizer(models.BPE(unk_token="<unk>", byte_fallback=True))
    tk.pre_tokenizer = pre_tokenizers.Metaspace(replacement="\u2581", prepend_scheme=scheme)
    tk.decoder = decoders.Metaspace(replacement="\u2581", prepend_scheme=scheme)
    text = ["What is 12 and 30? The answer is: 42. Check your calculation carefully.",
            "You are a concise tutor. [INST] Read the student's attempt [/INST] and write short feedback."] * 50
    tk.train_from_iterator(text, trainers.BpeTrainer(vocab_size=400, special_tokens=["<unk>", "<s>", "</s>"],
                                                     initial_alphabet=list("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789 .,:?[]/\n'\u2581")))
    tok = PreTrainedTokenizerFast(tokenizer_object=tk, bos_token="<s>", eos_token="</s>", unk_token="<unk>")
    tok.chat_template = ("{{ bos_token }}{% for m in messages %}{% if m['role'] == 'user' %}{{ '[INST] ' + m['content'] + "
                         "' [/INST]' }}{% else %}{{ m['content'] + eos_token }}{% endif %}{% endfor %}")
    return tok


def test_sentencepiece_pieces_get_no_boundary_space(tok):
    """Mistral's tokenizer starts every encoded text with "▁": encoded piece by piece, the refine's context
    read "</s> [INST]  Feedback:  recheck" (a space at every seam). Now it is the template's rendering; a
    byte-level tokenizer (SmolLM2's) encodes as it always did."""
    t = _sentencepiece_tokenizer("first")
    fmt = ChatFormat(t, [t.eos_token_id])
    p1 = fmt.first_prompt("What is 12 and 30?")
    reply = fmt.encode("It is 42.") + [t.eos_token_id]
    assert not t.convert_ids_to_tokens(reply)[0].startswith("\u2581")
    cont, cut = fmt.continue_with_user(p1 + reply, ["Feedback: ", fmt.encode("recheck"), " please"])
    assert t.decode(p1 + reply + cont) == t.apply_chat_template(
        [{"role": "user", "content": "What is 12 and 30?"}, {"role": "assistant", "content": "It is 42."},
         {"role": "user", "content": "Feedback: recheck please"}], add_generation_prompt=True, tokenize=False)
    assert cont[cut[0]:cut[1]] == fmt.encode("recheck")
    plain = ChatFormat(tok, [tok.eos_token_id])
    assert plain.encode("\n\nThe problem again") == list(tok.encode("\n\nThe problem again", add_special_tokens=False))


def test_strategy_index_tokens_are_single_pieces_on_a_sentencepiece_tokenizer(tok):
    """upper.q_source=logits reads the LM head's rows of "1".."K": a SentencePiece tokenizer encodes a lone
    "1" as "▁" "1", so the digit is taken as it appears inside a text, as on a byte-level tokenizer."""
    from tosca_mlmt.upper.critic import strategy_token_ids

    t = _sentencepiece_tokenizer("first")
    ids = strategy_token_ids(t, 6)
    assert [t.convert_ids_to_tokens(i) for i in ids] == [str(k) for k in range(1, 7)]
    assert strategy_token_ids(tok, 6) == [tok.encode(str(k), add_special_tokens=False)[0] for k in range(1, 7)]
