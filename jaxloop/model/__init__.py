"""The built-in models (MLP, GPT), attention, precision policies, FLOPs counts, and the one
interface over a Linen or NNX module that the step trains."""
