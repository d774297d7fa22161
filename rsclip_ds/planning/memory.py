"""The memory model: pure functions, bytes per GPU and per node (the planner is planner.py).

A rank's peak is its model states plus the larger of two phases (`Peak`, `peak`):

    forward/backward  activations of one micro-batch + the loss's logits + the micro-batch itself
                      + gradients alive beside the states + DeepSpeed's reduce buckets
                      + ZeRO-3's gathered parameters
    step              the gradient partition's copies and the optimizer's temporaries
    allocated = states + max(forward/backward, step)      (torch.cuda.max_memory_allocated)
    reserved  = allocated + FRAGMENTATION x the larger phase + RESERVE   (what must fit)

Model states, Ψ parameters (Ψ_t of them trainable), G = gpus in all, n = gpus per node; bytes per
parameter are p (weights) g (gradients) k (optimizer: fp32 master + Adam m, v): mixed precision
2 + 2 + 12, fp32 4 + 4 + 12 (DeepSpeed keeps an fp32 master partition in fp32 too), the autocast
precisions amp_bf16 and amp 4 + 4 + 12 as fp32 (the module's weights and gradients stay fp32; ZeRO-1/2
clone them into the fp32 master partition, and ZeRO-3's branch that would alias them never runs, below),
bf16 masters (`master="bf16"`, bf16.master_weights=bf16) 2 + 2 + 6 (a bf16 master partition and bf16
m, v). Stage 0 (the ddp profile, no ZeRO) has no master partition: fp32, amp_bf16 and amp step torch's
AdamW on the module's own fp32 parameters (4 + 4 + 8: m and v); bf16 and fp16 run DeepSpeed's
FP16_UnfusedOptimizer (torch's AdamW is not its FusedAdam), which keeps an fp32 copy of every parameter
(2 + 2 + 12). Per GPU (DeepSpeed's `estimate_zero{2,3}_model_states_mem_needs`, corrected by what
benchmarks/memory/per_rank.py measures in 0.19.8):
    stage 0          pΨ + (g+k)Ψ_t (everything whole, on every GPU; no offload)
    ZeRO-1 = ZeRO-2  pΨ + (g+k)Ψ_t/G (the gradient partition, alive from backward to the step)
    ZeRO-3  pΨ/G + (g+k)Ψ_t/G
    ZeRO-2 + optimizer offload  pΨ        ZeRO-3 + optimizer offload  pΨ/G     + param offload  0
    ZeRO-3 + hpZ (group h): + pΨ/h, the secondary partition (alive from a parameter's first release
    to the step); MiCS (group s): pΨ/s + (g+k)Ψ_t/s; ZeRO++: tens of MB (`quantisation_buffers`)
With offload the CPU of a node holds (k + m)Ψ_t n/G (the master's gradient, m = 4 bytes for fp32
masters, 2 for bf16, lives there too), at ZeRO-3 + gΨ_t n/G (a flat gradient partition), plus
pΨ n/G with parameter offload.

The transient terms, read from DeepSpeed 0.19.8 and measured on 2 CPU ranks with
git-rsclip-base (benchmarks/memory/per_rank.py --peak; docs/benchmarks/memory.md explains each term):
  buckets    ZeRO-1/2: `torch.empty(reduce_bucket_size)` in the gradient dtype, two with
             overlap_comm, allocated whole on a GPU at every step's first backward, plus the
             gradients waiting to be copied into it (one bucket's worth). ZeRO-3: one reduce
             bucket, allocated at start-up and kept (in both phases).
  gradients  ZeRO-1 with accumulation > 1 reduces only at the boundary: every micro-step holds
             the full gradients gΨ_t (instead of the partition).
  gathered   ZeRO-3 (from the second step, once it has traced the module order) with prefetching
             on (`stage3_prefetch_bucket_size` > 0) keeps every parameter it prefetched for a later
             use gathered until that use: all of them, pΨ, from forward to backward, whatever
             `stage3_max_reuse_distance` says (measured: 0 and 1e9 give the same peak). Without
             prefetching a module's parameters are released after its forward unless used again
             within the reuse distance (forward, then backward in reverse): about half of it
             stays gathered at the turn, plus the layer at work.
  step       ZeRO-1/2: a flat copy of the gradient partition, its fp32 cast (16-bit runs) and
             the optimizer's temporaries (torch's AdamW: one partition-sized fp32 tensor per
             step on a GPU (foreach), two on CPU (per tensor)); ZeRO-3: the same per sub-group.
             Stage 0: torch's fused AdamW updates each parameter in place (nothing); under bf16/fp16
             the FP16_UnfusedOptimizer first casts every 16-bit gradient to fp32 (4Ψ_t); on W > 1 ranks
             the all-reduce's buckets (below) if larger.
  autocast   amp_bf16 / amp (activations.py): autocast's 16-bit copy of every trainable weight it casts
             (~2 bytes per Linear/Conv parameter), alive from forward to backward, at every stage.
             The wire dtype is per parameter (DeepSpeed's comm_dtype: 16 bits for the parameters of
             Linear and Conv modules, Ψ_a of them; fp32 for the rest), and ZeRO keeps a reduce bucket
             per wire dtype: ZeRO-1/2 two (or four, with overlap_comm) buckets in the fp32 gradient dtype
             and a 16-bit cast of one in flight; ZeRO-3 one bucket in each wire dtype.
  stage 0    the gradient all-reduce of rsclip_ds.gradients (W > 1 only): in the backward that ends the
             step it copies every gradient into a bucket of its wire dtype as autograd finishes it and
             holds all the buckets until that backward ends (`GradientBuckets._finish` frees them):
             a whole copy of the gradients, 2Ψ_a + 4(Ψ_t - Ψ_a) bytes under autocast, gΨ_t otherwise,
             at the moment the activations are gone; counted in the step's phase (the larger of the
             two, which never coexist). One rank reduces nothing.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass
from functools import lru_cache

from rsclip_ds.planning.activations import activation_bytes_per_sample, autocast_weight_bytes, meta_model
from rsclip_ds.planning.comms import hybrid_settings
from rsclip_ds.precision import AUTOCAST_MODULES, is_autocast, weight_dtype

GiB = 2**30
# Allocator fragmentation, on the bytes that churn (activations, buckets, gathered layers,
# transient gradients). The flat ZeRO buffers are allocated once at start-up and do not fragment.
FRAGMENTATION = 0.10
# Per GPU, outside PyTorch's allocated bytes: the CUDA context and kernels (~0.5 GiB with torch
# 2.x on H100/H200-class GPUs), NCCL's communicators and buffers (~0.3-0.5 GiB), cuBLAS workspaces.
RESERVE = GiB
# ZeRO-3's stage3_param_persistence_threshold (DeepSpeed's and our profiles'): smaller parameters stay gathered
PERSISTENCE_THRESHOLD = 100_000
# torch's AdamW temporaries of the size of one (flat) partition: foreach on a GPU, per tensor on CPU
ADAM_TEMPORARIES = {"cuda": 1, "cpu": 2}
# p, g, k per parameter under ZeRO. DeepSpeed 0.19.8 keeps an fp32 master partition even in fp32
# (`single_partition_of_fp32_groups`, `fp32_partitioned_groups_flat`), so k = 4 + 8 always
# (measured by benchmarks/memory/per_rank.py), under autocast too: ZeRO-1/2 clone the fp32 weights, and
# ZeRO-3's branch that would alias them (stage3.py, "groups in fp32_partitioned_groups are aliases")
# compares a torch.device with a device string and never runs (measured: memory_amp_bf16.json).
BYTES = {"fp32": (4, 4, 12), "bf16": (2, 2, 12), "fp16": (2, 2, 12), "amp_bf16": (4, 4, 12), "amp": (4, 4, 12)}
# Stage 0 (no ZeRO optimizer): fp32 weights (fp32, amp_bf16, amp) are stepped in place by torch's AdamW:
# m and v only; 16-bit weights get DeepSpeed's FP16_UnfusedOptimizer: an fp32 copy per parameter + m, v.
STAGE0_OPTIMIZER_BYTES = {"fp32": 8, "bf16": 12, "fp16": 12}
WIRE16 = 2   # bytes per element of a gradient that travels in the autocast dtype
# Bytes per element of the master weights, of their gradient in the step and of AdamW's m and v, by
# bf16.master_weights. 'bf16' (bf16_master_weights_and_grads + bf16_optimizer_states), measured in
# 0.19.8 (benchmarks/memory/per_rank.py --set bf16.master_weights=bf16): a bf16 master partition beside the
# bf16 weights at every stage -- stage3.py's branch that would let the weight partition serve as
# the master compares a torch.device with a string and never runs -- and bf16 m and v: k = 3 x 2.
MASTER_BYTES = {"fp32": 4, "bf16": 2}


def state_bytes(precision: str, master: str = "fp32", stage: int = 1) -> tuple[int, int, int]:
    """(p, g, k) bytes per parameter for a precision, a master dtype and a ZeRO ``stage`` (module
    docstring; 0: no ZeRO, the ddp profile)."""
    if master == "fp32":
        p, g, k = BYTES[precision]
        return (p, g, STAGE0_OPTIMIZER_BYTES[weight_dtype(precision)]) if stage == 0 else (p, g, k)
    if precision != "bf16":
        raise ValueError(f"master weights in {master} apply to bf16 training only, not {precision}")
    if stage == 0:   # runtime/config.py: "Bf16_master_weights_and_grads is only supported with ZeRO Stage 1, 2, or 3"
        raise ValueError(f"master weights in {master} need ZeRO (stage 1, 2 or 3): DeepSpeed refuses them at stage 0")
    p, g, _ = BYTES[precision]
    return p, g, 3 * MASTER_BYTES[master]


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
    small_params: int = 0        # elements in parameters of <= 1e5 (what ZeRO-3 keeps gathered)
    layer_params: int = 0        # elements of the encoder layers' larger parameters (what ZeRO-3 re-gathers
                                 # when checkpointing recomputes them)
    autocast_params: int = 0     # trainable elements of Linear/Conv modules (DeepSpeed's lower_precision_safe_modules,
                                 # by exact class): the gradients on the 16-bit wire under amp_bf16 / amp
    autocast_all: int = 0        # all elements of those modules' parameters, frozen too (ZeRO-3 gathers them in
                                 # 16 bits)
    autocast_small: int = 0      # of autocast_all, those in parameters of <= 1e5 elements (kept gathered by ZeRO-3)

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


def model_spec(config, name: str = "custom", finetune=None) -> ModelSpec:
    """Counts from a SiglipConfig, on the meta device (no memory, any size); ``finetune`` (a
    FinetuneConfig) sets what trains and adds LoRA's parameters."""
    if finetune is not None and finetune.image_size:
        config = config.__class__.from_dict(config.to_dict())
        config.vision_config.image_size = finetune.image_size
    ft = finetune.model_dump_json() if finetune is not None else "{}"
    m = meta_model(config, ft)
    largest = max(sum(p.numel() for p in mod.parameters(recurse=False)) for mod in m.modules())
    vc, tc = config.vision_config, config.text_config

    def count(module, trainable=False):
        return sum(p.numel() for p in module.parameters() if p.requires_grad or not trainable)
    small = sum(p.numel() for p in m.parameters() if p.numel() <= PERSISTENCE_THRESHOLD)
    layers = sum(p.numel() for tower in (m.vision_model, m.text_model) for p in tower.encoder.layers.parameters()
                 if p.numel() > PERSISTENCE_THRESHOLD)
    return ModelSpec(name, config.to_json_string(use_diff=False), count(m.vision_model), count(m.text_model), largest,
                     (vc.image_size // vc.patch_size) ** 2, tc.max_position_embeddings, vc.hidden_size,
                     count(m.vision_model, True), count(m.text_model, True), ft, small, layers, autocast_elements(m),
                     autocast_elements(m, trainable=False),
                     autocast_elements(m, trainable=False, at_most=PERSISTENCE_THRESHOLD))


def autocast_elements(model, trainable: bool = True, at_most: int | None = None) -> int:
    """Elements of the parameters whose module class is one of precision.AUTOCAST_MODULES, exactly as
    DeepSpeed's init_autocast_params matches them (`module.__class__ in ...`: the attention pooling head's
    NonDynamicallyQuantizableLinear and in_proj_weight are not), which it gives a 16-bit `comm_dtype` under
    an autocast precision: the trainable ones' gradients travel in 16 bits (the rest in fp32), and ZeRO-3
    all-gathers all of them in 16 bits. ``trainable``: only those that require grad; ``at_most``: only
    parameters of at most that many elements."""
    names = set(AUTOCAST_MODULES)
    return sum(p.numel() for mod in model.modules() if f"{type(mod).__module__}.{type(mod).__name__}" in names
               for p in mod.parameters(recurse=False)
               if (p.requires_grad or not trainable) and (at_most is None or p.numel() <= at_most))


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


def logits_bytes(loss: str, rows: int, cols: int) -> int:
    """Bytes the loss saves for backward for `rows` local samples against `cols` candidates, as
    fp32 (rows, cols) tensors counted with saved_tensors_hooks under torch 2.13: siglip keeps the
    logits, label*logits and logsigmoid's two buffers (4); clip with global negatives two
    (rows, cols) logits and their log-softmax outputs (4; the local form shares one logits
    matrix: 2, counted as 4 here). The ring form saves every arriving (B_local, B_local) block,
    so it is (B_local, B_global) as well."""
    return {"siglip": 4, "clip": 4}[loss] * 4 * rows * cols


# --------------------------------------------------------------------------- model states

@dataclass(frozen=True)
class StateBytes:
    gpu: int            # per GPU, held through the step (ZeRO-1/2: with the gradient partition)
    cpu_node: int       # per node: offloaded states, or the fp32 model every rank builds first


def model_state_bytes(params: int, stage: int, offload_optimizer: bool, offload_param: bool, precision: str,
                      gpus: int, gpus_per_node: int, trainable: int | None = None, master: str = "fp32",
                      hpz: int = 1, shard: int = 0) -> StateBytes:
    """Model states of one rank (formulas in the module docstring). ``trainable``: elements with
    gradients and optimizer states (locked towers and LoRA's frozen weights have neither); the
    weights' p bytes count for all ``params``. ``master``: bf16.master_weights. ZeRO-3: ``hpz``, ``shard``:
    hpZ's and MiCS's groups (1, 0: off). Stage 0 (no ZeRO): everything whole on every GPU."""
    if stage not in (0, 1, 2, 3):
        raise ValueError(f"ZeRO stage {stage} is not modelled (0, 1, 2 or 3)")
    if stage < 3 and (hpz > 1 or shard):
        raise ValueError("hpZ and MiCS are ZeRO-3 options")
    if stage == 0 and (offload_optimizer or offload_param):
        raise ValueError("offload needs ZeRO (stage 1, 2 or 3), not stage 0")
    p, g, k = state_bytes(precision, master, stage)
    m = MASTER_BYTES[master]                              # the master's gradient in the step
    psi, G, n = params, shard or gpus, gpus_per_node
    t = psi if trainable is None else trainable            # Ψ_t: what has gradients and states
    part, tpart = math.ceil(psi / G), math.ceil(t / G)
    cpu = 4 * psi * n                                     # every rank builds the fp32 model on CPU
    if stage == 0:
        return StateBytes(p * psi + (g + k) * t, cpu)
    if stage < 3:
        # ZeRO-1 in DeepSpeed 0.19.8 shares ZeRO-2's optimizer and, at the boundary, also keeps
        # only its gradient partition (`averaged_gradients`).
        gpu = p * psi + (g + k) * tpart
        if offload_optimizer:
            gpu, cpu = p * psi, max(cpu, (k + m) * tpart * n)
        return StateBytes(gpu, cpu)
    gpu = p * part + (g + k) * tpart + (p * math.ceil(psi / hpz) if hpz > 1 else 0)
    if offload_optimizer:
        gpu = p * part
        # + the flat gradient partition (`grad_partitions_flat_buffer`) next to the fp32 one
        cpu = max(cpu, (k + m + g) * tpart * n + (p * part * n if offload_param else 0))
    if offload_param:
        gpu = 0
    return StateBytes(gpu, cpu)


# --------------------------------------------------------------------------- the peak

@dataclass(frozen=True)
class Peak:
    """One rank's peak by term (module docstring), bytes. On CPU ranks (``device="cpu"``) the
    offloaded states and the CPU optimizer's temporaries share the memory: ``host``."""
    states: int         # held throughout (StateBytes.gpu)
    activations: int    # saved for backward by one micro-batch (or the loss alone, if larger)
    loss: int           # the loss's saved logits, beside the activations ('plain' accumulation)
    inputs: int         # the micro-batch on the device
    gradients: int      # beside the states in forward/backward
    buckets: int        # reduce buckets (+ ZeRO-3's prefetch)
    gathered: int       # ZeRO-3: gathered parameters alive at the turn of forward to backward
    step: int           # transient in step() on the accelerator
    host_states: int    # offloaded states of this rank (StateBytes.cpu_node / gpus per node)
    host_step: int      # the CPU optimizer's temporaries (offload)
    reserve: int        # CUDA context, NCCL (0 on CPU ranks)
    autocast_weights: int = 0   # amp_bf16 / amp: autocast's 16-bit weight copies, forward to backward

    @property
    def train(self) -> int:
        return (self.activations + self.loss + self.inputs + self.gradients + self.buckets + self.gathered
                + self.autocast_weights)

    @property
    def phase(self) -> str:
        return "step" if self.step > self.train else "forward/backward"

    @property
    def allocated(self) -> int:
        """What torch.cuda.max_memory_allocated would report."""
        return self.states + max(self.train, self.step)

    @property
    def reserved(self) -> int:
        """What must fit in the GPU: allocated + the allocator's headroom + the reserve."""
        return int(self.allocated + FRAGMENTATION * max(self.train, self.step)) + self.reserve

    @property
    def host(self) -> int:
        """On CPU ranks, where the offloaded states live in the same memory: the whole peak."""
        return self.allocated + self.host_states + self.host_step

    def to_dict(self) -> dict:
        return {**asdict(self), "train": self.train, "phase": self.phase, "allocated": self.allocated,
                "reserved": self.reserved, "host": self.host}


def peak(spec: ModelSpec, profile, precision: str, gpus: int, gpus_per_node: int, *, micro: int,
         accumulation_steps: int = 1, checkpointing: bool = False, loss: str = "siglip",
         negatives: str = "global", accumulation: str = "global", device: str = "cuda",
         input_bytes: int | None = None, grad_accum: str = "auto", master: str = "fp32") -> Peak:
    """The peak of one rank (module docstring) for a ``profile`` (profiles.Profile: its stage,
    offload and zero_optimization block; DeepSpeed's defaults where it is silent) at ``micro``
    samples per micro-batch and ``accumulation_steps`` micro-batches per step. ``device="cpu"``:
    CPU ranks, where a buffer's untouched pages cost nothing and torch's AdamW makes two
    temporaries. ``input_bytes``: bytes per sample of the batch on the device (default: uint8
    pixels and int64 token ids, what the loader sends). ``grad_accum``, ``master``: the run's
    bf16.grad_accum_dtype and bf16.master_weights."""
    stage, zero = profile.stage, profile.strategy.get("zero_optimization", {})
    p, g, _ = state_bytes(precision, master, stage)
    mg = MASTER_BYTES[master]
    psi, t, G = spec.params, spec.trainable, gpus
    h = hybrid_settings(zero, gpus_per_node, G)          # hpZ's and MiCS's groups (0: off)
    tpart = math.ceil(t / (h["mics"] or G))              # the partition: MiCS shards over its group
    states = model_state_bytes(psi, stage, profile.offload_optimizer, profile.offload_param, precision, G,
                               gpus_per_node, trainable=t, master=master, hpz=h["hpz"] or 1, shard=h["mics"])
    # forward/backward: activations, the loss, the batch; autocast's 16-bit weight copies
    zero3_frozen = stage == 3 and spec.trainable < spec.params
    act = _activation_bytes(spec, precision, checkpointing, zero3_frozen) * micro
    weights16 = _autocast_weight_bytes(spec, precision, zero3_frozen)
    per_rank = micro * accumulation_steps
    cols = G if negatives == "global" else 1
    if accumulation == "global" and accumulation_steps > 1:   # the loss runs alone over the cached features
        act, logits = max(act, logits_bytes(loss, per_rank, per_rank * cols)), 0
    else:
        logits = logits_bytes(loss, micro, micro * cols)
    if input_bytes is None:
        config = _config(spec)
        input_bytes = 3 * config.vision_config.image_size ** 2 + 8 * config.text_config.max_position_embeddings
    inputs = input_bytes * micro
    if stage == 0:
        return _stage0_peak(spec, precision, G, states, act, logits, inputs, weights16, device)
    # DeepSpeed's buffers
    bucket = int(zero.get("reduce_bucket_size", 5e8))
    buffers = 2 if zero.get("overlap_comm", stage == 3) else 1
    wires = wire_elements(spec, precision)                # {wire bytes: elements}: a reduce bucket each
    # a GPU allocates a bucket whole; on CPU only the pages written cost (the gradients fill it)
    touched = {c: buffers * bucket if device == "cuda" else min(buffers * bucket, n) for c, n in wires.items()}
    cast16 = min(bucket, wires.get(WIRE16, 0)) * WIRE16 if is_autocast(precision) else 0   # the bucket's wire copy
    awaiting = min(bucket, t) * g                        # gradients not yet copied into a bucket
    temporaries = ADAM_TEMPORARIES[device] * mg          # AdamW computes in the masters' dtype
    cast = 0 if g == mg else mg                          # 16-bit gradients cast to the masters' dtype
    # bf16 with fp32 gradient accumulation (bf16.grad_accum_dtype; measured: docs/results/training.md#grad-accum,
    # placement read from DeepSpeed): the partition is fp32 and the step's cast goes; ZeRO-1 runs
    # the BF16_Optimizer with a whole fp32 gradient copy per GPU; ZeRO-2 offload adds an fp32
    # partition on the GPU; ZeRO-3 offload keeps it on the CPU
    grad_extra = host_extra = 0
    fp32_accumulation = precision == "bf16" and _accumulates_in_fp32(profile, grad_accum, master, accumulation_steps)
    if fp32_accumulation:
        cast = 0 if mg == 4 else mg                      # bf16 masters: the fp32 sum is cast down
        if stage == 1:
            grad_extra = 4 * t - g * tpart
        elif profile.offload_optimizer:
            grad_extra, host_extra = (4 * tpart, 0) if stage == 2 else (0, (4 - g) * tpart)
        else:
            grad_extra = (4 - g) * tpart
    gathered, host_step = 0, 0
    if stage < 3:
        gradients = g * (t - tpart) if stage == 1 and accumulation_steps > 1 else awaiting
        buckets = sum(touched.values()) * g + cast16     # ZeRO-1/2's buckets hold the gradient dtype
        step = g * tpart + cast * tpart + temporaries * tpart    # flat copy, fp32 cast, AdamW
        if profile.offload_optimizer:
            step, host_step = 0, (temporaries * tpart if device == "cpu" else 0) * _torch_adam_offload(master)
    else:
        reuse = int(zero.get("stage3_max_reuse_distance", 1e9))
        if int(zero.get("stage3_prefetch_bucket_size", 5e7)) > 0:
            gathered = p * psi   # prefetch marks every parameter used again in backward: none is released
        else:
            gathered = p * min(psi, reuse // 2 + spec.largest_layer)
        # ZeRO-3's reduce bucket is in the wire dtype (one per wire dtype under autocast); one on CPU touched in part
        gradients = awaiting
        buckets = sum((min(bucket, n) if device == "cpu" else bucket) * (c if is_autocast(precision) else g)
                      for c, n in wires.items())
        buckets += quantisation_buffers(zero, spec.largest_layer)
        sub = min(tpart, int(zero.get("sub_group_size", 1e9)))
        # the sub-group's fp32 gradient (bf16 masters: its flat bf16 copy, or the cast of an fp32
        # sum) and AdamW's temporaries; ZeRO-3's one reduce bucket is allocated at start-up and
        # stays (stage3.py), so the step has it too
        master_grad = (0 if fp32_accumulation else 4) if master == "fp32" else mg
        step = master_grad * sub + temporaries * sub + buckets
        if profile.offload_optimizer:   # the step runs on the CPU; the bucket stays on the GPU
            step, host_step = buckets, (temporaries * sub if device == "cpu" else 0) * _torch_adam_offload(master)
    host_states = states.cpu_node // gpus_per_node if (profile.offload_optimizer or profile.offload_param) else 0
    return Peak(states.gpu + grad_extra, act, logits, inputs, gradients, buckets, gathered, step,
                host_states + host_extra, host_step, RESERVE if device == "cuda" else 0, weights16)


def _stage0_peak(spec: ModelSpec, precision: str, gpus: int, states: StateBytes, act: int, logits: int,
                 inputs: int, weights16: int, device: str) -> Peak:
    """Stage 0 (no ZeRO; module docstring): the gradients are in the states, whole, from backward to the
    step. After the forward/backward: the all-reduce's buckets at the end of the step's last backward
    (W > 1: every gradient copied once in its wire dtype), then the step (fused AdamW in place, or the
    FP16_UnfusedOptimizer's fp32 copy of every 16-bit gradient): the larger of the two."""
    reducer = sum(c * n for c, n in wire_elements(spec, precision).items()) if gpus > 1 else 0
    step = max(reducer, 4 * spec.trainable if weight_dtype(precision) != "fp32" else 0)
    return Peak(states.gpu, act, logits, inputs, 0, 0, 0, step, 0, 0, RESERVE if device == "cuda" else 0, weights16)


def wire_elements(spec: ModelSpec, precision: str) -> dict[int, int]:
    """{bytes per element on the wire: trainable elements} of the gradient reduction (module docstring):
    under autocast the Linear/Conv parameters in 16 bits and the rest in fp32, otherwise all of them in
    the gradient dtype (the key is then that dtype's bytes); empty groups left out."""
    t = spec.trainable
    if not is_autocast(precision):
        return {BYTES[precision][1]: t}
    return {c: n for c, n in ((WIRE16, spec.autocast_params), (4, t - spec.autocast_params)) if n > 0}


def quantisation_buffers(zero: dict, largest_layer: int) -> int:
    """ZeRO++'s transient buffers: qwZ's int8 gather of a prefetch bucket (+ an fp32 scale per 8000),
    qgZ's int4 copies of the largest gradient (swizzled, exchanged, node-reduced: ~1.5 B/element)."""
    qwz = zero.get("zero_quantized_weights") and int(zero.get("stage3_prefetch_bucket_size", 5e7)) * (1 + 4 / 8000)
    return int(qwz or 0) + (int(1.5 * largest_layer) if zero.get("zero_quantized_gradients") else 0)


def _accumulates_in_fp32(profile, grad_accum: str, master: str = "fp32", accumulation_steps: int = 1) -> bool:
    from rsclip_ds.resolve import bf16_accumulation   # the run's rule, one home

    return bf16_accumulation(grad_accum, master, profile, accumulation_steps) == "fp32"


def _torch_adam_offload(master: str) -> int:
    """1 where an offloaded step on CPU ranks runs torch's AdamW (its temporaries count); 0 with
    bf16 masters, which need DeepSpeedCPUAdam (profiles.bf16_master_flags), updating in place."""
    return int(master == "fp32")


@lru_cache(maxsize=None)   # one SiglipConfig per spec, shared: read it, never change it (~15 ms each;
# a plan asks in every row)
def _config(spec: ModelSpec):
    from transformers import SiglipConfig

    return SiglipConfig.from_dict(json.loads(spec.config_json))


@lru_cache(maxsize=None)   # and the towers' sum: activation_bytes_per_sample's key alone costs ~15 ms
def _activation_bytes(spec: ModelSpec, precision: str, checkpointing: bool, zero3: bool) -> int:
    return sum(activation_bytes_per_sample(_config(spec), precision, checkpointing, spec.finetune_json,
                                           zero3).values())


@lru_cache(maxsize=None)
def _autocast_weight_bytes(spec: ModelSpec, precision: str, zero3: bool) -> int:
    return autocast_weight_bytes(_config(spec), precision, spec.finetune_json, zero3)
