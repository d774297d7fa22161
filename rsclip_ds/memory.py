"""The memory model and the profile picker: pure functions, bytes per GPU and per node.

Peak GPU bytes of a rank are the larger of two phases (activations are freed before the step):

    train = states + buckets + gathered layer (ZeRO-3) + micro x activations/sample + loss logits
    step  = states + fp32 gradient partition made by step() + all-gather bucket (ZeRO-1/2)
    peak  = states + (1 + FRAGMENTATION) x (the rest of the larger phase)

Model states, Ψ parameters, G = gpus in all, n = gpus per node; bytes per parameter are
p (weights) g (gradients) k (optimizer: fp32 master + Adam m, v): mixed precision 2 + 2 + 12,
fp32 4 + 4 + 12 (DeepSpeed keeps an fp32 master partition in fp32 too). Per GPU
(DeepSpeed's `estimate_zero{2,3}_model_states_mem_needs`, corrected by what benchmarks/memory.py
measures in 0.19.8):
    ZeRO-1 = ZeRO-2  pΨ + (g+k)Ψ/G (0.19.8's ZeRO-1 keeps only its gradient partition as well)
    ZeRO-3  (p+g+k)Ψ/G
    ZeRO-2 + optimizer offload  pΨ        ZeRO-3 + optimizer offload  pΨ/G     + param offload  0
With offload the CPU of a node holds (k + 4)Ψ n/G (the step's fp32 gradient lives there too),
at ZeRO-3 + gΨ n/G (a flat gradient partition), plus pΨ n/G with parameter offload. ZeRO-2's step peak, 2Ψ + 18Ψ/G, is exactly DeepSpeed's
`estimate_zero2_model_states_mem_needs`; ZeRO-3's is 20Ψ/G + 4L against DeepSpeed's 18Ψ/G + 4L
(its estimator leaves out the 16-bit parameter partition; we keep it: it is on the GPU).
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass
from functools import lru_cache

import torch

GiB = 2**30
# Allocator fragmentation, on the bytes that churn (activations, buckets, gathered layers,
# transient gradients). The flat ZeRO buffers are allocated once at start-up and do not fragment.
FRAGMENTATION = 0.10
# p, g, k per parameter. DeepSpeed 0.19.8 keeps an fp32 master partition even in fp32
# (`single_partition_of_fp32_groups`, `fp32_partitioned_groups_flat`), so k = 4 + 8 always
# (measured by benchmarks/memory.py).
BYTES = {"fp32": (4, 4, 12), "bf16": (2, 2, 12), "fp16": (2, 2, 12)}
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


@dataclass(frozen=True)
class Hardware:
    """Assumed throughput for the relative speed score (ratios matter, not absolutes)."""
    flops: float = 100e12        # achieved FLOP/s per GPU (bf16; fp32 at a quarter)
    intra_bw: float = 100e9      # bytes/s per rank on collectives inside a node
    inter_bw: float = 12.5e9     # bytes/s per rank across nodes (100 Gb/s)
    pcie_bw: float = 12e9        # bytes/s GPU <-> pinned CPU memory per rank
    cpu_adam: float = 1e9        # parameters/s one node's CPU Adam updates


@dataclass(frozen=True)
class ModelSpec:
    name: str
    config_json: str       # the SiglipConfig, as JSON (hashable, for the probe's cache)
    vision_params: int
    text_params: int
    largest_layer: int     # parameters of the largest module (its own, not its children's)
    vision_tokens: int     # patches per image
    text_tokens: int
    embed_dim: int
    trainable_vision: int = -1   # elements that train (locks, LoRA); -1: all
    trainable_text: int = -1
    finetune_json: str = "{}"    # the FinetuneConfig the counts were made with (for the probe)

    @property
    def params(self) -> int:
        return self.vision_params + self.text_params + 2   # + logit scale and bias

    @property
    def trainable(self) -> int:
        """Elements with gradients and optimizer states."""
        if self.trainable_vision < 0:
            return self.params
        return self.trainable_vision + self.trainable_text + 2

    def tower_trains(self, tower: str) -> float:
        """The share of a tower's backward work: its trainable fraction (a locked tower runs
        forward only; with its last N blocks unlocked, backward stops below them); a LoRA tower
        back-propagates through all its activations but makes no weight gradients of its frozen
        matrices: 1/2 (activation gradients are half of backward's 4 FLOPs per parameter)."""
        ft = json.loads(self.finetune_json)
        if tower in ft.get("lora", {}).get("towers", []):
            return 0.5
        if self.trainable_vision < 0:
            return 1.0
        trained, total = ((self.trainable_vision, self.vision_params) if tower == "vision"
                          else (self.trainable_text, self.text_params))
        return trained / total


def _meta_model(config, finetune_json: str = "{}"):
    """The dual encoder on the meta device, with the fine-tuning controls applied (a new image
    size changes the config before; LoRA adds its adapters; locks set requires_grad)."""
    from rsclip_ds.config import FinetuneConfig
    from rsclip_ds.finetune import apply_lora, apply_trainability
    from rsclip_ds.model import new_dual_encoder

    finetune = FinetuneConfig.model_validate(json.loads(finetune_json))
    with torch.device("meta"):
        model = new_dual_encoder(config)
        apply_lora(model, finetune.lora)
    apply_trainability(model, finetune)
    return model


def model_spec(config, name: str = "custom", finetune=None) -> ModelSpec:
    """Counts from a SiglipConfig, on the meta device (no memory, any size); ``finetune`` (a
    FinetuneConfig) sets what trains and adds LoRA's parameters."""
    if finetune is not None and finetune.image_size:
        config = config.__class__.from_dict(config.to_dict())
        config.vision_config.image_size = finetune.image_size
    ft = finetune.model_dump_json() if finetune is not None else "{}"
    m = _meta_model(config, ft)
    largest = max(sum(p.numel() for p in mod.parameters(recurse=False)) for mod in m.modules())
    vc, tc = config.vision_config, config.text_config

    def count(module, trainable=False):
        return sum(p.numel() for p in module.parameters() if p.requires_grad or not trainable)
    return ModelSpec(name, config.to_json_string(use_diff=False), count(m.vision_model), count(m.text_model), largest,
                     (vc.image_size // vc.patch_size) ** 2, tc.max_position_embeddings, vc.hidden_size,
                     count(m.vision_model, True), count(m.text_model, True), ft)


def preset_spec(preset: str, finetune=None) -> ModelSpec:
    from rsclip_ds.model import preset_config

    return model_spec(preset_config(preset), preset, finetune)


def scaled_spec(params: float) -> ModelSpec:
    """A hypothetical model of ~`params`: git-rsclip-large's towers scaled in width (head dim 64)
    and depth together (params ~ s^3), then the depth set to land on `params`."""
    from transformers import SiglipConfig

    from rsclip_ds.model import PRESETS

    s = (params / 652e6) ** (1 / 3)
    h = max(128, round(1024 * s / 128) * 128)

    def config(layers):
        shape = dict(hidden_size=h, intermediate_size=4 * h, num_hidden_layers=layers, num_attention_heads=h // 64)
        return SiglipConfig(text_config={**PRESETS["git-rsclip-large"]["text"], **shape, "pad_token_id": 1,
                                         "bos_token_id": None, "eos_token_id": 1},
                            vision_config={**PRESETS["git-rsclip-large"]["vision"], **shape})

    one, two = model_spec(config(1)).params, model_spec(config(2)).params
    layers = max(1, round((params - one) / (two - one)) + 1)
    return model_spec(config(layers), f"custom-{params:.3g}")


# --------------------------------------------------------------------------- activations

class _FlashLikeSDPA(torch.autograd.Function):
    """Stands in for F.scaled_dot_product_attention in the probe: saves what flash attention
    saves on a GPU (q, k, v, out, fp32 logsumexp), not the (N, N) probabilities that the meta
    device's math fallback would save. Forward only (shapes), never differentiated."""

    @staticmethod
    def forward(ctx, q, k, v):
        b, h, n, _ = q.shape   # laid out (B, N, H, Dv) as the kernels do, so the caller's
        out = torch.empty(b, n, h, v.shape[-1], dtype=q.dtype, device=q.device).transpose(1, 2)  # transpose+contiguous is free
        ctx.save_for_backward(q, k, v, out, torch.empty(q.shape[:-1], dtype=torch.float32, device=q.device))
        return out

    @staticmethod
    def backward(ctx, grad):
        raise RuntimeError("the activation probe is forward-only")


def _sdpa(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False):
    return _FlashLikeSDPA.apply(query, key, value)


def saved_bytes(fn, exclude=()) -> int:
    """Bytes of distinct storages autograd saves for backward while `fn()` runs (parameters,
    and views of them, excluded). Works on the meta device, where storages have no data."""
    skip = {t.untyped_storage()._cdata for t in exclude}
    seen: dict[int, int] = {}

    def pack(t):
        key = t.untyped_storage()._cdata
        if key not in skip:
            seen[key] = max(seen.get(key, 0), t.untyped_storage().nbytes())
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        fn()
    return sum(seen.values())


@lru_cache(maxsize=None)
def _probe(config_json: str, precision: str, checkpointing: bool, samples: int,
           finetune_json: str = "{}", zero3: bool = False) -> tuple[int, int]:
    from unittest import mock

    from transformers import SiglipConfig

    from rsclip_ds.finetune import keep_checkpointed_inputs_differentiable
    from rsclip_ds.model import apply_activation_checkpointing

    config = SiglipConfig.from_dict(json.loads(config_json))
    model = _meta_model(config, finetune_json).to(DTYPES[precision]).train()
    if checkpointing:
        if finetune_json != "{}":
            keep_checkpointed_inputs_differentiable(model)
        apply_activation_checkpointing(model)
    vc, tc = config.vision_config, config.text_config
    with torch.device("meta"):
        pixels = torch.empty(samples, 3, vc.image_size, vc.image_size, dtype=DTYPES[precision])
        ids = torch.zeros(samples, tc.max_position_embeddings, dtype=torch.long)
    params = list(model.parameters())
    linear = torch.nn.functional.linear
    if zero3:   # what a ZeRO-3 engine puts in place of F.linear (memory_efficient_linear, on by default)
        from deepspeed.runtime.zero.linear import zero3_linear_wrap as linear
    with mock.patch.object(torch.nn.functional, "scaled_dot_product_attention", _sdpa), \
            mock.patch.object(torch.nn.functional, "linear", linear):
        vision = saved_bytes(lambda: model.vision_model(pixel_values=pixels), params)
        text = saved_bytes(lambda: model.text_model(input_ids=ids), params)
    return vision, text


def activation_bytes_per_sample(config, precision: str = "bf16", checkpointing: bool = False,
                                finetune_json: str = "{}", zero3: bool = False) -> dict:
    """Measured bytes per sample saved for backward by each tower (SiglipConfig or preset name).

    A forward of 2 samples on the meta device (real shapes, no memory) under
    `saved_tensors_hooks`, halved. With checkpointing, the saved layer inputs plus one layer's
    activations, alive while backward recomputes it: (full - checkpointed) / layers. With the
    fine-tuning controls applied (``finetune_json``): a locked tower saves (almost) nothing.
    ``zero3``: with ZeRO-3's linear, which saves its input also for frozen weights (it matters
    for LoRA towers and partly locked ones; with everything trainable the bytes are the same)."""
    if isinstance(config, str):
        from rsclip_ds.model import preset_config

        config = preset_config(config)
    cj = config.to_json_string()
    full = _probe(cj, precision, False, 2, finetune_json, zero3)
    if not checkpointing:
        return {"vision": full[0] // 2, "text": full[1] // 2}
    ckpt = _probe(cj, precision, True, 2, finetune_json, zero3)
    layers = (config.vision_config.num_hidden_layers, config.text_config.num_hidden_layers)
    # backward recomputes one layer at a time, of one tower: only the larger layer counts
    layer = [max(0, f - c) // n for f, c, n in zip(full, ckpt, layers)]
    top = 0 if layer[0] >= layer[1] else 1
    return {tower: (ckpt[i] + (layer[i] if i == top else 0)) // 2
            for i, tower in enumerate(("vision", "text"))}


def logits_bytes(loss: str, rows: int, cols: int) -> int:
    """Bytes the loss saves for backward for `rows` local samples against `cols` candidates:
    fp32 (rows, cols) tensors: siglip keeps logits, label*logits, and the logsigmoid buffer
    (3); clip keeps the scaled logits and the log-softmax, for both directions (4). The ring
    form saves every arriving (B_local, B_local) block, so it is (B_local, B_global) as well."""
    return {"siglip": 3, "clip": 4}[loss] * 4 * rows * cols


# --------------------------------------------------------------------------- model states

@dataclass(frozen=True)
class StateBytes:
    gpu: int            # persistent per GPU
    step_extra: int     # transient in step(): fp32 gradient partition (+ all-gather bucket)
    train_extra: int    # transient in forward/backward: buckets, gathered layers
    cpu_node: int       # per node: offloaded states, or the fp32 model every rank builds first


def model_state_bytes(params: int, largest_layer: int, stage: int, offload_optimizer: bool,
                      offload_param: bool, precision: str, gpus: int, gpus_per_node: int,
                      zero: dict | None = None, trainable: int | None = None) -> StateBytes:
    """Model states of one rank (formulas in the module docstring); `zero` is the profile's
    zero_optimization block, for its bucket sizes (elements; DeepSpeed's defaults otherwise).
    ``trainable``: elements with gradients and optimizer states (locked towers and LoRA's frozen
    weights have neither); the weights' p bytes count for all ``params``."""
    if stage not in (1, 2, 3):
        raise ValueError(f"ZeRO stage {stage} is not modelled (1, 2 or 3)")
    zero = zero or {}
    p, g, k = BYTES[precision]
    psi, G, n = params, gpus, gpus_per_node
    t = psi if trainable is None else trainable            # Ψ_t: what has gradients and states
    part, tpart = math.ceil(psi / G), math.ceil(t / G)
    fp32_grad = 0 if precision == "fp32" else 4          # step() casts the gradient partition
    buffers = 2 if zero.get("overlap_comm", False) else 1  # double-buffered reduce buckets
    reduce = min(int(zero.get("reduce_bucket_size", 5e8)), t) * g * buffers
    cpu = 4 * psi * n                                     # every rank builds the fp32 model on CPU
    if stage < 3:
        # ZeRO-1 in DeepSpeed 0.19.8 shares ZeRO-2's optimizer and also keeps only its gradient
        # partition (`averaged_gradients`); the textbook (p + g)Ψ + kΨ/G over-counts it.
        gpu = p * psi + (g + k) * tpart
        step = fp32_grad * tpart + min(int(zero.get("allgather_bucket_size", 5e8)), t) * p
        if offload_optimizer:
            gpu, step = p * psi, 0
            cpu = max(cpu, (k + 4) * tpart * n)
        return StateBytes(gpu, step, reduce, cpu)
    layer = 2 * p * largest_layer                         # gathered 16-bit layer + its gradient
    prefetch = min(int(zero.get("stage3_prefetch_bucket_size", 5e7)), psi) * p
    sub_group = min(tpart, int(zero.get("sub_group_size", 1e9)))
    gpu, step = p * part + (g + k) * tpart, fp32_grad * sub_group
    if offload_optimizer:
        gpu, step = p * part, 0
        # + the flat gradient partition (`grad_partitions_flat_buffer`) next to the fp32 one
        cpu = max(cpu, (k + 4 + g) * tpart * n + (p * part * n if offload_param else 0))
    if offload_param:
        gpu = 0
    return StateBytes(gpu, step, reduce + prefetch + layer, cpu)


# --------------------------------------------------------------------------- the planner

@dataclass(frozen=True)
class Budget:
    gpus_per_node: int
    nodes: int
    gpu_bytes: int
    cpu_bytes: int | None = None   # per node; None: not checked

    @property
    def gpus(self) -> int:
        return self.gpus_per_node * self.nodes


@dataclass(frozen=True)
class Row:
    profile: str
    checkpointing: bool
    fits: bool
    max_micro: int        # largest micro-batch that fits (0: not even 1)
    micro: int            # micro-batch used: global = micro x accumulation x gpus
    accumulation: int
    gpu_gib: float        # predicted peak per GPU at `micro` (at 1 when nothing fits)
    cpu_gib_node: float
    step_s: float         # modelled seconds per optimizer step (Hardware)
    relative_speed: float = 0.0   # step time of the fastest fitting row / this one's; 0 if it does not fit

    def to_dict(self) -> dict:
        return asdict(self)


def peak_gpu_bytes(spec: ModelSpec, states: StateBytes, precision: str, checkpointing: bool, micro: int,
                   per_rank: int, gpus: int, loss: str = "siglip", negatives: str = "global",
                   accumulation: str = "global", zero3: bool = False) -> int:
    """Peak bytes of one GPU at this micro-batch (`per_rank` = global batch / gpus).
    'plain' accumulation: logits (micro, micro x gpus) next to the towers' activations.
    'global': the loss runs alone on (per_rank, global) logits; the towers re-run per micro."""
    act = sum(activation_bytes_per_sample(_config(spec), precision, checkpointing, spec.finetune_json,
                                          zero3 and spec.trainable < spec.params).values()) * micro
    cols = gpus if negatives == "global" else 1
    if accumulation == "global":
        train = max(act, logits_bytes(loss, per_rank, per_rank * cols))
    else:
        train = act + logits_bytes(loss, micro, micro * cols)
    dynamic = max(states.train_extra + train, states.step_extra)
    return int(states.gpu + (1 + FRAGMENTATION) * dynamic)


def _config(spec: ModelSpec):
    from transformers import SiglipConfig

    return SiglipConfig.from_dict(json.loads(spec.config_json))


def accumulation_for(per_rank: int, max_micro: int) -> tuple[int, int]:
    """The smallest accumulation a with per_rank % a == 0 and per_rank / a <= max_micro:
    (micro, a). Whole micro-batches only, so the micro used can be below the largest that fits."""
    for a in range(math.ceil(per_rank / max_micro), per_rank + 1):
        if per_rank % a == 0:
            return per_rank // a, a
    raise AssertionError("unreachable: a = per_rank always divides")


def step_seconds(spec: ModelSpec, stage: int, offload_optimizer: bool, offload_param: bool, precision: str,
                 checkpointing: bool, per_rank: int, accum: int, budget: Budget, accumulation: str = "global",
                 hw: Hardware = Hardware()) -> float:
    """Seconds per optimizer step, compute + communication + offload, not overlapped:
      compute  6 x (Ψ_vision x patches + Ψ_text x tokens) FLOPs per sample, x 8/6 with
               checkpointing (one more forward), x 8/6 more for 'global' accumulation's cached pass;
      network  per rank, ring collectives move (G-1)/G of the bytes: ZeRO-1 gΨ + pΨ per step;
               ZeRO-2 gΨ per micro-batch + pΨ per step; ZeRO-3 (2pΨ + gΨ) per micro-batch;
      PCIe     optimizer offload: g Ψ/G per micro-batch out, p Ψ/G per step in; parameter
               offload 2p Ψ/G more per micro-batch; CPU Adam on the node's n Ψ/G parameters."""
    p, g, _ = BYTES[precision]
    psi, G, t = spec.params, budget.gpus, spec.trainable
    # forward 2, backward 4 FLOPs per parameter and token; a locked tower runs forward only
    per_tower = [(spec.vision_params * spec.vision_tokens, spec.tower_trains("vision")),
                 (spec.text_params * spec.text_tokens, spec.tower_trains("text"))]
    flops = sum(work * (2 + 4 * trains) for work, trains in per_tower) * per_rank
    flops *= (1 + 2 / 6 * checkpointing + 2 / 6 * (accumulation == "global" and accum > 1))
    compute = flops / (hw.flops / (4 if precision == "fp32" else 1))
    ring = (G - 1) / G
    net = {1: g * t + p * t, 2: g * t * accum + p * t, 3: 2 * p * psi * accum + g * t * accum}[stage] * ring
    bw = hw.intra_bw if budget.nodes == 1 else hw.inter_bw
    part, tpart = psi / G, t / G
    pcie = (g * tpart * accum + p * tpart) * offload_optimizer + 2 * p * part * accum * offload_param
    cpu = tpart * budget.gpus_per_node / hw.cpu_adam if offload_optimizer else 0.0
    return compute + net / bw + pcie / hw.pcie_bw + cpu


def plan(spec: ModelSpec, budget: Budget, global_batch: int, precision: str = "bf16",
         profiles: list[str] | None = None, loss: str = "siglip", negatives: str = "global",
         accumulation: str = "global", hw: Hardware = Hardware()) -> list[Row]:
    """One row per (profile, activation checkpointing), fastest first."""
    from rsclip_ds.profiles import available_profiles, load_profile

    if global_batch % budget.gpus:
        raise ValueError(f"global batch {global_batch} is not a multiple of {budget.gpus} GPUs")
    per_rank = global_batch // budget.gpus
    rows = []
    for prof in map(load_profile, profiles or available_profiles()):
        states = model_state_bytes(spec.params, spec.largest_layer, prof.stage, prof.offload_optimizer,
                                   prof.offload_param, precision, budget.gpus, budget.gpus_per_node,
                                   prof.strategy.get("zero_optimization"), trainable=spec.trainable)
        for ac in (False, True):
            def peak(m):
                return peak_gpu_bytes(spec, states, precision, ac, m, per_rank, budget.gpus, loss,
                                      negatives, accumulation, zero3=prof.stage == 3)
            lo, hi = 0, per_rank                      # largest m with peak(m) <= budget (monotonic)
            while lo < hi:
                mid = (lo + hi + 1) // 2
                lo, hi = (mid, hi) if peak(mid) <= budget.gpu_bytes else (lo, mid - 1)
            cpu_ok = budget.cpu_bytes is None or states.cpu_node <= budget.cpu_bytes
            micro, accum = accumulation_for(per_rank, lo) if lo else (0, 0)
            secs = step_seconds(spec, prof.stage, prof.offload_optimizer, prof.offload_param, precision, ac,
                                per_rank, max(accum, 1), budget, accumulation, hw)
            rows.append(Row(prof.name, ac, bool(lo) and cpu_ok, lo, micro, accum,
                            round(peak(max(micro, 1)) / GiB, 2), round(states.cpu_node / GiB, 2), secs))
    best = min((r.step_s for r in rows if r.fits), default=0.0)
    rows = [Row(**{**r.to_dict(), "relative_speed": round(best / r.step_s, 3) if r.fits and r.step_s else 0.0}) for r in rows]
    return sorted(rows, key=lambda r: (not r.fits, r.step_s))


def recommend(rows: list[Row]) -> Row | None:
    """The fastest row that fits; ties go to the smaller GPU footprint. None if nothing fits."""
    fitting = [r for r in rows if r.fits]
    return min(fitting, key=lambda r: (r.step_s, r.gpu_gib)) if fitting else None
