// Forward kernel, head dim 128, fp16, causal (top-left).
#include "../fa2/launch.hpp"
FA2_INSTANTIATE_FWD(128, kFP16, true)
