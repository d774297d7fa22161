"""Communication and scaling: bytes per step against the communication model, scaling on paper, heartbeat traffic."""
