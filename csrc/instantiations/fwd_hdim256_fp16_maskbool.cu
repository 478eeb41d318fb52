// Forward kernel, head dim 256, fp16, boolean attention mask (True = attend), with its pre-pass.
#include "../fa2/launch.hpp"
FA2_INSTANTIATE_FWD_MASKED(256, kFP16, kBool)
