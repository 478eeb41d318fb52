// Forward kernel, head dim 256, bf16, causal (top-left).
#include "../fa2/launch.hpp"
FA2_INSTANTIATE_FWD(256, kBF16, true)
