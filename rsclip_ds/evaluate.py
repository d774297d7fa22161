"""Zero-shot classification and image-text retrieval for a trained dual encoder.

    rsclip-ds eval --model runs/export/ --zero-shot data/AID --retrieval data/RSICD/dataset_rsicd.json

Metrics are pure functions of embeddings (top of this module). Embedding runs in batches through
the model's own ``forward()`` (the engine's under ZeRO-3, which gathers the partitioned
parameters there; see notes/deepspeed.md), with the items split over ranks and all-gathered,
so every rank computes identical metrics.

Ties count against the model (a wrong candidate scoring *equal* to the right one ranks above
it): a collapsed model whose embeddings are all equal gets recall 0, not 1.
"""

from __future__ import annotations

import json
import logging
import re
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import Callable, Sequence

import numpy as np
import torch
import torch.distributed as dist
from PIL import Image
from rich.progress import Progress

from rsclip_ds.config import ConfigError, EvalConfig
from rsclip_ds.model import ModelBundle
from rsclip_ds.tokenizer import tokenize

log = logging.getLogger("rsclip_ds")


# --------------------------------------------------------------------------- metrics (pure)

def _rank_of_correct(scores: torch.Tensor, correct: torch.Tensor) -> torch.Tensor:
    """scores (Q, K), correct (Q, K) bool, >= 1 True per row -> (Q,) rank of the best correct
    candidate: the number of wrong candidates scoring >= the best correct score (0 = top)."""
    best = scores.masked_fill(~correct, float("-inf")).max(dim=1, keepdim=True).values   # (Q, 1)
    return ((scores >= best) & ~correct).sum(dim=1)                                      # (Q,)


def retrieval_metrics(image_emb: torch.Tensor, text_emb: torch.Tensor,
                      text_image_index: torch.Tensor, ks: tuple[int, ...] = (1, 5, 10)) -> dict:
    """Recall@k both ways for N images and M captions (several per image).

    image_emb (N, D), text_emb (M, D) L2-normalised; text_image_index (M,) the image of each
    caption. image->text: a hit when any of the image's captions is among the top k captions;
    text->image: when its image is among the top k images. Fractions in [0, 1];
    ``mean_recall`` is the mean of the six numbers (RSICD papers' "mR", in percent there)."""
    image_emb, text_emb = image_emb.float(), text_emb.float()
    index = torch.as_tensor(text_image_index, dtype=torch.long)
    n, m = len(image_emb), len(text_emb)
    if m != len(index) or m == 0 or n == 0:
        raise ValueError(f"retrieval needs >= 1 image and one image index per caption "
                         f"(got {n} images, {m} captions, {len(index)} indices)")
    if bool((index < 0).any() or (index >= n).any()):
        raise ValueError(f"text_image_index must lie in [0, {n}); got {index.min()}..{index.max()}")
    sim = image_emb @ text_emb.T                                          # (N, M)
    owns = index[None, :] == torch.arange(n)[:, None]                     # (N, M) caption j of image i
    if not bool(owns.any(dim=1).all()):
        raise ValueError("every image needs at least one caption for image->text recall")
    i2t = _rank_of_correct(sim, owns)                                     # (N,)
    t2i = _rank_of_correct(sim.T, owns.T)                                 # (M,)
    out: dict = {}
    for k in ks:
        out[f"i2t_R@{k}"] = (i2t < k).float().mean().item()
    for k in ks:
        out[f"t2i_R@{k}"] = (t2i < k).float().mean().item()
    out["mean_recall"] = sum(out.values()) / len(out)
    out.update(num_images=n, num_texts=m)
    return out


def zero_shot_metrics(image_emb: torch.Tensor, class_emb: torch.Tensor, labels: torch.Tensor,
                      class_names: list[str] | None = None) -> dict:
    """Top-1 / top-5 and per-class accuracy of classifying each image as its nearest class.

    image_emb (N, D), class_emb (C, D) (one embedding per class, e.g. the normalised mean over
    prompt templates), labels (N,) in [0, C). ``mean_per_class`` is the unweighted mean of the
    per-class top-1 accuracies (classes without images are left out of it)."""
    image_emb, class_emb = image_emb.float(), class_emb.float()
    labels = torch.as_tensor(labels, dtype=torch.long)
    c = len(class_emb)
    names = list(class_names) if class_names is not None else [str(i) for i in range(c)]
    if len(names) != c or len(labels) != len(image_emb) or len(labels) == 0:
        raise ValueError(f"zero-shot needs one label per image and one name per class (got "
                         f"{len(image_emb)} images, {len(labels)} labels, {c} classes, {len(names)} names)")
    scores = image_emb @ class_emb.T                                      # (N, C)
    correct = torch.nn.functional.one_hot(labels, c).bool()               # (N, C)
    rank = _rank_of_correct(scores, correct)                              # (N,)
    per_class = {}
    for i, name in enumerate(names):
        mine = labels == i
        if mine.any():
            per_class[name] = (rank[mine] == 0).float().mean().item()
    return {"top1": (rank < 1).float().mean().item(), "top5": (rank < 5).float().mean().item(),
            "mean_per_class": sum(per_class.values()) / len(per_class), "per_class": per_class,
            "num_images": len(labels), "num_classes": c}


# --------------------------------------------------------------------------- datasets

IMAGE_EXTENSIONS = (".jpg", ".jpeg", ".png", ".tif", ".tiff", ".bmp", ".webp")


def class_name_from_folder(folder: str) -> str:
    """'denseResidential' / 'DenseResidential' / 'dense_residential' -> 'dense residential';
    'AnnualCrop' -> 'annual crop' (EuroSAT), 'baseball_diamond' -> 'baseball diamond' (NWPU)."""
    name = re.sub(r"[_\-\s]+", " ", folder)
    name = re.sub(r"(?<=[a-z0-9])(?=[A-Z])", " ", name)        # camelCase / CamelCase boundary
    name = re.sub(r"(?<=[A-Z])(?=[A-Z][a-z])", " ", name)      # acronym then word: 'RSImage'
    return " ".join(name.split()).lower()


def default_templates_path() -> Path:
    return Path(str(resources.files("rsclip_ds") / "templates" / "remote_sensing.txt"))


def load_templates(path: str | Path | None = None) -> list[str]:
    """Prompt templates, one per line with a single '{}'; '#' lines and blank lines skipped."""
    path = Path(path) if path is not None else default_templates_path()
    if not path.is_file():
        raise ConfigError(f"templates file not found: {path} (one template per line, '{{}}' marks the "
                          f"class name; leave eval.templates unset for the shipped remote-sensing set)")
    templates = []
    for number, line in enumerate(path.read_text().splitlines(), 1):
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        if line.count("{}") != 1:
            raise ConfigError(f"{path}:{number}: a template needs exactly one '{{}}' for the class name, "
                              f"got {line!r}")
        templates.append(line)
    if not templates:
        raise ConfigError(f"{path} holds no templates")
    return templates


@dataclass
class ClassFolderSet:
    """A zero-shot set: image paths, their class ids, and the readable class names."""
    paths: list[Path]
    labels: list[int]
    class_names: list[str]
    folders: list[str]


def load_class_folders(root: str | Path) -> ClassFolderSet:
    """root/<ClassFolder>/<image> (AID, NWPU-RESISC45, EuroSAT, UCMerced's Images/)."""
    root = Path(root)
    if not root.is_dir():
        raise ConfigError(f"zero-shot folder not found: {root} (expected one sub-folder per class)")
    folders = sorted(d.name for d in root.iterdir() if d.is_dir() and not d.name.startswith("."))
    if len(folders) < 2:
        raise ConfigError(f"{root} has {len(folders)} class folder(s); zero-shot needs >= 2 "
                          f"(point it at the folder that holds one folder per class)")
    paths, labels = [], []
    for label, folder in enumerate(folders):
        found = sorted(p for p in (root / folder).iterdir() if p.suffix.lower() in IMAGE_EXTENSIONS)
        if not found:
            log.warning("class folder %s has no images (%s); it still competes as a class",
                        root / folder, ", ".join(IMAGE_EXTENSIONS))
        paths += found
        labels += [label] * len(found)
    if not paths:
        raise ConfigError(f"no images under {root}/*/ (extensions {', '.join(IMAGE_EXTENSIONS)})")
    return ClassFolderSet(paths, labels, [class_name_from_folder(f) for f in folders], folders)


@dataclass
class CaptionSet:
    """A retrieval set: N images, M captions, and the image index of every caption."""
    image_paths: list[Path]
    captions: list[str]
    text_image_index: list[int]


def _images_folder(json_path: Path, first: str, images_dir: Path | None) -> Path:
    candidates = [images_dir] if images_dir else [json_path.parent / "images", json_path.parent / "imgs",
                                                  json_path.parent]
    for folder in candidates:
        if (Path(folder) / first).is_file():
            return Path(folder)
    raise ConfigError(f"{json_path}: image {first!r} not found in {', '.join(map(str, candidates))}; "
                      f"pass the image folder (eval.retrieval_images / --retrieval-images)")


def load_caption_json(path: str | Path, images_dir: str | Path | None = None,
                      split: str = "test") -> CaptionSet:
    """Karpathy-style JSON: {"images": [{"filename", "split", "sentences": [{"raw"}]}]}."""
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"caption JSON not found: {path}")
    entries = [e for e in json.loads(path.read_text())["images"] if e.get("split") == split]
    if not entries:
        raise ConfigError(f"{path} has no images with split {split!r} (set eval.retrieval_split / --split)")
    folder = _images_folder(path, entries[0]["filename"], Path(images_dir) if images_dir else None)
    images, captions, index = [], [], []
    for entry in entries:
        raws = [s["raw"].strip() for s in entry.get("sentences", []) if s.get("raw", "").strip()]
        if not raws:
            log.warning("%s: %s has no captions; left out", path, entry["filename"])
            continue
        index += [len(images)] * len(raws)
        images.append(folder / entry["filename"])
        captions += raws
    return CaptionSet(images, captions, index)


@dataclass
class EvalSets:
    """What one evaluation reads; loaded (and checked) once, before any training."""
    zero_shot: ClassFolderSet | None = None
    templates: list[str] | None = None
    retrieval: CaptionSet | None = None

    @classmethod
    def from_config(cls, cfg: EvalConfig) -> "EvalSets":
        zero_shot = load_class_folders(cfg.zero_shot_dir) if cfg.zero_shot_dir else None
        retrieval = (load_caption_json(cfg.retrieval_json, cfg.retrieval_images, cfg.retrieval_split)
                     if cfg.retrieval_json else None)
        if zero_shot is None and retrieval is None:
            raise ConfigError("nothing to evaluate: give a zero-shot class-folder set "
                              "(--zero-shot / eval.zero_shot_dir) and/or a caption JSON "
                              "(--retrieval / eval.retrieval_json)")
        return cls(zero_shot, load_templates(cfg.templates) if zero_shot else None, retrieval)


# --------------------------------------------------------------------------- embedding

def load_image(path: Path, size: int, mean: torch.Tensor, std: torch.Tensor) -> torch.Tensor:
    """-> (3, size, size), squashed (no crop) and normalised like the training data."""
    with Image.open(path) as img:
        img.draft("RGB", (size, size))   # JPEG: decode at a smaller scale when it can
        pixels = np.asarray(img.convert("RGB").resize((size, size), Image.Resampling.BICUBIC), np.uint8)
    pixels = torch.from_numpy(pixels.copy()).permute(2, 0, 1).float().div_(255.0)   # (3, S, S)
    return (pixels - mean) / std


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
    dtype: torch.dtype = torch.float32
    device: torch.device | str = "cpu"
    progress: bool = True

    def embed(self, image_paths: Sequence[Path], texts: Sequence[str], what: str) -> tuple[torch.Tensor, torch.Tensor]:
        """-> image embeddings (N, D), text embeddings (M, D), float32, on every rank, in order."""
        b, w, r = self.batch_size, self.world_size, self.rank
        mine_img, mine_txt = list(image_paths)[r::w], list(texts)[r::w]
        per_rank = (-(-len(image_paths) // w), -(-len(texts) // w))   # ceil: the largest share
        steps = max(-(-per_rank[0] // b), -(-per_rank[1] // b))
        b_ = self.bundle
        mean = torch.tensor(b_.image_mean).view(3, 1, 1)
        std = torch.tensor(b_.image_std).view(3, 1, 1)
        dummy_pixels = torch.zeros(1, 3, b_.image_size, b_.image_size)
        dummy_ids = torch.full((1, 1), b_.tokenizer.pad_token_id or 0, dtype=torch.long)
        images, txts = [], []
        with torch.no_grad(), Progress(transient=True, disable=not (self.progress and r == 0)) as bar:
            task = bar.add_task(f"eval {what}", total=steps)
            for s in range(steps):
                paths, caps = mine_img[s * b:(s + 1) * b], mine_txt[s * b:(s + 1) * b]
                pixels = (torch.stack([load_image(p, b_.image_size, mean, std) for p in paths])
                          if paths else dummy_pixels)                                     # (B, 3, H, W)
                ids = tokenize(b_.tokenizer, caps, b_.max_text_length) if caps else dummy_ids  # (B, L)
                image, text, _, _ = self.model(pixels.to(self.device, self.dtype), ids.to(self.device))
                images.append(image[:len(paths)].float())
                txts.append(text[:len(caps)].float())
                bar.advance(task)
        return (self._gather(torch.cat(images), len(image_paths), per_rank[0]),
                self._gather(torch.cat(txts), len(texts), per_rank[1]))

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


def evaluate(embedder: Embedder, sets: EvalSets) -> dict:
    """-> {"zero_shot": zero_shot_metrics(...), "retrieval": retrieval_metrics(...)} (present ones)."""
    results: dict = {}
    if sets.zero_shot is not None:
        zs, templates = sets.zero_shot, sets.templates
        prompts = [t.format(name) for name in zs.class_names for t in templates]   # class-major
        image_emb, text_emb = embedder.embed(zs.paths, prompts, "zero-shot")
        classes = class_embeddings(text_emb, len(zs.class_names), len(templates))
        results["zero_shot"] = zero_shot_metrics(image_emb, classes, torch.tensor(zs.labels), zs.class_names)
    if sets.retrieval is not None:
        rs = sets.retrieval
        image_emb, text_emb = embedder.embed(rs.image_paths, rs.captions, "retrieval")
        results["retrieval"] = retrieval_metrics(image_emb, text_emb, torch.tensor(rs.text_image_index))
    return results


def flat_metrics(results: dict) -> dict[str, float]:
    """{"zero_shot/top1": ..., "retrieval/t2i_R@1": ...}: the scalars, for logs and monitors."""
    return {f"{group}/{key}": float(value) for group, metrics in results.items()
            for key, value in metrics.items()
            if isinstance(value, float)}


# --------------------------------------------------------------------------- reporting

def print_results(results: dict, title: str) -> None:
    """A rich table of the scalar metrics, and one of the per-class zero-shot accuracies."""
    from rich.console import Console
    from rich.table import Table

    console = Console()
    table = Table(title=title)
    for col in ("metric", "value"):
        table.add_column(col)
    for key, value in flat_metrics(results).items():
        table.add_row(key, f"{100 * value:.2f} %")
    if "zero_shot" in results:
        r = results["zero_shot"]
        table.add_row("zero_shot/size", f"{r['num_images']} images, {r['num_classes']} classes")
    if "retrieval" in results:
        r = results["retrieval"]
        table.add_row("retrieval/size", f"{r['num_images']} images, {r['num_texts']} captions")
    console.print(table)
    if "zero_shot" in results:
        per_class = Table(title="zero-shot accuracy per class")
        per_class.add_column("class")
        per_class.add_column("top-1")
        for name, acc in results["zero_shot"]["per_class"].items():
            per_class.add_row(name, f"{100 * acc:.1f} %")
        console.print(per_class)


def log_results(results: dict, step: int | None = None) -> None:
    prefix = f"eval at step {step}: " if step is not None else "eval: "
    log.info(prefix + "  ".join(f"{k} {100 * v:.2f}" for k, v in flat_metrics(results).items()))


def write_monitor(monitor, results: dict, step: int) -> None:
    """DeepSpeed's MonitorMaster (TensorBoard / CSV / W&B as the DeepSpeed config says);
    events 'eval/<group>/<metric>' at the optimizer step."""
    if monitor is not None and monitor.enabled:
        monitor.write_events([(f"eval/{k}", v, step) for k, v in flat_metrics(results).items()])


def build_monitor(ds_config: dict):
    """MonitorMaster from a DeepSpeed config dict, None when it enables no monitor."""
    from deepspeed.monitor.config import get_monitor_config
    from deepspeed.monitor.monitor import MonitorMaster

    config = get_monitor_config(ds_config)
    return MonitorMaster(config) if config.enabled else None


# --------------------------------------------------------------------------- during training

def build_eval_hook(run, bundle: ModelBundle, rank: int, world_size: int):
    """-> hook(step, engine) evaluating every `run.eval.every` steps and after the last, through
    the engine's forward (ZeRO-3 safe); None when run.eval.every is 0. The data sets are read
    now, so a wrong path fails before training starts. Returns the flat metrics, None on other
    steps; rank 0 writes {output_dir}/eval/step{N:08d}.json and the engine's monitor events."""
    from rsclip_ds.engine import engine_dtype

    cfg = run.eval
    if cfg.every == 0:
        return None
    sets = EvalSets.from_config(cfg)
    out_dir = Path(run.output_dir) / "eval"

    def hook(step: int, engine) -> dict | None:
        if step % cfg.every and step != run.steps:
            return None
        was_training = engine.module.training
        engine.eval()
        try:
            embedder = Embedder(engine, bundle, cfg.batch_size, rank, world_size,
                                engine_dtype(engine), engine.device, progress=False)
            results = evaluate(embedder, sets)
        finally:
            engine.train(was_training)
        if rank == 0:
            out_dir.mkdir(parents=True, exist_ok=True)
            (out_dir / f"step{step:08d}.json").write_text(json.dumps({"step": step, **results}, indent=2))
            log_results(results, step)
        write_monitor(getattr(engine, "monitor", None), results, step)
        return flat_metrics(results)

    return hook


# --------------------------------------------------------------------------- `rsclip-ds eval`

def add_eval_parser(sub) -> None:
    p = sub.add_parser("eval", help="zero-shot classification and retrieval for a checkpoint or a "
                       "Hugging Face folder (alone, or under the deepspeed launcher: data split over ranks)")
    which = p.add_mutually_exclusive_group(required=True)
    which.add_argument("--checkpoint", type=Path, help="a training checkpoint: {output_dir}/checkpoints/"
                       "step{N:08d}, the checkpoints folder or the run's output_dir (newest checkpoint)")
    which.add_argument("--model", type=Path, help="a Hugging Face folder (SiglipModel, tokenizer, "
                       "image processor), e.g. from `rsclip-ds export`")
    p.add_argument("--zero-shot", type=Path, help="class-folder data set (default for a checkpoint: "
                   "the run's eval.zero_shot_dir)")
    p.add_argument("--retrieval", type=Path, help="Karpathy-style caption JSON (default for a "
                   "checkpoint: the run's eval.retrieval_json)")
    p.add_argument("--retrieval-images", type=Path, help="folder of the caption JSON's images")
    p.add_argument("--split", default=None, help="caption JSON split (default: test)")
    p.add_argument("--templates", type=Path, help="prompt templates file (default: shipped RS set)")
    p.add_argument("--batch-size", type=int, default=None, help="per rank (default 64)")
    p.add_argument("--precision", choices=("fp32", "bf16", "fp16"), default="fp32")
    p.add_argument("--out", type=Path, help="results JSON (default: {output_dir}/eval/<tag>.json for a "
                   "checkpoint, eval/<folder name>.json for a model folder)")
    p.add_argument("--ds-config", type=Path, help="DeepSpeed config JSON whose tensorboard / csv_monitor "
                   "/ wandb sections receive the metrics (default for a checkpoint: the run's ds_config.json)")


def _eval_config(args, base: EvalConfig) -> EvalConfig:
    """--flags over the run's eval section (a checkpoint) or the defaults (a model folder)."""
    given = {"zero_shot_dir": args.zero_shot, "retrieval_json": args.retrieval,
             "retrieval_images": args.retrieval_images, "retrieval_split": args.split,
             "templates": args.templates, "batch_size": args.batch_size}
    return base.model_copy(update={k: v for k, v in given.items() if v is not None})


def _load_for_eval(args, loss: str = "siglip"):
    """-> (bundle, step or None, EvalConfig defaults, default out path, DeepSpeed config or None)."""
    from rsclip_ds.config import ModelConfig
    from rsclip_ds.model import build_model

    if args.model is not None:
        bundle = build_model(ModelConfig(pretrained=args.model), seed=0, loss=loss)
        return bundle, None, EvalConfig(), Path("eval") / f"{args.model.resolve().name}.json", None
    from rsclip_ds.checkpoint import consolidated_state_dict, resolve_checkpoint

    try:
        root, tag = resolve_checkpoint(args.checkpoint)
        run, state = consolidated_state_dict(Path(root) / tag)
    except FileNotFoundError as err:
        raise ConfigError(str(err)) from None
    hf = Path(root) / tag / "hf"   # the checkpoint's own model config + tokenizer, when it has them
    bundle = _bundle_from_hf_folder(hf, run.loss.name) if (hf / "config.json").is_file() else \
        build_model(run.model, run.seed, loss=run.loss.name)
    bundle.model.load_state_dict(state)
    step = int(m.group(1)) if (m := re.fullmatch(r"step(\d+)", str(tag))) else None
    ds_path = Path(root).parent / "ds_config.json"
    ds_config = json.loads(ds_path.read_text()) if ds_path.is_file() else None
    return bundle, step, run.eval, Path(root).parent / "eval" / f"{tag}.json", ds_config


def _bundle_from_hf_folder(folder: Path, loss: str) -> ModelBundle:
    """A randomly initialised model with the folder's architecture, tokenizer and normalisation
    (the weights come from the checkpoint): independent of the run's original paths."""
    from transformers import SiglipConfig, SiglipImageProcessorPil

    from rsclip_ds.model import load_tokenizer, new_dual_encoder

    model = new_dual_encoder(SiglipConfig.from_pretrained(str(folder)), loss)
    proc = SiglipImageProcessorPil.from_pretrained(str(folder))
    vc, tc = model.config.vision_config, model.config.text_config
    return ModelBundle(model, load_tokenizer(folder), vc.image_size, tuple(proc.image_mean),
                       tuple(proc.image_std), tc.max_position_embeddings)


def cmd_eval(args) -> int:
    """The `rsclip-ds eval` handler: every rank embeds its share, rank 0 reports."""
    from rsclip_ds.cli import _configure_logging
    from rsclip_ds.distributed import destroy_distributed, init_distributed

    # everything that can fail (paths, checkpoint, data sets) before a process group exists
    bundle, step, base, default_out, ds_config = _load_for_eval(args)
    cfg = _eval_config(args, base)
    sets = EvalSets.from_config(cfg)
    if args.ds_config is not None:
        if not args.ds_config.is_file():
            raise ConfigError(f"--ds-config {args.ds_config}: file not found")
        ds_config = json.loads(args.ds_config.read_text())
    info = init_distributed()
    try:
        _configure_logging(info.rank)
        device = torch.device("cpu")
        if info.on_gpu:
            from deepspeed.accelerator import get_accelerator
            device = torch.device(get_accelerator().device_name(info.local_rank))
        dtype = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}[args.precision]
        model = bundle.model.to(device, dtype).eval()
        results = evaluate(Embedder(model, bundle, cfg.batch_size, info.rank, info.world_size, dtype,
                                    device), sets)
        if info.rank == 0:
            source = str(args.checkpoint or args.model)
            out = args.out or default_out
            out.parent.mkdir(parents=True, exist_ok=True)
            record = {"source": source, "step": step, "precision": args.precision, **results}
            out.write_text(json.dumps(record, indent=2))
            log_results(results, step)
            print_results(results, f"rsclip-ds eval: {source}")
            log.info("results written to %s", out)
        write_monitor(build_monitor(ds_config) if ds_config else None, results, step or 0)
        return 0
    finally:
        destroy_distributed()
