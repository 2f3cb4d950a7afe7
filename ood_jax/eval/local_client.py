"""A local transformers LVLM as an MLLM client (`TransformersClient`)."""

from __future__ import annotations

import os
import time

from ood_jax.eval.clients import Reply, Request


class TransformersClient:
    """A local transformers LVLM: the processor's chat template, greedy decoding.

    `path` is a directory saved with save_pretrained holding the model and its processor
    (tokenizer, image processor, chat template). Images go to the processor in placeholder
    order, and the model reads each where the prompt puts it: where the chat template would
    move images ahead of the text (LLaVA-1.5's does), a turn with an image after text is
    rendered with the model's image token at each placeholder instead, or refused with a message
    naming the model and `task` (ood_jax.eval.interleaving.LocalPrompts). Not thread-safe: the
    runner calls it from one thread (the model already uses every core).
    """

    concurrency_limit = 1

    def __init__(
        self,
        path: str,
        max_new_tokens: int = 10,
        device: str | None = None,
        dtype: str = "auto",
        task: str | None = None,
    ):
        try:
            import torch
            import transformers
        except ImportError as e:
            raise ImportError(f"the local client needs PyTorch and transformers: {e}") from None
        if not os.path.isdir(path):
            raise FileNotFoundError(f"{path}: no such model directory")
        self.path = path
        self.max_new_tokens = int(max_new_tokens)
        self._torch = torch
        self.device = device or ("cuda" if torch.cuda.is_available() else "cpu")
        if dtype == "auto":
            torch_dtype = torch.bfloat16 if self.device.startswith("cuda") else torch.float32
        else:
            torch_dtype = getattr(torch, dtype)
        self.processor = transformers.AutoProcessor.from_pretrained(path, local_files_only=True)
        # Imported here, as torch and transformers are: only the local client needs it.
        from ood_jax.eval import interleaving

        # Before the weights load: a template that cannot be used fails at once.
        self.prompts = interleaving.LocalPrompts(self.processor, path, task)
        self.model = transformers.AutoModelForImageTextToText.from_pretrained(
            path, local_files_only=True, dtype=torch_dtype
        ).to(self.device)
        self.model.eval()

    def identity(self) -> dict:
        return {
            "client": "transformers",
            "model": os.path.abspath(self.path),
            "max_new_tokens": self.max_new_tokens,
            **self.prompts.identity(),
        }

    def inputs(self, request: Request):
        """The processor's tensors for `request`: one user turn, its images in place."""
        text = self.prompts.render(request)
        images = [image.to_pil() for image in request.images]
        inputs = self.processor(text=text, images=images or None, return_tensors="pt")
        # Only floating tensors (pixel values) take the model's dtype; token ids stay integers.
        return inputs.to(self.device).to(self.model.dtype)

    def generate(self, request: Request) -> Reply:
        started = time.monotonic()
        inputs = self.inputs(request)
        with self._torch.inference_mode():
            output = self.model.generate(
                **inputs, do_sample=False, num_beams=1, max_new_tokens=self.max_new_tokens
            )
        prompt_tokens = int(inputs["input_ids"].shape[1])
        new_tokens = output[:, prompt_tokens:]
        completion_tokens = int(new_tokens.shape[1])
        # Cut at the budget unless the last token ended the reply, as a server's "length" says.
        eos = self.model.generation_config.eos_token_id
        eos = set(eos if isinstance(eos, list) else [] if eos is None else [eos])
        truncated = completion_tokens == self.max_new_tokens and int(output[0, -1]) not in eos
        return Reply(
            self.processor.batch_decode(new_tokens, skip_special_tokens=True)[0].strip(),
            finish_reason="length" if truncated else "stop",
            usage={
                "prompt_tokens": prompt_tokens,
                "completion_tokens": completion_tokens,
                "total_tokens": prompt_tokens + completion_tokens,
            },
            latency_s=round(time.monotonic() - started, 3),
            attempts=1,
            model=os.path.abspath(self.path),
        )
