"""The Porter (1980) stemmer, as Lucene's PorterStemFilter applies it (the original WebShop's search
index used Lucene's English analyzer). Written from the published algorithm, including the two
changes of Porter's own reference implementation that Lucene follows: step 2 maps "bli" -> "ble"
(instead of "abli" -> "able") and "logi" -> "log". Words of one or two letters are left alone.
"""
from __future__ import annotations

from functools import lru_cache


def _cv(w: str) -> str:
    """"c" or "v" per letter: a, e, i, o, u are vowels, and y after a consonant."""
    out = ""
    for i, c in enumerate(w):
        out += "v" if c in "aeiou" or (c == "y" and i > 0 and out[-1] == "c") else "c"
    return out


def _measure(stem: str) -> int:
    """m in [C](VC){m}[V]."""
    return _cv(stem).count("vc")


def _has_vowel(stem: str) -> bool:
    return "v" in _cv(stem)


def _double_consonant(w: str) -> bool:
    return len(w) >= 2 and w[-1] == w[-2] and _cv(w)[-1] == "c"


def _cvc(w: str) -> bool:
    """consonant-vowel-consonant ending, the last consonant not w, x or y."""
    return _cv(w).endswith("cvc") and w[-1] not in "wxy"


# Sorted longest suffix first: the longest matching suffix decides.
_STEP2 = sorted([("ational", "ate"), ("tional", "tion"), ("enci", "ence"), ("anci", "ance"), ("izer", "ize"),
                 ("bli", "ble"), ("alli", "al"), ("entli", "ent"), ("eli", "e"), ("ousli", "ous"),
                 ("ization", "ize"), ("ation", "ate"), ("ator", "ate"), ("alism", "al"), ("iveness", "ive"),
                 ("fulness", "ful"), ("ousness", "ous"), ("aliti", "al"), ("iviti", "ive"), ("biliti", "ble"),
                 ("logi", "log")], key=lambda r: -len(r[0]))
_STEP3 = sorted([("icate", "ic"), ("ative", ""), ("alize", "al"), ("iciti", "ic"), ("ical", "ic"), ("ful", ""),
                 ("ness", "")], key=lambda r: -len(r[0]))
_STEP4 = sorted(["al", "ance", "ence", "er", "ic", "able", "ible", "ant", "ement", "ment", "ent", "ion", "ou",
                 "ism", "ate", "iti", "ous", "ive", "ize"], key=len, reverse=True)


@lru_cache(maxsize=200_000)
def stem(word: str) -> str:
    w = word
    if len(w) <= 2:
        return w
    # Step 1a
    if w.endswith(("sses", "ies")):
        w = w[:-2]
    elif w.endswith("s") and not w.endswith("ss"):
        w = w[:-1]
    # Step 1b
    second_third = False
    if w.endswith("eed"):
        if _measure(w[:-3]) > 0:
            w = w[:-1]
    elif w.endswith("ed") and _has_vowel(w[:-2]):
        w, second_third = w[:-2], True
    elif w.endswith("ing") and _has_vowel(w[:-3]):
        w, second_third = w[:-3], True
    if second_third:
        if w.endswith(("at", "bl", "iz")):
            w += "e"
        elif _double_consonant(w) and w[-1] not in "lsz":
            w = w[:-1]
        elif _measure(w) == 1 and _cvc(w):
            w += "e"
    # Step 1c
    if w.endswith("y") and _has_vowel(w[:-1]):
        w = w[:-1] + "i"
    # Step 2 and 3 (m > 0 to replace)
    for rules in (_STEP2, _STEP3):
        for suffix, repl in rules:
            if w.endswith(suffix):
                if _measure(w[: len(w) - len(suffix)]) > 0:
                    w = w[: len(w) - len(suffix)] + repl
                break
    # Step 4 (m > 1)
    for suffix in _STEP4:
        if w.endswith(suffix):
            stem_ = w[: len(w) - len(suffix)]
            if _measure(stem_) > 1 and (suffix != "ion" or stem_.endswith(("s", "t"))):
                w = stem_
            break
    # Step 5a
    if w.endswith("e"):
        stem_ = w[:-1]
        m = _measure(stem_)
        if m > 1 or (m == 1 and not _cvc(stem_)):
            w = stem_
    # Step 5b
    if _measure(w) > 1 and _double_consonant(w) and w.endswith("l"):
        w = w[:-1]
    return w
