"""Throughput and peers: our loop against a bare DeepSpeed loop, the Hugging Face Trainer and open_clip."""
