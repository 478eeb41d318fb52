"""Tiny Hugging Face models, one per family, built from configs in code (nothing is downloaded).

Each family knows how to build its model for an attention implementation, how to make inputs, and how
many attention sites one forward pass has (computed from the config), so tests, the graph-dump script
and the GPU tests share one table.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import torch
from torch.utils._python_dispatch import TorchDispatchMode

VOCAB = 128
HIDDEN = 64
HEADS = 4
LAYERS = 2
BATCH = 2
SEQ = 12
ENCODER_SEQ = 16
MAX_POSITIONS = 1024  # room for the GPU tests' longer sequences


@dataclass(frozen=True)
class Family:
    name: str
    make_config: Callable[[int], object]  # hidden size -> config
    model_class: str  # transformers class name
    make_inputs: Callable[[object, torch.device], dict]
    count_attention_sites: Callable[[object], int]
    # Why the pass must refuse this family's attention sites; None when they must all be rewritten.
    refusal: str | None = None
    # "outside_attention_interface": some attention is not routed through transformers' AttentionInterface.
    tags: frozenset = field(default_factory=frozenset)
    impls: tuple = ("eager", "sdpa")  # the attention implementations transformers has for the family

    def build(self, attn_implementation: str, dtype=torch.float32, device="cpu", hidden=HIDDEN, **config_overrides):
        """The model with seeded random weights, in eval mode; head_dim = hidden // HEADS."""
        import transformers

        torch.manual_seed(0)
        config = self.make_config(hidden)
        for name, value in config_overrides.items():
            setattr(config, name, value)
        model_cls = getattr(transformers, self.model_class)
        model = model_cls._from_config(config, attn_implementation=attn_implementation, dtype=dtype)
        return model.to(device).eval()


def _padding_mask(batch: int, seq: int, device) -> torch.Tensor:
    """Row 0 is full, row 1 has its last quarter padded (right padding, as in training batches)."""
    mask = torch.ones(batch, seq, dtype=torch.long, device=device)
    mask[1, seq - seq // 4 :] = 0
    return mask


def _token_ids(batch: int, seq: int, device) -> torch.Tensor:
    gen = torch.Generator().manual_seed(1)
    return torch.randint(3, VOCAB, (batch, seq), generator=gen).to(device)


def _decoder_inputs(config, device) -> dict:
    return {"input_ids": _token_ids(BATCH, SEQ, device), "attention_mask": _padding_mask(BATCH, SEQ, device)}


def _encoder_decoder_inputs(config, device) -> dict:
    return {
        "input_ids": _token_ids(BATCH, ENCODER_SEQ, device),
        "attention_mask": _padding_mask(BATCH, ENCODER_SEQ, device),
        "decoder_input_ids": _token_ids(BATCH, SEQ, device),
    }


def _image_inputs(config, device) -> dict:
    gen = torch.Generator().manual_seed(1)
    shape = (BATCH, config.num_channels, config.image_size, config.image_size)
    return {"pixel_values": torch.randn(shape, generator=gen).to(device)}


def _decoder_sites(config) -> int:
    return config.num_hidden_layers


def _encoder_decoder_sites(config) -> int:
    # Encoder self-attention, decoder self-attention and decoder cross-attention per layer.
    return config.encoder_layers + 2 * config.decoder_layers


def _t5_sites(config) -> int:
    return config.num_layers + 2 * config.num_decoder_layers


def _llama_config(hidden: int):
    from transformers import LlamaConfig

    return LlamaConfig(
        vocab_size=VOCAB, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=LAYERS,
        num_attention_heads=HEADS, num_key_value_heads=HEADS // 2, max_position_embeddings=MAX_POSITIONS,
    )


def _mistral_config(hidden: int):
    from transformers import MistralConfig

    # sliding_window < SEQ so the sliding-window mask really cuts keys.
    return MistralConfig(
        vocab_size=VOCAB, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=LAYERS,
        num_attention_heads=HEADS, num_key_value_heads=HEADS // 2, max_position_embeddings=MAX_POSITIONS,
        sliding_window=SEQ // 2,
    )


def _qwen2_config(hidden: int):
    from transformers import Qwen2Config

    return Qwen2Config(
        vocab_size=VOCAB, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=LAYERS,
        num_attention_heads=HEADS, num_key_value_heads=1, max_position_embeddings=MAX_POSITIONS,
    )


def _gpt2_config(hidden: int):
    from transformers import GPT2Config

    return GPT2Config(
        vocab_size=VOCAB, n_embd=hidden, n_layer=LAYERS, n_head=HEADS, n_positions=MAX_POSITIONS,
        bos_token_id=VOCAB - 1, eos_token_id=VOCAB - 1,
    )


def _bert_config(hidden: int):
    from transformers import BertConfig

    return BertConfig(
        vocab_size=VOCAB, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=LAYERS,
        num_attention_heads=HEADS, max_position_embeddings=MAX_POSITIONS,
    )


def _vit_config(hidden: int):
    from transformers import ViTConfig

    return ViTConfig(
        image_size=32, patch_size=8, hidden_size=hidden, intermediate_size=2 * hidden,
        num_hidden_layers=LAYERS, num_attention_heads=HEADS,
    )


def _t5_config(hidden: int):
    from transformers import T5Config

    return T5Config(
        vocab_size=VOCAB, d_model=hidden, d_kv=hidden // HEADS, d_ff=2 * hidden, num_layers=LAYERS,
        num_decoder_layers=LAYERS, num_heads=HEADS, relative_attention_num_buckets=8,
        decoder_start_token_id=0, pad_token_id=0,
    )


def _bart_config(hidden: int):
    from transformers import BartConfig

    return BartConfig(
        vocab_size=VOCAB, d_model=hidden, encoder_layers=LAYERS, decoder_layers=LAYERS,
        encoder_attention_heads=HEADS, decoder_attention_heads=HEADS, encoder_ffn_dim=2 * hidden,
        decoder_ffn_dim=2 * hidden, max_position_embeddings=MAX_POSITIONS,
    )


def _pegasus_x_config(hidden: int):
    from transformers import PegasusXConfig

    # Blocks of 4 tokens: the 16 encoder tokens make 4 blocks, the staggered layer's (padded by 2 on each side) 5.
    return PegasusXConfig(
        vocab_size=VOCAB, d_model=hidden, encoder_layers=LAYERS, decoder_layers=LAYERS,
        encoder_attention_heads=HEADS, decoder_attention_heads=HEADS, encoder_ffn_dim=2 * hidden,
        decoder_ffn_dim=2 * hidden, max_position_embeddings=MAX_POSITIONS, num_global_tokens=3, block_size=4,
    )


def _pegasus_x_sites(config) -> int:
    # Each encoder layer's global-token and block-local attention (the last layer's global tokens are not
    # read: their attention is dead code), and the decoder's self- and cross-attention.
    return 2 * config.encoder_layers - 1 + 2 * config.decoder_layers


def _gpt_neox_config(hidden: int):
    from transformers import GPTNeoXConfig

    return GPTNeoXConfig(
        vocab_size=VOCAB, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=LAYERS,
        num_attention_heads=HEADS, max_position_embeddings=MAX_POSITIONS, rotary_pct=0.25,
    )


def _phi_config(hidden: int):
    from transformers import PhiConfig

    return PhiConfig(
        vocab_size=VOCAB, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=LAYERS,
        num_attention_heads=HEADS, max_position_embeddings=MAX_POSITIONS, partial_rotary_factor=0.5,
    )


def _gemma_config(hidden: int):
    from transformers import GemmaConfig

    return GemmaConfig(
        vocab_size=VOCAB, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=LAYERS,
        num_attention_heads=HEADS, num_key_value_heads=1, head_dim=hidden // HEADS, max_position_embeddings=MAX_POSITIONS,
    )


def _gemma2_config(hidden: int):
    from transformers import Gemma2Config

    return Gemma2Config(
        vocab_size=VOCAB, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=LAYERS,
        num_attention_heads=HEADS, num_key_value_heads=2, head_dim=hidden // HEADS, max_position_embeddings=MAX_POSITIONS,
        sliding_window=SEQ // 2, attn_logit_softcapping=50.0, final_logit_softcapping=30.0,
    )


def _bloom_config(hidden: int):
    from transformers import BloomConfig

    return BloomConfig(vocab_size=VOCAB, hidden_size=hidden, n_layer=LAYERS, n_head=HEADS)


def _gpt_neox_japanese_config(hidden: int):
    from transformers import GPTNeoXJapaneseConfig

    return GPTNeoXJapaneseConfig(
        vocab_size=VOCAB, hidden_size=hidden, num_hidden_layers=LAYERS, num_attention_heads=HEADS,
        intermediate_multiple_size=2, max_position_embeddings=MAX_POSITIONS, bos_token_id=VOCAB - 1, eos_token_id=VOCAB - 1,
    )


def _falcon_config(hidden: int):
    from transformers import FalconConfig

    return FalconConfig(vocab_size=VOCAB, hidden_size=hidden, num_hidden_layers=LAYERS, num_attention_heads=HEADS)


def _squeezebert_config(hidden: int):
    from transformers import SqueezeBertConfig

    return SqueezeBertConfig(
        vocab_size=VOCAB, hidden_size=hidden, embedding_size=hidden, intermediate_size=2 * hidden,
        num_hidden_layers=LAYERS, num_attention_heads=HEADS, max_position_embeddings=MAX_POSITIONS,
    )


def _siglip_vision_config(hidden: int):
    from transformers import SiglipVisionConfig

    return SiglipVisionConfig(
        hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=LAYERS, num_attention_heads=HEADS,
        image_size=32, patch_size=8,
    )


def _wavlm_config(hidden: int):
    from transformers import WavLMConfig

    return WavLMConfig(
        hidden_size=hidden, num_hidden_layers=LAYERS, num_attention_heads=HEADS, intermediate_size=2 * hidden,
        conv_dim=(32, 32), conv_stride=(5, 4), conv_kernel=(10, 8), num_conv_pos_embeddings=16,
        num_conv_pos_embedding_groups=4, num_buckets=32, max_bucket_distance=64,
    )


def _xglm_config(hidden: int):
    from transformers import XGLMConfig

    return XGLMConfig(vocab_size=VOCAB, d_model=hidden, num_layers=LAYERS, attention_heads=HEADS, ffn_dim=2 * hidden)


def _gpt_oss_config(hidden: int):
    from transformers import GptOssConfig

    return GptOssConfig(
        vocab_size=VOCAB, hidden_size=hidden, intermediate_size=hidden, num_hidden_layers=LAYERS,
        num_attention_heads=HEADS, num_key_value_heads=HEADS // 2, head_dim=hidden // HEADS, num_local_experts=4,
        num_experts_per_tok=2, sliding_window=SEQ // 2, max_position_embeddings=MAX_POSITIONS,
    )


def _longformer_config(hidden: int):
    from transformers import LongformerConfig

    return LongformerConfig(
        vocab_size=VOCAB, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=LAYERS,
        num_attention_heads=HEADS, attention_window=4, max_position_embeddings=MAX_POSITIONS,
    )


def _audio_inputs(config, device) -> dict:
    gen = torch.Generator().manual_seed(1)
    return {"input_values": torch.randn((BATCH, 1600), generator=gen).to(device)}


EAGER_ONLY = ("eager",)

FAMILIES = {
    f.name: f
    for f in (
        Family("llama", _llama_config, "LlamaForCausalLM", _decoder_inputs, _decoder_sites, tags=frozenset({"gqa"})),
        Family("mistral", _mistral_config, "MistralForCausalLM", _decoder_inputs, _decoder_sites,
               tags=frozenset({"gqa", "sliding_window"})),
        Family("qwen2", _qwen2_config, "Qwen2ForCausalLM", _decoder_inputs, _decoder_sites, tags=frozenset({"mqa"})),
        Family("gpt2", _gpt2_config, "GPT2LMHeadModel", _decoder_inputs, lambda c: c.n_layer),
        Family("bert", _bert_config, "BertModel", _decoder_inputs, _decoder_sites, tags=frozenset({"encoder"})),
        Family("vit", _vit_config, "ViTModel", _image_inputs, _decoder_sites, tags=frozenset({"encoder"})),
        Family("t5", _t5_config, "T5ForConditionalGeneration", _encoder_decoder_inputs, _t5_sites,
               tags=frozenset({"position_bias", "cross_attention"})),
        Family("bart", _bart_config, "BartForConditionalGeneration", _encoder_decoder_inputs, _encoder_decoder_sites,
               tags=frozenset({"cross_attention"})),
        # Block-local attention over the global tokens' keys and the block's own, concatenated in the scores.
        Family("pegasus_x", _pegasus_x_config, "PegasusXForConditionalGeneration", _encoder_decoder_inputs,
               _pegasus_x_sites, tags=frozenset({"cross_attention", "concatenated_keys"}), impls=EAGER_ONLY),
        Family("gpt_neox", _gpt_neox_config, "GPTNeoXForCausalLM", _decoder_inputs, _decoder_sites),
        Family("phi", _phi_config, "PhiForCausalLM", _decoder_inputs, _decoder_sites),
        Family("gemma", _gemma_config, "GemmaForCausalLM", _decoder_inputs, _decoder_sites, tags=frozenset({"mqa"})),
        Family("gemma2", _gemma2_config, "Gemma2ForCausalLM", _decoder_inputs, _decoder_sites,
               tags=frozenset({"gqa", "sliding_window", "softcap"})),
        Family("bloom", _bloom_config, "BloomForCausalLM", _decoder_inputs, lambda c: c.n_layer,
               tags=frozenset({"alibi", "baddbmm"}), impls=EAGER_ONLY),
        Family("gpt_neox_japanese", _gpt_neox_japanese_config, "GPTNeoXJapaneseForCausalLM", _decoder_inputs,
               _decoder_sites, tags=frozenset({"baddbmm"}), impls=EAGER_ONLY),
        # max(scores + mask, finfo.min) before the softmax; P viewed as [B, H, M, K] and back.
        Family("xglm", _xglm_config, "XGLMForCausalLM", _decoder_inputs, lambda c: c.num_layers, impls=EAGER_ONLY),
        Family("falcon", _falcon_config, "FalconForCausalLM", _decoder_inputs, _decoder_sites,
               tags=frozenset({"mqa", "outside_attention_interface"})),
        Family("squeezebert", _squeezebert_config, "SqueezeBertModel", _decoder_inputs, _decoder_sites,
               tags=frozenset({"encoder", "permuted_layout"}), impls=EAGER_ONLY),
        # The pooling head's nn.MultiheadAttention is one more site (sequence-first layout).
        Family("siglip_vision", _siglip_vision_config, "SiglipVisionModel", _image_inputs, lambda c: c.num_hidden_layers + 1,
               tags=frozenset({"encoder", "multihead_attention", "outside_attention_interface"})),
        # F.multi_head_attention_forward with the gated relative position bias as its float attn_mask.
        Family("wavlm", _wavlm_config, "WavLMModel", _audio_inputs, _decoder_sites,
               tags=frozenset({"encoder", "multihead_attention", "position_bias"}), impls=EAGER_ONLY),
        Family("gpt_oss", _gpt_oss_config, "GptOssForCausalLM", _decoder_inputs, _decoder_sites,
               tags=frozenset({"gqa", "sinks"}), impls=EAGER_ONLY),
        # Sliding chunks: its scores are assembled from diagonals of chunked products.
        Family("longformer", _longformer_config, "LongformerModel", _decoder_inputs, _decoder_sites,
               refusal="unrecognised_scores", tags=frozenset({"encoder", "sliding_chunks"}), impls=EAGER_ONLY),
    )
}


def model_output(output) -> torch.Tensor:
    """The tensor a family's forward returns for comparison: logits, or the last hidden state."""
    logits = getattr(output, "logits", None)
    return logits if logits is not None else output.last_hidden_state


class CountOpCalls(TorchDispatchMode):
    """Counts calls of one op (e.g. ``torch.ops.fa2_inductor.flash_attention_fwd.default``) while active."""

    def __init__(self, op):
        super().__init__()
        self.op = op
        self.calls = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is self.op:
            self.calls += 1
        return func(*args, **(kwargs or {}))
