"""Prompt phrases for the class folders of a set the catalog does not know: the folder-name rule
(rsclip_ds.evaluation.datasets.class_name_from_folder), checked word by word against a vocabulary
(every word of the catalog's phrases plus rsclip_ds/evaluation/sets/words.txt), and a warning when a
folder name is not made of known words. A run-together name made of known words ("oiltank",
"denseresidential") is split into them, and that is said too: a split is a guess to check."""

from __future__ import annotations

import re
from importlib import resources

from rsclip_ds.evaluation.datasets import class_name_from_folder

MIN_PIECE = 2   # a split never makes a one-letter word ("parkinglot" must not become "p ark in g lot")


def shipped_words() -> set[str]:
    text = (resources.files("rsclip_ds") / "evaluation" / "sets" / "words.txt").read_text()
    return {w.strip().lower() for w in text.splitlines() if w.strip() and not w.startswith("#")}


def vocabulary(phrases: list[str]) -> frozenset[str]:
    """The words of ``phrases`` plus the shipped word list."""
    words = shipped_words()
    for phrase in phrases:
        words.update(re.findall(r"[a-z]+", phrase.lower()))
    return frozenset(words)


def _known(token: str, vocab: frozenset[str]) -> bool:
    if token.isdigit() or token in vocab:
        return True
    return (token.endswith("s") and token[:-1] in vocab) or (token.endswith("es") and token[:-2] in vocab)


def word_break(token: str, vocab: frozenset[str]) -> list[str] | None:
    """``token`` as the fewest known words (each >= MIN_PIECE letters), or None."""
    best: list[list[str] | None] = [[]] + [None] * len(token)   # best[i]: split of token[:i]
    for end in range(1, len(token) + 1):
        for start in range(max(0, end - 24), end - MIN_PIECE + 1):
            head, piece = best[start], token[start:end]
            if head is not None and _known(piece, vocab):
                if best[end] is None or len(head) + 1 < len(best[end]):
                    best[end] = head + [piece]
    found = best[len(token)]
    return found if found and len(found) > 1 else None


def phrase_for_folder(set_name: str, folder: str, vocab: frozenset[str]) -> tuple[str, str | None]:
    """(prompt phrase, warning or None) for a class folder of an unknown set."""
    words, split, unknown = [], [], []
    for token in class_name_from_folder(folder).split():
        if _known(token, vocab):
            words.append(token)
        elif (pieces := word_break(token, vocab)) is not None:
            words += pieces
            split.append(f"'{token}' -> '{' '.join(pieces)}'")
        else:
            words.append(token)
            unknown.append(f"'{token}'")
    phrase = " ".join(words)
    fix = (f'; name the class in an overrides JSON {{"{set_name}": {{"{folder}": "<phrase>"}}}} '
           f"if the prompt is wrong")
    if unknown:
        verb = "is not a known word" if len(unknown) == 1 else "are not known words"
        return phrase, f"{set_name}/{folder}: {', '.join(unknown)} {verb}, so the class is prompted as '{phrase}'{fix}"
    if split:
        return phrase, (f"{set_name}/{folder}: run-together words split ({', '.join(split)}), prompted as "
                        f"'{phrase}'{fix}")
    return phrase, None
