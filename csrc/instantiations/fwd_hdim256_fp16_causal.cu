// Forward kernel, head dim 256, fp16, causal (top-left).
#include "../fa2/launch.hpp"
FA2_INSTANTIATE_FWD(256, kFP16, true)
