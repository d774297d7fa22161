"""Data commands: `make-shards` (caption datasets -> webdataset shards), `make-synthetic`
(synthetic overhead-imagery shards and evaluation sets), `train-tokenizer`."""

from __future__ import annotations

import json
from pathlib import Path

from rsclip_ds.config import ConfigError
from rsclip_ds.data.geotiff import BandChoice, BandsError
from rsclip_ds.data.near_duplicates import MAX_DISTANCE, MAX_FINE_DISTANCE
from rsclip_ds.data.shard_writer import Encoding, Record, make_shards, read_folder, read_karpathy, read_table
from rsclip_ds.data.where import Where


def register(sub) -> None:
    _register_make_shards(sub)
    p = sub.add_parser("make-synthetic", help="write synthetic remote-sensing image-caption shards")
    p.add_argument("--out", required=True, type=Path)
    p.add_argument("--num-train", type=int, default=4096)
    p.add_argument("--num-val", type=int, default=512)
    p.add_argument("--eval", action="store_true", help="also write the val split as a class-folder "
                   "tree (eval/classes/) and a caption JSON (eval/captions.json) for `rsclip-ds eval`")
    p.add_argument("--shard-size", type=int, default=512)
    p.add_argument("--image-size", type=int, default=64)
    p.add_argument("--seed", type=int, default=0)
    p.set_defaults(handler=make_synthetic_command)
    p = sub.add_parser("train-tokenizer", help="train a tokenizer on the captions of shards")
    p.add_argument("--shards", required=True, help="brace pattern / glob / list file of shards")
    p.add_argument("--out", required=True, type=Path)
    p.add_argument("--vocab-size", type=int, default=1000)
    p.add_argument("--max-length", type=int, default=64)
    p.add_argument("--caption-key", default="txt")
    p.set_defaults(handler=train_tokenizer_command)


def make_synthetic_command(args) -> int:
    from rsclip_ds.data.synthetic import make_synthetic

    info = make_synthetic(args.out, num_train=args.num_train, num_val=args.num_val,
                          shard_size=args.shard_size, image_size=args.image_size, seed=args.seed,
                          eval_layout=args.eval)
    print(json.dumps({k: v for k, v in info.items() if k not in ("train", "val")}, indent=2))
    return 0


def train_tokenizer_command(args) -> int:
    from rsclip_ds.data import expand_urls
    from rsclip_ds.data.tokenizer import iter_captions, train_tokenizer

    tok = train_tokenizer(iter_captions(expand_urls(args.shards), args.caption_key), args.out,
                          vocab_size=args.vocab_size, max_length=args.max_length)
    print(f"tokenizer with {len(tok)} tokens written to {args.out}")
    return 0


def _register_make_shards(sub) -> None:
    p = sub.add_parser("make-shards", help="write webdataset shards from a caption JSON, a CSV/JSONL "
                       "table, an image folder with .txt captions or a Hugging Face dataset (Git-10M)")
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--karpathy", type=Path, help="Karpathy-style caption JSON (RSICD, UCM, Sydney, RSITMD)")
    src.add_argument("--table", type=Path, help="CSV/TSV (header row) or JSONL of image path + caption")
    src.add_argument("--folder", type=Path, help="image folder with a .txt caption file per image")
    src.add_argument("--hf-dataset", metavar="FOLDER_OR_ID", help="a Hugging Face dataset with the image "
                     "bytes in a column (Git-10M: lcybuaa/Git-10M): a hub id (fetched into the cache; "
                     "HF_HUB_OFFLINE=1 reads the cache only), a folder in the hub's repo layout, a "
                     "save_to_disk folder or one .parquet/.arrow file; streamed, resumable")
    p.add_argument("--images", type=Path, help="image folder of --karpathy; root of relative --table "
                   "paths (default: the table's folder)")
    p.add_argument("--out", required=True, type=Path, help="output folder (shards, index.json, report)")
    p.add_argument("--split", default=None, help="keep these splits, comma-separated (e.g. train or "
                   "train,restval); default: all. Also the shard name prefix unless --prefix. "
                   "--hf-dataset: the dataset split (default train)")
    p.add_argument("--prefix", default=None, help="shard names {prefix}-000000.tar (default: the split, "
                   "or 'train')")
    p.add_argument("--path-column", default="path", help="--table: column with the image path")
    p.add_argument("--caption-column", default="caption", help="--table / --hf-dataset: column(s) with "
                   "captions, comma-separated (SkyScript: title,title_multi_objects); all are kept")
    p.add_argument("--image-column", default="image", help="--hf-dataset: column with the image bytes")
    p.add_argument("--revision", default=None, help="--hf-dataset hub id: branch, tag or commit")
    p.add_argument("--hf-config", default=None, help="--hf-dataset: the dataset's config name (its "
                   "README's configs:), default: the default one")
    p.add_argument("--where", default=None, help="keep rows where this holds, over the row's columns, e.g. "
                   "\"img_quality_score >= 0.5 and resolution <= 2\" (comparisons, and/or/not, in [..], "
                   "len(col); Google_location also gives latitude/longitude)")
    p.add_argument("--min-caption-words", type=int, default=0, help="--hf-dataset: skip rows whose "
                   "longest caption has fewer words")
    p.add_argument("--max-caption-words", type=int, default=0, help="--hf-dataset: skip rows whose "
                   "shortest caption has more words (0: no bound)")
    p.add_argument("--bands", default=None, help="multi-band/16-bit GeoTIFFs: three 1-based bands as "
                   "R,G,B (Sentinel-2 true colour: 4,3,2), written as 8-bit PNG")
    p.add_argument("--band-scale", default="percentile:2,98", help="with --bands: 'percentile:LO,HI' "
                   "per band and image, or 'range:MIN,MAX' fixed (Sentinel-2 L1C: range:0,3000)")
    p.add_argument("--verify", default="header", choices=["header", "decode"], help="--hf-dataset: how "
                   "images are checked: header + end marker (fast), or a full decode")
    p.add_argument("--restart", action="store_true", help="--hf-dataset: discard an interrupted "
                   "conversion in --out instead of resuming it")
    p.add_argument("--split-column", default=None, help="--table: column with the split (for --split)")
    p.add_argument("--shard-size", type=int, default=1000, help="samples per shard at most")
    p.add_argument("--shard-bytes", type=float, default=0, help="payload bytes per shard at most "
                   "(a shard closes after the sample that reaches it; 0: no limit), e.g. 1e9")
    p.add_argument("--max-side", type=int, default=0, help="re-encode images whose longer side is "
                   "above this (aspect kept); 0 copies them as they are")
    p.add_argument("--format", default="keep", choices=["keep", "jpg", "png", "webp"],
                   help="image format in the shards; 'keep' copies files (re-encoding only resized "
                   "ones, resized .tif as jpg, .bmp as png)")
    p.add_argument("--quality", type=int, default=95, help="JPEG/WebP quality when re-encoding")
    p.add_argument("--workers", type=int, default=1, help="processes reading/re-encoding images "
                   "(output is the same for any number)")
    p.add_argument("--exclude-near", action="append", type=Path, metavar="ROOT_OR_JSON", help="drop images "
                   "that are near-duplicates of these evaluation images (a suite root or a caption JSON, as "
                   "check-leakage --against; repeatable); counted as near_evaluation, pairs in the report")
    p.add_argument("--exclude-max-distance", type=int, default=MAX_DISTANCE, help="--exclude-near: "
                   "check-leakage's --max-distance")
    p.add_argument("--exclude-max-fine-distance", type=int, default=MAX_FINE_DISTANCE, help="--exclude-near: "
                   "check-leakage's --max-fine-distance")
    p.set_defaults(handler=make_shards_command)


def _records(args, filtered: list[str]) -> tuple[list[Record], Path | None]:
    splits = {s.strip() for s in args.split.split(",")} if args.split else None
    if args.karpathy:
        if args.images is None:
            raise ValueError("--karpathy needs --images, the folder holding the images it names")
        return list(read_karpathy(args.karpathy, args.images, splits)), args.images
    if args.table:
        if splits and not args.split_column:
            raise ValueError("--split with --table needs --split-column naming the split column")
        root = args.images or args.table.parent
        return list(read_table(args.table, args.images, args.path_column, args.caption_column,
                               args.split_column, splits, Where.parse(args.where), filtered)), root
    if args.where:
        raise ValueError("--where filters --table and --hf-dataset rows (their columns); a --karpathy or "
                         "--folder input has none (filter at load time with data.where)")
    return list(read_folder(args.folder)), args.folder


def _exclude(args, console):
    """--exclude-near: the evaluation images' index (hashed in --workers processes), or None."""
    if not args.exclude_near:
        return None
    from rsclip_ds.evaluation.leakage import build_near_index

    evals = build_near_index(args.exclude_near, workers=args.workers, max_distance=args.exclude_max_distance,
                             max_fine_distance=args.exclude_max_fine_distance, console=console)
    for line in evals.unreadable[:3]:
        console.print(f"[yellow]--exclude-near: unreadable evaluation image[/yellow] {line}")
    return evals.near


def _convert_hf(args, prefix: str, console, exclude) -> dict:
    from rsclip_ds.data.convert import convert
    from rsclip_ds.data.hf_source import resolve_hf_dataset
    from rsclip_ds.data.ingest import RowSpec
    from rsclip_ds.runtime.host_memory import keep_freed_memory

    # the datasets parquet reader allocates fresh buffers per record batch: glibc then hands back
    # and re-faults their pages each time (measured: 150k page faults and a third of the CPU time
    # for 12,000 rows of 45 KB images; 6k kept): keep freed memory in the process, as the trainer does
    keep_freed_memory()

    split = args.split or "train"
    source = resolve_hf_dataset(args.hf_dataset, split=split, config=args.hf_config, revision=args.revision)
    spec = RowSpec(image_column=args.image_column,
                   caption_columns=tuple(c.strip() for c in args.caption_column.split(",") if c.strip()),
                   where=args.where or "", min_words=args.min_caption_words, max_words=args.max_caption_words,
                   max_side=args.max_side, format=args.format, quality=args.quality,
                   bands=BandChoice.parse(args.bands, args.band_scale), verify=args.verify, split=split)
    return convert(source, args.out, prefix=prefix, spec=spec, shard_size=args.shard_size,
                   shard_bytes=args.shard_bytes, workers=args.workers, restart=args.restart, console=console,
                   exclude=exclude)


def make_shards_command(args) -> int:
    from rich.console import Console
    from rich.table import Table

    console = Console(stderr=True)
    prefix = args.prefix or (args.split.split(",")[0] if args.split else "train")
    try:
        exclude = _exclude(args, console)
        if args.hf_dataset:
            info = _convert_hf(args, prefix, console, exclude)
        else:
            filtered: list[str] = []
            records, root = _records(args, filtered)
            encoding = Encoding(args.max_side, args.format, args.quality, BandChoice.parse(args.bands, args.band_scale))
            info = make_shards(records, args.out, prefix=prefix, shard_size=args.shard_size,
                               shard_bytes=args.shard_bytes, root=root, workers=args.workers,
                               encoding=encoding, console=console, filtered=filtered, exclude=exclude)
    except (ValueError, OSError, BandsError) as err:
        raise ConfigError(str(err)) from None
    table = Table(title=f"make-shards {prefix} -> {args.out}")
    table.add_column("what")
    table.add_column("count", justify="right")
    table.add_row("samples written", str(info["num_samples"]))
    table.add_row("shards", str(info["num_shards"]))
    table.add_row("captions", str(info["captions"]))
    for kind, n in info["skipped"].items():
        table.add_row(f"skipped: {kind}", str(n))
    console.print(table)
    for kind, paths in info["examples"].items():
        console.print(f"[yellow]skipped ({kind})[/yellow] e.g. " + "; ".join(paths[:3]))
    if info["skipped"]:
        console.print(f"skipped inputs (by reason, with examples): {args.out / f'{prefix}-report.json'}")
    if exclude is not None:
        console.print(f"--exclude-near: dropped {info['skipped'].get('near_evaluation', 0)} image(s) within "
                      f"pHash {args.exclude_max_distance} (fine {args.exclude_max_fine_distance}) of the "
                      f"{len(exclude.paths):,} evaluation images; pairs in {args.out / f'{prefix}-report.json'} "
                      "(near_evaluation_pairs)")
    print(json.dumps({"train_shards": str(args.out / info["pattern"]), "num_samples": info["num_samples"],
                      "num_shards": info["num_shards"], "skipped": info["skipped"]}))
    return 0
