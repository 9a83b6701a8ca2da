"""Token-exact prompt construction for the three turns.

Every prompt after turn 1 is built by *appending ids* to ids that already exist
(the turn-1 prompt, the sampled response, the sampled feedback), never by decoding
and re-encoding a transcript. Only the fixed template text around them is encoded.
The template pieces come from rendering the model's own chat template with
placeholders, so any template that renders a user/assistant/user conversation works, not
just SmolLM2's: one without a system turn (Gemma) gets the system text at the start of the
user message, and a turn is closed by the template's own close token, whichever place the
model's eos list gives it (Llama 3, Gemma, Phi-3 list another eos first).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from jinja2.exceptions import TemplateError

from tosca_mlmt.errors import ModelError

_A, _B = "\u2063ATTEMPT\u2063", "\u2063USER\u2063"
_S = "\u2063SYSTEM\u2063"
# Passed to every rendering. Llama 3.2's template stamps today's date (strftime_now) into its system
# block unless date_string is given, so a prompt, and with it a collect snapshot, would change with
# the calendar; this is Llama 3.1's own fixed default. Templates that do not read it ignore it.
TEMPLATE_VARS = {"date_string": "26 Jul 2024"}
# model.chat_template=chatml, for a base model without a template of its own: each turn ends with the
# model's eos token, so a reply that stopped on it has closed its turn (ChatFormat.close_id)
CHATML = ("{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\n' + m['content'] + eos_token + '\n' }}"
          "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")

WRITER_SYSTEM = (
    "You are a concise tutor. You read a student's attempt at a problem and write short, "
    "specific feedback. Never state the final answer yourself."
)
WRITER_STATE = "Problem:\n{question}\n\n"
WRITER_STRATEGY = (
    "Feedback strategy: {instruction}\n"
    "Write one to three sentences of feedback for the student following this strategy."
)
REFINE_USER_PREFIX = "A reviewer left this feedback on your answer:\n"
# The refine restates the question (a 135M solver loses it behind its own attempt and the feedback)
# and says what to do with a right answer: without that, "solve again" reads as "change it".
REFINE_USER_SUFFIX = ("\n\nThe problem again: {question}\n"
                      "If your answer was right, give the same answer again; if it was wrong, solve the problem "
                      "again. {answer_format}")


def boundary_anchor(tok) -> list[int]:
    """For a SentencePiece tokenizer (Llama 2, Mistral), which starts every text it encodes with its
    word-boundary marker "▁" (inside a prompt, a space that is not there): the ids of a newline, after
    which :func:`encode_piece` encodes a text and which it then drops. Empty for any other tokenizer."""
    first = tok.convert_ids_to_tokens(tok.encode("a", add_special_tokens=False)[:1])
    return list(tok.encode("\n", add_special_tokens=False)) if first and str(first[0]).startswith("\u2581") else []


def encode_piece(tok, text: str, anchor: list[int]) -> list[int]:
    """``text``'s ids as a piece inside a sequence (``anchor``: :func:`boundary_anchor` of ``tok``)."""
    if anchor:
        ids = list(tok.encode("\n" + text, add_special_tokens=False))
        if ids[:len(anchor)] == anchor:
            return ids[len(anchor):]
    return list(tok.encode(text, add_special_tokens=False))


def use_chat_template(tok, source: str, what: str) -> None:
    """Give ``tok`` the template of ``model.chat_template`` (``source``: "", "chatml" or a Jinja file),
    or check it has one; ``what`` names the model in the error."""
    if source:
        tok.chat_template = CHATML if source == "chatml" else Path(source).expanduser().read_text()
    elif not tok.chat_template:
        raise ModelError(f"{what} has no chat template (a base model, not an instruct one?): set model.chat_template "
                         "to a Jinja file or to 'chatml'")


@dataclass
class ChatFormat:
    """Pieces of one tokenizer's chat template, rendered once."""

    tok: object
    eos_ids: list[int]
    # model.chat_template_kwargs: variables for every rendering, over TEMPLATE_VARS
    template_kwargs: dict = field(default_factory=dict)

    def __post_init__(self):
        self._anchor = boundary_anchor(self.tok)
        msgs = [{"role": "user", "content": "q"}, {"role": "assistant", "content": _A},
                {"role": "user", "content": _B}]
        full = self._render(msgs)
        a_end = full.index(_A) + len(_A)
        b_start = full.index(_B)
        self.between = full[a_end:b_start]  # closes the assistant turn, opens a user turn
        self.after_user = full[b_start + len(_B):]  # closes the user turn, opens the assistant turn
        self.eos_texts = {i: self.tok.decode([i]) for i in self.eos_ids}
        # The id the template closes an assistant turn with. Not always eos_ids[0]: Llama 3 lists
        # <|end_of_text|> before the <|eot_id|> its turns end with, Gemma <eos> before <end_of_turn>.
        self.close_id = next((i for i in self.eos_ids if self.eos_texts[i] and self.between.startswith(self.eos_texts[i])),
                             self.eos_ids[0])
        # Gemma's template refuses a system message and others drop it: the system text then opens
        # the user message, as Gemma 3's template does itself.
        try:
            self.system_role = _S in self._render([{"role": "system", "content": _S}, {"role": "user", "content": _B}])
        except TemplateError:  # the template's raise_exception
            self.system_role = False

    def _render(self, msgs: list[dict], tokenize: bool = False):
        return self.tok.apply_chat_template(msgs, add_generation_prompt=True, tokenize=tokenize,
                                            **{**TEMPLATE_VARS, **self.template_kwargs})

    def _messages(self, system: str | None, user: str) -> list[dict]:
        if system and not self.system_role:
            return [{"role": "user", "content": f"{system}\n\n{user}"}]
        return ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": user}]

    def encode(self, text: str) -> list[int]:
        return encode_piece(self.tok, text, self._anchor)

    def first_prompt(self, user: str, system: str | None = None) -> list[int]:
        ids = self._render(self._messages(system, user), tokenize=True)
        if isinstance(ids, dict) or hasattr(ids, "keys"):  # transformers 5 may return a BatchEncoding
            ids = ids["input_ids"]
        return list(ids)

    def strip_eos(self, ids: list[int] | tuple[int, ...]) -> list[int]:
        ids = list(ids)
        return ids[:-1] if ids and ids[-1] in self.eos_ids else ids

    def continue_with_user(self, response_ids: list[int], pieces: list[str | list[int]]) -> tuple[list[int], list[int]]:
        """Ids that follow ``response_ids`` in the context: close that assistant turn, add a
        user turn made of ``pieces`` (text is encoded, id lists are copied), open the next
        assistant turn. When the response stopped on eos, that eos already closes the turn.

        Returns (ids, cut) where ``cut[i]`` is the length of ids after piece i."""
        between = self.between
        # a response that ended on the template's own turn close has closed it (any other eos
        # it stopped on stays, and the template's close follows)
        end = self.eos_texts.get(response_ids[-1]) if response_ids else None
        if end and between.startswith(end):
            between = between[len(end):]
        out = self.encode(between)
        cut = []
        for p in pieces:
            out += self.encode(p) if isinstance(p, str) else list(p)
            cut.append(len(out))
        return out + self.encode(self.after_user), cut

    def user_prompt_with_ids(self, system: str | None, pieces: list[str | list[int]]) -> tuple[list[int], list[int]]:
        """A fresh conversation whose user message mixes text and exact ids.

        Returns (ids, cut) where ``cut[i]`` is the length of ids after piece i, so callers can
        slice states (e.g. the writer's state ends before the strategy text)."""
        head = self._render(self._messages(system, _B))
        before, after = head.split(_B)
        ids = self.encode(before)
        cut = []
        for p in pieces:
            ids += self.encode(p) if isinstance(p, str) else list(p)
            cut.append(len(ids))
        return ids + self.encode(after), cut
