from textkit.strings import initials, slugify, word_count


def test_slugify():
    assert slugify("Hello, World!") == "hello-world"
    assert slugify("  a  -- b ") == "a-b"


def test_word_count():
    assert word_count("one two  three") == 3
    assert word_count("") == 0


def test_initials():
    assert initials("ada lovelace") == "AL"
