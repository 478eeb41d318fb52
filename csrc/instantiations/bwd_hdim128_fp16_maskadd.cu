// Backward kernel, head dim 128, fp16, additive mask.
#include "../fa2/bwd_launch.hpp"
FA2_INSTANTIATE_BWD(128, kFP16, false, kAdditive)
