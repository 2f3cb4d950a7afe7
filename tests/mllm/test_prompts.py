"""Prompt texts against the papers' printed prompts (strings copied from ../shared/papers/)."""

import pytest

from ood_jax import prompts

# FOCI Appendix A, with the listing's line numbers removed and its "C. $CHOICE2" typo read as the
# third choice.
FOCI_PET = """Which of these pets is shown in the image?
Choices:
A. Bengal
B. Abyssinian
C. Egyptian Mau
D. Russian Blue
Answer with the letter from the given choices directly."""

FOCI_QUESTIONS = {
    "IN-Animal": "Which of these animals is shown in the image?",
    "imagenet21k_animal": "Which of these animals is shown in the image?",
    "IN-Plant": "Which of these plants is shown in the image?",
    "imagenet21k_plant": "Which of these plants is shown in the image?",
    "FGVC-Aircraft": "Which of these aircrafts is shown in the image?",
    "fgvc_aircraft": "Which of these aircrafts is shown in the image?",
    "Flowers102": "Which of these flowers is shown in the image?",
    "flowers102": "Which of these flowers is shown in the image?",
    "Food101": "Which of these dishes is shown in the image?",
    "food101": "Which of these dishes is shown in the image?",
    "Oxford-Pet": "Which of these pets is shown in the image?",
    "oxford_pet": "Which of these pets is shown in the image?",
    "Stanford-Cars": "Which of these cars is shown in the image?",
    "stanford_cars": "Which of these cars is shown in the image?",
    "imagenet21k_food": "Which of these choices is shown in the image?",
    "imagenet21k_artifact": "Which of these choices is shown in the image?",
    "custom": "Which of these choices is shown in the image?",
}


def test_foci_multiple_choice_matches_appendix_a() -> None:
    options = ["Bengal", "Abyssinian", "Egyptian Mau", "Russian Blue"]
    assert prompts.foci_multiple_choice("oxford_pet", options) == FOCI_PET
    assert prompts.foci_multiple_choice("Oxford-Pet", options) == FOCI_PET


@pytest.mark.parametrize("dataset, question", sorted(FOCI_QUESTIONS.items()))
def test_foci_question_per_dataset(dataset: str, question: str) -> None:
    prompt = prompts.foci_multiple_choice(dataset, ["w", "x", "y", "z"])
    assert prompt.splitlines()[0] == question


def test_foci_needs_four_options() -> None:
    with pytest.raises(ValueError, match="4 options"):
        prompts.foci_multiple_choice("food101", ["a", "b", "c"])


# OODBench, data-construction paragraph and CoT paragraph.
@pytest.mark.parametrize(
    "negated, cot, expected",
    [
        (False, False, "Does this image contain a dog? (yes or no)"),
        (True, False, "Does this image not contain a dog? (yes or no)"),
        (
            False,
            True,
            "Does this image contain dog? Yes or No? Let\u2019s break down the information step "
            "by step.",
        ),
        (
            True,
            True,
            "Does this image not contain dog? Yes or No? Let\u2019s break down the information "
            "step by step.",
        ),
    ],
)
def test_oodbench_question(negated: bool, cot: bool, expected: str) -> None:
    assert prompts.oodbench_question("dog", negated=negated, chain_of_thought=cot) == expected


def test_bap_questions() -> None:
    # The logical question is the paper's (quotes as ASCII); the other two are the project's.
    assert prompts.bap_question("logical", "cat", "dog") == (
        "Is the number of cat in the image greater than the number of dog? "
        "Answer with 'yes' or 'no'"
    )
    assert prompts.bap_question("existential", "cat") == "Is there a cat in the image?"
    assert prompts.bap_question("counting", "cat") == "How many cat are there in the image?"
    with pytest.raises(ValueError, match="pass b"):
        prompts.bap_question("logical", "cat")
    with pytest.raises(ValueError, match="one category"):
        prompts.bap_question("counting", "cat", "dog")
    with pytest.raises(ValueError, match="level"):
        prompts.bap_question("reasoning", "cat")


# COUNTS Tables 8-11, placeholders filled in.
TABLE_8 = """Question: What object is in the red box? <image>
Option: (A) car
(B) bus
(C) truck
(D) bicycle
Please respond with the following format:
\u2014BEGIN FORMAT TEMPLATE\u2013
Answer Choice: [Your Answer Choice Here]
\u2014END FORMAT TEMPLATE\u2013
Do not deviate from the above format. Repeat the format template for the answer."""

TABLE_9 = """Answer the final question according to the following examples.
Examples:
Question: What object is in the red box? <image>
Option:
(A) car
(B) bus
(C) truck
(D) bicycle
Please respond with the following format:
\u2014BEGIN FORMAT TEMPLATE\u2013
Answer Choice: [Your Answer Choice Here]
\u2014END FORMAT TEMPLATE\u2013
Do not deviate from the above format. Repeat the format template for the answer.
Answer choice: [B]
Question: What object is in the red box? <image>
Option:
(A) dog
(B) cat
(C) horse
(D) sheep
Please respond with the following format:
\u2014BEGIN FORMAT TEMPLATE\u2013
Answer Choice: [Your Answer Choice Here]
\u2014END FORMAT TEMPLATE\u2013
Do not deviate from the above format. Repeat the format template for the answer.
Answer choice: [A]
Final Question: What object is in the red box? <image>
Option:
(A) car
(B) bus
(C) truck
(D) bicycle
Please respond with the following format:
\u2014BEGIN FORMAT TEMPLATE\u2013
Answer Choice: [Your Answer Choice Here]
\u2014END FORMAT TEMPLATE\u2013
Do not deviate from the above format. Repeat the format template for the answer."""

TABLE_10 = """Knowing that the dimensions of the input image are weight 448 and height 448,
find all the objects of car in the image and return the coordinates [X, Y, W, H]
of the rectangular box in which they are located,
where X, Y denote the horizontal coordinate and the vertical coordinate of the
upper-left corner of the rectangular box, respectively.
W, H denote the weight and the height of the rectangular box, respectively.
Please respond with the following format:
\u2014BEGIN FORMAT TEMPLATE\u2013
Box item: [the coordinates of the box]
\u2014END FORMAT TEMPLATE\u2013
Do not deviate from the above format. Repeat the format template for the answer."""

TABLE_11 = """Question: What object is in the blue box, red box, yellow box, and green box, \
respectively? <image>
Option:
(A) car
(B) bus
(C) truck
(D) bicycle
Please respond with the following format:
\u2014BEGIN FORMAT TEMPLATE\u2013
Answer Choice:
blue box:[Your Answer Choice Here]
red box:[Your Answer Choice Here]
yellow box:[Your Answer Choice Here]
green box:[Your Answer Choice Here]
\u2014END FORMAT TEMPLATE\u2013
Do not deviate from the above format. Repeat the format template for the answer."""

VEHICLES = ["car", "bus", "truck", "bicycle"]


def test_counts_grounding_without_examples_matches_table_8() -> None:
    assert prompts.counts_grounding(VEHICLES) == TABLE_8


def test_counts_grounding_with_examples_matches_table_9() -> None:
    examples = [
        prompts.InContextExample(VEHICLES, "[B]"),
        prompts.InContextExample(["dog", "cat", "horse", "sheep"], "[A]"),
    ]
    assert prompts.counts_grounding(VEHICLES, in_context=examples) == TABLE_9


def test_counts_localization_matches_table_10() -> None:
    assert prompts.counts_localization("car") == TABLE_10
    assert "weight 640 and height 480," in prompts.counts_localization("car", 640, 480)


def test_counts_mapping_matches_table_11() -> None:
    assert prompts.counts_mapping(VEHICLES) == TABLE_11


def test_counts_options_are_checked() -> None:
    with pytest.raises(ValueError, match="2 to 26"):
        prompts.counts_grounding(["car"])


def test_counts_grounding_places_one_image_per_question() -> None:
    # Clients send the k-th image at the k-th "<image>": after each example's question, then
    # after the final question.
    from ood_jax.eval.clients import ImageInput, Request

    image = ImageInput(b"\x89PNG\r\n\x1a\n", "image/png")
    for k in range(4):
        text = prompts.counts_grounding(VEHICLES, [prompts.InContextExample(VEHICLES, "[A]")] * k)
        segments = Request(text, (image,) * (k + 1)).segments()
        images = [i for i, part in enumerate(segments) if isinstance(part, ImageInput)]
        assert len(images) == k + 1
        for i in images:
            assert segments[i - 1].endswith("What object is in the red box? ")
        final = "Final Question" if k else "Question"
        assert segments[images[-1] - 1].endswith(f"{final}: What object is in the red box? ")
    # Table 10 prints no image placeholder: an items file has to add one for its image.
    assert prompts.IMAGE_PLACEHOLDER not in prompts.counts_localization("car")
    assert prompts.counts_mapping(VEHICLES).count(prompts.IMAGE_PLACEHOLDER) == 1
