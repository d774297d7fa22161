"""Embedding evaluation sets through the model, split over ranks, and computing the metrics.

Embedding runs in batches through the model's own ``forward()`` (the engine's under ZeRO-3,
which gathers partitioned parameters only inside a module's forward), with the items split over
ranks and all-gathered, so every rank computes identical metrics. Images go through the
training loader's transform with augmentation off (data/transforms.py) and reach the model as
uint8, as training's do: one normalisation, the model's (model.normalize_pixels).

Unreadable images (missing, truncated, not an image) are skipped: the rank that meets one logs
it, embeds zeros in its place and marks it; the marks are gathered with the embeddings, and
`evaluate` leaves those images (and, for retrieval, their captions) out of the metrics, reports
how many, and stops with DataError when more than ``eval.max_bad_fraction`` of a set is unreadable.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Sequence

import numpy as np
import torch
import torch.distributed as dist
from rich.progress import Progress

from rsclip_ds.data.bad import DataError
from rsclip_ds.data.tokenizer import tokenize
from rsclip_ds.data.geotiff import BandChoice
from rsclip_ds.data.transforms import IMAGE_ERRORS, ImageTransform
from rsclip_ds.evaluation.datasets import EvalSets
from rsclip_ds.evaluation.metrics import retrieval_metrics, zero_shot_metrics
from rsclip_ds.evaluation.samples import classification_rows, retrieval_rows, unreadable_errors
from rsclip_ds.model import ModelBundle

log = logging.getLogger("rsclip_ds")
SHOWN_PER_RANK = 3   # unreadable images named in the log per rank and set (then one count line)


def eval_transform(bundle: ModelBundle, bands: BandChoice | None = None) -> ImageTransform:
    """The training loader's image transform with augmentation off (uint8 (S, S, 3) out);
    ``bands``: multispectral TIFFs -> RGB (eval.bands)."""
    return ImageTransform.from_config(bundle.image_size, bands=bands)


def uint8_batch(transform: ImageTransform, images: Sequence) -> torch.Tensor:
    """Images -> uint8 (N, 3, S, S), the layout the training loader hands over (a view of
    (N, S, S, 3) storage); the model normalises it."""
    return torch.from_numpy(np.stack([transform(p) for p in images])).permute(0, 3, 1, 2)


def read_images(transform: ImageTransform, paths: Sequence[Path]) -> tuple[torch.Tensor, list[str | None]]:
    """Like uint8_batch for image files, but an unreadable or missing one becomes zeros:
    -> uint8 (N, 3, S, S) and, per image, None or why it could not be read."""
    size = transform.size
    out = np.zeros((len(paths), size, size, 3), np.uint8)
    errors: list[str | None] = []
    for i, path in enumerate(paths):
        try:
            out[i] = transform(path)
            errors.append(None)
        except IMAGE_ERRORS as err:
            errors.append(f"{type(err).__name__}: {err}")
    return torch.from_numpy(out).permute(0, 3, 1, 2), errors


@dataclass
class Embedder:
    """Runs `model(pixel_values, input_ids)` (an engine or a DualEncoder) in batches.

    Items are split over ranks (rank r takes items r, r + W, ...). Every rank runs the same
    number of forward calls, padding with a 1-item dummy when its share is used up: under ZeRO-3
    each forward gathers parameters with collectives every rank must join."""
    model: Callable
    bundle: ModelBundle
    batch_size: int
    rank: int = 0
    world_size: int = 1
    device: torch.device | str = "cpu"
    progress: bool = True
    logit_scale: torch.Tensor | None = None   # set by embed(): the model's log temperature
    logit_bias: torch.Tensor | None = None
    image_ok: torch.Tensor | None = None      # set by embed(): (N,) bool, False where unreadable
    bands: BandChoice | None = None            # eval.bands: multispectral TIFFs -> RGB
    unreadable: list[tuple[Path, str]] = field(default_factory=list)   # this rank's, from the last embed()

    def embed(self, image_paths: Sequence[Path], texts: Sequence[str], what: str) -> tuple[torch.Tensor, torch.Tensor]:
        """-> image embeddings (N, D), text embeddings (M, D), float32, on every rank, in order."""
        b, w, r = self.batch_size, self.world_size, self.rank
        mine_img, mine_txt = list(image_paths)[r::w], list(texts)[r::w]
        per_rank = (-(-len(image_paths) // w), -(-len(texts) // w))   # ceil: the largest share
        steps = max(-(-per_rank[0] // b), -(-per_rank[1] // b))
        b_ = self.bundle
        transform = eval_transform(b_, self.bands)
        dummy_pixels = torch.zeros(1, 3, b_.image_size, b_.image_size, dtype=torch.uint8)
        dummy_ids = torch.full((1, 1), b_.tokenizer.pad_token_id or 0, dtype=torch.long)
        images, txts, ok, scale, bias = [], [], [], None, None
        self.unreadable = []
        with torch.no_grad(), Progress(transient=True, disable=not (self.progress and r == 0)) as bar:
            task = bar.add_task(f"eval {what}", total=steps)
            for s in range(steps):
                paths, caps = mine_img[s * b:(s + 1) * b], mine_txt[s * b:(s + 1) * b]
                pixels, errors = read_images(transform, paths) if paths else (dummy_pixels, [])  # (B,3,H,W) u8
                self._note_unreadable(paths, errors, what)
                ok.append(torch.tensor([[float(e is None)] for e in errors]).reshape(-1, 1))
                ids = tokenize(b_.tokenizer, caps, b_.max_text_length) if caps else dummy_ids  # (B, L)
                image, text, scale, bias = self.model(pixels.to(self.device), ids.to(self.device))
                images.append(image[:len(paths)].float())
                txts.append(text[:len(caps)].float())
                bar.advance(task)
        if scale is not None:   # the model's temperature and bias, for probabilities
            self.logit_scale, self.logit_bias = scale.detach().float().cpu(), bias.detach().float().cpu()
        mine_ok = torch.cat(ok).to(images[0].device) if ok else torch.zeros(0, 1, device=images[0].device)
        self.image_ok = self._gather(mine_ok, len(image_paths), per_rank[0])[:, 0] > 0.5
        return (self._gather(torch.cat(images), len(image_paths), per_rank[0]),
                self._gather(torch.cat(txts), len(texts), per_rank[1]))

    def _note_unreadable(self, paths: Sequence[Path], errors: list[str | None], what: str) -> None:
        for path, error in zip(paths, errors):
            if error is None:
                continue
            self.unreadable.append((Path(path), error))
            if len(self.unreadable) <= SHOWN_PER_RANK:
                log.warning("eval %s: rank %d skips unreadable image %s (%s)", what, self.rank, path, error)

    def _gather(self, mine: torch.Tensor, total: int, per_rank: int) -> torch.Tensor:
        """This rank's rows (items r, r + W, ...) -> all rows in item order, on every rank."""
        if self.world_size == 1:
            return mine.cpu()
        dim = mine.shape[1]
        padded = torch.zeros(per_rank, dim, device=mine.device)
        padded[:len(mine)] = mine
        parts = [torch.empty_like(padded) for _ in range(self.world_size)]
        dist.all_gather(parts, padded)
        return interleave_ranks(parts, total).cpu()


def interleave_ranks(parts: list[torch.Tensor], total: int) -> torch.Tensor:
    """Rank r's rows (items r, r + W, ..., zero-padded to P rows) -> (total, D) in item order."""
    # (W, P, D) -> (P, W, D): row p of rank r is item p * W + r
    return torch.stack(parts).transpose(0, 1).reshape(-1, parts[0].shape[1])[:total]


def class_embeddings(text_emb: torch.Tensor, num_classes: int, num_templates: int) -> torch.Tensor:
    """(C * T, D) prompt embeddings, class-major -> (C, D): normalised mean over templates."""
    per_class = text_emb.view(num_classes, num_templates, -1).mean(dim=1)
    return torch.nn.functional.normalize(per_class, dim=-1)


def evaluate(embedder: Embedder, sets: EvalSets, samples: bool = False) -> dict:
    """-> {"zero_shot": zero_shot_metrics(...), "retrieval": retrieval_metrics(...)} (present ones),
    over the readable images; each group's ``skipped_images`` counts the unreadable ones
    (retrieval also leaves out their captions: ``skipped_captions``). ``samples``: on rank 0 each group
    also holds "rows", its per-sample results (rsclip_ds.evaluation.samples), from the same embeddings."""
    results: dict = {}
    if sets.zero_shot is not None:
        zs, templates = sets.zero_shot, sets.templates
        prompts = [t.format(name) for name in zs.class_names for t in templates]   # class-major
        image_emb, text_emb = embedder.embed(zs.paths, prompts, "zero-shot")
        ok = _readable(embedder, "zero-shot", sets.max_bad_fraction)
        classes = class_embeddings(text_emb, len(zs.class_names), len(templates))
        results["zero_shot"] = zero_shot_metrics(image_emb[ok], classes, torch.tensor(zs.labels)[ok], zs.class_names)
        results["zero_shot"]["skipped_images"] = int((~ok).sum())
        results["zero_shot"]["class_phrases"] = dict(zip(zs.folders, zs.class_names))   # class-index order
        if samples and embedder.rank == 0:
            results["zero_shot"]["rows"] = classification_rows(zs.paths, zs.labels, zs.class_names, ok, image_emb,
                                                               classes, unreadable_errors(embedder, zs.paths))
    if sets.retrieval is not None:
        rs = sets.retrieval
        image_emb, text_emb = embedder.embed(rs.image_paths, rs.captions, "retrieval")
        ok = _readable(embedder, "retrieval", sets.max_bad_fraction)
        index = torch.tensor(rs.text_image_index)
        kept = ok[index]                                        # captions whose image was read
        new_index = torch.cumsum(ok.long(), 0) - 1              # old image index -> index among the kept
        results["retrieval"] = retrieval_metrics(image_emb[ok], text_emb[kept], new_index[index[kept]])
        results["retrieval"].update(skipped_images=int((~ok).sum()), skipped_captions=int((~kept).sum()))
        if samples and embedder.rank == 0:
            errors = unreadable_errors(embedder, rs.image_paths)
            results["retrieval"]["rows"] = retrieval_rows(rs.image_paths, rs.captions, rs.text_image_index, ok,
                                                          image_emb, text_emb, errors)
    return results


def _readable(embedder: Embedder, what: str, max_bad_fraction: float) -> torch.Tensor:
    """The gathered readable-image mask of the last embed(); logs the skipped count (rank 0) and
    raises DataError, the same on every rank, past ``max_bad_fraction`` of the set."""
    ok = embedder.image_ok
    bad, total = int((~ok).sum()), len(ok)
    if bad and embedder.rank == 0:
        log.warning("eval %s: %d of %d images unreadable or missing, left out of the metrics", what, bad, total)
    if bad > max_bad_fraction * total or bad == total:
        mine = "; ".join(f"{p} ({e})" for p, e in embedder.unreadable[:SHOWN_PER_RANK])
        raise DataError(f"eval {what}: {bad} of {total} images are unreadable or missing, more than "
                        f"eval.max_bad_fraction={max_bad_fraction} of the set" +
                        (f" (e.g. {mine})" if mine else "") +
                        "; fix or remove them, point the set at the right image folder, or raise "
                        "eval.max_bad_fraction (--set eval.max_bad_fraction=...)")
    return ok
