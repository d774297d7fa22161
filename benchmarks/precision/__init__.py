"""Precision: bf16 gradient accumulation and bf16 master weights against fp32."""
