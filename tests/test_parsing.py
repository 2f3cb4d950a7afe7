"""Reply parsing: option letters (strict and FOCI's rule), yes/no, COUNTS boxes and counts, and
reasoning models' <think> blocks taken out first."""

import pytest

from ood_jax.eval.parsing import (
    parse_boxes,
    parse_choice,
    parse_choice_or_option,
    parse_count,
    parse_final_yes_no,
    parse_mapping,
    parse_option_text,
    parse_yes_no,
    split_think,
)

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
