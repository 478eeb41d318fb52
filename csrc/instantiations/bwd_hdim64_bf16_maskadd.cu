// Backward kernel, head dim 64, bf16, additive mask.
#include "../fa2/bwd_launch.hpp"
FA2_INSTANTIATE_BWD(64, kBF16, false, kAdditive)
