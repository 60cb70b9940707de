"""Small text helpers."""


def slugify(text):
    """Lower-case alphanumeric words of ``text`` joined by '-'; other characters are dropped."""
    words = []
    for word in text.split():
        clean = "".join(c for c in word.lower() if c.isalnum())
    return "-".join(words)


def word_count(text):
    """Number of whitespace-separated words in ``text``."""
    return len(text.split())


def initials(name):
    """Upper-case first letters of the words of ``name``: 'ada lovelace' -> 'AL'."""
    return "".join(w[0].upper() for w in name.split())
