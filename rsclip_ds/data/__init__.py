"""Training data: webdataset tar shards -> decoded, tokenized, full micro-batches per rank.

    sources.py       shard specs (braces, globs, lists, pipe:/http urls) -> urls; sample counts
    schedule.py      which samples (shard pieces) each (rank, worker) stream reads per epoch, batches, coverage
    tar.py           tar members -> samples; broken tars counted, never raised
    transforms.py    the one image transform (training and evaluation), sample decoding; Normalize (reference)
    bad.py           bad-data kinds, per-stream counts, the stop threshold (DataError)
    where.py         the row filter language (make-shards --where, data.where)
    filter_counts.py the samples data.where keeps per shard, counted at start-up ('exact')
    loader.py        the streams, the DataLoader, resumable position: build_train_loader
    shm.py           /dev/shm: what the workers' batches in flight need, the start-up check
    workers.py       a worker that dies: named, replaced at the same position, LoaderWorkerDied (exit 7)
    remap.py         a saved position continued on another number of ranks (workers, micro batch)
    tokenizer.py     training a caption tokenizer; tokenize()
    shard_writer.py  caption datasets as users have them -> shards + index (make-shards)
    synthetic.py     synthetic overhead-imagery shards and evaluation sets (make-synthetic)
    near_duplicates.py  perceptual hashes and their exact index (check-leakage, make-shards --exclude-near)

Full guide: docs/guides/data.md.
"""

from rsclip_ds.data.bad import BAD_KINDS, DataError, StreamCounter
from rsclip_ds.data.loader import TrainLoader, build_train_loader
from rsclip_ds.data.shm import check_shared_memory, shared_memory_need
from rsclip_ds.data.schedule import EpochSchedule, build_epoch_schedule
from rsclip_ds.data.sources import expand_sources, expand_urls, shard_counts, shard_counts_from_rank0
from rsclip_ds.data.tar import read_shard
from rsclip_ds.data.transforms import ImageTransform, Normalize, SampleDecoder

__all__ = ["BAD_KINDS", "DataError", "EpochSchedule", "ImageTransform", "Normalize", "SampleDecoder",
           "StreamCounter", "TrainLoader", "build_epoch_schedule", "build_train_loader",
           "check_shared_memory", "expand_sources", "expand_urls", "read_shard", "shard_counts",
           "shard_counts_from_rank0", "shared_memory_need"]
