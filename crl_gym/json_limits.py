"""How deep and how large a JSON document is, read from its raw bytes before anything parses it.

The stdlib parser recurses once per nesting level, so ``[[[[…`` a hundred thousand deep raises
``RecursionError`` (and costs a deep C stack) before any model sees the body; and a body of a
million tiny items costs far more memory once parsed than its bytes. :func:`json_shape` measures
both in a bounded number of vectorised passes over the bytes (numpy), linear in the body's length
and without building any object, so a server can refuse such a body first. Brackets and commas
inside strings do not count: a string starts and ends at a quote not escaped by an odd run of
backslashes.

>>> json_shape(b'{"a": [1, 2, {"b": "[[[,"}]}')
(3, 5)
>>> json_shape(b'[[[[')  # unterminated: still measured
(4, 4)
"""

from __future__ import annotations

import numpy as np

_QUOTE, _BACKSLASH, _COMMA = ord('"'), ord("\\"), ord(",")
_OPEN, _CLOSE = (ord("["), ord("{")), (ord("]"), ord("}"))


def quick_bound(body: bytes) -> tuple[int, int]:
    """Upper bounds of :func:`json_shape` from two byte counts (C speed): every opener may nest,
    and every comma or opener may be an item. When both are within limits no scan is needed."""
    openers = body.count(b"[") + body.count(b"{")
    return openers, openers + body.count(b",")


def json_shape(body: bytes) -> tuple[int, int]:
    """``(depth, items)`` of the JSON text ``body``: the deepest nesting of arrays and objects, and
    the containers plus the commas between values, both counted outside strings. Not a validator:
    malformed text is measured as far as its brackets go (the parser refuses it afterwards)."""
    a = np.frombuffer(body, dtype=np.uint8)
    if a.size == 0:
        return 0, 0
    quotes = np.flatnonzero(a == _QUOTE)
    outside = np.ones(a.size, dtype=bool)
    if quotes.size:
        # length of the backslash run just before each quote: odd means the quote is escaped
        positions = np.arange(a.size, dtype=np.int64)
        last_other = np.maximum.accumulate(np.where(a == _BACKSLASH, -1, positions))
        before = quotes - 1
        run = np.where(before >= 0, before - last_other[np.maximum(before, 0)], 0)
        real = quotes[run % 2 == 0]
        toggles = np.zeros(a.size, dtype=np.int8)
        toggles[real] = 1
        outside = (np.cumsum(toggles, dtype=np.int32) & 1) == 0
    opens = ((a == _OPEN[0]) | (a == _OPEN[1])) & outside
    closes = ((a == _CLOSE[0]) | (a == _CLOSE[1])) & outside
    level = np.cumsum(opens.astype(np.int32) - closes.astype(np.int32), dtype=np.int32)
    depth = int(level.max(initial=0))
    items = int(np.count_nonzero(opens)) + int(np.count_nonzero((a == _COMMA) & outside))
    return depth, items
