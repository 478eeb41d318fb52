// Backward kernel, head dim 256, fp16, no mask.
#include "../fa2/bwd_launch.hpp"
FA2_INSTANTIATE_BWD(256, kFP16, false, kNone)
