// Backward kernel, head dim 256, bf16, bool mask.
#include "../fa2/bwd_launch.hpp"
FA2_INSTANTIATE_BWD(256, kBF16, false, kBool)
