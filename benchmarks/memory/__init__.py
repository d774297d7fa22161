"""Memory per rank against the memory model: model states, activations, the peak, the build, checkpoints, page faults."""
