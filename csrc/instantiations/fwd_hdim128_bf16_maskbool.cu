// Forward kernel, head dim 128, bf16, boolean attention mask (True = attend), with its pre-pass.
#include "../fa2/launch.hpp"
FA2_INSTANTIATE_FWD_MASKED(128, kBF16, kBool)
