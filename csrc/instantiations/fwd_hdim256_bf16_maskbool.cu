// Forward kernel, head dim 256, bf16, boolean attention mask (True = attend), with its pre-pass.
#include "../fa2/launch.hpp"
FA2_INSTANTIATE_FWD_MASKED(256, kBF16, kBool)
