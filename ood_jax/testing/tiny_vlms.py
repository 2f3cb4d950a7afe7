"""Tiny random-weight VLMs built offline, saved where `transformers serve` or `--local` loads them.

Two families whose published chat templates place images differently: `build_llava` (LLaVA-1.5:
every image of a turn first, then its texts) and `build_qwen2_vl` (Qwen2-VL: each image where it
stands among the texts). The templates are the published texts, verbatim; the tokenizers are
byte-level BPEs trained here on the benchmarks' prompt texts. About 10^5 parameters, well under
a second to decode 16 tokens on one core. Replies are noise, but deterministic: what the tests
compare is what the model was shown.
"""

from __future__ import annotations

import pathlib

from ood_jax import prompts

# llava-hf/llava-1.5-7b-hf chat_template.json, as quoted by openvino.genai (src/cpp/src/
# tokenizer.cpp, whose fallback map matches templates by exact string equality: "llava-1.5,
# llava-v1.6-vicuna (chat_template.json)") and transformers' tests/models/llava/
# test_processing_llava.py.
LLAVA_1_5_CHAT_TEMPLATE = (
    "{% for message in messages %}{% if message['role'] != 'system' %}"
    "{{ message['role'].upper() + ': '}}{% endif %}{# Render all images first #}"
    "{% for content in message['content'] | selectattr('type', 'equalto', 'image') %}"
    "{{ '<image>\\n' }}{% endfor %}{# Render all text next #}"
    "{% if message['role'] != 'assistant' %}"
    "{% for content in message['content'] | selectattr('type', 'equalto', 'text') %}"
    "{{ content['text'] + ' '}}{% endfor %}{% else %}"
    "{% for content in message['content'] | selectattr('type', 'equalto', 'text') %}"
    "{% generation %}{{ content['text'] + ' '}}{% endgeneration %}{% endfor %}{% endif %}"
    "{% endfor %}{% if add_generation_prompt %}{{ 'ASSISTANT:' }}{% endif %}"
)

# Qwen/Qwen2-VL-2B-Instruct (and -7B-Instruct) chat template, as quoted by the same openvino.genai
# map ("Qwen2-VL-2B-Instruct (tokenizer_config.json)") and VLMEvalKit's Qwen2-VL wrapper.
QWEN2_VL_CHAT_TEMPLATE = (
    "{% set image_count = namespace(value=0) %}{% set video_count = namespace(value=0) %}"
    "{% for message in messages %}{% if loop.first and message['role'] != 'system' %}"
    "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n{% endif %}"
    "<|im_start|>{{ message['role'] }}\n{% if message['content'] is string %}"
    "{{ message['content'] }}<|im_end|>\n{% else %}{% for content in message['content'] %}"
    "{% if content['type'] == 'image' or 'image' in content or 'image_url' in content %}"
    "{% set image_count.value = image_count.value + 1 %}"
    "{% if add_vision_id %}Picture {{ image_count.value }}: {% endif %}"
    "<|vision_start|><|image_pad|><|vision_end|>"
    "{% elif content['type'] == 'video' or 'video' in content %}"
    "{% set video_count.value = video_count.value + 1 %}"
    "{% if add_vision_id %}Video {{ video_count.value }}: {% endif %}"
    "<|vision_start|><|video_pad|><|vision_end|>"
    "{% elif 'text' in content %}{{ content['text'] }}{% endif %}{% endfor %}<|im_end|>\n"
    "{% endif %}{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)

# llava-hf/llava-onevision-qwen2-*-ov-hf, as convert_llava_onevision_weights_to_hf.py writes it.
# Only to check how a template renders: no model here carries it.
LLAVA_ONEVISION_CHAT_TEMPLATE = (
    "{% for message in messages %}{{'<|im_start|>' + message['role'] + '\n'}}"
    "{# Render all images first #}"
    "{% for content in message['content'] | selectattr('type', 'equalto', 'image') %}"
    "{{ '<image>\n' }}{% endfor %}{# Render all video then #}"
    "{% for content in message['content'] | selectattr('type', 'equalto', 'video') %}"
    "{{ '<video>\n' }}{% endfor %}{# Render all text next #}"
    "{% if message['role'] != 'assistant' %}"
    "{% for content in message['content'] | selectattr('type', 'equalto', 'text') %}"
    "{{ content['text'] }}{% endfor %}{% else %}"
    "{% for content in message['content'] | selectattr('type', 'equalto', 'text') %}"
    "{% generation %}{{ content['text'] }}{% endgeneration %}{% endfor %}{% endif %}"
    "{{'<|im_end|>' + '\n'}}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)

LLAVA_SPECIAL_TOKENS = ("<unk>", "<s>", "</s>", "<pad>", "<image>")
QWEN2_VL_SPECIAL_TOKENS = (
    "<|endoftext|>",
    "<|im_start|>",
    "<|im_end|>",
    "<|vision_start|>",
    "<|vision_end|>",
    "<|image_pad|>",
    "<|video_pad|>",
)
# Trained on the prompt texts, so every prompt encodes without unknown tokens (and without a
# download). Enough merges for the prompt words to become a few tokens each; the rest is bytes.
_VOCAB_SIZE = 600
# Random logits are nearly flat: scaled up, greedy decoding picks varied tokens rather than one
# token over and over, so that different inputs visibly give different replies.
_LOGIT_SCALE = 40.0


def _prompt_corpus() -> list[str]:
    """The benchmarks' prompt texts, what the tokenizers are trained on."""
    options = ["cat", "dog", "cow", "hen"]
    example = prompts.InContextExample(options, "(A) cat")
    return [
        prompts.foci_multiple_choice("custom", options),
        prompts.counts_grounding(options),
        prompts.counts_grounding(options, [example, example]),
        prompts.counts_localization("dog"),
        prompts.counts_mapping(options),
        "USER: ASSISTANT: system user assistant You are a helpful assistant.",
        "0123456789 ABCDEFGHIJKLMNOPQRSTUVWXYZ abcdefghijklmnopqrstuvwxyz",
    ]


def _byte_level_tokenizer(special_tokens, **named_tokens):
    """A byte-level BPE trained on the prompt corpus, as a transformers fast tokenizer."""
    import transformers
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=_VOCAB_SIZE,
        special_tokens=list(special_tokens),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(_prompt_corpus(), trainer)
    return transformers.PreTrainedTokenizerFast(tokenizer_object=tokenizer, **named_tokens)


def _sharpen_and_save(model, processor, path: pathlib.Path, eos: int, pad: int) -> pathlib.Path:
    import torch

    with torch.no_grad():
        model.lm_head.weight.mul_(_LOGIT_SCALE)
    model.generation_config.eos_token_id = eos
    model.generation_config.pad_token_id = pad
    path.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(path)
    processor.save_pretrained(path)
    return path


def build_llava(path: str | pathlib.Path, seed: int = 0) -> pathlib.Path:
    """A LLaVA-1.5-style model in `path`: 32 px images of 16 patch tokens, the llava-1.5 template."""
    import torch
    import transformers

    tokenizer = _byte_level_tokenizer(
        LLAVA_SPECIAL_TOKENS,
        bos_token="<s>",
        eos_token="</s>",
        unk_token="<unk>",
        pad_token="<pad>",
        extra_special_tokens={"image_token": "<image>"},
    )
    vision = transformers.CLIPVisionConfig(
        hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
        image_size=32, patch_size=8, projection_dim=32,
    )  # fmt: skip
    text = transformers.LlamaConfig(
        vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=2048,
        bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )  # fmt: skip
    config = transformers.LlavaConfig(
        vision_config=vision,
        text_config=text,
        image_token_index=tokenizer.convert_tokens_to_ids("<image>"),
        vision_feature_select_strategy="default",
        vision_feature_layer=-1,
    )
    torch.manual_seed(seed)
    model = transformers.LlavaForConditionalGeneration(config).eval()
    processor = transformers.LlavaProcessor(
        image_processor=transformers.CLIPImageProcessor(
            size={"shortest_edge": 32}, crop_size={"height": 32, "width": 32}
        ),
        tokenizer=tokenizer,
        patch_size=8,
        vision_feature_select_strategy="default",
        num_additional_image_tokens=1,  # the CLS token that "default" then drops
        chat_template=LLAVA_1_5_CHAT_TEMPLATE,
    )
    return _sharpen_and_save(
        model, processor, pathlib.Path(path), tokenizer.eos_token_id, tokenizer.pad_token_id
    )


def build_qwen2_vl(path: str | pathlib.Path, seed: int = 0) -> pathlib.Path:
    """A Qwen2-VL-style model in `path`: images resized to 56 x 56, 4 merged tokens each."""
    import torch
    import transformers

    tokenizer = _byte_level_tokenizer(
        QWEN2_VL_SPECIAL_TOKENS,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        extra_special_tokens={"image_token": "<|image_pad|>", "video_token": "<|video_pad|>"},
    )
    ids = tokenizer.convert_tokens_to_ids
    vision = transformers.Qwen2VLVisionConfig(
        depth=2, embed_dim=32, hidden_size=32, num_heads=2, mlp_ratio=2, patch_size=14,
        spatial_merge_size=2, temporal_patch_size=2,
    )  # fmt: skip
    # mrope_section splits the 8 rotary frequencies of a 16-wide head into time, height, width.
    text = transformers.Qwen2VLTextConfig(
        vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=2048,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 3, 3]},
        bos_token_id=None, eos_token_id=ids("<|im_end|>"), pad_token_id=ids("<|endoftext|>"),
    )  # fmt: skip
    config = transformers.Qwen2VLConfig(
        vision_config=vision,
        text_config=text,
        image_token_id=ids("<|image_pad|>"),
        video_token_id=ids("<|video_pad|>"),
        vision_start_token_id=ids("<|vision_start|>"),
        vision_end_token_id=ids("<|vision_end|>"),
    )
    torch.manual_seed(seed)
    model = transformers.Qwen2VLForConditionalGeneration(config).eval()
    pixels = 56 * 56
    processor = transformers.Qwen2VLProcessor(
        image_processor=transformers.Qwen2VLImageProcessor(
            size={"shortest_edge": pixels, "longest_edge": pixels}, patch_size=14, merge_size=2
        ),
        tokenizer=tokenizer,
        video_processor=transformers.Qwen2VLVideoProcessor(
            size={"shortest_edge": pixels, "longest_edge": pixels}, patch_size=14, merge_size=2
        ),
        chat_template=QWEN2_VL_CHAT_TEMPLATE,
    )
    return _sharpen_and_save(
        model, processor, pathlib.Path(path), ids("<|im_end|>"), ids("<|endoftext|>")
    )


def main(argv: list[str] | None = None) -> None:
    """`python -m ood_jax.testing.tiny_vlms DIR`: both models, as DIR/tiny_llava and
    DIR/tiny_qwen2_vl, for trying `eval-mllm --local` (or `transformers serve`) offline."""
    import argparse

    parser = argparse.ArgumentParser(
        prog="python -m ood_jax.testing.tiny_vlms", description=main.__doc__
    )
    parser.add_argument("out", help="directory to write the two model directories into")
    out = pathlib.Path(parser.parse_args(argv).out)
    for name, build in (("tiny_llava", build_llava), ("tiny_qwen2_vl", build_qwen2_vl)):
        print(f"{build(out / name)}: random weights, {name[5:]} chat template")


if __name__ == "__main__":
    main()
