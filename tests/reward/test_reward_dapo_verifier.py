"""The DAPO rule-based verifier: last 300 characters, last `Answer:` line, Minerva rules."""

import pytest

from dapo_mega.reward import DapoVerifier, build_verifier, extract_answer, normalize_final_answer


@pytest.mark.parametrize("raw, expected", [
    ("46", "46"),
    ("  46 ", "46"),                               # spaces dropped
    ("x = 12", "12"),                              # text after the last "="
    ("\\$1,000 dollars", "1000"),                  # \$, unit word, thousands separator
    ("$\\frac{1}{2}$", "\\frac{1}{2}"),            # inside $...$
    ("\\boxed{\\frac12}", "\\frac{1}{2}"),         # \boxed unwrapped, \fracab repaired
    ("\\sqrt3", "\\sqrt{3}"),                      # \sqrta repaired
    ("90^\\circ", "90"),                           # degrees sign
    ("\\text{(A)}", "(A)"),                        # \text unwrapped
    ("\\textbf{7}", "7"),
    ("\\overline{3}", "3"),
    ("5 cm", "5"),
    ("an apple", "apple"),                         # leading article dropped
    ("1,2", "12"),                                 # all digits after removing commas
    ("1,a", "1,a"),                                # not a number: commas kept
])
def test_minerva_normalisation(raw, expected):
    assert normalize_final_answer(raw) == expected


def test_extracts_the_last_answer_line_case_insensitively():
    assert extract_answer("Answer: 12\nthen more\nANSWER : 46\n") == "46"
    assert extract_answer("answer:46 is it") == "46 is it"
    assert extract_answer("no marker here") is None


def test_only_the_last_300_characters_count():
    # the answer line lies 400+ characters before the end → outside the window → wrong
    verifier = DapoVerifier()
    far = "Answer: 46\n" + "x" * 400
    near = "x" * 400 + "\nAnswer: 46"
    assert verifier.score(far, "46").correct is False
    assert verifier.score(far, "46").extracted is None
    assert verifier.score(near, "46").correct is True


def test_scores_plus_and_minus_one():
    verifier = build_verifier("dapo")
    ok = verifier.score("The sum is 46.\nAnswer: 46", "46")
    assert (ok.correct, ok.reward, ok.extracted, ok.error) == (True, 1.0, "46", None)
    wrong = verifier.score("Answer: 47", "46")
    assert (wrong.correct, wrong.reward, wrong.extracted) == (False, -1.0, "47")
    # the ground truth is normalised too: "1,000" == "1000"; "\boxed{1000}" as well
    assert verifier.score("Answer: \\boxed{1000}", "1,000").correct
    # Minerva compares strings: 0.5 is not \frac{1}{2} for this verifier
    assert not verifier.score("Answer: 0.5", "\\frac{1}{2}").correct


def test_name_and_version_are_stamped():
    verifier = build_verifier("dapo")
    assert verifier.name == "dapo" and isinstance(verifier.version, str) and verifier.version
    assert verifier.runs_in_process and verifier.max_response_chars == 300
    with pytest.raises(ValueError, match="algo.verifier"):
        build_verifier("nope")
