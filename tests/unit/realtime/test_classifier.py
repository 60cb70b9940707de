"""The dissatisfied-follow-up classifier: trained on the shipped set, measured on held-out splits."""

from __future__ import annotations

import pytest

from opencomposer.realtime.classifier import (
    FollowupClassifier,
    default_classifier,
    held_out_accuracy,
    load_examples,
)
from opencomposer.realtime.users import (
    DISSATISFIED,
    NEUTRAL_AFTER_FAIL,
    NEUTRAL_AFTER_PASS,
)


def test_shipped_set_is_a_few_hundred_balanced_distinct_examples():
    texts, labels = load_examples()
    assert len(texts) >= 300 and len({t.lower() for t in texts}) == len(texts)
    assert 0.35 < sum(labels) / len(labels) < 0.65


def test_held_out_accuracy_beats_the_majority_class_by_a_wide_margin():
    _, labels = load_examples()
    majority = max(sum(labels), len(labels) - sum(labels)) / len(labels)
    accs = [held_out_accuracy(seed=s)["accuracy"] for s in (0, 1, 2)]
    print(f"held-out accuracy {accs} (majority class {majority:.3f})")
    assert min(accs) > 0.78 and sum(accs) / 3 > majority + 0.25


def test_words_of_errors_and_fixes_do_not_decide_alone():
    clf = default_classifier()
    # hard negatives: mention a failure or a fix but ask for the next thing
    for text in ("now fix the same bug in the writer too", "great, can you add a test for the error case"):
        assert clf.prob(text) < 0.5, text
    for text in ("nope, the error is still there", "you broke the parser, undo it"):
        assert clf.prob(text) > 0.5, text


def test_the_simulated_users_messages_are_read_as_meant():
    """The simulation's templates are not in the training set; the classifier must still read them."""
    clf = default_classifier()
    fmt = {"symbol": "clamp", "file": "textkit/numbers.py"}
    wrong = [t for t in DISSATISFIED if not clf.dissatisfied(t.format(**fmt))]
    wrong += [t for t in NEUTRAL_AFTER_FAIL + NEUTRAL_AFTER_PASS if clf.dissatisfied(t.format(**fmt))]
    assert len(wrong) <= 2, wrong


def test_bad_training_input_is_refused(tmp_path):
    with pytest.raises(ValueError, match="0/1 labels"):
        FollowupClassifier.train(["a", "b"], [0, 2])
    bad = tmp_path / "f.jsonl"
    bad.write_text('{"text": "ok", "dissatisfied": 0}\n{"txt": "oops"}\n')
    with pytest.raises(ValueError, match=r"f.jsonl:2: expected"):
        load_examples(bad)
