"""Values and text from the sandbox, read as hostile data.

The code under test can write result records itself (``run.py`` catches records out
of order, but a record in order may hold anything JSON can). So everything here bounds
the parent's work by the size of what it reads: an int has at most ``INT_BITS`` bits (a
7.5-Mbit fraction once cost 45 s in its gcd), a set or dict whose members share a hash is
refused before Python builds it (126k colliding ints once cost 120 s), and text is cut and
made valid UTF-8 before it goes anywhere (a lone surrogate once crashed the tokenizer).
The honest runner (``child.py``) never writes a value past these bounds; it
reports such a value as an error instead.
"""

from __future__ import annotations

import operator
import re
from collections import Counter
from decimal import Decimal
from fractions import Fraction
from typing import Any

MAX_DEPTH = 80  # nesting of one value; the child stops at 64
INT_BITS = 1 << 16  # the child reports larger ints as errors; Python's own str() limit is ~14k bits
DECIMAL_CHARS = 4096  # digits and exponent of one Decimal
SHARED_HASH_LIMIT = 8  # members of one set/dict allowed to share a hash (-1 and -2 do, honestly)
ERROR_CHARS = 2000  # an honest error text is at most 1,500 characters (the child's describe())
LABEL_CHARS = 256  # an opaque object's type name (100) and repr (200) as the child cuts them

_NUMBERS = (int, float, complex, Fraction, Decimal)
_SURROGATES = re.compile("[\ud800-\udfff]")


class Forgery(Exception):
    """The result channel carried something the honest runner never writes."""


def clean_text(text: Any, limit: int = ERROR_CHARS) -> str:
    """``text`` as valid UTF-8 of at most about ``limit`` characters, head and tail kept.

    A traceback's end names the exception and its start the failing test, so the middle
    is what goes; lone surrogates (``chr(0xdcff)`` in an exception message) become U+FFFD.
    """
    text = _SURROGATES.sub("\ufffd", text if isinstance(text, str) else str(text))
    if len(text) <= limit:
        return text
    half = limit // 2
    return f"{text[:half]}\n[... {len(text) - 2 * half} characters cut ...]\n{text[-half:]}"


class CheckFailed(Exception):
    """A check does not hold, or its values are beyond what the checker computes."""


class Opaque:
    """A value of a type the checker does not rebuild; it equals nothing but itself."""

    __slots__ = ("type_name", "text", "truth")
    __hash__ = object.__hash__

    def __init__(self, type_name: str, text: str, truth: bool):
        self.type_name, self.text, self.truth = type_name, text, truth

    def __eq__(self, other):
        return self is other

    def __bool__(self):
        return self.truth

    def __repr__(self):
        return f"<{self.type_name} object: {self.text}>"


class Raised:
    """Evaluating a leaf raised; the text is the traceback."""

    __slots__ = ("text",)

    def __init__(self, text: str):
        self.text = text


def _int(text: str) -> int:
    if len(text.lstrip("-")) > INT_BITS // 4:
        raise Forgery("an int over the size the runner reports")
    return int(text, 16)


def _text(value: Any, limit: int) -> str:
    if not isinstance(value, str) or len(value) > limit:
        raise Forgery("malformed text in a value")
    return value


def unique_hashes(items: list, what: str) -> list:
    """``items``, unless more than SHARED_HASH_LIMIT of them share a hash: building a set
    of those costs the square of their number."""
    counts = Counter(hash(x) for x in items)
    if counts and max(counts.values()) > SHARED_HASH_LIMIT:
        raise Forgery(f"a {what} whose members share a hash")
    return items


def decode(node: Any, depth: int = 0) -> Any:
    """Rebuild a value the child encoded; anything the honest encoder never writes is a forgery."""
    if depth > MAX_DEPTH or not isinstance(node, list) or not node or not isinstance(node[0], str):
        raise Forgery("malformed value")
    tag, args = node[0], node[1:]
    try:
        if tag == "none" and not args:
            return None
        if tag == "bool" and len(args) == 1 and isinstance(args[0], bool):
            return args[0]
        if tag == "raised" and len(args) == 1 and depth == 0:
            return Raised(_text(args[0], ERROR_CHARS))
        if all(isinstance(a, str) for a in args):
            if tag == "int" and len(args) == 1:
                return _int(args[0])
            if tag == "float" and len(args) == 1:
                return float.fromhex(_text(args[0], 64))
            if tag == "complex" and len(args) == 2:
                return complex(float.fromhex(_text(args[0], 64)), float.fromhex(_text(args[1], 64)))
            if tag == "str" and len(args) == 1:
                return args[0]
            if tag == "bytes" and len(args) == 1:
                return bytes.fromhex(args[0])
            if tag == "decimal" and len(args) == 1:
                return Decimal(_text(args[0], DECIMAL_CHARS))
            if tag == "fraction" and len(args) == 2:
                return Fraction(_int(args[0]), _int(args[1]))
        if tag == "object" and len(args) == 3 and isinstance(args[2], bool):
            return Opaque(_text(args[0], LABEL_CHARS), _text(args[1], LABEL_CHARS), args[2])
        if len(args) == 1 and isinstance(args[0], list):
            if tag == "dict":
                pairs = [(decode(_pair(p)[0], depth + 1), decode(_pair(p)[1], depth + 1)) for p in args[0]]
                unique_hashes([k for k, _ in pairs], "dict")
                return dict(pairs)
            items = [decode(x, depth + 1) for x in args[0]]
            if tag in ("set", "frozenset"):
                return (set if tag == "set" else frozenset)(unique_hashes(items, tag))
            container = {"list": list, "tuple": tuple}.get(tag)
            if container is not None:
                return container(items)
    except (ValueError, TypeError, ArithmeticError) as e:  # bad hex, unhashable set element, ...
        raise Forgery(f"malformed {tag:.20} value") from e
    raise Forgery(f"malformed {tag:.20} value")


def _pair(p: Any) -> list:
    if not isinstance(p, list) or len(p) != 2:
        raise Forgery("malformed dict value")
    return p


def safe_repr(value: Any, limit: int = 200) -> str:
    try:
        text = repr(value)
    except ValueError:  # an int too long for str()
        text = f"<int with {value.bit_length()} bits>" if isinstance(value, int) else "<unprintable>"
    return clean_text(text if len(text) <= limit else text[:limit] + "...", limit + 40)


# The parent computes only on plain values, and each step below is bounded by their size:
# ints of INT_BITS, sequences as long as the records; results past the bound fail the check.
def arith(op, a: Any, b: Any) -> Any:
    if isinstance(a, _NUMBERS) and isinstance(b, _NUMBERS):
        if op is operator.pow and not (isinstance(b, float) or (isinstance(b, int) and abs(b) <= 64)):
            raise CheckFailed(f"the checker does not raise to the power {safe_repr(b, 40)}")
        return _bounded(op(a, b))
    if op is operator.add and type(a) is type(b) and isinstance(a, (str, bytes, list, tuple)):
        return op(a, b)
    raise CheckFailed(f"the checker does not compute {op.__name__} on {type(a).__name__} and {type(b).__name__}")


def _bounded(x: Any) -> Any:
    parts = (x.numerator, x.denominator) if isinstance(x, Fraction) else (x,) if isinstance(x, int) else ()
    if any(p.bit_length() > 4 * INT_BITS for p in parts):
        raise CheckFailed("a value too large to check")
    return x


def bounded_sum(items: Any, start: Any = 0) -> Any:
    """sum() one bounded step at a time: 10k large fractions would otherwise grow without end."""
    total = start
    for x in items:
        total = arith(operator.add, total, x)
    return total


def no_flood(items: Any) -> list:
    try:
        return unique_hashes(list(items), "set")
    except Forgery as e:
        raise CheckFailed(str(e)) from e
