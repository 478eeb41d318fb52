// Forward kernel, head dim 256, bf16, additive attention mask (float32/bf16/fp16), with its pre-pass.
#include "../fa2/launch.hpp"
FA2_INSTANTIATE_FWD_MASKED(256, kBF16, kAdditive)
