"""Reply parsing: option letters (strict and FOCI's rule), yes/no, COUNTS boxes and counts, and
reasoning models' <think> blocks taken out first; and every parse mode over the shapes real
replies take (the table the parser audit stands on)."""

import string

import pytest

from ood_jax.eval.parsing import (
    CHOICE_MODES,
    parse_boxes,
    parse_choice,
    parse_choice_or_option,
    parse_count,
    parse_final_yes_no,
    parse_last_choice,
    parse_mapping,
    parse_option_text,
    parse_yes_no,
    read_choice,
    split_think,
)
from ood_jax.eval.tasks import FociScoring

COUNTS_REPLY = (
    "\u2014BEGIN FORMAT TEMPLATE\u2013\nAnswer Choice: [B]\n\u2014END FORMAT TEMPLATE\u2013"
)

# (reply, strict answer, FOCI-rule answer), four options.
CHOICE_CASES = [
    ("B", 1, 1),
    ("b", 1, 1),
    ("b.", 1, 1),
    ("  C  ", 2, 2),
    ("(C) golden retriever", 2, None),
    ("C. golden retriever", 2, 2),
    ("D) tabby", 3, 3),
    ("[A]", 0, None),
    ("**A**", 0, None),
    ("Answer: D", 3, 0),
    ("answer: d.", 3, 0),
    ("Answer Choice: [B]", 1, 0),
    ("The answer is (C).", 2, None),
    ("The answer is C", 2, None),
    ("I pick (B) because of the stripes.", 1, None),
    (COUNTS_REPLY, 1, None),
    # FOCI's pitfall: free text that begins with an option letter.
    ("Bengal", None, 1),
    ("Abyssinian", None, 0),
    ("A golden retriever", None, 0),
    ("Cat", None, 2),
    # Letters beyond the options.
    ("E", None, None),
    ("(F) something", None, None),
    # Two different letters.
    ("(A) or (B)", None, None),
    ("Answer: A\nAnswer: B", None, 0),
    ("B. Actually (C)", None, 1),
    # Nothing to parse.
    ("", None, None),
    ("I don't know.", None, None),
    ("The answer is a dog", None, None),
    ("Answer Choice: [Your Answer Choice Here]", None, 0),
    ("The dog(s) in the image", None, None),
]


@pytest.mark.parametrize("reply, strict, foci", CHOICE_CASES)
def test_parse_choice(reply: str, strict: int | None, foci: int | None) -> None:
    assert parse_choice(reply, 4, mode="strict") == strict
    assert parse_choice(reply, 4, mode="foci") == foci


def test_parse_choice_default_is_strict_and_respects_num_options() -> None:
    assert parse_choice("Bengal", 4) is None
    assert parse_choice("C", 2) is None
    assert parse_choice("C", 2, mode="foci") is None
    assert parse_choice("Z", 26) == 25


def test_parse_choice_rejects_bad_arguments() -> None:
    with pytest.raises(ValueError, match="mode"):
        parse_choice("A", 4, mode="loose")
    with pytest.raises(ValueError, match="num_options"):
        parse_choice("A", 0)


@pytest.mark.parametrize(
    "reply, expected",
    [
        ("Yes", True),
        ("yes.", True),
        ("YES!", True),
        ("Yes, there is a dog.", True),
        ("**Yes**", True),
        ("Answer: yes", True),
        ("No", False),
        ("no.", False),
        ("No, there is no dog.", False),
        ("  nO  ", False),
        ("Answer: No.", False),
        ("Yes or no", None),
        ("yes/no", None),
        ("Yesterday I saw a dog", None),
        ("Nope", None),
        ("The image shows a dog, so yes.", None),
        ("", None),
        ("Maybe", None),
    ],
)
def test_parse_yes_no(reply: str, expected: bool | None) -> None:
    assert parse_yes_no(reply) is expected


@pytest.mark.parametrize(
    "reply, expected",
    [
        ("Box item: [10, 20, 30, 40]", [[10.0, 20.0, 30.0, 40.0]]),
        (
            "\u2014BEGIN FORMAT TEMPLATE\u2013\nBox item: [1.5, 2, 3.25, 4]\n"
            "box item:[5,6,7,8]\n\u2014END FORMAT TEMPLATE\u2013",
            [[1.5, 2.0, 3.25, 4.0], [5.0, 6.0, 7.0, 8.0]],
        ),
        ("Box item: [1, 2, 3, 4], [5, 6, 7, 8]", [[1.0, 2.0, 3.0, 4.0], [5.0, 6.0, 7.0, 8.0]]),
        ("Box item: [the coordinates of the box]", []),
        ("Box item: [1, 2, 3]", []),
        ("[1, 2, 3, 4]", []),
        ("There is no such object.", []),
        ("", []),
    ],
)
def test_parse_boxes(reply: str, expected: list[list[float]]) -> None:
    assert parse_boxes(reply) == expected


@pytest.mark.parametrize(
    "reply, expected",
    [
        ("3", 3),
        ("There are 12 cars.", 12),
        ("three", 3),
        ("There are Seven birds.", 7),
        ("zero", 0),
        ("twenty", 20),
        ("Eleven people", 11),
        ("I count 2 dogs and 3 cats.", 2),
        ("twenty-one", None),
        ("2.5", None),
        ("none", None),
        ("", None),
        ("I cannot tell.", None),
    ],
)
def test_parse_count(reply: str, expected: int | None) -> None:
    assert parse_count(reply) == expected


@pytest.mark.parametrize(
    "reply, expected",
    [
        ("Let me look. The image shows a dog on grass. So the answer is yes.", True),
        ("Step 1: there is no cat. Step 2: nothing else. Answer: No", False),
        ("Does it contain a cat? Yes or No? I think yes", True),
        ("Yes. Step by step: the dog is visible.", True),
        ("There is no zebra here, so no.", False),
        ("The answer is yes or no, hard to tell.", None),
        ("I cannot decide.", None),
        ("", None),
    ],
)
def test_parse_final_yes_no(reply: str, expected: bool | None) -> None:
    assert parse_final_yes_no(reply) is expected


OPTIONS = ["cat", "dog", "traffic light", "hen"]


@pytest.mark.parametrize(
    "reply, expected",
    [
        ("Answer Choice: [dog]", 1),
        ("Answer Choice: Traffic Light.", 2),
        ("hen", 3),
        ("**cat**", 0),
        ("A dog is shown.", None),  # a name inside a sentence is no answer
        ("Answer Choice: [Your Answer Choice Here]", None),
        ("cow", None),
    ],
)
def test_parse_option_text(reply: str, expected: int | None) -> None:
    assert parse_option_text(reply, OPTIONS) == expected


def test_parse_option_text_needs_a_unique_name() -> None:
    assert parse_option_text("dog", ["dog", "cat", "Dog"]) is None


@pytest.mark.parametrize(
    "reply, expected",
    [
        (COUNTS_REPLY, 1),  # the letter wins
        ("Answer Choice: [D]", 3),
        ("Answer Choice: traffic light", 2),
        ("Answer Choice: [E]", None),
        ("no idea", None),
    ],
)
def test_parse_choice_or_option(reply: str, expected: int | None) -> None:
    assert parse_choice_or_option(reply, OPTIONS) == expected


def test_parse_mapping_reads_the_answer_after_the_echoed_template() -> None:
    reply = (
        "\u2014BEGIN FORMAT TEMPLATE\u2013\nAnswer Choice:\n"
        "blue box:[Your Answer Choice Here]\nred box:[Your Answer Choice Here]\n"
        "yellow box:[Your Answer Choice Here]\ngreen box:[Your Answer Choice Here]\n"
        "\u2014END FORMAT TEMPLATE\u2013\nAnswer Choice:\n"
        "blue box:[B]\nRed box: (A) cat\nyellow box: traffic light\ngreen box:[Your Answer Choice Here]"
    )
    assert parse_mapping(reply, OPTIONS) == [1, 0, 2, None]
    assert parse_mapping("", OPTIONS) == [None] * 4
    assert parse_mapping("blue box: D\nred box: C\nyellow box: B\ngreen box: A", OPTIONS) == [
        3,
        2,
        1,
        0,
    ]


@pytest.mark.parametrize(
    "reply, answer, reasoning",
    [
        ("(B) a dog", "(B) a dog", None),
        ("<think>The ears are long.</think>\n\n(B) a dog", "(B) a dog", "The ears are long."),
        # The chat template opened the block (Qwen3, DeepSeek-R1): only its end is in the reply.
        ("Long ears, so a dog.\n</think>\n\nAnswer: B", "Answer: B", "Long ears, so a dog."),
        # The budget ran out while thinking: no answer at all.
        ("<think>First, the image shows a", "", "First, the image shows a"),
        ("  <THINK>x</Think> yes", "yes", "x"),
        ("<think></think>C", "C", None),
        ("A <think>one</think>B<think>two</think>", "A B", "one\n\ntwo"),
    ],
)
def test_split_think(reply: str, answer: str, reasoning: str | None) -> None:
    assert split_think(reply) == (answer, reasoning)


def test_think_blocks_made_both_parse_modes_fail_until_split() -> None:
    # Finding 5 of issue 15: a reasoning model's reply, as vLLM sends it without a parser.
    reply = "<think>Options A to D; the fur is striped, so tabby.</think>\nD"
    assert parse_choice(reply, 4, "strict") is None
    assert parse_choice(reply, 4, "foci") is None
    answer, _ = split_think(reply)
    assert parse_choice(answer, 4, "strict") == parse_choice(answer, 4, "foci") == 3


# ---------------------------------------------------------------------------------------------
# Every parse mode over the shapes real replies take
# ---------------------------------------------------------------------------------------------

# Options chosen so that names start with other options' letters: Dalmatian is A, Abyssinian D.
BREEDS = ["Dalmatian", "Bengal", "Chihuahua", "Abyssinian"]
A, B, C, D = range(4)
JUDGE = "judge"  # the judge mode asks the judge: no rule reads the reply

# (shape, reply, foci, strict, last, judge): the option each mode reads (None: no answer).
# The judge mode reads what strict reads, and sends the judge only what no rule reads.
REPLY_SHAPES = [
    ("letter", "B", B, B, B, B),
    ("lower-case letter, full stop", "b.", B, B, B, B),
    ("letter in parentheses", "(B)", None, B, B, B),
    ("letter in markdown bold", "**B**", None, B, B, B),
    ("answer label", "Answer: B", A, B, B, B),
    ("a sentence naming the letter", "The correct answer is (B)", None, B, B, B),
    ("letter and option", "B. Bengal", B, B, B, B),
    ("option text, its own letter", "Bengal", B, B, B, B),
    ("option text, another option's letter", "Abyssinian", A, D, D, D),
    ("option text, another option's letter", "Dalmatian", D, A, A, A),
    ("a sentence opening with another letter", "Based on the image, the answer is (C).", B, C, C, C),
    ("option named inside a sentence", "Based on the fur pattern, it is a Bengal.", B, None, None, JUDGE),
    ("labelled option text", "Step 1: the coat is spotted.\nFinal answer: Dalmatian", None, A, A, A),
    (
        "chain-of-thought over every option, then the answer",
        "Let me compare. (A) Dalmatian: spotted, no. (D) Abyssinian: ticked, close. "
        "(B) Bengal: rosettes match. The answer is B.",
        None, None, B, JUDGE,
    ),
    ("chain-of-thought, the letter last", "The coat has rosettes.\nB", None, None, B, JUDGE),
    (
        "chain-of-thought without a verdict",
        "(A) Dalmatian: no.\n(D) Abyssinian: close.\n(B) Bengal: rosettes match.",
        None, None, None, JUDGE,
    ),
    ("a changed mind", "Answer: A\nAnswer: B", A, None, B, JUDGE),
    ("the answer, then a discussion", "The answer is B. (A) is wrong because", None, None, B, JUDGE),
    ("two letters", "(A) or (B)", None, None, None, JUDGE),
    ("two options named", "Dalmatian or Bengal?", D, None, None, JUDGE),
    ("refusal", "I'm sorry, but I can't identify breeds from images.", None, None, None, JUDGE),
    ("refusal opening with a letter", "As an AI, I cannot view images.", A, None, None, JUDGE),
    ("a letter beyond the options", "E", None, None, None, JUDGE),
    ("empty", "", None, None, None, None),
    ("blank", "  \n ", None, None, None, None),
]  # fmt: skip


@pytest.mark.parametrize(
    "reply, foci, strict, last",
    [row[1:5] for row in REPLY_SHAPES],
    ids=[r[0] for r in REPLY_SHAPES],
)
def test_every_rule_mode_over_real_reply_shapes(reply, foci, strict, last):
    expected = {"foci": foci, "strict": strict, "last": last}
    assert {mode: read_choice(reply, BREEDS, mode) for mode in CHOICE_MODES} == expected


class AskedVerdicts:
    """A judge that names option C for whatever it is asked, and remembers the asking."""

    def __init__(self):
        self.asked = []

    def identity(self):
        return {"model": "judge", "prompt_version": "test"}

    def lookup(self, options, reply):
        self.asked.append(reply)
        return True, C


@pytest.mark.parametrize(
    "reply, judge", [(row[1], row[5]) for row in REPLY_SHAPES], ids=[r[0] for r in REPLY_SHAPES]
)
def test_the_judge_mode_asks_only_about_what_no_rule_reads(reply, judge):
    verdicts = AskedVerdicts()
    scoring = FociScoring().reading("judge", verdicts)
    meta = {"options": BREEDS, "answer": B}
    parsed, correct = scoring.score(meta, reply)
    if judge == JUDGE:
        assert verdicts.asked == [reply] and parsed == C and correct is False
    else:
        assert verdicts.asked == [] and parsed == judge
    record = {"error": None, "reply": reply, "meta": meta}
    assert (scoring.needs_judge(record) is not None) == (judge == JUDGE)


def test_the_two_pitfalls_of_the_first_letter_rule():
    # "The correct answer is (B)" is B to every mode but FOCI's, which reads the "T" it opens
    # with wherever there are 20 options or more; "Based on..." is a lucky B to FOCI's rule.
    many = [f"option {k}" for k in range(26)]
    reply = "The correct answer is (B)"
    assert [read_choice(reply, many, mode) for mode in ("strict", "last")] == [B, B]
    assert read_choice(reply, many, "foci") == string.ascii_uppercase.index("T")
    assert read_choice(reply, BREEDS, "foci") is None
    lucky = "Based on the shape of the ears, I cannot tell."
    assert read_choice(lucky, BREEDS, "foci") == B
    assert read_choice(lucky, BREEDS, "strict") is read_choice(lucky, BREEDS, "last") is None


@pytest.mark.parametrize(
    "reply, expected",
    [
        ("The answer is **C**.", C),
        ("answer is: (D) Abyssinian", D),
        ("I considered (A).\nFinal answer: Bengal", B),
        ("The answer is a Dalmatian", None),  # "a" is an article, not option A
        ("Answer: E", None),  # beyond the options
        ("Answer: Your Answer Here", None),
        ("chihuahua", C),
    ],
)
def test_parse_last_choice(reply, expected):
    assert parse_last_choice(reply, BREEDS) == expected


def test_read_choice_rejects_an_unknown_mode():
    with pytest.raises(ValueError, match="mode must be one of"):
        read_choice("A", BREEDS, "judge")
