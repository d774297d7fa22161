"""Where a pretrained model comes from: a local folder or a Hugging Face hub id.

    model.pretrained=models/Git-RSCLIP                       a folder (config.json + weights + tokenizer)
    model.pretrained=lcybuaa/Git-RSCLIP model.revision=<sha>  a hub id, pinned

A hub id is fetched with `huggingface_hub.snapshot_download` into the standard cache
(`HF_HOME` / `HF_HUB_CACHE`). Under the launcher one process per node fetches (local rank 0)
while the others wait at a barrier and then read the same cache without touching the network;
with `HF_HUB_OFFLINE=1` every process reads the cache only. The resolved `ModelSource` (id,
revision, the commit actually used, the folder) goes into the run's summary and the export's
model card, so a result says which weights it started from.
"""

from __future__ import annotations

import re
from dataclasses import asdict, dataclass
from pathlib import Path

from rsclip_ds.config import ConfigError, ModelConfig

# What a SigLIP model folder needs; weights in safetensors only (pickled .bin is never read).
ALLOW_PATTERNS = ["*.json", "*.safetensors", "spiece.model", "*.txt"]
_HUB_ID = re.compile(r"[A-Za-z0-9][\w.-]*/[\w.-]+")


@dataclass(frozen=True)
class ModelSource:
    kind: str                    # 'preset' | 'folder' | 'hub'
    name: str                    # preset name, folder path, or hub id
    folder: str | None = None    # the local folder read (a hub snapshot in the cache)
    revision: str | None = None  # hub: the revision asked for
    commit: str | None = None    # hub: the commit the snapshot holds

    def __str__(self) -> str:
        if self.kind == "hub":
            return f"{self.name}@{(self.commit or self.revision or 'main')[:12]} (hub)"
        return self.name if self.kind == "preset" else f"{self.name} (folder)"

    def to_dict(self) -> dict:
        return asdict(self)


def is_hub_id(name: str) -> bool:
    """'org/name' that is not an existing path."""
    return bool(_HUB_ID.fullmatch(name)) and not Path(name).exists()


def check_source(cfg: ModelConfig) -> None:
    """Before any process starts: a folder must exist and look like a model; a hub id must look
    like one (whether it exists is only known when fetched)."""
    if cfg.pretrained is None:
        return
    if Path(cfg.pretrained).exists():
        _check_folder(Path(cfg.pretrained), cfg.pretrained)
    elif not is_hub_id(cfg.pretrained):
        raise ConfigError(f"model.pretrained={cfg.pretrained}: no such folder, and not a hub id of the "
                          "form 'org/name' (e.g. lcybuaa/Git-RSCLIP)")


def _check_folder(folder: Path, what: str) -> None:
    if not (folder / "config.json").is_file():
        raise ConfigError(f"model.pretrained={what} is not a Hugging Face model folder (no config.json in "
                          f"{folder}); download one with `hf download lcybuaa/Git-RSCLIP --local-dir DIR` "
                          "or export one with `rsclip-ds export`")


def resolve_source(cfg: ModelConfig, *, fetch: bool = True) -> ModelSource:
    """The model config -> a ModelSource with a local folder. ``fetch=False`` reads the local
    cache only (the ranks that wait for their node's download)."""
    if cfg.pretrained is None:
        return ModelSource("preset", cfg.preset)
    if not is_hub_id(cfg.pretrained):
        folder = Path(cfg.pretrained)
        _check_folder(folder, cfg.pretrained)
        return ModelSource("folder", cfg.pretrained, folder=str(folder))
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import (GatedRepoError, LocalEntryNotFoundError, RepositoryNotFoundError,
                                        RevisionNotFoundError)

    rev = f" --revision {cfg.revision}" if cfg.revision else ""
    try:
        folder = snapshot_download(cfg.pretrained, revision=cfg.revision, local_files_only=not fetch,
                                   allow_patterns=ALLOW_PATTERNS)
    except LocalEntryNotFoundError:
        raise ConfigError(f"model.pretrained={cfg.pretrained}{rev}: not in the local Hugging Face cache and "
                          f"it could not be fetched (offline: HF_HUB_OFFLINE=1, or no network). Fetch it where "
                          f"there is a network with `hf download {cfg.pretrained}{rev}` (same HF_HOME), or "
                          "point model.pretrained at a downloaded folder") from None
    except (RepositoryNotFoundError, GatedRepoError) as err:
        raise ConfigError(f"model.pretrained={cfg.pretrained}: the hub refused it ({type(err).__name__}); "
                          "check the id, or log in with `hf auth login` for a gated or private model") from None
    except RevisionNotFoundError:
        raise ConfigError(f"model.revision={cfg.revision} does not exist for {cfg.pretrained}") from None
    _check_folder(Path(folder), cfg.pretrained)
    return ModelSource("hub", cfg.pretrained, folder=str(folder), revision=cfg.revision,
                       commit=Path(folder).name)


def resolve_source_per_node(cfg: ModelConfig, local_rank: int) -> ModelSource:
    """Inside a process group: local rank 0 of every node fetches, all wait, the others then
    read their node's cache. A failure on any rank ends every rank with its message."""
    import torch
    import torch.distributed as dist
    from deepspeed.accelerator import get_accelerator

    if not (dist.is_available() and dist.is_initialized()) or cfg.pretrained is None:
        return resolve_source(cfg)
    source, error = None, None
    if local_rank == 0:
        try:
            source = resolve_source(cfg, fetch=True)
        except ConfigError as err:
            error = err
    failed = torch.tensor([float(error is not None)], device=get_accelerator().current_device_name())
    dist.all_reduce(failed)   # the barrier: nobody reads the cache before its node has fetched
    if error is not None:
        raise error
    if failed.item():
        raise ConfigError(f"model.pretrained={cfg.pretrained}: the download failed on another node's "
                          "local rank 0 (its error is in that rank's log)")
    return source or resolve_source(cfg, fetch=False)
