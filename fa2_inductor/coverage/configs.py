"""A family's default config made tiny: the same architecture with small sizes.

Generic over families: attributes with the usual names are set where the config has them; lists with one
entry per layer are cut to the new layer count; nested configs (text/vision/audio, encoder/decoder) are
shrunk the same way.
"""

from __future__ import annotations

HIDDEN = 64
HEADS = 4
KV_HEADS = 2
HEAD_DIM = HIDDEN // HEADS
LAYERS = 2
INTERMEDIATE = 2 * HIDDEN
VOCAB = 256
SPECIAL_TOKENS = 16  # the top of the vocabulary: special token ids; inputs use the ids below
MAX_POSITIONS = 512
IMAGE_SIZE = 32
PATCH_SIZE = 8
EXPERTS = 4
EXPERTS_PER_TOKEN = 2

_SIZES = {
    **dict.fromkeys(("hidden_size", "d_model", "n_embd", "embed_dim", "emb_dim", "dim", "word_embed_proj_dim"), HIDDEN),
    **dict.fromkeys(("num_attention_heads", "n_head", "num_heads", "n_heads", "encoder_attention_heads",
                     "decoder_attention_heads", "attention_heads"), HEADS),
    **dict.fromkeys(("num_key_value_heads", "num_kv_heads", "n_kv_heads", "multi_query_group_num"), KV_HEADS),
    **dict.fromkeys(("head_dim", "d_kv", "attention_head_size", "kv_channels", "v_head_dim"), HEAD_DIM),
    # Multi-head latent attention (DeepSeek-V2/V3): q/k head dim = nope + rope parts, low-rank projections.
    **dict.fromkeys(("qk_nope_head_dim", "qk_rope_head_dim"), HEAD_DIM // 2),
    **dict.fromkeys(("kv_lora_rank", "q_lora_rank"), 2 * HEAD_DIM),
    **dict.fromkeys(("n_group", "topk_group"), 1),  # expert groups must divide the (fewer) experts
    **dict.fromkeys(("intermediate_size", "d_ff", "ffn_dim", "encoder_ffn_dim", "decoder_ffn_dim", "n_inner",
                     "ffn_hidden_size", "moe_intermediate_size", "shared_expert_intermediate_size",
                     "ffn_size", "hidden_dim", "mlp_dim"), INTERMEDIATE),
    **dict.fromkeys(("num_experts", "num_local_experts", "n_routed_experts", "moe_num_experts"), EXPERTS),
    **dict.fromkeys(("num_experts_per_tok", "moe_topk", "top_k", "num_selected_experts"), EXPERTS_PER_TOKEN),
    "vocab_size": VOCAB,
    "rotary_dim": HEAD_DIM // 2,  # the rotated part of a head (CodeGen, GPT-J)
}
_LAYER_COUNTS = ("num_hidden_layers", "num_layers", "n_layer", "n_layers", "encoder_layers", "decoder_layers",
                 "num_decoder_layers", "num_encoder_layers")
_CAPS = {"max_position_embeddings": MAX_POSITIONS, "n_positions": MAX_POSITIONS, "max_source_positions": 64,
         "max_target_positions": MAX_POSITIONS}
_IMAGE = {"image_size": IMAGE_SIZE, "patch_size": PATCH_SIZE}


def tiny_config(config_class):
    """The family's default config with tiny sizes (a new object; the defaults are kept otherwise)."""
    return shrink(config_class())


def shrink(config):
    from transformers import PretrainedConfig

    for name, value in list(vars(config).items()):
        if isinstance(value, PretrainedConfig):
            setattr(config, name, shrink(value))
    overrides = _overrides(config)
    try:  # through the constructor: configs derive sizes (and check them) in __init__
        shrunk = type(config)(**{**_sub_configs(config), **overrides})
    except Exception:
        shrunk = config
    for name, value in overrides.items():
        setattr(shrunk, name, value)
    return shrunk


def _per_layer_entries(values: dict, layers: int) -> dict:
    """Per-layer lists and patterns (layer_types, "M-M*" strings, ...) cut to the kept layers, and layer
    indices/periods moved inside them. The kept layers are the first of each kind of the first such list,
    so a hybrid model (mostly linear attention or Mamba, some full attention) keeps an attention layer."""
    per_layer = {name: entries for name, entries in values.items()
                 if isinstance(entries, (list, tuple, str)) and len(entries) == layers and not name.startswith("_")}
    kinds = next(iter(per_layer.values()), range(layers))
    kept = sorted({kinds.index(kind) for kind in kinds})[:LAYERS]
    kept += [i for i in range(layers) if i not in kept][: LAYERS - len(kept)]
    kept.sort()
    cut = {}
    for name, entries in per_layer.items():
        picked = [entries[i] for i in kept]
        cut[name] = "".join(picked) if isinstance(entries, str) else type(entries)(picked)
    for name, value in values.items():  # which layers have attention, by index or by period
        if (name.endswith(("layer_indices", "layers_idxs", "attn_idxs")) and isinstance(value, (list, tuple))
                and value and all(isinstance(i, int) for i in value)):
            cut[name] = type(value)([LAYERS - 1])
        elif name.endswith("_period") and isinstance(value, int) and value > LAYERS:
            cut[name] = LAYERS
        elif name.endswith("_offset") and isinstance(value, int) and value >= LAYERS:
            cut[name] = LAYERS - 1
    return cut


def _rescaled(sections: list, total: int) -> list:
    """``sections`` scaled to add up to ``total`` (each at least 1)."""
    scaled = [max(1, section * total // sum(sections)) for section in sections]
    scaled[0] += total - sum(scaled)
    return scaled


def _sub_configs(config) -> dict:
    from transformers import PretrainedConfig

    return {name: value for name, value in vars(config).items() if isinstance(value, PretrainedConfig)}


def _overrides(config) -> dict:
    values = vars(config)
    config_class = type(config)
    overrides = {name: size for name, size in _SIZES.items() if isinstance(values.get(name), int)}
    if "head_dim" in overrides or "d_kv" in overrides:  # kept consistent with the heads
        heads = overrides.get("num_attention_heads", overrides.get("num_heads", HEADS))
        for name in ("head_dim", "d_kv"):
            if name in overrides:
                overrides[name] = HIDDEN // heads
    if "qk_rope_head_dim" in overrides:  # MLA: head_dim is the rope part; K/V come per head from the latent
        overrides.update({name: value for name, value in (("head_dim", HEAD_DIM // 2), ("num_key_value_heads", HEADS))
                          if name in overrides})
    for name in _LAYER_COUNTS:
        layers = values.get(name)
        if isinstance(layers, int) and layers > LAYERS:
            overrides[name] = LAYERS
            overrides.update(_per_layer_entries(values, layers))
    for name, cap in _CAPS.items():
        if isinstance(values.get(name), int) and values[name] > cap:
            overrides[name] = cap
    for name, size in _IMAGE.items():
        if isinstance(values.get(name), int):
            overrides[name] = size
    if isinstance(values.get("output_stride"), int) and isinstance(values.get("patch_size"), int):
        # Transformer blocks deep in a convolutional backbone (MobileViT): an image large enough for 2 x 2
        # patches at the deepest stride, so that their attention runs over several tokens, not one.
        overrides["patch_size"] = min(values["patch_size"], PATCH_SIZE)
        overrides["image_size"] = 2 * overrides["patch_size"] * values["output_stride"]
    if isinstance(values.get("sliding_window"), int) and values["sliding_window"] > 0:
        overrides["sliding_window"] = 8  # shorter than the inputs, so a window really cuts keys
    for name in ("rope_parameters", "rope_scaling"):  # multimodal RoPE: sections add up to half a head
        rope = values.get(name)
        uses_mrope = "mrope_section" in getattr(config_class, "ignore_keys_at_rope_validation", ())
        if isinstance(rope, dict) and (uses_mrope or "mrope_section" in rope):
            # absent: the modelling code's default, Qwen2-VL's 16/24/24 split of a 128-dim head
            overrides[name] = {**rope, "mrope_section": _rescaled(rope.get("mrope_section", [16, 24, 24]), HEAD_DIM // 2)}
    if "vocab_size" in overrides:  # special tokens moved into the top of the tiny vocabulary, kept distinct
        special = [name for name, token_id in values.items() if name.endswith("token_id")
                   and isinstance(token_id, int) and token_id >= VOCAB]
        overrides.update({name: VOCAB - 1 - i for i, name in enumerate(special)})
    return overrides
