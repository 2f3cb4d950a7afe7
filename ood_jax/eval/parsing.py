"""Reading MLLM replies: option letters or names (`parse_choice`; `read_choice` under one of
CHOICE_MODES: foci, FOCI's first-letter rule; strict; last, for chain-of-thought), yes/no,
boxes, counts and COUNTS box mappings, and `split_think`, which takes `<think>` text out first."""

from __future__ import annotations

import re
import string
from collections.abc import Sequence

from ood_jax.prompts import MAPPING_COLORS

# Recorded in every eval-mllm run's manifest.json: raise it whenever a change here reads some
# reply differently (tests/mllm/test_parsing.py's tables say which), since the scores move with it.
PARSER_VERSION = 1

_LETTERS = string.ascii_uppercase

_THINK_OPEN = re.compile(r"<think>", re.IGNORECASE)
_THINK_CLOSE = re.compile(r"</think>", re.IGNORECASE)


def split_think(text: str) -> tuple[str, str | None]:
    """(answer, reasoning): a reply with its `<think>` blocks taken out, and their text.

    Reads three shapes reasoning models produce: closed `<think>...</think>` blocks; a
    `</think>` with no opening tag (the chat template opened the block, as Qwen3's and
    DeepSeek-R1's do), whose text before it is reasoning; and a `<think>` never closed (the
    token budget ran out while thinking), whose text after it is reasoning, leaving no answer.
    A reply without any tag comes back unchanged, with reasoning None.
    """
    thoughts, rest = [], text
    first_close, first_open = _THINK_CLOSE.search(rest), _THINK_OPEN.search(rest)
    if first_close is not None and (first_open is None or first_close.start() < first_open.start()):
        thoughts.append(rest[: first_close.start()])
        rest = rest[first_close.end() :]
    answer = []
    while (opened := _THINK_OPEN.search(rest)) is not None:
        answer.append(rest[: opened.start()])
        closed = _THINK_CLOSE.search(rest, opened.end())
        if closed is None:
            thoughts.append(rest[opened.end() :])
            rest = ""
            break
        thoughts.append(rest[opened.end() : closed.start()])
        rest = rest[closed.end() :]
    if not thoughts:
        return text, None
    answer.append(rest)
    reasoning = "\n\n".join(t.strip() for t in thoughts if t.strip())
    return "".join(answer).strip(), reasoning or None


# Strict mode: the places where a letter counts as an answer; the letter is a pattern's one group
# that matched.
_STRICT_PATTERNS = (
    # The whole reply is one letter, perhaps wrapped or punctuated: "B", "b.", "(C)", "**A**".
    re.compile(r"^\W*([a-z])\W*$", re.IGNORECASE),
    # A leading letter closed by a delimiter: "(C) golden retriever", "C. golden", "C) golden".
    # A bare "A " is left out on purpose: it is the article in "A golden retriever".
    re.compile(r"^\W*?[\(\[]([a-z])[\)\]]", re.IGNORECASE),
    re.compile(r"^\W*([a-z])[\.\):](?:\s|$)", re.IGNORECASE),
    # After an answer label: "Answer: D", "Answer Choice: [B]" (COUNTS' template), "answer is (C)".
    # A bare letter there must end its line or meet punctuation: "The answer is a dog" is no "A".
    re.compile(
        r"\banswer(?:\s+choice)?\s*(?:is\s*)?[:\-]?\s*"
        r"(?:[\(\[]([a-z])[\)\]]|([a-z])(?=[\.\),:;]|[ \t]*(?:\n|$)))",
        re.IGNORECASE,
    ),
    # A letter in parentheses or brackets anywhere, not glued to a word ("dog(s)"): "I pick (B)".
    re.compile(r"(?<![a-z0-9])[\(\[]([a-z])[\)\]]", re.IGNORECASE),
)


def parse_choice(text: str, num_options: int, mode: str = "strict") -> int | None:
    """The chosen option's index (A -> 0) in a reply to a lettered multiple-choice prompt.

    Returns None when no letter parses, when the letter is beyond `num_options`, or (strict) when
    the reply names two different letters.
    """
    if not 1 <= num_options <= len(_LETTERS):
        raise ValueError(f"num_options must be 1 to 26, got {num_options}")
    if mode == "foci":
        reply = text.strip().upper()
        if reply and reply[0] in _LETTERS[:num_options]:
            return _LETTERS.index(reply[0])
        return None
    if mode != "strict":
        raise ValueError(f"mode must be 'strict' or 'foci', got {mode!r}")
    letters = {
        next(letter for letter in match.groups() if letter).upper()
        for pattern in _STRICT_PATTERNS
        for match in pattern.finditer(text.strip())
    }
    if len(letters) != 1:
        return None
    index = _LETTERS.index(letters.pop())
    return index if index < num_options else None


# A leading yes or no, after any markup or an "Answer:" label; "yes or no" / "yes/no" is no answer.
_YES_NO = re.compile(
    r"^\W*(?:answer\s*(?:is)?\s*:?\W*)?(yes|no)\b(?!\s*(?:/|or)\s*(?:yes|no)\b)", re.IGNORECASE
)


def parse_yes_no(text: str) -> bool | None:
    """True for a reply led by "yes", False for "no" (any case, punctuation), otherwise None."""
    match = _YES_NO.match(text)
    if match is None:
        return None
    return match.group(1).lower() == "yes"


# The "yes or no" echo of a question ("Yes or No?", "yes/no") names no answer.
_YES_NO_WORD = re.compile(
    r"(?<![a-z])(?:(yes|no)\s*(?:/|or)\s*(?:yes|no)\b|(yes|no)\b)", re.IGNORECASE
)
_LABELLED_YES_NO = re.compile(
    r"\banswer\s*(?:is)?\s*[:\-]?\W*(yes|no)\b(?!\s*(?:/|or)\s*(?:yes|no)\b)", re.IGNORECASE
)


def parse_final_yes_no(text: str) -> bool | None:
    """The verdict of a step-by-step (chain-of-thought) reply, where the answer usually comes last.

    In order: the last "answer: yes/no" or "answer is yes/no"; a reply led by yes or no
    (`parse_yes_no`); otherwise the last standalone "yes" or "no" word. Echoes of the question's
    "Yes or No?" never count.
    """
    labelled = _LABELLED_YES_NO.findall(text)
    if labelled:
        return labelled[-1].lower() == "yes"
    leading = parse_yes_no(text)
    if leading is not None:
        return leading
    words = [single for _, single in _YES_NO_WORD.findall(text) if single]
    return words[-1].lower() == "yes" if words else None


# An "Answer Choice:" label (COUNTS' template) or a whole reply holding nothing but an option name.
_ANSWER_LABEL = re.compile(r"\banswer(?:\s+choice)?\s*:\s*(.*)", re.IGNORECASE)
_WRAPPING = " \t\r\n\"'`*.,;:!?[](){}"


def parse_option_text(text: str, options: Sequence[str]) -> int | None:
    """The option whose name is the whole answer (any case, brackets and punctuation stripped).

    The answer is what follows the last "Answer:" / "Answer Choice:" label, or else the whole
    reply. A name merely mentioned inside longer text is no answer, and neither is a name that
    two options share.
    """
    labelled = _ANSWER_LABEL.findall(text)
    return _named_option(labelled[-1] if labelled else text, options)


def _named_option(text: str, options: Sequence[str]) -> int | None:
    """The one option whose whole name `text` is, wrapping stripped; None for none or two."""
    answer = text.strip(_WRAPPING).casefold()
    matches = [i for i, option in enumerate(options) if option.strip().casefold() == answer]
    return matches[0] if len(matches) == 1 else None


def parse_choice_or_option(text: str, options: Sequence[str]) -> int | None:
    """A strict option letter, or failing that an option named in full (`parse_option_text`)."""
    letter = parse_choice(text, len(options), mode="strict")
    return letter if letter is not None else parse_option_text(text, options)


# An answer label, and what may follow it on its line: "Answer: D", "The correct answer is (B)",
# "Final answer: **C**", "Answer Choice: [B]". As in strict mode, a bare letter must meet
# punctuation or the line's end, so "the answer is a dog" states no "A".
_LABEL = re.compile(r"\banswer(?:\s+choice)?[ \t]*(?:is[ \t]*)?[:\-]?[ \t]*", re.IGNORECASE)
_LABELLED_LETTER = re.compile(
    r"[*_]*(?:[\(\[]([a-z])[\)\]]|([a-z])(?=[*_]*(?:[\.\),:;]|[ \t]*$)))", re.IGNORECASE
)
# Strict mode's letter shapes, read line by line: a line that is one letter, a line led by "(C)"
# or "C.", and a bracketed letter anywhere.
_LINE_LETTERS = (_STRICT_PATTERNS[0], _STRICT_PATTERNS[1], _STRICT_PATTERNS[2], _STRICT_PATTERNS[4])


def parse_last_choice(text: str, options: Sequence[str]) -> int | None:
    """The last choice a reply states: for chain-of-thought replies, which weigh the options
    before they settle on one.

    A choice is stated after an answer label (a letter, or an option's whole name up to the end
    of the line), and the last labelled one counts: "Answer: A ... Answer: B" chose B. Without
    a label, the lines are read by strict mode's letter shapes (a line that is one letter, a
    line led by "(C)" or "C.", a bracketed letter anywhere) and a line that is an option's
    whole name counts too; they must all name the same option, since a reply that goes through
    "(A) ...", "(B) ..." without saying which it picks chose nothing a rule can tell. Letters
    beyond the options state nothing.
    """
    if not 1 <= len(options) <= len(_LETTERS):
        raise ValueError(f"options must number 1 to 26, got {len(options)}")
    labelled: list[int] = []
    unlabelled: set[int] = set()
    for line in text.splitlines():
        for label in _LABEL.finditer(line):
            rest = line[label.end() :]
            letter = _LABELLED_LETTER.match(rest)
            if letter is not None:
                index = _LETTERS.index((letter.group(1) or letter.group(2)).upper())
            else:
                index = _named_option(rest, options)
            if index is not None and index < len(options):
                labelled.append(index)
        stated = {
            _LETTERS.index(next(g for g in match.groups() if g).upper())
            for pattern in _LINE_LETTERS
            for match in pattern.finditer(line)
        }
        stated = {index for index in stated if index < len(options)}
        named = _named_option(line, options)
        if named is not None:
            stated.add(named)
        unlabelled |= stated
    if labelled:
        return labelled[-1]
    return unlabelled.pop() if len(unlabelled) == 1 else None


CHOICE_MODES = ("foci", "strict", "last")


def read_choice(text: str, options: Sequence[str], mode: str) -> int | None:
    """The option a multiple-choice reply chooses under `mode` (CHOICE_MODES), or None."""
    if mode == "foci":
        return parse_choice(text, len(options), mode="foci")
    if mode == "strict":
        return parse_choice_or_option(text, options)
    if mode == "last":
        return parse_last_choice(text, options)
    raise ValueError(f"mode must be one of {CHOICE_MODES}, got {mode!r}")


_NUMBER = r"[-+]?(?:\d+(?:\.\d*)?|\.\d+)"
_BOX_LINE = re.compile(r"box\s+item\s*:(.*)", re.IGNORECASE)
_BOX = re.compile(rf"\[\s*({_NUMBER})\s*,\s*({_NUMBER})\s*,\s*({_NUMBER})\s*,\s*({_NUMBER})\s*\]")


def parse_boxes(text: str) -> list[list[float]]:
    """Every [x, y, w, h] on the reply's "Box item:" lines (COUNTS Table 10), in order.

    Brackets that do not hold exactly four numbers (such as the echoed template "[the coordinates
    of the box]") are skipped; a reply without any box gives [].
    """
    boxes = []
    for line in text.splitlines():
        found = _BOX_LINE.search(line)
        if found is not None:
            boxes += [[float(v) for v in box] for box in _BOX.findall(found.group(1))]
    return boxes


_NUMBER_WORDS = (
    "zero one two three four five six seven eight nine ten eleven twelve thirteen fourteen "
    "fifteen sixteen seventeen eighteen nineteen twenty"
).split()
# A whole number in digits (not part of a decimal), or a number word that is not half of a
# compound such as "twenty-one" (beyond the words this reads).
_COUNT = re.compile(
    rf"(?<![\d.])(\d+)(?!\.?\d)|(?<![a-z]-)\b({'|'.join(_NUMBER_WORDS)})\b(?!-[a-z])",
    re.IGNORECASE,
)


def parse_count(text: str) -> int | None:
    """The first whole number in the reply, in digits or as a word from zero to twenty."""
    match = _COUNT.search(text)
    if match is None:
        return None
    digits, word = match.groups()
    return int(digits) if digits is not None else _NUMBER_WORDS.index(word.lower())


def parse_mapping(
    text: str, options: Sequence[str], colors: Sequence[str] = MAPPING_COLORS
) -> list[int | None]:
    """COUNTS' Visual and Semantic Mapping reply (Table 11): the option chosen for each colour.

    Reads the last "<colour> box: ..." line of each colour (the echoed template comes first when
    a model repeats it) with `parse_choice_or_option`; a colour without a readable answer is None.
    """
    chosen: list[int | None] = []
    for color in colors:
        lines = re.findall(rf"\b{re.escape(color)}\s+box\s*:(.*)", text, re.IGNORECASE)
        answers = [parse_choice_or_option(line, options) for line in lines]
        answers = [a for a in answers if a is not None]
        chosen.append(answers[-1] if answers else None)
    return chosen
