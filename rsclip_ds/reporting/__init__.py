"""What a run tells while it runs and when it ends: the progress line (progress), metrics.jsonl and
DeepSpeed's monitor events (metrics), per-rank step time, data wait and peak memory (load), the
run summary (summary) and the training curves (curves)."""
