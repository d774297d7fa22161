"""Streaming training data: webdataset tar shards -> decoded, tokenized, full micro-batches.

Shard assignment (the part that must agree across ranks):
  every epoch e, all ranks shuffle the full shard list with the same seed (seed, e); rank r
  takes shards[r::world_size] and DataLoader worker w of that rank takes its [w::workers].
  Epochs repeat forever: the trainer stops after a fixed number of steps, so a rank with one
  shard more than another never runs dry and never hangs a collective (see notes/data.md).
Within a worker: samples pass a shuffle buffer seeded by (seed, rank, worker), are decoded
(JPEG DCT-domain downscale via ``Image.draft``), resized, normalised, randomly flipped with a
generator seeded by (seed, rank, worker) and batched; the captions of a batch are tokenized
at once. The DataLoader takes batches from its workers round-robin, so the same seed, rank,
world size and worker count always give the same batch sequence.
"""

from __future__ import annotations

import glob
import hashlib
import io
import itertools
import logging
import random
from functools import partial
from pathlib import Path
from typing import Iterator, Sequence

import braceexpand
import numpy as np
import torch
import webdataset as wds
from PIL import Image
from torch.utils.data import IterableDataset, get_worker_info

from rsclip_ds.config import DataConfig
from rsclip_ds.tokenizer import tokenize

log = logging.getLogger(__name__)
_REMOTE_PREFIXES = ("pipe:", "http://", "https://", "gs://", "hf://", "ais://")


# --------------------------------------------------------------------------- shard lists

def _read_list(path: Path) -> list[str]:
    """A shard list: one url per line, '#' comments; relative paths are relative to the list."""
    lines = (ln.split("#", 1)[0].strip() for ln in path.read_text().splitlines())
    return [ln if ln.startswith(_REMOTE_PREFIXES) or Path(ln).is_absolute() else str(path.parent / ln)
            for ln in lines if ln]


def _expand_one(item: str, spec: str) -> list[str]:
    """One brace-expanded entry -> urls (glob, list file, remote url or existing local file)."""
    if item.startswith(_REMOTE_PREFIXES):
        return [item]
    local = item.removeprefix("file:")
    if any(c in local for c in "*?["):
        found = sorted(glob.glob(local))
    elif not Path(local).is_file():
        found = []
    elif local.endswith(".txt"):
        found = [url for line in _read_list(Path(local)) for url in _expand_one(line, spec)]
    else:
        found = [item]
    if not found:
        raise ValueError(f"data.train_shards {spec!r}: {item!r} matches no file; check the path "
                         "(a brace pattern, a glob, a .txt shard list or a pipe:/http(s): url)")
    return found


def expand_urls(spec: str) -> list[str]:
    """'a-{000..009}.tar::more/*.tar::list.txt::pipe:cat x.tar' -> list of shard urls, in order."""
    urls = [url for part in spec.split("::") if part.strip()
            for item in braceexpand.braceexpand(part.strip()) for url in _expand_one(item, spec)]
    if not urls:
        raise ValueError(f"data.train_shards {spec!r} names no shards")
    return urls


def derive_seed(*parts) -> int:
    """Stable 63-bit seed from ints/strings (Python's hash() of str is salted per process)."""
    digest = hashlib.blake2b(repr(parts).encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 1


def shards_for_epoch(urls: Sequence[str], epoch: int, *, seed: int, rank: int, world_size: int,
                     worker: int = 0, num_workers: int = 1) -> list[str]:
    """The shards worker ``worker`` of rank ``rank`` reads in ``epoch``; disjoint, covering all."""
    order = list(urls)
    random.Random(derive_seed(seed, "shards", epoch)).shuffle(order)  # same on every rank
    return order[rank::world_size][worker::num_workers]


def _worker() -> tuple[int, int]:
    """(worker id, worker count) of the calling DataLoader worker; (0, 1) in the main process."""
    info = get_worker_info()
    return (0, 1) if info is None else (info.id, info.num_workers)


class ShardStream(IterableDataset):
    """Endless {"url": ...} stream for this rank and worker, reshuffled every epoch."""

    def __init__(self, urls: Sequence[str], *, seed: int, rank: int, world_size: int):
        super().__init__()
        self.urls, self.seed, self.rank, self.world_size = list(urls), seed, rank, world_size

    def __iter__(self) -> Iterator[dict]:
        worker, num_workers = _worker()
        for epoch in itertools.count():
            for url in shards_for_epoch(self.urls, epoch, seed=self.seed, rank=self.rank,
                                        world_size=self.world_size, worker=worker,
                                        num_workers=num_workers):
                yield {"url": url}


# --------------------------------------------------------------------------- per-sample stages

def _shuffle_stage(src: Iterator[dict], *, bufsize: int, seed: int, rank: int) -> Iterator[dict]:
    # Seeded here, not when the pipeline is built: the worker id is only known inside the worker.
    rng = random.Random(derive_seed(seed, "samples", rank, _worker()[0]))
    yield from wds.shuffle(bufsize, rng=rng)(src)


def _decode_image(key: str, data: bytes, *, size: int) -> Image.Image:
    """webdataset decoder handler (only called for the configured image keys) -> PIL RGB."""
    img = Image.open(io.BytesIO(data))
    img.draft("RGB", (size, size))  # JPEG: decode at the smallest 1/2^k scale still >= size (~2x faster)
    return img.convert("RGB")


def _pick(sample: dict, *, image_keys: list[str], caption_keys: list[str]) -> dict:
    image = next((sample[k] for k in image_keys if k in sample), None)
    caption = next((sample[k] for k in caption_keys if k in sample), None)
    if image is None or caption is None:
        members = sorted(k for k in sample if not k.startswith("__"))
        raise ValueError(f"sample {sample.get('__key__')!r} in {sample.get('__url__')} has members "
                         f"{members}; set data.image_key (now {image_keys}) / data.caption_key "
                         f"(now {caption_keys}) to match")
    if isinstance(caption, bytes):
        caption = caption.decode("utf-8")
    return {"image": image, "caption": caption.strip(), "key": sample["__key__"]}


def _to_tensor(img: Image.Image, size: int, mean: torch.Tensor, std: torch.Tensor) -> torch.Tensor:
    img = img.resize((size, size), Image.Resampling.BICUBIC)  # squash, no crop (as SigLIP)
    pixels = torch.from_numpy(np.asarray(img, dtype=np.uint8).copy())  # (H, W, 3)
    pixels = pixels.permute(2, 0, 1).float().div_(255.0)  # (3, H, W) in [0, 1]
    return (pixels - mean) / std


def _preprocess_stage(src: Iterator[dict], *, size: int, mean: torch.Tensor, std: torch.Tensor,
                      flip: bool, seed: int, rank: int) -> Iterator[dict]:
    rng = random.Random(derive_seed(seed, "flip", rank, _worker()[0]))
    for sample in src:
        img = sample["image"]
        if flip and rng.random() < 0.5:
            img = img.transpose(Image.Transpose.FLIP_LEFT_RIGHT)
        yield {"pixel_values": _to_tensor(img, size, mean, std), "caption": sample["caption"],
               "key": sample["key"]}


class Collate:
    """Samples -> {"pixel_values": (B, 3, H, W) float32, "input_ids": (B, L) int64[, "keys"]}."""

    def __init__(self, tokenizer, max_text_length: int, return_keys: bool = False):
        self.tokenizer, self.max_text_length, self.return_keys = tokenizer, max_text_length, return_keys

    def __call__(self, samples: list[dict]) -> dict:
        batch = {"pixel_values": torch.stack([s["pixel_values"] for s in samples]),  # (B, 3, H, W)
                 "input_ids": tokenize(self.tokenizer, [s["caption"] for s in samples],
                                       self.max_text_length)}  # (B, L)
        if self.return_keys:
            batch["keys"] = [s["key"] for s in samples]
        return batch


# --------------------------------------------------------------------------- the loader

def _split_keys(keys: str) -> list[str]:
    return [k.strip().lower() for k in keys.split(";") if k.strip()]


def _rank_workers(num_shards: int, rank: int, world_size: int, num_workers: int) -> int:
    """Worker count for this rank: at most one worker per shard of the rank."""
    if num_shards < world_size:
        raise ValueError(f"{num_shards} training shard(s) cannot feed {world_size} ranks: each rank needs "
                         f"at least one. Write more, smaller shards (`rsclip-ds make-synthetic "
                         f"--shard-size` smaller) or launch fewer ranks.")
    rank_shards = len(range(rank, num_shards, world_size))
    if num_workers > rank_shards:
        log.warning("rank %d has %d shard(s) for data.num_workers=%d; using %d worker(s) so that "
                    "none idles", rank, rank_shards, num_workers, rank_shards)
        return rank_shards
    return num_workers


def build_train_pipeline(cfg: DataConfig, urls: Sequence[str], *, tokenizer, image_size: int,
                         image_mean, image_std, max_text_length: int, micro_batch_size: int,
                         rank: int, world_size: int, seed: int, return_keys: bool = False,
                         flip: bool = False) -> wds.DataPipeline:
    """The per-worker pipeline (an endless IterableDataset of full batches)."""
    mean = torch.tensor(image_mean, dtype=torch.float32).view(3, 1, 1)
    std = torch.tensor(image_std, dtype=torch.float32).view(3, 1, 1)
    image_keys = _split_keys(cfg.image_key)
    shuffle = (partial(_shuffle_stage, bufsize=cfg.shuffle_buffer, seed=seed, rank=rank)
               if cfg.shuffle_buffer > 1 else None)  # DataPipeline skips None stages
    return wds.DataPipeline(
        ShardStream(urls, seed=seed, rank=rank, world_size=world_size),
        wds.tarfile_to_samples(),
        shuffle,  # before decoding: the buffer then holds compressed bytes
        wds.decode(partial(_decode_image, size=image_size), only=image_keys),
        wds.map(partial(_pick, image_keys=image_keys, caption_keys=_split_keys(cfg.caption_key))),
        partial(_preprocess_stage, size=image_size, mean=mean, std=std, flip=flip, seed=seed, rank=rank),
        wds.batched(micro_batch_size, collation_fn=Collate(tokenizer, max_text_length, return_keys),
                    partial=False),
    )


def build_train_loader(cfg: DataConfig, *, tokenizer, image_size: int, image_mean, image_std,
                       max_text_length: int, micro_batch_size: int, rank: int, world_size: int,
                       seed: int, return_keys: bool = False, flip: bool = False) -> wds.WebLoader:
    """Endless iterable of full micro-batches for ``rank`` (see the module docstring).

    ``flip`` is off by default: a mirrored image no longer matches a caption that says
    "in the top left" (the synthetic captions, and many remote-sensing captions, do)."""
    if cfg.train_shards is None:
        raise ValueError("data.train_shards is not set; point it at tar shards "
                         "(e.g. --set data.train_shards='data/train-{000000..000007}.tar')")
    if not 0 <= rank < world_size:
        raise ValueError(f"rank {rank} is outside world size {world_size}")
    urls = expand_urls(cfg.train_shards)
    workers = _rank_workers(len(urls), rank, world_size, cfg.num_workers)
    pipeline = build_train_pipeline(
        cfg, urls, tokenizer=tokenizer, image_size=image_size, image_mean=image_mean,
        image_std=image_std, max_text_length=max_text_length, micro_batch_size=micro_batch_size,
        rank=rank, world_size=world_size, seed=seed, return_keys=return_keys, flip=flip)
    # batch_size=None: batching happens inside the pipeline (one tokenizer call per batch).
    return wds.WebLoader(pipeline, batch_size=None, num_workers=workers,
                         persistent_workers=workers > 0, pin_memory=torch.cuda.is_available())
