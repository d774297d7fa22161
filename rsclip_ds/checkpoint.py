"""Checkpoints: DeepSpeed save/resume behind our own atomic pointer, consolidation, HF export.

Layout (docs/reference/file-formats.md):

    {output_dir}/checkpoints/
        rsclip_latest             our pointer: the tag of the newest checkpoint every rank finished
        step00000040/             one tag per saved step
            rsclip_meta.json      step, resolved config, rsclip_ds version; written only after
                                  every rank finished writing, so it marks a complete checkpoint
            rsclip_manifest.json  every file's path, size and xxh3_128 (runtime/integrity.py); written
                                  just before the meta, verified on resume
            rsclip_rank00000.pt   each rank's RNG state and data position (one small file per rank)
            rsclip_history.json   the run's per-step losses, learning rates and evaluations
            hf/                   config.json, tokenizer, preprocessor_config.json (no weights)
            mp_rank_00_model_states.pt, *_optim_states.pt   DeepSpeed's shards
            universal/            DeepSpeed's universal format of this tag, made by the first resume
                                  on another number of ranks (reshard.py; rsclip_universal.json
                                  marks it complete)

DeepSpeed's own `latest` file is written by rank 0 before the other ranks finish their shards,
so we save with `save_latest=False` and never read it. The pointer moves after every rank has
reported its writes (one all_gather), by write-temp + fsync + os.replace: a process killed
mid-save leaves the previous checkpoint as the one `--resume latest` and `resolve_checkpoint`
find. A write that finds the disk full is reported too: every rank then raises the same
DiskFullError and rank 0 removes the torn tag. A resume verifies the manifest and falls back to
the newest intact tag (`select_resume_tag`).
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import re
import shutil
import signal
from pathlib import Path
from typing import Any, Callable

import torch

from rsclip_ds import __version__
from rsclip_ds.config import CheckpointConfig, ConfigError, RunConfig
from rsclip_ds.finite import check_state_dict, check_weights
from rsclip_ds.runtime.integrity import (MANIFEST, DiskFullError, SaveWrites, WriteFailure, build_manifest, deepspeed_writes,
                                 disk_full_message, verify_tag)
from rsclip_ds.runtime.storage import decide_on_rank0, fsync_dir, gather_on_every_rank, is_no_space

log = logging.getLogger("rsclip_ds")

CHECKPOINT_DIR = "checkpoints"
POINTER = "rsclip_latest"
META = "rsclip_meta.json"
HF_DIR = "hf"
RANK_FILE = "rsclip_rank{:05d}.pt"   # one rank's RNG and data position
HISTORY = "rsclip_history.json"     # the run's losses, learning rates, evaluations (rank 0, once)
UNIVERSAL_DIR = "universal"         # in a tag folder: its DeepSpeed universal conversion (not a tag)
UNIVERSAL_DONE = "rsclip_universal.json"   # in UNIVERSAL_DIR: written last, marks a complete conversion
_TAG = re.compile(r"^step(\d{8})$")


def tag_for(step: int) -> str:
    return f"step{step:08d}"


def checkpoint_root(output_dir: Path) -> Path:
    return Path(output_dir) / CHECKPOINT_DIR


def _atomic_write(path: Path, text: str) -> None:
    """Readers see the old file or the new one, never a torn one (also across a power loss)."""
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    try:
        with open(tmp, "w") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)   # a full disk leaves no temp file behind
        raise
    fsync_dir(path.parent)   # the rename itself is durable only once the folder is synced


def read_pointer(root: Path) -> str | None:
    path = Path(root) / POINTER
    return path.read_text().strip() if path.is_file() else None


def is_complete(root: Path, tag: str) -> bool:
    return (Path(root) / tag / META).is_file()


def complete_tags(root: Path) -> list[str]:
    """Complete checkpoints, oldest first."""
    root = Path(root)
    if not root.is_dir():
        return []
    tags = [p.name for p in root.iterdir() if _TAG.match(p.name) and is_complete(root, p.name)]
    return sorted(tags)


def latest_tag(root: Path) -> str | None:
    """The pointer's tag; if that one lost its meta (a run resumed from an older tag was killed
    while re-saving it), the newest complete tag instead."""
    tag = read_pointer(root)
    if tag is not None and is_complete(root, tag):
        return tag
    complete = complete_tags(root)
    if complete:
        log.warning("%s names %s, which is incomplete; using %s", Path(root) / POINTER, tag, complete[-1])
        return complete[-1]
    return None


def resolve_checkpoint(path: str | Path) -> tuple[Path, str]:
    """(checkpoint root, tag) from a run's output_dir, its checkpoints folder, or a tag folder.
    A root resolves through our pointer (the newest checkpoint every rank finished)."""
    p = Path(path)
    if (p / META).is_file():
        return p.parent, p.name
    if p.is_dir() and _TAG.match(p.name):
        raise FileNotFoundError(f"{p} is an incomplete checkpoint (no {META}: a rank died while "
                                f"saving it); use the checkpoints folder {p.parent} to get the newest complete one")
    if (p / CHECKPOINT_DIR).is_dir():
        p = p / CHECKPOINT_DIR
    tag = latest_tag(p)
    if tag is None:
        raise FileNotFoundError(f"no complete checkpoint under {path} (no {POINTER} file); pass a run "
                                f"output_dir, its '{CHECKPOINT_DIR}' folder or a step######## folder")
    return p, tag


def resume_tag(root: Path, resume: str) -> str | None:
    """The tag `checkpoint.resume` names under ``root``: 'auto' the newest complete checkpoint
    or None (a fresh start: one command serves a job's first submission and its requeues);
    'latest' the same but an error without one; else a tag that must be complete."""
    if resume in ("auto", "latest"):
        tag = latest_tag(root)
        if tag is None and resume == "latest":
            raise ConfigError(f"--resume latest: no complete checkpoint in {root} (set checkpoint.every to save "
                              f"some, start without --resume, or use --resume auto: resume if there is one)")
        return tag
    if not _TAG.match(resume):
        raise ConfigError(f"--resume {resume!r}: expected 'auto', 'latest' or a tag like step00000040")
    if not is_complete(root, resume):
        have = ", ".join(complete_tags(root)) or "none"
        raise ConfigError(f"--resume {resume}: no complete checkpoint of that name in {root} (complete ones: {have})")
    return resume


def select_resume_tag(root: Path, resume: str, *, checksums: bool = True, rank: int = 0,
                      world_size: int = 1) -> str | None:
    """resume_tag, decided by rank 0, then verified against its manifest by every rank (each the
    files its rank number wrote: integrity.verify_files): the same tag on every rank. 'auto' /
    'latest' fall back to the newest intact tag, with a warning naming the broken file and the
    tag resumed from; a named tag that is broken, or no intact tag left, is a ConfigError naming
    the files. Every rank of the group must call it."""
    candidates = decide_on_rank0(lambda: _candidates(Path(root), resume))
    broken: list[tuple[str, list[str]]] = []
    for tag in candidates:
        views = gather_on_every_rank(verify_tag(Path(root) / tag, checksums, (rank, world_size)))
        if all(v is None for v in views):
            if rank == 0:
                log.info("checkpoint %s has no %s (an older rsclip_ds wrote it): loading it without checking sizes "
                         "or checksums", tag, MANIFEST)
        problems = sorted(p for v in views if v for p in v)
        if not problems:
            if rank == 0:
                for bad, why in broken:
                    log.warning("checkpoint %s is broken: %s; resuming from %s, the newest intact checkpoint",
                                bad, "; ".join(why), tag)
            return tag
        if resume not in ("auto", "latest"):
            raise ConfigError(f"--resume {resume}: checkpoint {tag} is broken: {'; '.join(problems)}. Resume another "
                              f"tag, or --resume latest for the newest intact one (rsclip-ds verify-checkpoint "
                              f"{root} lists them)")
        broken.append((tag, problems))
    if broken:
        listed = " | ".join(f"{tag}: {'; '.join(why)}" for tag, why in broken)
        raise ConfigError(f"--resume {resume}: no intact checkpoint left in {root} ({listed}). Restore the files "
                          f"named, or start afresh in another output_dir")
    return None


def _candidates(root: Path, resume: str) -> list[str]:
    """The tags to try, in order: the one resume_tag names, then ('auto', 'latest') older complete ones."""
    first = resume_tag(root, resume)
    if first is None:
        return []
    older = [t for t in reversed(complete_tags(root)) if t < first] if resume in ("auto", "latest") else []
    return [first, *older]


def prepare_fresh_root(root: Path, overwrite: bool, rank: int) -> None:
    """A run that starts fresh must not share its checkpoints folder with another run's
    checkpoints: pruning goes by tag, so an earlier run's step00020000 would outrank and outlive
    this run's own newest saves. Refuse (ConfigError, naming the ways out); with ``overwrite``
    rank 0 moves the folder aside to checkpoints.replaced-<UTC time> (nothing is deleted)."""
    import time

    import torch.distributed as dist

    found = complete_tags(root)
    if not found:
        return
    if not overwrite:
        raise ConfigError(f"{root} holds checkpoints of another run ({found[0]} .. {found[-1]}); a fresh run there "
                          f"would mix its tags with theirs and prune its own newest saves. Continue that run with "
                          f"--resume auto, give this one another output_dir (--set output_dir=...), or move them "
                          f"aside with --set checkpoint.overwrite=true")
    group = dist.is_available() and dist.is_initialized()
    if group:
        dist.barrier()   # every rank has looked before the folder moves
    if rank == 0:
        aside = root.with_name(f"{root.name}.replaced-{time.strftime('%Y%m%dT%H%M%SZ', time.gmtime())}")
        root.rename(aside)
        log.warning("checkpoint.overwrite: moved the earlier run's checkpoints %s .. %s to %s", found[0],
                    found[-1], aside)
    if group:
        dist.barrier()


def load_meta(root: Path, tag: str) -> dict[str, Any]:
    return json.loads((Path(root) / tag / META).read_text())


def finite_fallback(root: Path, tag: str, verb: str) -> str:
    """What to do instead of resuming or exporting ``tag``, whose weights are not finite: ``verb`` the
    newest older checkpoint whose save tested its weights (meta 'weights_finite'), else try the
    older ones nobody tested. ``verb``: 'resume' or 'export'."""
    how = {"resume": "--resume {}", "export": f"rsclip-ds export {root}/{{}} ..."}[verb]
    older = [t for t in complete_tags(root) if t < tag]
    tested = [t for t in older if load_meta(root, t).get("weights_finite")]
    if tested:
        return f"The newest checkpoint whose save tested its weights is {tested[-1]}: {how.format(tested[-1])}"
    if older:
        return (f"No older checkpoint's save tested its weights (an older rsclip_ds wrote {', '.join(older)}): "
                f"try {how.format(older[-1])}")
    return "No older checkpoint exists: start afresh (another output_dir, or --set checkpoint.overwrite=true)"


@contextlib.contextmanager
def weights_only_loads():
    """Force `torch.load(weights_only=True)` inside DeepSpeed's loaders, which pass
    weights_only=False. The allow-list holds what DeepSpeed 0.19 pickles besides tensors and
    containers (see docs/guides/checkpoints.md); anything else fails to load instead of running."""
    original = torch.load

    def safe_load(*args, **kwargs):
        kwargs["weights_only"] = True
        return original(*args, **kwargs)

    with torch.serialization.safe_globals(_safe_globals()):
        torch.load = safe_load
        try:
            yield
        finally:
            torch.load = original


def _safe_globals() -> list:
    from deepspeed.runtime.fp16.loss_scaler import DynamicLossScaler, LossScaler
    from deepspeed.runtime.zero.config import ZeroStageEnum
    from deepspeed.utils.tensor_fragment import fragment_address

    return [ZeroStageEnum, LossScaler, DynamicLossScaler, fragment_address]


def consolidated_state_dict(path: str | Path) -> tuple[RunConfig, dict[str, torch.Tensor]]:
    """The run config and one fp32 state dict (SiglipModel keys) from a checkpoint of any ZeRO
    stage; `path` as in resolve_checkpoint. Runs on one process, no process group needed."""
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

    root, tag = resolve_checkpoint(path)
    run = RunConfig.model_validate(load_meta(root, tag)["config"])
    whole = root / tag / "mp_rank_00_model_states.pt"
    if not any((root / tag).glob("*zero_pp_rank_*")):   # stage 0: the module, whole, is the state
        with weights_only_loads():
            module = torch.load(whole, map_location="cpu")["module"]
        # stage 0 trains fp32 weights (fp32, amp_bf16, amp: resolve.py refuses 16-bit ones there)
        return run, {k: v.float() for k, v in module.items() if v.is_floating_point()}
    with weights_only_loads():
        state = get_fp32_state_dict_from_zero_checkpoint(str(root), tag=tag)
        if whole.is_file():   # ZeRO-1/2: the module, unpartitioned
            # 0.19.8 saves frozen (locked) parameters for zero_to_fp32 only when gradients are
            # partitioned (ZeRO-2/3); under ZeRO-1 they are only in the module state dict
            module = torch.load(whole, map_location="cpu")["module"]
            state.update({k: v.float() for k, v in module.items() if k not in state and v.is_floating_point()})
    return run, state


# --------------------------------------------------------------------------- save / resume

class Checkpointer:
    """Saves on every rank, moves the pointer once all ranks finished, keeps the newest N.

    `write_extras(folder)` runs on rank 0 for each save (the tokenizer and model config for
    export). `expected_bytes`: one checkpoint's size as estimated at start-up (for the disk-full
    message until a save has measured one). Fault injection: `kill_in_save_at`
    (faults.inject_kill_in_save_at_step), `enospc_in_save_at` / `enospc_rank`
    (faults.inject_enospc_in_save_at_step / _rank: that rank's first write of that save fails
    with a real OSError(ENOSPC) after 4 KiB)."""

    def __init__(self, cfg: CheckpointConfig, root: Path, *, rank: int, world_size: int,
                 run_config: dict[str, Any], write_extras: Callable[[Path], None] | None = None,
                 kill_in_save_at: int | None = None, enospc_in_save_at: int | None = None,
                 enospc_rank: int | None = None, expected_bytes: int | None = None):
        self.cfg, self.root = cfg, Path(root)
        self.rank, self.world_size = rank, world_size
        self.run_config = run_config
        self.write_extras = write_extras
        self.kill_in_save_at = kill_in_save_at
        self.enospc_in_save_at = enospc_in_save_at
        self.enospc_rank = world_size - 1 if enospc_rank is None else enospc_rank   # resolve.py checked it
        self.expected_bytes = expected_bytes
        self.saved: list[str] = []

    def due(self, step: int, last_step: int) -> bool:
        return bool((self.cfg.every and step % self.cfg.every == 0) or (self.cfg.at_end and step == last_step))

    def save(self, engine, step: int, client_state: dict[str, Any]) -> str:
        """Write ``step``'s checkpoint on every rank and move the pointer to it. Raises
        finite.NonFiniteWeights, before any file is written, when a rank holds an inf/NaN weight or
        optimizer state (the pointer keeps naming the previous checkpoint); DiskFullError when a
        write found no room."""
        tag = tag_for(step)
        folder = self.root / tag
        previous = latest_tag(self.root)
        check_weights(engine, f"not saving checkpoint {tag}",
                      f"The resume point stays {previous or 'the start (no checkpoint yet)'}: lower optim.lr or raise "
                      f"optim.warmup_steps, check the data, then --resume latest")
        # O(1) per rank: each rank writes its own RNG and data position to its own small file, rank
        # 0 the run's history once. (DeepSpeed writes the client state into rank 0's file at
        # ZeRO-1/2 and into every rank's at ZeRO-3: a gathered history there grew with ranks².)
        history = client_state.pop("result")
        if self.rank == 0:
            self.root.mkdir(parents=True, exist_ok=True)
            for stale in (META, MANIFEST):   # a re-save after a resume: not complete until re-marked
                (folder / stale).unlink(missing_ok=True)
            shutil.rmtree(folder / UNIVERSAL_DIR, ignore_errors=True)   # converted from the old shards
        injected = self.enospc_in_save_at == step and self.rank == self.enospc_rank
        writes = SaveWrites(folder, self.rank, fail_after=4096 if injected else None)
        self._save_deepspeed(engine, writes, tag, step)
        folder.mkdir(parents=True, exist_ok=True)
        writes.write(folder / RANK_FILE.format(self.rank), lambda f: torch.save(client_state, f))
        if self.rank == 0:
            writes.write_bytes(folder / HISTORY, json.dumps(history).encode())
            if self.write_extras is not None and writes.failure is None:
                with writes.no_space(folder / HF_DIR):
                    self.write_extras(folder / HF_DIR)
                    writes.add_written(folder / HF_DIR)
        if self.kill_in_save_at == step and self.rank == self.world_size - 1:
            log.warning("fault injection: rank %d SIGKILLs itself inside the save of %s", self.rank, tag)
            os.kill(os.getpid(), signal.SIGKILL)
        # every rank's shards are on disk, or some rank found no room: each rank learns both here
        reports = gather_on_every_rank(writes.report())
        failures = [WriteFailure(**r["failure"]) for r in reports if r["failure"]]
        # rank 0 commits (manifest, meta, pointer) or removes the torn tag; its outcome on every rank
        message = decide_on_rank0(lambda: self._abandon(tag, failures) if failures else self._commit(tag, step, reports))
        if message is not None:
            raise DiskFullError(message)
        if self.rank == 0:
            self._prune()
        self.saved.append(tag)
        log.info("checkpoint %s saved to %s", tag, self.root)
        return tag

    def _save_deepspeed(self, engine, writes: SaveWrites, tag: str, step: int) -> None:
        """DeepSpeed's shards, written through ``writes``. A full disk outside its checkpoint engine
        (its recovery scripts) escapes save_checkpoint before its last barrier, where the other
        ranks wait: this rank then takes that barrier itself, so the collectives stay paired."""
        import torch.distributed as dist

        try:
            with deepspeed_writes(engine, writes):
                engine.save_checkpoint(str(self.root), tag=tag, save_latest=False,
                                       client_state={"rsclip": {"step": step, "version": __version__}})
        except OSError as err:
            if not is_no_space(err):
                raise
            writes.record(err, self.root)
            if dist.is_available() and dist.is_initialized():
                dist.barrier()

    def _commit(self, tag: str, step: int, reports: list[dict[str, Any]]) -> str | None:
        """Rank 0, once every rank wrote its files: the manifest, the meta, then the pointer. None,
        or the DiskFull message when one of these found no room."""
        folder = self.root / tag
        try:
            manifest = build_manifest(folder, tag, reports, skip=(META,))
            _atomic_write(folder / MANIFEST, json.dumps(manifest, indent=1))
            # weights_finite: this save tested every rank's weights and optimizer states (check_weights)
            meta = {"step": step, "tag": tag, "world_size": self.world_size, "weights_finite": True,
                    "rsclip_ds_version": __version__, "config": self.run_config}
            _atomic_write(folder / META, json.dumps(meta, indent=2))
            _atomic_write(self.root / POINTER, tag + "\n")
        except OSError as err:
            if not is_no_space(err):
                raise
            (folder / META).unlink(missing_ok=True)   # not complete: the pointer still names the previous tag
            writes = SaveWrites(folder, self.rank)
            writes.record(err, folder)
            return self._abandon(tag, [writes.failure])
        self.expected_bytes = manifest["bytes"]
        return None

    def _abandon(self, tag: str, failures: list[WriteFailure]) -> str:
        """Rank 0, after a save some rank could not finish: remove the torn tag; the message."""
        shutil.rmtree(self.root / tag, ignore_errors=True)
        return disk_full_message(tag, failures, self.expected_bytes, latest_tag(self.root), self.cfg.keep_last)

    def _prune(self) -> None:
        """Delete complete checkpoints older than the newest `keep_last`, and incomplete ones
        older than the newest complete one (a newer incomplete one is overwritten on resume)."""
        keep = complete_tags(self.root)[-self.cfg.keep_last:]
        oldest_kept = keep[0]
        for p in self.root.iterdir():
            if _TAG.match(p.name) and p.name not in keep and p.name < oldest_kept:
                shutil.rmtree(p, ignore_errors=True)

    def load(self, engine, resume: str) -> dict[str, Any]:
        """Load engine state (module, optimizer, scheduler) and return this rank's client state
        (what `train.client_state` made). ``resume``: a tag or 'latest' (resume_tag) written by
        as many ranks as this run has; another number goes through reshard.load_resharded."""
        tag = resume_tag(self.root, resume)
        if tag is None:
            raise ConfigError(f"--resume {resume}: no complete checkpoint in {self.root}")
        saved_world = load_meta(self.root, tag).get("world_size")
        if saved_world != self.world_size:
            raise ConfigError(f"checkpoint {tag} was written by {saved_world} ranks, this run has {self.world_size}: "
                              f"load it with rsclip_ds.reshard.load_resharded (Trainer.build does)")
        with weights_only_loads():
            path, client = engine.load_checkpoint(str(self.root), tag=tag)
        if path is None:
            raise FileNotFoundError(f"DeepSpeed could not load {self.root / tag}")
        log.info("resumed from %s (step %d)", self.root / tag, client["rsclip"]["step"])
        if "ranks" in client["rsclip"]:   # rsclip_ds 0.1 gathered every rank's state into the client state
            return client["rsclip"]["ranks"][self.rank]
        state = torch.load(self.root / tag / RANK_FILE.format(self.rank), weights_only=True)
        state["result"] = json.loads((self.root / tag / HISTORY).read_text())
        return state


SOURCE_FILE = "rsclip_source.json"   # in the checkpoint's hf/ folder: where the run's model came from


def write_hf_extras(folder: Path, model_config, tokenizer, image_size: int, mean, std, source=None) -> None:
    """Everything of a Hugging Face folder except the weights (those come at export), and the
    model's source (hub.ModelSource) for the export's model card."""
    from transformers import SiglipImageProcessorPil

    folder.mkdir(parents=True, exist_ok=True)
    model_config.save_pretrained(str(folder))
    tokenizer.save_pretrained(str(folder))
    SiglipImageProcessorPil(size={"height": image_size, "width": image_size}, image_mean=list(mean),
                            image_std=list(std)).save_pretrained(str(folder))
    if source is not None:
        (folder / SOURCE_FILE).write_text(json.dumps(source.to_dict(), indent=2))


def _model_card(name: str, source: dict | None, step: int, dtype: str) -> str:
    """README.md with the Hub's metadata header: `base_model` names the hub model it started from."""
    header = ["---", "library_name: transformers", "pipeline_tag: zero-shot-image-classification",
              "tags: [siglip, remote-sensing, rsclip_ds]"]
    origin = "a randomly initialised model"
    if source and source.get("kind") == "hub":
        header.append(f"base_model: {source['name']}")
        origin = f"[{source['name']}](https://huggingface.co/{source['name']}) at commit {source.get('commit')}"
    elif source and source.get("kind") == "folder":
        origin = f"the local model folder {source['name']}"
    elif source:
        origin = f"the `{source['name']}` preset, randomly initialised"
    return "\n".join(header + ["---", "", f"# {name}", "",
                                f"SigLIP dual encoder trained with rsclip_ds {__version__} from {origin}, "
                                f"{step} optimizer steps; weights in {dtype}.", ""])


# --------------------------------------------------------------------------- export

EXPORT_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def export_hf(checkpoint: str | Path, out_dir: str | Path, dtype: str = "fp32") -> Path:
    """A Hugging Face folder (config, model.safetensors, tokenizer, image processor) that
    `transformers.AutoModel.from_pretrained` loads as a SiglipModel, from any ZeRO stage. A
    LoRA run's adapters are merged into the weights, and also saved alone in `adapter/`."""
    from transformers import AutoConfig, SiglipModel

    root, tag = resolve_checkpoint(checkpoint)
    extras = root / tag / HF_DIR
    if not (extras / "config.json").is_file():
        raise FileNotFoundError(f"{extras} is missing: the checkpoint was not written by rsclip_ds")
    run, state = consolidated_state_dict(root / tag)
    # both checks before any file is written: the checkpoint's weights, then the weights in `dtype`
    check_state_dict(state, f"not exporting {root / tag}", finite_fallback(root, tag, "export"))
    lora = run.finetune.lora
    if lora.towers:
        from rsclip_ds.finetune import merge_lora_state, save_adapter
    model = SiglipModel(AutoConfig.from_pretrained(str(extras)))
    model.load_state_dict(merge_lora_state(state, lora) if lora.towers else state, strict=True)
    model.to(EXPORT_DTYPES[dtype])
    check_state_dict(model.state_dict(), f"not exporting {root / tag} in {dtype}",
                     "A weight beyond the dtype's range (fp16: 65,504) became inf: export with --dtype bf16 or fp32")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    if lora.towers:   # the adapters alone (peft format); the model holds them merged into the weights
        (out / "adapter").mkdir(exist_ok=True)
        save_adapter(state, lora, out / "adapter")
    model.save_pretrained(str(out), safe_serialization=True)
    for item in extras.iterdir():
        if item.name not in ("config.json", SOURCE_FILE):
            shutil.copy2(item, out / item.name)
    meta = load_meta(root, tag)
    source = json.loads((extras / SOURCE_FILE).read_text()) if (extras / SOURCE_FILE).is_file() else None
    (out / "rsclip_export.json").write_text(json.dumps(
        {"checkpoint": str(root / tag), "step": meta["step"], "dtype": dtype, "base_model": source,
         "rsclip_ds_version": __version__}, indent=2))
    (out / "README.md").write_text(_model_card(out.name, source, meta["step"], dtype))
    return out
