// Forward kernel, head dim 128, bf16, no causal mask.
#include "../fa2/launch.hpp"
FA2_INSTANTIATE_FWD(128, kBF16, false)
