"""Resume a checkpoint on another number of ranks, through DeepSpeed's universal checkpoint.

    root/step00000040/            written by W ranks (checkpoint.py)
        universal/                its universal format: one folder per parameter with the whole
            zero/<param>/fp32.pt, exp_avg.pt, exp_avg_sq.pt     fp32 master and Adam moments
            zero/optimizer_state.pt, *model_states.pt           common optimizer state, DeepSpeed's
            rsclip_universal.json                               written last: a complete conversion

Trainer.build reads the saved world size before it builds the engine (`saved_run`; resolve.py's
resume plan then says 'universal' and the engine's DeepSpeed config loads that format);
`load_resharded` then converts on rank 0 (once), waits for it on every rank, loads the new
partitions, repairs what DeepSpeed 0.19.8's ZeRO-3 load gets wrong and makes each new rank's
client state (docs/guides/checkpoints.md, "Resume on another number of ranks").
"""

from __future__ import annotations

import contextlib
import hashlib
import io
import json
import logging
import os
import shutil
import time
from pathlib import Path
from typing import Any

import torch

from rsclip_ds.checkpoint import (HISTORY, RANK_FILE, UNIVERSAL_DIR, UNIVERSAL_DONE, Checkpointer, _atomic_write,
                                  _safe_globals, load_meta, resume_tag, weights_only_loads)
from rsclip_ds.config import ConfigError
from rsclip_ds.resolve import SavedRun
from rsclip_ds.runtime.storage import decide_on_rank0, fsync_dir

log = logging.getLogger("rsclip_ds")


def load_resharded(checkpointer: Checkpointer, engine, resume: str) -> dict[str, Any]:
    """Resume ``resume`` (a tag or 'latest'), written by another number of ranks than
    ``checkpointer``'s, on this run's ranks -> this rank's client state (as Checkpointer.load).
    Rank 0 converts the tag to DeepSpeed's universal format (once; a complete conversion is
    reused), then every rank loads its new partition from it. The engine must have been built
    from the DeepSpeed config of a run resolved with this checkpoint (its resume plan 'universal')."""
    ck = checkpointer
    tag = resume_tag(ck.root, resume)
    if tag is None:
        raise ConfigError(f"--resume {resume}: no complete checkpoint in {ck.root}")
    saved = saved_run(ck.root, tag)
    saved_world = saved.world_size
    if not saved.partitioned:   # stage 0: every rank's file holds everything, whatever the world
        with weights_only_loads():
            path, client = engine.load_checkpoint(str(ck.root), tag=tag)
        if path is None:
            raise FileNotFoundError(f"DeepSpeed could not load {ck.root / tag}")
        step = client["rsclip"]["step"]
        if ck.rank == 0:
            log.info("resumed step %d written by %d ranks on %d ranks (stage 0: the whole model and optimizer in "
                     "one file, no conversion) from %s", step, saved_world, ck.world_size, ck.root / tag)
        return resharded_client_state(ck.root / tag, saved_world, ck.rank, step, ck.run_config.get("seed", 0))
    if not engine.load_universal_checkpoint():
        raise ConfigError(f"checkpoint {tag} was written by {saved_world} ranks, this run has {ck.world_size}: "
                          f"build the engine from deepspeed_config(resolve(..., saved=saved_run(root, tag))) "
                          f"(its checkpoint.load_universal) to load it through DeepSpeed's universal format "
                          f"(Trainer.build does)")
    seconds = convert_on_rank0(ck.root, tag, saved_world, ck.world_size)   # on disk before any rank reads it
    folder = ck.root / tag / UNIVERSAL_DIR
    with weights_only_loads():
        path, client = engine.load_checkpoint(str(folder.parent), tag=folder.name)
    if path is None:
        raise FileNotFoundError(f"DeepSpeed could not load {folder}")
    _repair_optimizer_state(engine, folder)
    step = client["rsclip"]["step"]
    if ck.rank == 0:
        done = json.loads((folder / UNIVERSAL_DONE).read_text())
        how = f"converted in {seconds:.1f} s" if seconds else f"converted in {done['seconds']:.1f} s earlier, reused"
        log.info("resumed step %d written by %d ranks on %d ranks (universal checkpoint, %s) from %s",
                 step, saved_world, ck.world_size, how, folder)
    return resharded_client_state(ck.root / tag, saved_world, ck.rank, step, ck.run_config.get("seed", 0))


def convert_on_rank0(root: Path, tag: str, saved_world: int, world_size: int) -> float:
    """convert_to_universal on rank 0 while the others wait -> rank 0's seconds, on every rank. A
    conversion that fails stops every rank at once with rank 0's error (a ConfigError naming the
    cause and the ways on), instead of leaving the others in a barrier until DEEPSPEED_TIMEOUT."""
    def convert() -> float:
        try:
            return convert_to_universal(root, tag)
        except Exception as err:   # noqa: BLE001 -- any failure: the checkpoint cannot be resharded
            first = (str(err).strip().splitlines() or [""])[0].split(". ")[0]   # its first sentence
            raise ConfigError(
                f"rank 0 could not convert checkpoint {tag} (written by {saved_world} ranks) to DeepSpeed's universal "
                f"format for this run's {world_size} ranks: {type(err).__name__}: {first[:300]}. A checkpoint file "
                f"may be damaged or cut short (a full disk, a copy that stopped): resume it on {saved_world} ranks, "
                f"which needs no conversion, or an earlier tag (--resume stepNNNNNNNN)") from err
    return decide_on_rank0(convert)


def saved_run(root: Path, tag: str) -> SavedRun:
    """What a tag's files say about the run that wrote it, for resolve.py's resume plan: its number of ranks
    and whether it holds ZeRO partitions (DeepSpeed's zero_pp_rank_* files; a stage-0 tag has only the whole
    model and optimizer state, mp_rank_00_model_states.pt, which any number of ranks loads)."""
    return SavedRun(tag, int(load_meta(root, tag).get("world_size", 1)),
                    partitioned=any((Path(root) / tag).glob("*zero_pp_rank_*")))


def convert_to_universal(root: Path, tag: str, workers: int = 1) -> float:
    """Convert ``root/tag`` to DeepSpeed's universal format in ``root/tag/universal`` -> the
    seconds it took (0.0 when a complete conversion is already there). One process (rank 0).

    In-process, DeepSpeed 0.19.8's ds_to_universal.main; ``workers`` 1 runs its extraction and
    merge loops serially, without its ProcessPoolExecutor (which would fork the rank with its
    gloo and heartbeat threads; not tried, and the tiny model converts in about a second). The
    folder is written as
    `universal.partial`, marked with rsclip_universal.json and renamed: a conversion killed
    midway is redone, never half-used. Inside the tag folder it is pruned with its tag and
    never mistaken for one."""
    import argparse

    from deepspeed.checkpoint import ds_to_universal

    tag_dir = Path(root) / tag
    final, partial_dir = tag_dir / UNIVERSAL_DIR, tag_dir / f"{UNIVERSAL_DIR}.partial"
    if (final / UNIVERSAL_DONE).is_file():
        return 0.0
    for stale in (final, partial_dir):
        shutil.rmtree(stale, ignore_errors=True)
    args = argparse.Namespace(input_folder=str(tag_dir), output_folder=str(partial_dir), num_extract_workers=workers,
                              num_merge_workers=workers, keep_temp_folder=False, strict=True,
                              # 0.19.8 saves no universal_checkpoint_info for a plain module at ZeRO-1/2
                              # (engine.py _save_checkpoint: only from module attributes or AutoEP)
                              inject_missing_state=True)
    t0 = time.perf_counter()
    printed = io.StringIO()   # its progress prints; tqdm's bars go to stderr
    with weights_only_loads(), contextlib.redirect_stdout(printed):
        ds_to_universal.main(args)
    (tag_dir / "latest_universal").unlink(missing_ok=True)   # DeepSpeed's pointer to the folder; we pass the tag
    seconds = time.perf_counter() - t0
    meta = load_meta(root, tag)
    _atomic_write(partial_dir / UNIVERSAL_DONE, json.dumps(
        {"seconds": seconds, "from_world_size": meta.get("world_size"), "step": meta.get("step"),
         "deepspeed_version": _deepspeed_version()}, indent=2))
    os.replace(partial_dir, final)
    fsync_dir(tag_dir)   # the rename is durable
    log.debug("ds_to_universal output:\n%s", printed.getvalue())
    return seconds


def _deepspeed_version() -> str:
    import deepspeed

    return deepspeed.__version__


def _repair_optimizer_state(engine, folder: Path) -> None:
    """What DeepSpeed 0.19.8's ZeRO-3 universal load gets wrong (runtime/zero/stage3.py,
    load_hp_checkpoint_state_from_checkpoint_dir_stage3), set right for every stage (at ZeRO-1/2
    it is already so and nothing changes):
    * it copies group 0's options onto every group (lines 3686-3691, "we can obtain from any
      parameter"): the no-decay group would get the decay group's weight_decay. Each group gets
      its saved options back.
    * it puts one and the same Adam `step` tensor into every group's state (lines 3664, 3681);
      torch's fused AdamW counts it up in place once per group and step, so every group after
      the first used a step count too high for its bias correction from the first step after
      the resume (measured, tiny fp32 2 -> 3 ranks: the loss 2 steps after the resume 4.2828
      instead of 4.2773; with a tensor per group equal to the run that never stopped)."""
    with torch.serialization.safe_globals(_safe_globals()):
        saved = torch.load(folder / "zero" / "optimizer_state.pt", map_location="cpu", weights_only=True)["param_groups"]
    base = engine.optimizer.optimizer
    if len(saved) != len(base.param_groups):
        raise ConfigError(f"{folder}: the checkpoint has {len(saved)} optimizer parameter groups, this run "
                          f"{len(base.param_groups)}: resume with the same optim/finetune settings")
    for group, options in zip(base.param_groups, saved):
        group.update({k: v for k, v in options.items() if k != "params"})
    for state in base.state.values():
        if torch.is_tensor(state.get("step")):
            state["step"] = state["step"].clone()


def derived_seed(seed: int, step: int, rank: int) -> int:
    """The RNG seed of ``rank`` resuming step ``step`` on another number of ranks: a 63-bit
    hash of (seed, step, rank), the same on every resume of that tag at that size."""
    digest = hashlib.sha256(f"rsclip-rng:{seed}:{step}:{rank}".encode()).digest()
    return int.from_bytes(digest[:8], "little") >> 1


def resharded_client_state(tag_dir: Path, saved_world: int, rank: int, step: int, seed: int) -> dict[str, Any]:
    """The client state of new rank ``rank`` when ``tag_dir`` was written by ``saved_world``
    ranks: the run's history as saved; an RNG seeded by derived_seed (the old ranks' streams
    cannot be split or merged); and the data position as every old rank's loader state in
    old-rank order, ``{"remap_from": [state_0, ..., state_{W-1}]}`` (None when the run had no
    loader state), for build_train_loader to map onto the new ranks."""
    old = [torch.load(tag_dir / RANK_FILE.format(r), weights_only=True) for r in range(saved_world)]
    data = [s["data"] for s in old]
    return {"step": step, "rng": {"seed": derived_seed(seed, step, rank)},
            "data": None if all(d is None for d in data) else {"remap_from": data},
            "result": json.loads((tag_dir / HISTORY).read_text())}
