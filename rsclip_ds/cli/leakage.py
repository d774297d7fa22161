"""`rsclip-ds check-leakage`: training shards against evaluation sets, by perceptual hash.

Exit codes: 0 no training image near an evaluation image (cross-set duplicates among the
evaluation sets are reported, not counted against), 3 near-duplicates found (the report lists
every pair), 2 a bad argument or path (one line on stderr).
"""

from __future__ import annotations

import json
import time
from pathlib import Path

from rsclip_ds.config import ConfigError
from rsclip_ds.data.near_duplicates import MAX_DISTANCE, MAX_FINE_DISTANCE

EXIT_LEAKAGE = 3


def register(sub) -> None:
    p = sub.add_parser("check-leakage", help="find training images that are near-duplicates of evaluation "
                       "images (perceptual hashes: resized and re-encoded copies too)")
    p.add_argument("--shards", required=True, help="training shards: a brace pattern, a glob or a .txt list "
                   "('::' joins several), as data.train_shards takes them")
    p.add_argument("--against", required=True, action="append", metavar="ROOT_OR_JSON", type=Path,
                   help="evaluation images: a suite root (one folder per set; a set's name is its folder) or a "
                   "Karpathy caption JSON (its images, all splits); repeat for several")
    p.add_argument("--max-distance", type=int, default=MAX_DISTANCE, help="bits of the 64-bit pHash two "
                   "images may differ in (the index radius)")
    p.add_argument("--max-fine-distance", type=int, default=MAX_FINE_DISTANCE, help="bits of the 256-bit "
                   "pHash they may differ in as well (cuts pairs of flat scenes that only look alike)")
    p.add_argument("--out", type=Path, default=Path("leakage-report.json"), help="the JSON report")
    p.add_argument("--workers", type=int, default=0, help="processes decoding and hashing (0: the cores "
                   "this process may run on)")
    p.add_argument("--image-key", default=None, help="image member extension(s) of the shards, ';'-separated "
                   "(default: data.image_key's)")
    p.set_defaults(handler=check_leakage_command)


def check_leakage_command(args) -> int:
    from rich.console import Console

    from rsclip_ds.data import expand_urls
    from rsclip_ds.data.loader import available_cores
    from rsclip_ds.evaluation.leakage import (DEFAULT_IMAGE_KEYS, build_near_index, check_shards, cross_set_pairs,
                                              leakage_report)

    if not 0 <= args.max_distance < 64 or args.workers < 0:
        raise ConfigError(f"--max-distance must be in 0..63 and --workers >= 0 (got {args.max_distance}, "
                          f"{args.workers})")
    console = Console(stderr=True)
    workers = args.workers or available_cores()
    try:
        urls = expand_urls(args.shards)
        t0 = time.perf_counter()
        evals = build_near_index(args.against, workers=workers, max_distance=args.max_distance,
                                 max_fine_distance=args.max_fine_distance, console=console)
    except ValueError as err:
        raise ConfigError(str(err)) from None
    cross = cross_set_pairs(evals.near)
    t1 = time.perf_counter()
    keys = tuple(k.strip() for k in (args.image_key or DEFAULT_IMAGE_KEYS).split(";") if k.strip())
    shards = check_shards(urls, evals.near, workers=workers, image_keys=keys, console=console)
    report = leakage_report(evals, cross, shards, {"evaluation": t1 - t0, "training": time.perf_counter() - t1})
    if report["training_images"] == 0:
        raise ConfigError(f"--shards {args.shards}: no readable image in {len(urls)} shard(s) (problems: "
                          f"{report['unreadable']['shards'] or report['unreadable']['training_examples'][:3]}); "
                          "check the pattern and --image-key")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2) + "\n")
    print_summary(console, report, args.out)
    print(json.dumps({"report": str(args.out), "training_images": report["training_images"],
                      "training_images_matched": report["training_images_matched"],
                      "training_pairs": report["training_pairs"], "cross_set_pairs": len(cross)}))
    return EXIT_LEAKAGE if report["training_pairs"] else 0


def print_summary(console, report: dict, out: Path) -> None:
    """One screen: per evaluation set what matched, the cross-set duplicates, the first pairs."""
    from rich.table import Table

    table = Table(title=f"check-leakage: {report['training_images']:,} training images against "
                  f"{report['evaluation_images']:,} evaluation images (pHash <= {report['max_distance']} "
                  f"and <= {report['max_fine_distance']} of 256)")
    for column in ("evaluation set", "images", "matched", "training images", "pairs"):
        table.add_column(column, justify="left" if column == "evaluation set" else "right")
    for name, c in report["counts"].items():
        style = "red" if c["pairs"] else None
        table.add_row(name, f"{c['images']:,}", f"{c['matched_images']:,}", f"{c['training_images']:,}",
                      f"{c['pairs']:,}", style=style)
    console.print(table)
    for label, n in report["cross_set"]["counts"].items():
        console.print(f"[yellow]evaluation sets sharing images[/yellow] {label}: {n} pair(s)")
    for p in report["pairs"][:5]:
        console.print(f"  {p['shard']} {p['key']} ~ {p['set']}: {p['image']} (distance {p['distance']}, "
                      f"fine {p['fine_distance']})")
    if len(report["pairs"]) > 5:
        console.print(f"  ... {len(report['pairs']) - 5} more")
    bad = report["unreadable"]
    if bad["training"] or bad["evaluation"] or bad["shards"]:
        console.print(f"[yellow]unreadable[/yellow]: {bad['training']} training image(s), {bad['evaluation']} "
                      f"evaluation image(s), shard problems {bad['shards'] or 'none'} (examples in the report)")
    console.print(f"{report['training_images_per_second']:,.0f} training images/s; report: {out}")
