// Backward kernel, head dim 128, bf16, bool mask.
#include "../fa2/bwd_launch.hpp"
FA2_INSTANTIATE_BWD(128, kBF16, false, kBool)
