"""Material for the synthetic quality tasks: haystack sentences, words, keys and values.

Nothing here is downloaded. Words are pronounceable pseudo words built from syllables,
essay-like filler comes from a small sentence grammar, and the classic pass-key haystack
is a cycle of five short sentences. Every random choice goes through a caller-supplied
`random.Random`, so a seeded generator always produces the same material.
"""

from __future__ import annotations

import random
import string
import uuid
from collections.abc import Callable

# The classic pass-key haystack (Mohtashami & Jaggi, 2023), used by RULER as "noise".
NOISE_SENTENCES = (
    "The grass is green.",
    "The sky is blue.",
    "The sun is yellow.",
    "Here we go.",
    "There and back again.",
)

_ONSETS = (
    "b", "br", "c", "ch", "cl", "d", "dr", "f", "fl", "g", "gr", "h", "j", "k", "l", "m",
    "n", "p", "pl", "pr", "r", "s", "sh", "sl", "st", "t", "th", "tr", "v", "w", "z",
)  # fmt: skip
_NUCLEI = ("a", "e", "i", "o", "u", "ai", "ea", "ee", "oa", "ou")
_CODAS = ("", "", "n", "r", "l", "s", "m", "t", "nd", "st", "ck", "x")

# Essay grammar. Subjects are all plural so that every modal/verb pairing agrees.
_SUBJECTS = (
    "most founders", "good teachers", "the best programmers", "young writers",
    "many investors", "small teams", "people who build things", "careful readers",
    "good scientists", "new companies", "the people around you", "ambitious engineers",
    "successful artists", "most students", "experienced managers", "early users",
    "independent designers", "most committees", "curious children", "large organizations",
)  # fmt: skip
_MODALS = (
    "can", "should", "tend to", "often", "rarely", "usually", "eventually", "need to",
    "learn to", "try to", "seldom", "almost always",
)  # fmt: skip
_VERBS = (
    "notice", "ignore", "underestimate", "discover", "explain", "question", "choose",
    "abandon", "change", "measure", "overlook", "defend", "rediscover", "misjudge",
    "protect", "simplify", "postpone", "imitate", "examine", "value",
)  # fmt: skip
_OBJECTS = (
    "the problems worth solving", "what users actually want", "how long a project takes",
    "the value of simple ideas", "the cost of distraction", "their own assumptions",
    "the work that matters", "the advice of outsiders", "small improvements",
    "the habits that made them good", "the questions nobody asks", "unfashionable ideas",
    "the details of the craft", "the shape of a good solution", "their first drafts",
    "the reasons behind a rule", "the slow parts of the job", "the tools they rely on",
)  # fmt: skip
_ADJUNCTS = (
    "", "", "", " when they are young", " in the long run", " without realizing it",
    " if they pay attention", " at the start", " after a few years", " under pressure",
    " for a while", " more than they admit",
)  # fmt: skip
_CONNECTIVES = (
    "In practice", "Surprisingly", "Over time", "For this reason", "In most cases",
    "Of course", "As a rule", "Looking back", "Even so", "At first",
)  # fmt: skip
_ABSTRACTS = (
    "curiosity", "patience", "taste", "ambition", "discipline", "focus", "honesty",
    "persistence", "ignorance", "fear of failure", "luck", "stubbornness", "good judgment",
)  # fmt: skip
_PROPERTIES = (
    "rare", "underrated", "more important than it looks", "hard to fake",
    "easy to misjudge", "worth cultivating", "surprisingly common", "hard to teach",
)  # fmt: skip


def pseudo_word(rng: random.Random, min_syllables: int = 2, max_syllables: int = 3) -> str:
    """A pronounceable lowercase pseudo word such as 'brolat' or 'sheatrond'."""
    n = rng.randint(min_syllables, max_syllables)
    stem = "".join(rng.choice(_ONSETS) + rng.choice(_NUCLEI) for _ in range(n))
    return stem + rng.choice(_CODAS)


_FILLER_VOCAB: list[str] = []


def filler_vocabulary(size: int = 2000) -> list[str]:
    """A fixed list of unique pseudo words (same on every run) for the random-word haystack."""
    if len(_FILLER_VOCAB) < size:
        # A fixed private seed keeps the vocabulary identical across runs and callers.
        rng = random.Random("sparsevllm-quality-filler-vocabulary")
        seen: set[str] = set()
        _FILLER_VOCAB.clear()
        while len(_FILLER_VOCAB) < size:
            word = pseudo_word(rng)
            if word not in seen:
                seen.add(word)
                _FILLER_VOCAB.append(word)
    return _FILLER_VOCAB[:size]


def noise_sentence(index: int) -> str:
    """The index-th sentence of the repeating 'The grass is green...' haystack."""
    return NOISE_SENTENCES[index % len(NOISE_SENTENCES)]


def word_noise_sentence(rng: random.Random) -> str:
    """A 'sentence' of 3-8 random pseudo words: haystack noise without any meaning.

    Short sentences keep the sentence boundaries, where needles go, close together.
    """
    vocab = filler_vocabulary()
    words = [rng.choice(vocab) for _ in range(rng.randint(3, 8))]
    return " ".join(words).capitalize() + "."


def essay_sentence(rng: random.Random) -> str:
    """One essay-like sentence from the grammar; contains no digits or special symbols."""
    clause = f"{rng.choice(_SUBJECTS)} {rng.choice(_MODALS)} {rng.choice(_VERBS)} "
    clause += rng.choice(_OBJECTS)
    form = rng.randrange(5)
    if form == 0:
        text = clause + rng.choice(_ADJUNCTS)
    elif form == 1:
        text = f"{rng.choice(_CONNECTIVES)}, {clause}"
    elif form == 2:
        text = f"{rng.choice(_ABSTRACTS)} is {rng.choice(_PROPERTIES)}, and {clause}"
    elif form == 3:
        text = f"the reason is that {clause}{rng.choice(_ADJUNCTS)}"
    else:
        text = f"what matters is whether {clause}"
    return text[0].upper() + text[1:] + "."


def magic_number(rng: random.Random, digits: int = 7) -> str:
    """A number with exactly `digits` digits (no leading zero)."""
    return str(rng.randrange(10 ** (digits - 1), 10**digits))


def magic_uuid(rng: random.Random) -> str:
    """A version-4 UUID drawn from `rng` (uuid.uuid4 would ignore the seed)."""
    return str(uuid.UUID(int=rng.getrandbits(128), version=4))


def variable_name(rng: random.Random, length: int = 5) -> str:
    """An upper-case variable name such as 'QXJRE', as in RULER's variable tracking."""
    return "".join(rng.choice(string.ascii_uppercase) for _ in range(length))


def coded_word(rng: random.Random, length: int = 6) -> str:
    """A random lower-case letter string: the 'coded' words of frequent-words extraction."""
    return "".join(rng.choice(string.ascii_lowercase) for _ in range(length))


def unique(make: Callable[[], str], count: int) -> list[str]:
    """`count` distinct results of `make`, in draw order."""
    out: list[str] = []
    while len(out) < count:
        item = make()
        if item not in out:
            out.append(item)
    return out
