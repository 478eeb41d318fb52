// Forward kernel, head dim 64, fp16, causal (top-left).
#include "../fa2/launch.hpp"
FA2_INSTANTIATE_FWD(64, kFP16, true)
