"""Images where the prompt puts them: where a processor's chat template renders the images of a
turn `text IMG text IMG text` (`template_layout`), the text a local model reads for a Request
(`LocalPrompts`: images kept in place, or a refusal naming the model and the task), and the
results' warning for a multi-image task on an endpoint (`endpoint_warning`). Which templates
move images, and how that is known: docs/guide/mllm.md, "Where images go"."""

from __future__ import annotations

import dataclasses

from ood_jax.prompts import IMAGE_PLACEHOLDER

# The eval-mllm flag that runs ood_jax.eval.probe; named in the warning so a user knows how to
# check a server.
PROBE_FLAG = "--check-interleaving"
IMAGE = "IMG"
# Text markers of the probe turn: plain words, so that no template escapes or strips them.
_MARKERS = ("oodjaxtextzero", "oodjaxtextone", "oodjaxtexttwo")
_SENTINEL = "oodjaximageslot{}end"


class InterleavingError(ValueError):
    """A prompt whose images this model would see elsewhere than where the prompt puts them."""


def _text(text: str) -> dict:
    return {"type": "text", "text": text}


def _turn(parts: list[dict]) -> list[dict]:
    return [{"role": "user", "content": parts}]


def _render(processor, parts: list[dict], model: str) -> str:
    try:
        return processor.apply_chat_template(
            _turn(parts), add_generation_prompt=True, tokenize=False
        )
    except Exception as e:  # a template raises whatever its author chose (jinja, ValueError)
        raise InterleavingError(
            f"{model}: its chat template fails on one user turn of text and images: {e}"
        ) from e


# ---------------------------------------------------------------------------------------------
# Where a chat template puts the images
# ---------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Layout:
    """Our probe turn (text IMG text IMG text) as sent, and the order the template rendered."""

    sent: tuple[str, ...]
    rendered: tuple[str, ...]
    image_text: str  # what the template renders for one image, e.g. "<image>\n"
    text: str  # the whole rendering

    @property
    def keeps_images_in_place(self) -> bool:
        return self.rendered == self.sent

    def describe(self) -> str:
        return f"sent {' '.join(self.sent)}, rendered {' '.join(self.rendered)}"


def _probe_parts() -> list[dict]:
    image = {"type": "image"}
    return [_text(_MARKERS[0]), image, _text(_MARKERS[1]), image, _text(_MARKERS[2])]


def _labels(parts: list[dict]) -> tuple[str, ...]:
    return tuple(
        IMAGE if p["type"] == "image" else f"text{_MARKERS.index(p['text'])}" for p in parts
    )


def _image_text(processor, model: str) -> str:
    """What the template adds for one image: the difference of one turn with and without it."""
    with_image = _render(processor, [{"type": "image"}, _text(_MARKERS[0])], model)
    without = _render(processor, [_text(_MARKERS[0])], model)
    start = 0
    while start < min(len(with_image), len(without)) and with_image[start] == without[start]:
        start += 1
    end = 0
    while end < len(without) - start and with_image[-1 - end] == without[-1 - end]:
        end += 1
    added = with_image[start : len(with_image) - end]
    if not added or len(with_image) - len(without) != len(added):
        raise InterleavingError(f"{model}: its chat template renders no text for an image")
    return added


def _order(rendered: str, image_text: str) -> tuple[str, ...]:
    """The markers and image renderings of `rendered`, in the order they occur."""
    found = []
    for k, marker in enumerate(_MARKERS):
        at = rendered.find(marker)
        if at >= 0:
            found.append((at, f"text{k}"))
    at = rendered.find(image_text)
    while at >= 0:
        found.append((at, IMAGE))
        at = rendered.find(image_text, at + len(image_text))
    return tuple(label for _, label in sorted(found))


def template_layout(processor, model: str = "the model") -> Layout:
    """Renders `text IMG text IMG text` with `processor`'s chat template and reads the order back.

    `model` names the model in errors. Raises InterleavingError when the template fails on such a
    turn or renders nothing for an image.
    """
    parts = _probe_parts()
    image_text = _image_text(processor, model)
    rendered = _render(processor, parts, model)
    return Layout(_labels(parts), _order(rendered, image_text), image_text, rendered)


# ---------------------------------------------------------------------------------------------
# The local client's prompts
# ---------------------------------------------------------------------------------------------


def image_after_text(request) -> bool:
    """Whether an image of `request` (a clients.Request) follows some text: the images a
    hoisting template moves."""
    seen_text = False
    for part in request.segments():
        if isinstance(part, str):
            seen_text = True
        elif seen_text:
            return True
    return False


class LocalPrompts:
    """The text a local model reads for a Request, with every image where the prompt puts it.

    Where the processor's chat template keeps images in place, that is the template's rendering
    of the turn. Where it moves them, a turn with an image after text is rendered as one text
    part with a slot at each placeholder, each slot then replaced by what the template renders
    for one image (the model's own image token, e.g. "<image>\\n" for LLaVA-1.5): the same role
    markers and generation prompt, the images in place. A turn whose images all come first is
    rendered by the template as it is (hoisting does not change it). If the template's text
    cannot be rebuilt this way, such a turn is refused with a message naming the model and task.
    """

    def __init__(self, processor, model: str, task: str | None = None):
        self.processor, self.model = processor, model
        self.layout = template_layout(processor, model)
        self.moves_images = not self.layout.keeps_images_in_place
        self._refusal = None
        if self.moves_images:
            try:
                self._check_rebuild()
            except InterleavingError as e:
                what = f"{task} prompts" if task else "prompts"
                self._refusal = (
                    f"{model}: its chat template moves images ({self.layout.describe()}) and "
                    f"its prompt cannot be rebuilt with them in place ({e}); refusing {what} "
                    "with images between texts, which it would see next to the wrong texts"
                )

    def identity(self) -> dict:
        """Part of the client's identity: a run rendered in place must not mix with one that was
        not (a run directory written before this existed holds hoisted prompts)."""
        return {"images": "in place, chat template bypassed"} if self.moves_images else {}

    def render(self, request) -> str:
        """The rendered turn of `request`, a clients.Request."""
        if not self.moves_images or not image_after_text(request):
            return _render(self.processor, _parts(request), self.model)
        if self._refusal is not None:
            raise InterleavingError(self._refusal)
        return self._in_place(request.prompt.split(IMAGE_PLACEHOLDER))

    def _in_place(self, pieces: list[str]) -> str:
        slots = [_SENTINEL.format(k) for k in range(len(pieces) - 1)]
        text = pieces[0] + "".join(slot + piece for slot, piece in zip(slots, pieces[1:]))
        rendered = _render(self.processor, [_text(text)], self.model)
        for slot in slots:
            if rendered.count(slot) != 1:
                raise InterleavingError(f"{self.model}: its chat template alters the prompt text")
            rendered = rendered.replace(slot, self.layout.image_text)
        return rendered

    def _check_rebuild(self) -> None:
        token = getattr(self.processor, "image_token", None)
        if not token:
            raise InterleavingError("its processor names no image token")
        if self.layout.image_text.count(token) != 1:
            raise InterleavingError(
                f"an image renders as {self.layout.image_text!r}, not one {token!r}"
            )
        pieces = [_MARKERS[0], _MARKERS[1], _MARKERS[2]]
        order = _order(self._in_place(pieces), self.layout.image_text)
        if order != self.layout.sent:
            raise InterleavingError(f"rebuilt, the turn reads {' '.join(order)}")


def _parts(request) -> list[dict]:
    return [
        _text(part) if isinstance(part, str) else {"type": "image"} for part in request.segments()
    ]


# ---------------------------------------------------------------------------------------------
# Endpoints: the warning and the probe
# ---------------------------------------------------------------------------------------------


def endpoint_warning(benchmark_name: str, max_images_per_item: int) -> str | None:
    """The results.json warning for a run against an endpoint, or None when no item has more
    than one image (a single image is the first part of its turn whatever the template does)."""
    if max_images_per_item < 2:
        return None
    return (
        f"{benchmark_name}: items carry up to {max_images_per_item} images placed between their "
        "texts; a server whose chat template renders every image first (LLaVA-1.5, LLaVA-NeXT, "
        "LLaVA-OneVision as published), or that places images itself (vLLM with a "
        "string-content template, without --interleave-mm-strings), shows the model all images "
        f"ahead of the text and in-context examples lose their pairing; {PROBE_FLAG} measures "
        "what this server does"
    )
