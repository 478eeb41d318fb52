"""The families the installed transformers knows, and one tiny model of each with inputs for it.

A family is a ``model_type`` of transformers' auto mappings. Its model is the seq2seq LM or causal LM
class where it has one, for logits, else its base model; the config is ``configs.tiny_config`` of the
family's config class. Inputs follow the model's ``main_input_name``: token ids with a right-padded
attention mask (one row full, one with its last quarter padded, as a tokenizer pads a batch), images,
audio samples or audio features; dual encoders (CLIP-like) get images too; encoder-decoder models also get decoder token ids.
"""

from __future__ import annotations

import inspect

import torch

from . import configs

BATCH = 2
SEQ = 12
DECODER_SEQ = 8
AUDIO_SAMPLES = 4000
AUDIO_FRAMES = 32
IMPLEMENTATIONS = ("eager", "sdpa")


def families() -> list[str]:
    """Every family with a base model class in the installed transformers, sorted."""
    from transformers.models.auto import modeling_auto

    return sorted(modeling_auto.MODEL_MAPPING_NAMES)


def model_class_name(family: str) -> str:
    from transformers.models.auto import modeling_auto as auto

    # Encoder-decoder heads first: some families also have a decoder-only causal LM (Whisper).
    for mapping in (auto.MODEL_FOR_SEQ_TO_SEQ_CAUSAL_LM_MAPPING_NAMES, auto.MODEL_FOR_SPEECH_SEQ_2_SEQ_MAPPING_NAMES,
                    auto.MODEL_FOR_CAUSAL_LM_MAPPING_NAMES, auto.MODEL_MAPPING_NAMES):
        name = mapping.get(family)
        if name:
            return name if isinstance(name, str) else name[0]
    raise KeyError(f"no model class for family {family!r}")


def model_class(family: str):
    import transformers

    return getattr(transformers, model_class_name(family))


def implementations(family: str) -> tuple[str, ...]:
    """The attention implementations the family's model class supports, of ``IMPLEMENTATIONS``."""
    cls = model_class(family)
    return tuple(impl for impl in IMPLEMENTATIONS if impl == "eager" or getattr(cls, "_supports_sdpa", False))


def build(family: str, attn_implementation: str):
    """(model in eval mode with seeded random float32 weights, inputs dict)."""
    from transformers import AutoConfig

    cls = model_class(family)
    config = configs.tiny_config(type(AutoConfig.for_model(family)))
    torch.manual_seed(0)
    model = cls._from_config(config, attn_implementation=attn_implementation, dtype=torch.float32).eval()
    return model, make_inputs(model)


def make_inputs(model) -> dict:
    config = model.config
    parameters = inspect.signature(model.forward).parameters
    generator = torch.Generator().manual_seed(1)
    name = model.main_input_name
    if name == "input_ids":
        inputs = {"input_ids": _token_ids(config, SEQ, generator)}
    elif name == "pixel_values":
        inputs = {"pixel_values": torch.randn(_image_shape(config), generator=generator)}
    elif name == "input_values":
        inputs = {"input_values": torch.randn(BATCH, AUDIO_SAMPLES, generator=generator)}
    elif name == "input_features":
        inputs = {"input_features": torch.randn(_feature_shape(config), generator=generator)}
    else:
        raise ValueError(f"no inputs for main input {name!r}")
    if name == "input_ids" and "attention_mask" in parameters:
        inputs["attention_mask"] = _right_padded_mask(SEQ)
    if name == "input_ids" and "pixel_values" in parameters and _is_dual_encoder(config):  # CLIP-like: both towers
        inputs["pixel_values"] = torch.randn(_image_shape(config), generator=generator)
    if "decoder_input_ids" in parameters and getattr(config, "is_encoder_decoder", False):
        inputs["decoder_input_ids"] = _token_ids(config, DECODER_SEQ, generator)
    return inputs


def _token_ids(config, seq: int, generator) -> torch.Tensor:
    vocab = _text_attribute(config, "vocab_size") or configs.VOCAB
    return torch.randint(3, max(4, vocab - configs.SPECIAL_TOKENS), (BATCH, seq), generator=generator)


def _right_padded_mask(seq: int) -> torch.Tensor:
    mask = torch.ones(BATCH, seq, dtype=torch.long)
    mask[1, seq - seq // 4 :] = 0
    return mask


def _image_shape(config) -> tuple:
    vision = getattr(config, "vision_config", None) or config
    size = getattr(vision, "image_size", configs.IMAGE_SIZE)
    height, width = (size, size) if isinstance(size, int) else tuple(size)[-2:]
    return (BATCH, getattr(vision, "num_channels", 3), height, width)


def _feature_shape(config) -> tuple:
    if hasattr(config, "num_mel_bins"):  # Whisper-like: mel bins × frames, frames = 2 × encoder positions
        frames = 2 * getattr(config, "max_source_positions", AUDIO_FRAMES // 2)
        return (BATCH, config.num_mel_bins, frames)
    if hasattr(config, "input_feat_per_channel"):  # Speech2Text-like: frames × features
        return (BATCH, AUDIO_FRAMES, config.input_feat_per_channel * getattr(config, "input_channels", 1))
    if hasattr(config, "feature_size"):
        return (BATCH, AUDIO_FRAMES, config.feature_size)
    raise ValueError("no known shape for input_features")


def _is_dual_encoder(config) -> bool:
    """Text and vision towers side by side (CLIP, SigLIP, ...): the forward needs both inputs."""
    return hasattr(config, "text_config") and hasattr(config, "vision_config") and hasattr(config, "projection_dim")


def _text_attribute(config, name: str):
    text = getattr(config, "text_config", None) or getattr(config, "decoder", None)
    return getattr(config, name, None) or getattr(text, name, None)
