"""The prompt texts of FOCI, COUNTS (OODG) and OODBench, in one place.

Every text is quoted from the papers in ../shared/papers/ (FOCI.txt Appendix A; COUNTS.txt
Tables 8-11; OODBench.txt, data-construction, CoT and BAP paragraphs). Where the extracted text is
ambiguous, the comment at the constant says what was read and why. `<image>` is kept literally
where COUNTS puts it: clients split the prompt there to interleave the image.
"""

from __future__ import annotations

import string
from collections.abc import Sequence
from dataclasses import dataclass

IMAGE_PLACEHOLDER = "<image>"
# Recorded in every eval-mllm run's manifest.json: raise it whenever a text here changes what a
# run sends, so that two runs' numbers say whether they asked the same questions.
PROMPTS_VERSION = 1

# ----------------------------------------------------------------------------------------------
# FOCI (Appendix A)
# ----------------------------------------------------------------------------------------------

FOCI_NUM_OPTIONS = 4
FOCI_DEFAULT_QUESTION = "Which of these choices is shown in the image?"
# The appendix lists question lines for seven domains; IN-Food and IN-Artifact have none, so they
# get the default line (the paper does not say whether IN-Food reuses Food101's "dishes" line).
_FOCI_DOMAIN_QUESTIONS = {
    "IN-Animal": "Which of these animals is shown in the image?",
    "IN-Plant": "Which of these plants is shown in the image?",
    "FGVC-Aircraft": "Which of these aircrafts is shown in the image?",
    "Flowers102": "Which of these flowers is shown in the image?",
    "Food101": "Which of these dishes is shown in the image?",
    "Oxford-Pet": "Which of these pets is shown in the image?",
    "Stanford-Cars": "Which of these cars is shown in the image?",
}
# The FOCI TFDS builder's config names, so an example's `dataset` feature selects its line.
_FOCI_CONFIG_NAMES = {
    "imagenet21k_animal": "IN-Animal",
    "imagenet21k_plant": "IN-Plant",
    "fgvc_aircraft": "FGVC-Aircraft",
    "flowers102": "Flowers102",
    "food101": "Food101",
    "oxford_pet": "Oxford-Pet",
    "stanford_cars": "Stanford-Cars",
}
# FOCI prints only this multiple-choice prompt: the paper has no yes/no variant, so none is
# defined here.
FOCI_CHOICES_HEADER = "Choices:"
FOCI_INSTRUCTION = "Answer with the letter from the given choices directly."


def foci_question(dataset: str) -> str:
    """The first prompt line for `dataset` (paper name such as "Oxford-Pet" or builder config name).

    Unknown names (IN-Food, IN-Artifact, custom sets) get the paper's "Default" line.
    """
    name = _FOCI_CONFIG_NAMES.get(dataset, dataset)
    return _FOCI_DOMAIN_QUESTIONS.get(name, FOCI_DEFAULT_QUESTION)


def foci_multiple_choice(dataset: str, options: Sequence[str]) -> str:
    """FOCI's prompt: question line, "Choices:", "A. .." to "D. ..", then the instruction.

    The listing's "C. $CHOICE2" is a typo in the paper (the third choice goes there). Lines are
    joined by single newlines, one listing line per prompt line.
    """
    if len(options) != FOCI_NUM_OPTIONS:
        raise ValueError(f"FOCI has {FOCI_NUM_OPTIONS} options, got {len(options)}: {options!r}")
    lines = [foci_question(dataset), FOCI_CHOICES_HEADER]
    lines += [f"{letter}. {option}" for letter, option in zip(string.ascii_uppercase, options)]
    lines.append(FOCI_INSTRUCTION)
    return "\n".join(lines)


# ----------------------------------------------------------------------------------------------
# OODBench
# ----------------------------------------------------------------------------------------------

# Data-construction paragraph (Fig. 4): "Does this image contain a [class]? (yes or no)" and the
# negated one. "[class]" is filled in literally, so the article stays "a" before vowels too.
OODBENCH_PRESENCE_QUESTION = "Does this image contain a {category}? (yes or no)"
OODBENCH_ABSENCE_QUESTION = "Does this image not contain a {category}? (yes or no)"
# CoT paragraph, quoted as printed: "Does this image contain [class]? Yes or No? Let’s break down
# the information step by step." It differs from the main questions (no "a", "Yes or No?" instead
# of "(yes or no)") although the paper says the setup "mirrors the main experiment"; the printed
# CoT text is used as is. The apostrophe is the PDF's U+2019, kept as printed.
OODBENCH_COT_SUFFIX = "Let\u2019s break down the information step by step."
OODBENCH_COT_PRESENCE_QUESTION = (
    "Does this image contain {category}? Yes or No? " + OODBENCH_COT_SUFFIX
)
OODBENCH_COT_ABSENCE_QUESTION = (
    "Does this image not contain {category}? Yes or No? " + OODBENCH_COT_SUFFIX
)

# BAP: the paper words only the logical question ("Is the number of [class 1] in the image greater
# than the number of [class 2]? Answer with ‘yes‘ or ‘no‘"); its quotes are extraction debris of
# LaTeX `yes' and are written as ASCII. The existential and counting wordings are not printed in
# the paper: these are the project's own (the same as the OODBench builder's).
BAP_EXISTENTIAL_QUESTION = "Is there a {category} in the image?"
BAP_COUNTING_QUESTION = "How many {category} are there in the image?"
BAP_LOGICAL_QUESTION = (
    "Is the number of {first} in the image greater than the number of {second}? "
    "Answer with 'yes' or 'no'"
)
BAP_LEVELS = ("existential", "counting", "logical")


def oodbench_question(category: str, negated: bool = False, chain_of_thought: bool = False) -> str:
    """OODBench's contain / not-contain question for `category`, optionally with the CoT wording."""
    if chain_of_thought:
        template = OODBENCH_COT_ABSENCE_QUESTION if negated else OODBENCH_COT_PRESENCE_QUESTION
    else:
        template = OODBENCH_ABSENCE_QUESTION if negated else OODBENCH_PRESENCE_QUESTION
    return template.format(category=category)


# Circular evaluation (ood_jax/eval/tasks/circular.py) asks every yes/no question again with its
# two answers listed the other way round. The paper has no such wording: this is the project's
# own, each of the paper's two listings with only its answers exchanged.
OODBENCH_ANSWER_ORDERS = {"(yes or no)": "(no or yes)", "Yes or No?": "No or Yes?"}


def oodbench_answers_swapped(question: str) -> str:
    """`question` (an OODBench yes/no question, as built or with the CoT wording) with its
    answers listed as "no" then "yes". Raises ValueError when it lists them not exactly once."""
    found = [listing for listing in OODBENCH_ANSWER_ORDERS if listing in question]
    if len(found) != 1 or question.count(found[0]) != 1:
        listings = " or ".join(repr(listing) for listing in OODBENCH_ANSWER_ORDERS)
        raise ValueError(f"the question must list its answers once, as {listings}: {question!r}")
    return question.replace(found[0], OODBENCH_ANSWER_ORDERS[found[0]])


def bap_question(level: str, a: str, b: str | None = None) -> str:
    """A BAP question: "existential" or "counting" about `a`, "logical" compares `a` with `b`."""
    if level not in BAP_LEVELS:
        raise ValueError(f"BAP level must be one of {BAP_LEVELS}, got {level!r}")
    if level == "logical":
        if b is None:
            raise ValueError("the logical BAP question compares two categories: pass b")
        return BAP_LOGICAL_QUESTION.format(first=a, second=b)
    if b is not None:
        raise ValueError(f"the {level} BAP question is about one category, got b={b!r}")
    template = BAP_EXISTENTIAL_QUESTION if level == "existential" else BAP_COUNTING_QUESTION
    return template.format(category=a)


# ----------------------------------------------------------------------------------------------
# COUNTS, OODG (Appendix B.3, Tables 8-11)
# ----------------------------------------------------------------------------------------------

# The tables print the template markers with an em dash before and an en dash after
# ("—BEGIN FORMAT TEMPLATE–"); whether the prompts sent had ASCII dashes (typeset by LaTeX into
# these) cannot be told from the paper, so the printed characters are kept.
FORMAT_BEGIN = "\u2014BEGIN FORMAT TEMPLATE\u2013"
FORMAT_END = "\u2014END FORMAT TEMPLATE\u2013"
FORMAT_REMINDER = "Do not deviate from the above format. Repeat the format template for the answer."
GROUNDING_QUESTION = f"Question: What object is in the red box? {IMAGE_PLACEHOLDER}"
GROUNDING_ANSWER_TEMPLATE = "Answer Choice: [Your Answer Choice Here]"
MAPPING_COLORS = ("blue", "red", "yellow", "green")
MAPPING_QUESTION = (
    "Question: What object is in the blue box, red box, yellow box, and green box, "
    f"respectively? {IMAGE_PLACEHOLDER}"
)
# Recognition and Localization (Table 10) prints its placeholders by name: "are weight weight and
# height height" reads as "weight {width} and height {height}" ("weight" for width is the paper's
# own wording, also in the W, H line), and "objects of category 1" as "objects of {category}".
# The line breaks are the table's and are kept; the paper's inputs are resized to 448 x 448.
LOCALIZATION_TEMPLATE = "\n".join(
    [
        "Knowing that the dimensions of the input image are weight {width} and height {height},",
        "find all the objects of {category} in the image and return the coordinates [X, Y, W, H]",
        "of the rectangular box in which they are located,",
        "where X, Y denote the horizontal coordinate and the vertical coordinate of the",
        "upper-left corner of the rectangular box, respectively.",
        "W, H denote the weight and the height of the rectangular box, respectively.",
        "Please respond with the following format:",
        FORMAT_BEGIN,
        "Box item: [the coordinates of the box]",
        FORMAT_END,
        FORMAT_REMINDER,
    ]
)
LOCALIZATION_IMAGE_SIZE = 448


@dataclass(frozen=True)
class InContextExample:
    """One COUNTS in-context example: its options and the text printed as "{ground truth}".

    The paper does not say whether the ground truth is the letter or the category name, so the
    caller passes the text to print.
    """

    options: Sequence[str]
    ground_truth: str


def _lettered(options: Sequence[str]) -> list[str]:
    if not 2 <= len(options) <= len(string.ascii_uppercase):
        raise ValueError(f"need 2 to 26 options, got {len(options)}: {options!r}")
    return [f"({letter}) {option}" for letter, option in zip(string.ascii_uppercase, options)]


def _grounding_block(question: str, options: Sequence[str], option_on_own_line: bool) -> list[str]:
    lettered = _lettered(options)
    if option_on_own_line:
        option_lines = ["Option:", *lettered]
    else:
        option_lines = [f"Option: {lettered[0]}", *lettered[1:]]
    answer = [
        "Please respond with the following format:",
        FORMAT_BEGIN,
        GROUNDING_ANSWER_TEMPLATE,
        FORMAT_END,
        FORMAT_REMINDER,
    ]
    return [question, *option_lines, *answer]


def counts_grounding(options: Sequence[str], in_context: Sequence[InContextExample] = ()) -> str:
    """Visual Grounding: Table 8 without in-context examples, Table 9 with them.

    Table 8 prints "Option: (A) {category 1}" on one line while Tables 9 and 11 put "Option:" on
    its own line; each table's layout is reproduced. In Table 9 every example ends with
    "Answer choice: {ground truth}" (lower-case "choice", as printed) and the examples follow one
    another ("⋯ (other examples)") before "Final Question:".
    """
    if not in_context:
        return "\n".join(_grounding_block(GROUNDING_QUESTION, options, option_on_own_line=False))
    lines = ["Answer the final question according to the following examples.", "Examples:"]
    for example in in_context:
        lines += _grounding_block(GROUNDING_QUESTION, example.options, option_on_own_line=True)
        lines.append(f"Answer choice: {example.ground_truth}")
    final_question = "Final " + GROUNDING_QUESTION
    lines += _grounding_block(final_question, options, option_on_own_line=True)
    return "\n".join(lines)


def counts_localization(
    category: str, width: int = LOCALIZATION_IMAGE_SIZE, height: int = LOCALIZATION_IMAGE_SIZE
) -> str:
    """Recognition and Localization (Table 10): boxes of `category` as "Box item: [X, Y, W, H]"."""
    return LOCALIZATION_TEMPLATE.format(width=width, height=height, category=category)


def counts_mapping(options: Sequence[str]) -> str:
    """Visual and Semantic Mapping (Table 11): one answer per box, blue, red, yellow, green."""
    lines = [MAPPING_QUESTION, "Option:", *_lettered(options)]
    lines += ["Please respond with the following format:", FORMAT_BEGIN, "Answer Choice:"]
    lines += [f"{color} box:[Your Answer Choice Here]" for color in MAPPING_COLORS]
    lines += [FORMAT_END, FORMAT_REMINDER]
    return "\n".join(lines)
