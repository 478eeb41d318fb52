// Forward kernel, head dim 256, bf16, no causal mask.
#include "../fa2/launch.hpp"
FA2_INSTANTIATE_FWD(256, kBF16, false)
