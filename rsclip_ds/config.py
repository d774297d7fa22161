"""The run config: one typed tree, defaults < config file < ``--set`` overrides.

Every field carries a description; unknown keys are rejected. ``load_config`` is the only
entry point, and it fails (``ConfigError``) before any process group exists, naming the key
and what is allowed. ``rsclip-ds show-config`` prints the whole tree with descriptions.

The sections of the model, loss, data, batch, optimizer, fine-tuning, logging, evaluation and
checkpoints are here; a section that belongs to one module lives beside what it configures:
`fp16` and `bf16` in precision.py, `faults` in faults.py, `distributed` in runtime/distributed.py,
`compile` in runtime/compilation.py, `distill` in distill/config.py. The schema checks what a
config says on its own; what needs the profile, the world or the device is resolve.py's.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated, Any, Literal, Optional, Union

import yaml
from pydantic import BaseModel, Field, ValidationError, field_validator, model_validator
from pydantic.fields import FieldInfo
from pydantic_core import to_jsonable_python

from rsclip_ds.distill.config import DistillConfig
from rsclip_ds.faults import FaultConfig
from rsclip_ds.precision import Bf16Config, Fp16Config, PrecisionChoice
from rsclip_ds.runtime.compilation import CompileConfig
from rsclip_ds.runtime.distributed import DistributedConfig
from rsclip_ds.runtime.settings import ConfigError, Strict


class ModelConfig(Strict):
    preset: Literal["tiny", "git-rsclip-base", "git-rsclip-large"] = Field(
        "tiny", description="Architecture preset: 'git-rsclip-large' (SigLIP-L/16, 256 px, ~650M), "
        "'git-rsclip-base' (SigLIP-B/16, 224 px, ~200M), 'tiny' (trains in seconds on a CPU).")
    pretrained: Optional[str] = Field(
        None, description="Start from a Hugging Face SigLIP model (weights, tokenizer, image "
        "processor): a local folder, or a hub id such as 'lcybuaa/Git-RSCLIP' (fetched once per node "
        "into the Hugging Face cache; HF_HUB_OFFLINE=1 reads the cache only). The preset is then "
        "ignored for the architecture.")
    revision: Optional[str] = Field(
        None, description="Hub revision (branch, tag or commit) of a `pretrained` hub id; default: "
        "the main branch. Pin a commit for reproducible runs.")
    tokenizer: Optional[Path] = Field(
        None, description="Tokenizer folder (from `rsclip-ds train-tokenizer`); defaults to the "
        "`pretrained` model's tokenizer. Required for from-scratch runs.")
    activation_checkpointing: Optional[bool] = Field(
        None, description="Recompute tower activations in backward to save memory. null: as the "
        "profile's `rsclip.activation_checkpointing` says.")
    patch_dropout: float = Field(0.0, ge=0.0, lt=1.0, description="Fraction of image patches dropped in training "
                                 "forward passes (FLIP; 0.5-0.75 cut the image tower's compute 2-4x); a random "
                                 "subset per image, never in evaluation. 0: off.")
    patch_dropout_off_last_steps: int = Field(0, ge=0, description="Train the last N steps on every patch "
                                              "(the unmasked phase after patch dropout).")

    @field_validator("pretrained", mode="before")
    @classmethod
    def _path_to_str(cls, value):
        return str(value) if isinstance(value, Path) else value

    @model_validator(mode="after")
    def _check(self) -> "ModelConfig":
        if self.revision is not None and self.pretrained is None:
            raise ValueError("model.revision is set without model.pretrained: name the hub id too, "
                             "e.g. --set model.pretrained=lcybuaa/Git-RSCLIP")
        return self


class LossConfig(Strict):
    name: Literal["siglip", "clip"] = Field(
        "siglip", description="Contrastive loss: 'siglip' (pairwise sigmoid, learnable temperature "
        "and bias) or 'clip' (softmax InfoNCE, learnable temperature).")
    negatives: Literal["global", "local"] = Field(
        "global", description="'global': every sample of the global batch is a negative (features "
        "gathered / ring-exchanged across ranks); 'local': each rank's loss sees its own "
        "micro-batch only (what the Hugging Face Trainer does).")
    chunk_size: int = Field(0, ge=0, description="siglip only: image rows per logits chunk, "
                            "recomputed in backward to bound peak memory (0: no chunking).")


class DataConfig(Strict):
    train_shards: Optional[str] = Field(
        None, description="Training shards: a brace pattern ('data/train-{000000..000009}.tar'), a "
        "glob, a file listing one shard per line, or several of these joined by '::'.")
    image_key: str = Field("jpg;jpeg;png;webp;tif;tiff;img_content",
                           description="Member extension(s) holding the image, ';'-separated, first match "
                           "wins ('img_content' is RS5M's name).")
    caption_key: str = Field("txt;caption", description="Member extension(s) holding the caption, "
                             "';'-separated, first match wins. Text members may hold several captions, one "
                             "per line; one is drawn per sample and epoch. A 'json' member is read as "
                             "{\"captions\": [...]} or {\"caption\": \"...\"}.")
    shuffle_buffer: int = Field(1000, ge=0, description="Samples held in the shuffle buffer of each worker (0: off).")
    num_workers: Union[Literal["auto"], Annotated[int, Field(ge=0)]] = Field(
        "auto", description="Data-loader worker processes per rank. 'auto': the cores this process may run "
        "on (its CPU affinity) shared by the ranks of its node (LOCAL_SIZE), less one core per rank for the "
        "rank's own process, at least 1; 'exact' caps it at the rank's shards; a resumed run keeps the "
        "saved count (exact resume needs the same streams). 0: batches are made in the rank's process.")
    policy: Literal["exact", "resampled"] = Field(
        "exact", description="Epoch policy. 'exact': every epoch reshuffles the shard list and reads it as one "
        "sequence of samples cut into consecutive ranges per rank and worker (a shard may be split); every "
        "rank gets the same number of batches, and an epoch delivers every sample once less fewer than one "
        "global batch (the start-up line says how many; see docs/guides/data.md). "
        "'resampled': every worker draws shards with replacement; an epoch is `epoch_batches` batches.")
    epoch_batches: Optional[int] = Field(
        None, ge=1, description="'resampled' only: batches per rank per epoch (default: all samples in "
        "the shard index / (world size x micro batch)).")
    train_weights: Optional[list[float]] = Field(
        None, description="One weight per '::'-separated source of train_shards. 'resampled': the chance "
        "of drawing a shard of that source is proportional to it. 'exact': whole numbers, each source's "
        "shards appear that many times per epoch (0 leaves a source out).")
    shard_index: Optional[str] = Field(
        None, description="Sample counts of the shards: index JSON file(s), '::'-separated, with "
        "[{\"url\": name, \"num_samples\": n}] lists (written by make-shards / make-synthetic). Default: "
        "index.json beside the shards, then img2dataset's *_stats.json, then counting local tars.")
    random_resized_crop: Optional[tuple[float, float]] = Field(
        None, description="Augmentation: crop a random area fraction in [min, max] (aspect 3/4..4/3) and "
        "resize it to the model size, e.g. [0.5, 1.0]. None: the whole image is resized (squashed).")
    hflip: bool = Field(False, description="Augmentation: random left-right flip. Off by default: captions "
                        "that say 'on the left' no longer match a mirrored image.")
    vflip: bool = Field(False, description="Augmentation: random top-bottom flip (same caveat as hflip).")
    rot90: bool = Field(False, description="Augmentation: random rotation by 0/90/180/270 degrees (overhead "
                        "imagery has no up; same caveat for captions with positions).")
    jpeg_draft: bool = Field(True, description="The fast training decode: colour JPEGs through simplejpeg, at a "
                             "reduced DCT scale when at least twice the needed size, squashed with torch's uint8 "
                             "bicubic (3-4x a PIL decode + resize per core; pixels within 2 grey levels of PIL's "
                             "resize, more where the DCT scale is taken: docs/guides/data.md). Evaluation always decodes "
                             "and resizes with PIL, as transformers does. false: training pixels equal evaluation's.")
    max_bad_fraction: float = Field(
        0.05, ge=0, le=1, description="Stop with an error when more than this fraction of the samples (or of "
        "the shards) a rank has read were unreadable. 1 never stops.")
    bad_data_min_samples: int = Field(
        1000, ge=0, description="Samples a rank reads before max_bad_fraction is checked.")
    where: Optional[str] = Field(None, description="Keep only samples whose JSON member satisfies this filter, "
                                 "e.g. 'img_quality_score >= 0.5 and resolution <= 2' (make-shards --where's "
                                 "language, docs/guides/corpora.md); dropped ones count as filtered_out. 'exact': "
                                 "the samples it keeps per shard are counted at start-up (the tars' JSON members, "
                                 "split over the ranks, cached in {output_dir}/where-counts/) and size the epochs; "
                                 "remote (pipe:, http) shards need 'resampled', whose epoch_batches counts all samples.")

    @model_validator(mode="after")
    def _weights(self) -> "DataConfig":
        """One weight per '::'-separated source, checked here so the error comes before any rank
        starts (the loader checks the same again on what it expanded); data.where parses."""
        from rsclip_ds.data.where import Where   # a filter typo fails before any rank starts
        Where.parse(self.where)
        if self.train_weights is None or self.train_shards is None:
            return self
        sources = [part for part in self.train_shards.split("::") if part.strip()]
        w = self.train_weights
        if len(w) != len(sources) or any(x < 0 for x in w) or sum(w) <= 0:
            raise ValueError(f"data.train_weights {w} needs one non-negative weight per '::'-separated source of "
                             f"data.train_shards ({len(sources)}: {sources}), not all zero")
        if self.policy == "exact" and any(x != int(x) for x in w):
            raise ValueError(f"data.train_weights {w}: with data.policy=exact a weight is how often a source's "
                             f"shards appear per epoch, a whole number; use data.policy=resampled for fractions")
        return self

    @field_validator("num_workers", mode="before")
    @classmethod
    def _workers(cls, value):
        if value == "auto" or (isinstance(value, int) and not isinstance(value, bool) and value >= 0):
            return value
        raise ValueError(f"'auto' or a whole number >= 0 (0: no worker processes), not {value!r}")


class BatchConfig(Strict):
    micro_batch_size: int = Field(16, ge=1, description="Samples per GPU per forward/backward pass.")
    gradient_accumulation_steps: int = Field(
        1, ge=1, description="Micro-batches per optimizer step. The global batch is "
        "micro_batch_size x gradient_accumulation_steps x world size.")
    accumulation: Literal["plain", "global"] = Field(
        "global", description="'global': the loss sees all accumulated samples as one batch "
        "(features cached without a graph, then each micro-batch re-run with one; costs one extra "
        "forward). 'plain': DeepSpeed's accumulation, each micro-batch's loss sees micro x world "
        "samples. Same thing when gradient_accumulation_steps is 1.")


class OptimConfig(Strict):
    lr: float = Field(5e-4, gt=0, description="Peak learning rate (before `lr_scaling`).")
    lr_scaling: Literal["none", "linear", "sqrt"] = Field(
        "none", description="Scale `lr` with the number of ranks: 'linear' (lr x world), 'sqrt' "
        "(lr x sqrt(world)) or 'none'.")
    weight_decay: float = Field(0.1, ge=0, description="AdamW weight decay on matrices; biases, norms "
                                "and the logit scale/bias (ndim < 2) are not decayed.")
    betas: tuple[float, float] = Field((0.9, 0.98), description="AdamW betas.")
    eps: float = Field(1e-6, gt=0, description="AdamW epsilon.")
    warmup_steps: int = Field(10, ge=0, description="Linear warmup steps of the warmup+cosine schedule: step n "
                              "(1-based) of the first warmup_steps trains at lr x n / warmup_steps (the first step "
                              "already moves), then cosine decay to lr x min_lr_ratio at the last step. 0: no warmup.")
    min_lr_ratio: float = Field(0.0, ge=0, le=1, description="Final learning rate as a fraction of the peak.")
    gradient_clipping: float = Field(1.0, ge=0, description="Clip the global gradient norm to this (0: off).")
    impl: Literal["auto", "torch", "deepspeed"] = Field(
        "auto", description="AdamW implementation: 'deepspeed' (FusedAdam on GPU, DeepSpeedCPUAdam "
        "with offload; JIT-built on first use, FusedAdam needs nvcc), 'torch' (torch.optim.AdamW, "
        "no build), 'auto' (DeepSpeedCPUAdam for GPU runs with optimizer offload, where torch's "
        "AdamW on CPU would be the bottleneck; torch everywhere else).")
    image_lr: Optional[float] = Field(None, gt=0, description="Peak learning rate of the image tower "
                                      "(null: `lr`); scaled by `lr_scaling` like `lr`.")
    text_lr: Optional[float] = Field(None, gt=0, description="Peak learning rate of the text tower (null: `lr`).")
    logit_lr: Optional[float] = Field(None, gt=0, description="Peak learning rate of the logit scale and "
                                      "bias (null: `lr`).")
    image_layer_decay: float = Field(1.0, gt=0, le=1, description="Layer-wise LR decay of the image tower: "
                                     "layer l of depth D (embeddings 0, blocks 1..L, final norm/head L+1 = D) "
                                     "trains at lr x decay^(D - l). 1: off.")
    text_layer_decay: float = Field(1.0, gt=0, le=1, description="Layer-wise LR decay of the text tower "
                                    "(as image_layer_decay).")


class LoraConfig(Strict):
    towers: list[Literal["image", "text"]] = Field(
        default_factory=list, description="Towers that get LoRA adapters (peft) on their attention "
        "projections (q, k, v, out); their other weights are frozen. Empty: no LoRA.")
    rank: int = Field(8, ge=1, description="LoRA rank r.")
    alpha: float = Field(16.0, gt=0, description="LoRA alpha (the update is scaled by alpha / r).")
    dropout: float = Field(0.0, ge=0, lt=1, description="Dropout on the LoRA branch's input.")
    mlp: bool = Field(False, description="Also adapt the MLP projections (fc1, fc2) of the encoder blocks.")


class FinetuneConfig(Strict):
    lock_image: bool = Field(False, description="Freeze the image tower (open_clip's --lock-image): no "
                             "gradients, no optimizer states, weights unchanged.")
    lock_image_unlocked_layers: int = Field(
        0, ge=0, description="With lock_image: train the last N encoder blocks anyway (the final "
        "norm/head follow the last block; the embeddings train only when all blocks do).")
    lock_text: bool = Field(False, description="Freeze the text tower (open_clip's --lock-text).")
    lock_text_unlocked_layers: int = Field(0, ge=0, description="With lock_text: train the last N "
                                           "blocks anyway (as lock_image_unlocked_layers).")
    image_size: Optional[int] = Field(
        None, ge=16, description="Train at this image size instead of the model's (e.g. 384 for a 256 "
        "px checkpoint): the position embeddings are interpolated once at load (bicubic), and the "
        "export and evaluation use the new size. A multiple of the patch size.")
    lora: LoraConfig = Field(default_factory=LoraConfig, description="Low-rank adapters (peft).")

    @model_validator(mode="after")
    def _check(self) -> "FinetuneConfig":
        for tower in ("image", "text"):
            lock, unlocked = getattr(self, f"lock_{tower}"), getattr(self, f"lock_{tower}_unlocked_layers")
            if unlocked and not lock:
                raise ValueError(f"finetune.lock_{tower}_unlocked_layers={unlocked} needs "
                                 f"finetune.lock_{tower}=true (without the lock every layer trains)")
            if lock and tower in self.lora.towers:
                raise ValueError(f"finetune.lock_{tower} and LoRA on the {tower} tower: LoRA already freezes "
                                 f"the tower's weights and trains only its adapters; drop one of "
                                 f"finetune.lock_{tower} or '{tower}' in finetune.lora.towers")
        if len(set(self.lora.towers)) != len(self.lora.towers):
            raise ValueError(f"finetune.lora.towers {self.lora.towers} names a tower twice")
        return self


class LoggingConfig(Strict):
    log_every: int = Field(10, ge=1, description="Optimizer steps between log lines / progress updates. "
                           "Each log step rank 0 also appends a line to {output_dir}/metrics.jsonl and "
                           "writes the monitor events (docs/guides/monitoring.md).")
    progress: Literal["auto", "rich", "plain"] = Field(
        "auto", description="'rich' live progress, 'plain' log lines, 'auto': rich on a terminal.")
    tensorboard: bool = Field(
        False, description="DeepSpeed's TensorBoard monitor, writing under {output_dir}/monitor/tensorboard "
        "(needs the `tensorboard` package). A profile may instead carry its own `tensorboard` section, "
        "but not both.")
    csv: bool = Field(
        False, description="DeepSpeed's CSV monitor: one CSV per metric under {output_dir}/monitor/csv. A "
        "profile may instead carry its own `csv_monitor` section, but not both.")
    wandb: bool = Field(
        False, description="A Weights & Biases run from rank 0: train lines, evaluations, config and summary on the "
        "optimizer-step axis (docs/guides/monitoring.md). Offline unless WANDB_MODE or WANDB_API_KEY is set; W&B's "
        "variables decide the rest. --resume continues the same W&B run. Needs `pip install wandb`.")
    wandb_project: Optional[str] = Field(None, description="The W&B project; unset: WANDB_PROJECT, else 'rsclip_ds'.")
    data_wait_warn_fraction: float = Field(
        0.2, ge=0, le=1, description="Warn when a rank spends more than this fraction of its step time "
        "waiting for its next batch ... (and see data_wait_warn_ratio; both must hold).")
    data_wait_warn_ratio: float = Field(
        3.0, ge=1, description="... and more than this many times the median data-wait fraction of the "
        "other ranks. Warned once when a rank crosses both, again only after it has recovered.")


class CheckpointConfig(Strict):
    every: int = Field(0, ge=0, description="Save a checkpoint every N optimizer steps (0: only at the "
                       "end). Checkpoints go to {output_dir}/checkpoints/step{N:08d}.")
    at_end: bool = Field(True, description="Save a checkpoint after the last step.")
    keep_last: int = Field(3, ge=1, description="Keep the newest N checkpoints; older ones are deleted "
                           "after a newer one is complete on every rank.")
    resume: Optional[str] = Field(
        None, description="Continue a run: 'auto' (the newest complete checkpoint in {output_dir}/checkpoints "
        "if there is one, else a fresh start: one command for a job's first submission and its requeues), "
        "'latest' (the newest complete checkpoint; an error without one) or a tag such as 'step00000040'. "
        "Same as `train --resume`.")
    overwrite: bool = Field(
        False, description="A fresh run refuses an output_dir whose checkpoints folder holds another run's "
        "checkpoints (pruning by tag would mix the runs). true: move that folder aside to "
        "checkpoints.replaced-<UTC time> and start.")
    stop_after: Optional[int] = Field(
        None, ge=1, description="End this process after this optimizer step of the run (saving a "
        "checkpoint, exit code 0), with the LR schedule of `steps` unchanged: for chains of jobs with "
        "a bounded wall time. The next job continues with --resume latest.")
    verify: Literal["checksum", "size"] = Field(
        "checksum", description="What a resume checks against the tag's manifest (every file's size and "
        "xxh3_128) before loading: 'checksum' (sizes and checksums; each rank reads the files its rank "
        "wrote; the hash costs ~0.06 s/GiB on top of the read) or 'size' (sizes only: a stat per file). "
        "A broken tag is skipped for the newest intact one under --resume auto/latest.")


TEMPLATE_SET_NAMES = ("ours", "git-rsclip", "remoteclip", "georsclip")   # evaluation/prompts.py


class EvalConfig(Strict):
    every: int = Field(0, ge=0, description="Evaluate every N optimizer steps and after the last step "
                       "(0: no evaluation during training). Results go to the log, "
                       "{output_dir}/eval/step{N:08d}.json and DeepSpeed's monitor.")
    zero_shot_dir: Optional[Path] = Field(
        None, description="Zero-shot classification set: one folder per class (AID / NWPU-RESISC45 / "
        "EuroSAT / UCMerced layout); class names from the folder names (CamelCase and '_' to words).")
    retrieval_json: Optional[Path] = Field(
        None, description="Retrieval set: a Karpathy-style caption JSON (RSICD dataset_rsicd.json, "
        "RSITMD, UCM-captions): images[].filename / split / sentences[].raw.")
    retrieval_images: Optional[Path] = Field(
        None, description="Folder of the caption JSON's images (default: 'images/' or 'imgs/' beside "
        "the JSON, else the JSON's folder).")
    retrieval_split: str = Field("test", description="Which `split` of the caption JSON to evaluate.")
    templates: Optional[Path] = Field(
        None, description="Prompt templates for zero-shot, one per line with '{}' for the class name; "
        "default: the shipped remote-sensing set (rsclip_ds/templates/remote_sensing.txt).")
    templates_set: Optional[Literal[TEMPLATE_SET_NAMES]] = Field(
        None, description="A shipped template set instead of a file: ours (the default), git-rsclip, remoteclip, "
        "georsclip; each file in rsclip_ds/templates/ names its source.")
    suite: Optional[Path] = Field(None, description="A folder of the standard remote-sensing sets as released "
                                  "(`rsclip-ds eval --suite`), evaluated during training too (Eval/suite/<set>/...).")
    suite_overrides: Optional[Path] = Field(None, description="With suite: a JSON of {set name: {folder name: "
                                            "prompt phrase}} over the shipped class phrases.")
    suite_every: int = Field(0, ge=0, description="Evaluate the suite every N optimizer steps and after the "
                             "last (0: at eval.every's steps); a multiple of eval.every keeps training fast.")
    batch_size: int = Field(64, ge=1, description="Images (and texts) per forward pass per rank.")
    bands: Optional[str] = Field(None, description="Multispectral TIFFs: 1-based bands as R,G,B (Sentinel-2: "
                                 "'4,3,2'), scaled by band_scale; unset, a > 3-band TIFF stops the evaluation.")
    band_scale: str = Field("percentile:2,98", description="With bands: 'percentile:LO,HI' or 'range:MIN,MAX'.")
    max_bad_fraction: float = Field(
        0.01, ge=0, le=1, description="Unreadable or missing images are skipped, counted "
        "(skipped_images in the results) and named in the log; past this fraction of a set the "
        "evaluation stops with the list.")

    @model_validator(mode="after")
    def _check(self) -> "EvalConfig":
        if self.every and self.zero_shot_dir is None and self.retrieval_json is None and self.suite is None:
            raise ValueError("eval.every is set but there is nothing to evaluate: set eval.zero_shot_dir "
                             "and/or eval.retrieval_json or eval.suite (or eval.every=0)")
        if self.templates is not None and self.templates_set is not None:
            raise ValueError("give eval.templates (a file) or eval.templates_set (a shipped set), not both")
        if self.suite_every and self.suite is None:
            raise ValueError("eval.suite_every is set but eval.suite is not: set eval.suite (or eval.suite_every=0)")
        if self.suite is not None and not (self.every or self.suite_every):
            raise ValueError("eval.suite is set but neither eval.every nor eval.suite_every: say how often")
        return self


class RunConfig(Strict):
    profile: str = Field("zero2", description="DeepSpeed strategy: a name in ds_profiles/ (zero1, zero2, "
                         "zero2_offload, zero3, zero3_offload) or a path to a profile JSON.")
    precision: PrecisionChoice = Field(
        "auto", description="docs/guides/precision.md: fp32; bf16/fp16 (16-bit weights, fp32 masters); "
        "amp_bf16/amp (fp32 weights, autocast, amp with a scaler); auto: amp_bf16 on ddp, else bf16.")
    steps: int = Field(100, ge=1, description="Optimizer steps to train.")
    seed: int = Field(0, description="Seed for model init, data order and dropout.")
    output_dir: Path = Field(Path("runs/default"), description="Where the run writes its summary and logs.")
    model: ModelConfig = Field(default_factory=ModelConfig, description="The dual encoder.")
    loss: LossConfig = Field(default_factory=LossConfig, description="The contrastive loss.")
    data: DataConfig = Field(default_factory=DataConfig, description="Training data.")
    batch: BatchConfig = Field(default_factory=BatchConfig, description="Batch arithmetic.")
    optim: OptimConfig = Field(default_factory=OptimConfig, description="Optimizer and LR schedule.")
    finetune: FinetuneConfig = Field(default_factory=FinetuneConfig, description="Fine-tuning controls: "
                                     "locked towers, LoRA, a new image size.")
    fp16: Fp16Config = Field(default_factory=Fp16Config, description="Loss-scaler settings (precision=fp16).")
    bf16: Bf16Config = Field(default_factory=Bf16Config, description="Master weights and gradient accumulation "
                             "dtype (precision=bf16).")
    logging: LoggingConfig = Field(default_factory=LoggingConfig, description="Progress output.")
    eval: EvalConfig = Field(default_factory=EvalConfig, description="Evaluation during training "
                             "(zero-shot classification, retrieval).")
    checkpoint: CheckpointConfig = Field(default_factory=CheckpointConfig,
                                         description="Checkpoints and resume (docs/guides/checkpoints.md).")
    faults: FaultConfig = Field(default_factory=FaultConfig,
                                description="Dead ranks, SIGTERM, non-finite losses (docs/guides/checkpoints.md).")
    distributed: DistributedConfig = Field(default_factory=DistributedConfig,
                                           description="Ranks on a node and on the wire: threads per rank, the "
                                           "gradients' dtype in the reduction (docs/guides/clusters.md).")
    distill: DistillConfig = Field(default_factory=DistillConfig, description="Distillation from a frozen teacher.")
    compile: CompileConfig = Field(default_factory=CompileConfig, description="torch.compile of the model for training.")

    @model_validator(mode="after")
    def _check(self) -> "RunConfig":
        if self.optim.warmup_steps >= self.steps and self.steps > 1:
            raise ValueError(f"optim.warmup_steps ({self.optim.warmup_steps}) must be below steps "
                             f"({self.steps}); lower it with --set optim.warmup_steps=N")
        if self.bf16.grad_accum_dtype != "auto" and self.precision not in ("bf16", "auto"):
            raise ValueError(f"bf16.grad_accum_dtype={self.bf16.grad_accum_dtype} applies to precision=bf16 only "
                             f"(precision is {self.precision}); drop it or set precision=bf16")
        if self.bf16.master_weights != "fp32" and self.precision not in ("bf16", "auto"):
            raise ValueError(f"bf16.master_weights={self.bf16.master_weights} applies to precision=bf16 only "
                             f"(precision is {self.precision}): set precision=bf16, or drop bf16.master_weights "
                             f"(fp32 training keeps fp32 weights)")
        return self


# --------------------------------------------------------------------------- loading

def _read_file(path: Path) -> dict[str, Any]:
    if not path.is_file():
        raise ConfigError(f"config file not found: {path}")
    text = path.read_text()
    data = json.loads(text) if path.suffix == ".json" else yaml.safe_load(text)
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: the top level must be a mapping of config keys")
    return data


def _apply_override(tree: dict[str, Any], item: str) -> None:
    """Apply one ``a.b.c=value``; the value is parsed as YAML (so 3, 1e-4, true, [1,2] work)."""
    key, sep, raw = item.partition("=")
    if not sep or not key:
        raise ConfigError(f"--set expects key=value, got {item!r} (for example --set batch.micro_batch_size=8)")
    *parents, leaf = key.strip().split(".")
    node = tree
    for part in parents:
        child = node.setdefault(part, {})
        if not isinstance(child, dict):
            raise ConfigError(f"--set {key}: '{part}' is a value, not a section")
        node = child
    node[leaf] = yaml.safe_load(raw) if raw.strip() else None


def _format_error(err: ValidationError) -> str:
    lines = []
    for e in err.errors():
        loc = ".".join(str(p) for p in e["loc"]) or "(top level)"
        if e["type"] == "extra_forbidden":
            section = _section_of(e["loc"][:-1])
            allowed = ", ".join(sorted(section.model_fields)) if section else "?"
            lines.append(f"  {loc}: unknown key; allowed here: {allowed}")
        elif e["type"] == "value_error":
            lines.append(f"  {loc}: {e['msg'].removeprefix('Value error, ')}")
        else:
            lines.append(f"  {loc}: {e['msg']} (got {e.get('input')!r})")
    return "invalid run config:\n" + "\n".join(lines) + "\n(`rsclip-ds show-config` lists every key)"


def _section_of(loc: tuple) -> type[BaseModel] | None:
    cls: type[BaseModel] = RunConfig
    for part in loc:
        field = cls.model_fields.get(str(part))
        ann = getattr(field, "annotation", None)
        if not (isinstance(ann, type) and issubclass(ann, BaseModel)):
            return None
        cls = ann
    return cls


def load_config(path: str | Path | None = None, overrides: list[str] | None = None) -> RunConfig:
    """defaults < file < overrides; raises ConfigError naming every bad key."""
    tree = _read_file(Path(path)) if path else {}
    for item in overrides or []:
        _apply_override(tree, item)
    try:
        return RunConfig.model_validate(tree)
    except ValidationError as err:
        raise ConfigError(_format_error(err)) from None


def describe(cls: type[BaseModel] = RunConfig, prefix: str = "") -> list[tuple[str, str, str, FieldInfo]]:
    """(key, default as JSON, description, the field: its annotation and bounds) for every leaf in
    schema order: what `rsclip-ds show-config` prints and docs/reference/config.md is made of."""
    rows = []
    for name, field in cls.model_fields.items():
        ann = field.annotation
        if isinstance(ann, type) and issubclass(ann, BaseModel):
            rows += describe(ann, f"{prefix}{name}.")
        else:
            default = to_jsonable_python(field.get_default(call_default_factory=True))
            rows.append((prefix + name, json.dumps(default), field.description or "", field))
    return rows
