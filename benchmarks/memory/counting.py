"""How benchmarks/memory/per_rank.py counts the bytes a DeepSpeed 0.19.8 engine holds, by role (see its
docstring for what is compared): the ZeRO optimizer's own buffers, each storage once, and the
tensors autograd saves for backward."""

from __future__ import annotations

import torch

from rsclip_ds.loop import _inputs


class Ledger:
    """Bytes by (role, place), each storage counted once (the first role that claims it wins:
    params, then grads, then optimizer, then buckets)."""

    def __init__(self):
        self.seen: set[int] = set()
        self.bytes: dict[tuple[str, str], int] = {}

    def add(self, role: str, place: str, tensors) -> None:
        for t in tensors:
            if not isinstance(t, torch.Tensor) or t.device.type == "meta" or t.numel() == 0:
                continue
            storage = t.untyped_storage()
            if storage.data_ptr() in self.seen or storage.nbytes() == 0:
                continue
            self.seen.add(storage.data_ptr())
            self.bytes[role, place] = self.bytes.get((role, place), 0) + storage.nbytes()

    def get(self, role: str, place: str | None = None) -> int:
        return sum(v for (r, p), v in self.bytes.items() if r == role and place in (None, p))


def _flat(values) -> list:
    out = []
    for v in values or []:
        if isinstance(v, (list, tuple)):
            out += _flat(v)
        elif isinstance(v, dict):
            out += _flat(list(v.values()))
        elif v is not None:
            out.append(v)
    return out


def count_params(ledger: Ledger, engine, stage: int, place: str) -> int:
    """Partitions the engine owns; returns the bytes of ZeRO-3 persistent (gathered) params.
    ZeRO-1/2 flatten only the trainable params (`bit16_groups_flat`, the module's trainable params
    are views of it); frozen ones (locked towers, LoRA's base weights) stay whole on every rank,
    each in its own storage. ZeRO-3 partitions every module param, frozen or not (`ds_tensor`)."""
    opt = engine.optimizer
    if stage == 0:   # no ZeRO: the module's own parameters, whole (16-bit under bf16/fp16)
        ledger.add("params", place, list(engine.module.parameters()))
        return 0
    if stage < 3:
        ledger.add("params", place, _flat(opt.bit16_groups_flat))
        ledger.add("params", place, [p for p in engine.module.parameters() if not p.requires_grad])
        return 0
    params = list(engine.module.parameters())
    ledger.add("params", place, [p.ds_tensor for p in params])
    return sum(p.numel() * p.element_size() for p in params if getattr(p, "ds_persist", False))


def count_grads(ledger: Ledger, engine, stage: int, place: str) -> None:
    opt = engine.optimizer
    if stage == 0:   # the parameters' own .grad (stage 0's all-reduce keeps no buffer past the backward)
        ledger.add("grads", place, [p.grad for p in engine.module.parameters()])
    elif stage < 3:
        ledger.add("grads", place, [p.grad for p in engine.module.parameters()])
        ledger.add("grads", place, [getattr(opt, "grads_in_partition", None)])
        ledger.add("grads", place, _flat(list(getattr(opt, "averaged_gradients", {}).values())))
        ledger.add("grads", place, [t.grad for t in opt.single_partition_of_fp32_groups])
    else:
        ledger.add("grads", place, [opt.grad_partitions_flat_buffer])
        ledger.add("grads", place, [t.grad for t in opt.fp32_partitioned_groups_flat])


def count_optimizer(ledger: Ledger, engine, stage: int, place: str) -> None:
    """Masters and torch's AdamW state. Stage 0: the engine's optimizer is torch's AdamW itself (fp32,
    amp_bf16, amp: no master) or DeepSpeed's FP16_UnfusedOptimizer around it (bf16, fp16: an fp32 copy
    of every parameter, `fp32_groups`)."""
    opt = engine.optimizer
    if stage == 0:
        masters = _flat(getattr(opt, "fp32_groups", []))
    else:
        masters = opt.single_partition_of_fp32_groups if stage < 3 else opt.fp32_partitioned_groups_flat
    ledger.add("optimizer", place, masters)
    inner = getattr(opt, "optimizer", opt)
    ledger.add("optimizer", place, _flat([dict(s) for s in inner.state.values()]))


def count_buckets(ledger: Ledger, engine, place: str) -> None:
    opt = engine.optimizer
    for bucket in getattr(opt, "ipg_buckets", {}).values():
        ledger.add("buckets", place, _flat([bucket.buffer]))
    ledger.add("buckets", place, _flat(getattr(opt, "param_buffer_of_bit16_for_cpu_offload_groups", [])))
    for name in ("temp_grad_buffer_for_cpu_offload", "temp_grad_buffer_for_gpu_offload"):
        ledger.add("buckets", place, [getattr(opt, name, None)])


class SavedActivations:
    """Bytes autograd saves for backward, by storage, minus the parameters' storages (looked up
    at pack time: ZeRO-3 gathers them into new storages during forward). `window()` starts a new
    count; the recompute of a checkpointed layer in backward opens one per layer."""

    def __init__(self, module: torch.nn.Module):
        self.module = module
        self.windows: list[dict[int, int]] = [{}]

    def window(self, *_) -> None:
        self.windows.append({})

    def _pack(self, t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        params = {p.untyped_storage().data_ptr() for p in self.module.parameters()}
        params |= {p.ds_tensor.untyped_storage().data_ptr() for p in self.module.parameters()
                   if hasattr(p, "ds_tensor")}
        if storage.data_ptr() not in params:
            self.windows[-1][storage.data_ptr()] = storage.nbytes()
        return t

    def hooks(self):
        return torch.autograd.graph.saved_tensors_hooks(self._pack, lambda t: t)


def measured_step(engine, batch, loss_fn, dtype, stage: int, places: dict, checkpointing: bool):
    """micro_batch_step split open: count saved activations in forward (and the recompute in
    backward), gradients between backward and step, parameters and optimizer after step."""
    # the first submodule of each encoder layer: the layer's own pre-hooks do not fire when
    # reentrant checkpointing recomputes it in backward, its submodules' do
    layers = [m.layer_norm1 for tower in (engine.module.vision_model, engine.module.text_model)
              for m in tower.encoder.layers]
    saved = SavedActivations(engine.module)
    with saved.hooks():
        image, text, logit_scale, logit_bias = engine(*_inputs(engine, batch, dtype))   # (B,D) x2
        forward = sum(saved.windows[0].values())
        saved.window()   # the loss's own saved tensors are not activations of the towers
        loss = loss_fn(image, text, logit_scale, logit_bias)
        handles = [m.register_forward_pre_hook(saved.window) for m in layers] if checkpointing else []
        try:
            engine.backward(loss)
        finally:
            for h in handles:
                h.remove()
    recompute = max((sum(w.values()) for w in saved.windows[2:]), default=0)
    ledger = Ledger()
    count_params(ledger, engine, stage, places["params"])   # claim param storages before grads
    count_grads(ledger, engine, stage, places["grads"])
    grads = {place: ledger.get("grads", place) for place in ("gpu", "cpu")}
    engine.step()
    ledger = Ledger()
    persistent = count_params(ledger, engine, stage, places["params"])
    count_optimizer(ledger, engine, stage, places["optimizer"])
    count_buckets(ledger, engine, places["optimizer"] if stage < 3 else "gpu")
    held = {(role, place): ledger.get(role, place) for role in ("params", "optimizer", "buckets")
            for place in ("gpu", "cpu")}
    held.update({("grads", place): b for place, b in grads.items()})
    return held, persistent, forward + recompute, {"forward": forward, "largest_recompute": recompute}
