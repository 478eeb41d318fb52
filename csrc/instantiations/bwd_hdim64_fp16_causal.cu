// Backward kernel, head dim 64, fp16, causal (top-left).
#include "../fa2/bwd_launch.hpp"
FA2_INSTANTIATE_BWD(64, kFP16, true, kNone)
