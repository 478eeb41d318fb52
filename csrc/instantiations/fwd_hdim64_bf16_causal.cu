// Forward kernel, head dim 64, bf16, causal (top-left).
#include "../fa2/launch.hpp"
FA2_INSTANTIATE_FWD(64, kBF16, true)
