"""The contrastive losses and accumulation modes: memory and time against the global batch."""
