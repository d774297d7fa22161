"""Weights & Biases on rank 0 (logging.wandb): our metrics on the optimizer-step axis, the run's
config and summary, the suite's tables and plot, its confusion matrices and retrieval galleries
(eval_visuals.py reads them from the step's suite folder), and DeepSpeed's own events beside them.

    wb = build_wandb_log(run.logging, run.output_dir, rank=rank, resumed_at=None, config={...})
    metrics = MetricsLog(out / "metrics.jsonl", engine.monitor, wandb=wb)   # train lines, evaluations
    engine.monitor = wb.deepspeed_monitor(engine)    # DeepSpeed's Train/Samples/* into the same run
    wb.summary(summary)                              # summary.json's scalars, at the end
    wb.finish(exit_code)

Why not DeepSpeed's W&B monitor: W&B keeps one step counter per run and drops any `log` at a lower
step, and DeepSpeed's monitor passes its sample count (optimizer steps x global batch) as that step,
so from step 2 on W&B dropped every event of ours. Here W&B's step is our optimizer step for every
event (evaluation before training: step 0); DeepSpeed's events are logged at the optimizer step
they belong to and carry their sample count as `samples`, the x axis of their charts (define_metric).

One W&B row per step: DeepSpeed's events (inside engine.step) and evaluations come first,
uncommitted; the train line commits the row (hands it to wandb-core, which writes the run's file).
A step with no train line (an evaluation between log steps) is committed by the next step's first
event, or at finish.

Resume: {output_dir}/monitor/wandb/run.json holds the W&B run's id. A resumed run (--resume)
continues that W&B run from the highest step it holds -- online the server's, offline the highest
in the files of its earlier segments. That can be below what the killed process logged: wandb-core
buffers the file, and a SIGKILL of rank 0 and its children takes the buffer (measured: a run killed
after 14 s had written nothing). So the steps up to the checkpoint that the W&B run lacks are
logged again from metrics.jsonl (the train and eval lines; DeepSpeed's events of those steps are
not there), and every event at or below the highest step is skipped: no step twice, none lost
that metrics.jsonl has. Where both hold a step, W&B keeps the first values and metrics.jsonl the
last (the same numbers in a deterministic run). A fresh run starts a new W&B run. Offline, each
process start is a folder wandb/offline-run-<time>-<id>; `wandb sync` uploads the folders of one
id as one run, in order.
"""

from __future__ import annotations

import json
import logging
import os
import re
import struct
from pathlib import Path
from typing import Any

from rsclip_ds.config import LoggingConfig
from rsclip_ds.reporting.eval_visuals import TOP, Gallery, read_step, render_confusion, step_folder, thumbnail
from rsclip_ds.reporting.metrics import eval_values, read_metrics, suite_ran, train_values

log = logging.getLogger("rsclip_ds")
STATE = "run.json"


def state_path(output_dir: str | Path) -> Path:
    return Path(output_dir) / "monitor" / "wandb" / STATE


def build_wandb_log(cfg: LoggingConfig, output_dir: str | Path, *, rank: int, resumed_at: int | None,
                    config: dict[str, Any]) -> "WandbLog | None":
    """The run's W&B writer on rank 0 when logging.wandb is on, else None. W&B's own variables
    decide what the config leaves open (WANDB_MODE, WANDB_ENTITY, WANDB_RUN_GROUP, WANDB_DIR,
    WANDB_PROJECT when logging.wandb_project is unset; runtime.distributed.configure_wandb_offline
    set the defaults: offline, rsclip_ds). ``config``: the resolved run config, the run's config."""
    if not cfg.wandb or rank != 0:
        return None
    return WandbLog.start(state_path(output_dir), project=cfg.wandb_project, config=config,
                          resumed_at=resumed_at, eval_dir=Path(output_dir) / "eval",
                          metrics_path=Path(output_dir) / "metrics.jsonl")


class WandbLog:
    """One W&B run written from rank 0. ``floor``: events at or below this step are skipped."""

    def __init__(self, run, state: Path, floor: int, eval_dir: Path | None = None):
        self.run, self.state, self.floor, self.eval_dir = run, state, floor, eval_dir
        self._said_big: set[str] = set()   # the sets whose confusion matrix was too big for W&B's chart

    @classmethod
    def start(cls, state: Path, *, project: str | None, config: dict[str, Any], resumed_at: int | None,
              eval_dir: Path | None = None, metrics_path: Path | None = None) -> "WandbLog":
        """A new W&B run, or (``resumed_at`` set and run.json there) the run.json's run continued;
        a resumed run first logs what the W&B run lacks up to ``resumed_at`` from ``metrics_path``."""
        import wandb

        saved = json.loads(state.read_text()) if resumed_at is not None and state.is_file() else None
        run = wandb.init(project=project, id=saved["id"] if saved else None, resume="allow" if saved else None)
        run.config.update(config, allow_val_change=True)   # a resume may change settings (steps, stop_after)
        run.define_metric("samples")
        run.define_metric("Train/Samples/*", step_metric="samples")   # DeepSpeed's family, on its own axis
        live = run.settings.mode != "disabled"
        self = cls(run, state, last_logged_step(run) if saved and live else -1, eval_dir)
        self._save()
        held = self.floor
        filled = self._backfill(metrics_path, resumed_at) if resumed_at is not None and metrics_path and live else []
        self._say_start(held if saved else None, filled)
        return self

    def _backfill(self, metrics_path: Path, resumed_at: int) -> list[int]:
        """Log metrics.jsonl's lines (of its last run) above the floor and up to ``resumed_at``, a
        step's evaluation before its train line as in the loop -> the steps logged."""
        if not metrics_path.is_file():
            return []
        m = read_metrics(metrics_path, last_run=True)
        lines = sorted([(r["step"], 0, r) for r in m["eval"]] + [(r["step"], 1, r) for r in m["train"]],
                       key=lambda t: t[:2])
        filled = []
        for step, is_train, r in lines:
            if not self.floor < step <= resumed_at:
                continue
            if is_train:
                self.train(step, r)
            else:
                self.eval(step, r["eval"])
            if not filled or filled[-1] != step:
                filled.append(step)
        return filled

    def _say_start(self, held: int | None, filled: list[int]) -> None:
        run = self.run
        after = "" if held is None else f", continued (it held {f'steps up to {held}' if held >= 0 else 'none'})"
        if filled:
            after += (f"; {len(filled)} logged step(s) it lacked ({filled[0]}..{filled[-1]}) sent again from "
                      f"metrics.jsonl")
        if run.settings.mode == "disabled":
            log.info("W&B: disabled (WANDB_MODE=disabled): nothing is logged there")
        elif run.offline:
            folders = Path(run.dir).parents[1] / f"offline-run-*-{run.id}*"   # run.dir: <folder>/files
            log.info("W&B: offline run %s (project %s)%s; upload it with: wandb sync %s", run.id, run.project,
                     after, folders)
        else:
            log.info("W&B: run %s%s", run.url, after)

    def _save(self) -> None:
        self.state.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.state.with_suffix(".tmp")
        tmp.write_text(json.dumps({"id": self.run.id}))
        os.replace(tmp, self.state)

    # ---- events
    def train(self, step: int, record: dict[str, Any]) -> None:
        """A train line: commits the step's row (with the step's earlier events) and moves the floor."""
        if step <= self.floor:
            return
        self.run.log(train_values(record, per_rank=True), step=step, commit=True)
        self.floor = step

    def eval(self, step: int, metrics: dict[str, Any]) -> None:
        """An evaluation's flat metrics (Eval/...); with the suite, its tables and plot (Suite/...)
        and per set its confusion matrix or gallery (Suite/<set>/confusion, Suite/<set>/gallery)."""
        if step <= self.floor:
            return
        row = eval_values(metrics)
        if suite_ran(metrics):
            row.update(self._suite(step))
            row.update(self._suite_visuals(step))
        self.run.log(row, step=step)

    def deepspeed_events(self, events: list[tuple[str, float, int]], step: int) -> None:
        """DeepSpeed's (name, value, samples) events of optimizer step ``step``."""
        if step <= self.floor or not events:
            return
        self.run.log({"samples": events[0][2], **{name: float(value) for name, value, _ in events}}, step=step)

    def _suite(self, step: int) -> dict[str, Any]:
        """suite.md's tables (W&B tables, percent as in suite.md, published numbers beside ours) and
        suite.png, from the evaluation's eval/step{N}.json (rank 0 wrote it before returning)."""
        import wandb

        from rsclip_ds.evaluation.catalog import published_results
        from rsclip_ds.evaluation.report import markdown_report, plot_report

        path = self.eval_dir / f"step{step:08d}.json" if self.eval_dir is not None else None
        suite = json.loads(path.read_text()).get("suite") if path is not None and path.is_file() else None
        if not suite:
            return {}
        results, published = {"model": f"step {step}", **suite}, published_results()
        row: dict[str, Any] = {}
        for title, head, rows in markdown_tables(markdown_report(results, published)):
            row[f"Suite/{title.split()[-1].lower()}"] = wandb.Table(columns=head, data=rows, allow_mixed_types=True)
        png = plot_report(results, published, path.with_name(f"suite_step{step:08d}.png"))
        if png is not None:
            row["Suite/plot"] = wandb.Image(str(png))
        return row

    def _suite_visuals(self, step: int) -> dict[str, Any]:
        """From the step's suite folder (eval/step{N:08d}/, eval_visuals.read_step): per
        classification set W&B's confusion-matrix chart of the top-1 predictions, per retrieval set a
        table of the sampled caption queries with their images. A matrix over W&B's table limit
        (wandb.plot.confusion_matrix makes a K x K table of counts: K^2 rows, truncated past
        Table.MAX_ROWS) goes as its rendering instead (needs matplotlib), said once per set."""
        import wandb

        visuals = read_step(step_folder(self.eval_dir, step)) if self.eval_dir is not None else None
        if visuals is None:
            return {}
        row: dict[str, Any] = {}
        for c in visuals.confusions:
            key = f"Suite/{c.set}/confusion"
            if len(c.classes) ** 2 <= wandb.Table.MAX_ROWS:
                row[key] = wandb.plot.confusion_matrix(y_true=c.labels, preds=c.preds, class_names=c.classes,
                                                       title=f"{c.set} (step {step})")
                continue
            image = render_confusion(c)
            if c.set not in self._said_big:
                self._said_big.add(c.set)
                log.info("W&B: %s has %d classes, %d cells over W&B's table limit of %d: its confusion matrix "
                         "goes as an image%s", c.set, len(c.classes), len(c.classes) ** 2, wandb.Table.MAX_ROWS,
                         "" if image is not None else " (not this run: matplotlib is not installed)")
            if image is not None:
                row[key] = wandb.Image(image, caption=f"{c.set}: rows true class, columns top-1, rows sum to 1")
        for g in visuals.galleries:
            row[f"Suite/{g.set}/gallery"] = gallery_table(g)
        return row

    # ---- the end
    def summary(self, summary: dict[str, Any]) -> None:
        """summary.json's numbers and words as the run's summary (summary/<key>, nested keys joined
        by '/'); its lists (losses, lrs, evals) are the history already."""
        self.run.summary.update({f"summary/{k}": v for k, v in flat_scalars(summary).items()})

    def finish(self, exit_code: int = 0) -> None:
        if self.run is not None:
            self.run.finish(exit_code=exit_code)
            self.run = None

    def deepspeed_monitor(self, engine) -> "DeepSpeedEvents":
        """A stand-in for engine.monitor (set it after MetricsLog took the original): DeepSpeed's own
        events still reach its TensorBoard / CSV monitors, and reach this run at engine.global_steps."""
        return DeepSpeedEvents(engine.monitor, self, lambda: engine.global_steps)


class DeepSpeedEvents:
    """MonitorMaster's interface (`enabled`, `write_events`) for the engine, which writes its
    samples-keyed events (Train/Samples/lr after every optimizer step; loss_scale under fp16;
    elapsed_time_ms_* with wall_clock_breakdown) only while its monitor is enabled, on rank 0."""

    enabled = True

    def __init__(self, inner, wandb_log: WandbLog, step_of):
        self.inner, self.wandb_log, self.step_of = inner, wandb_log, step_of

    def write_events(self, events: list[tuple[str, float, int]]) -> None:
        if self.inner is not None and self.inner.enabled:
            self.inner.write_events(events)
        self.wandb_log.deepspeed_events(events, self.step_of())


GALLERY_COLUMNS = ["caption", "caption_index", "rank", "correct image"] + [f"top{k}" for k in range(1, TOP + 1)]


def gallery_table(g: Gallery):
    """A retrieval set's sampled caption queries as a wandb.Table, one row per query: the caption, its
    index, the rank of its image, that image and the top-5 images as wandb.Image thumbnails (captioned
    with their score; the correct one 'correct'). A set with fewer than 5 images: empty cells."""
    import wandb

    thumbs: dict[str, Any] = {}   # an image in several rows is read once

    def image(path: str, caption: str):
        if path not in thumbs:
            thumbs[path] = thumbnail(path)
        return wandb.Image(thumbs[path], caption=caption)

    data = []
    for r in g.rows:
        top = [image(p, f"{score:.2f}" + (" correct" if i == r["image_index"] else ""))
               for p, i, score in zip(r["top5_images"], r["top5"], r["top5_scores"])]
        data.append([r["caption"], r["caption_index"], r["rank"], image(r["image"], "correct")]
                    + top + [None] * (TOP - len(top)))
    return wandb.Table(columns=GALLERY_COLUMNS, data=data)   # typed columns: W&B shows the images


def last_logged_step(run) -> int:
    """The highest step a resumed W&B run holds (-1: none): online the server's (W&B resumes past
    it), offline the highest in the files of its segments under the run's WANDB_DIR."""
    if not run.offline:
        return run.step - 1
    history = read_offline_run(Path(run.dir).parents[2], run.id)["history"]   # run.dir: <dir>/wandb/<folder>/files
    return max((r["_step"] for r in history if "_step" in r), default=-1)


def flat_scalars(d: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    """{"a": {"b": 1}, "c": [1, 2], "d": "x"} -> {"a/b": 1, "d": "x"}: numbers, words, flags and None."""
    out: dict[str, Any] = {}
    for key, value in d.items():
        if isinstance(value, dict):
            out.update(flat_scalars(value, f"{prefix}{key}/"))
        elif value is None or isinstance(value, (int, float, str, bool)):
            out[f"{prefix}{key}"] = value
    return out


def markdown_tables(text: str) -> list[tuple[str, list[str], list[list[Any]]]]:
    """The pipe tables of a markdown text -> [(the heading above it, columns, rows)]: cells as
    numbers where they are, None for a dash, else text."""
    tables, heading, lines = [], "", text.splitlines() + [""]
    block: list[str] = []
    for line in lines:
        if line.startswith("|"):
            block.append(line)
            continue
        if block:
            head, *rows = [_cells(b) for b in block[:1] + block[2:]]   # block[1]: the |---| rule
            tables.append((heading, head, [[_value(c) for c in r] for r in rows]))
            block = []
        if line.startswith("#"):
            heading = line.lstrip("#").strip()
    return tables


def _cells(line: str) -> list[str]:
    return [c.strip().replace("\\|", "|") for c in re.split(r"(?<!\\)\|", line.strip()[1:-1])]


def _value(cell: str) -> Any:
    if cell in ("—", "-", ""):
        return None
    try:
        return float(cell)
    except ValueError:
        return cell


# --------------------------------------------------------------------------- reading offline runs

BLOCK, HEADER = 32768, 7   # a .wandb file: LevelDB's log format after a 7-byte ':W&B' header


def wandb_records(path: str | Path):
    """The records of one .wandb file, parsed with wandb's own protobuf classes (chunks in 32 KiB
    blocks, each with a 7-byte header crc32/length/type; types 1 full, 2 first, 3 middle, 4 last)."""
    from wandb.proto import wandb_internal_pb2 as pb

    data, pos, chunks = Path(path).read_bytes(), HEADER, b""
    if data[:4] != b":W&B":
        raise ValueError(f"{path}: not a .wandb file (starts with {data[:7]!r})")
    while pos + HEADER <= len(data):
        if BLOCK - pos % BLOCK < HEADER:   # a block's tail too short for a header is padding
            pos += BLOCK - pos % BLOCK
            continue
        _, length, kind = struct.unpack("<IHB", data[pos:pos + HEADER])
        if (kind == 0 and length == 0) or pos + HEADER + length > len(data):   # the end, or cut off there
            break
        chunks += data[pos + HEADER:pos + HEADER + length]
        pos += HEADER + length
        if kind in (1, 4):
            record = pb.Record()
            record.ParseFromString(chunks)
            chunks = b""
            yield record


def read_offline_run(folder: str | Path, run_id: str) -> dict[str, Any]:
    """Every offline segment of one W&B run under ``folder`` (a WANDB_DIR: its wandb/offline-run-*-<id>
    folders, in start order) -> {"segments": n, "history": rows in logged order, "config": {...},
    "summary": {...}}: what `wandb sync` would upload. A media value (a table, an image) is the dict
    W&B stores: {"_type": "table-file", "path": <under the folder's files/>, ...}."""
    # offline-run-<YYYYmmdd_HHMMSS>-<id>, and -<n> after it for a second start within the same second
    name = re.compile(rf"offline-run-(\d{{8}}_\d{{6}})-{re.escape(run_id)}(?:-(\d+))?")
    found = [(m.group(1), int(m.group(2) or 0), d) for d in Path(folder).glob("wandb/offline-run-*")
             if (m := name.fullmatch(d.name))]
    paths = [d / f"run-{run_id}.wandb" for *_, d in sorted(found)]
    history, config, summary = [], {}, {}
    for path in paths:
        for record in wandb_records(path):
            kind = record.WhichOneof("record_type")
            if kind == "history":
                history.append(_items(record.history.item))
            elif kind in ("run", "config"):
                config.update(_items((record.run.config if kind == "run" else record.config).update))
            elif kind == "summary":
                summary.update(_items(record.summary.update))
    config.pop("_wandb", None)   # wandb's own bookkeeping
    return {"segments": len(paths), "history": history, "config": config, "summary": summary}


def _items(items) -> dict[str, Any]:
    """Items -> a dict; an item with a nested key (a media file's fields) -> nested dicts."""
    out: dict[str, Any] = {}
    for item in items:
        *parents, key = [item.key] if item.key else list(item.nested_key)
        d = out
        for name in parents:
            d = d.setdefault(name, {})
        d[key] = json.loads(item.value_json)
    return out
