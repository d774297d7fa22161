"""Will it fit, and how fast: pure functions over a model's shape and a ZeRO strategy.

memory (bytes per rank: model states, the peak), activations (the bytes a forward saves for
backward, measured on the meta device), comms (bytes each collective sends
per step), flops (model FLOPs per sample, MFU) and planner (the profile picker that `rsclip-ds
plan` prints). Nothing here starts a process or touches a device."""
