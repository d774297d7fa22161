"""Stage 0's gradient all-reduce (the `ddp` profile on more than one rank), overlapped with the backward.

DeepSpeed 0.19.8's stage-0 reduction waits for the whole backward, flattens every gradient into one
bucket of up to 5e8 elements, casts it to `communication_data_type`, all-reduces it, casts it back and
copies each gradient out again (engine.allreduce_gradients -> buffered_allreduce_fallback): four
passes over every gradient and no overlap. Under amp_bf16 it sends everything in one dtype, where its
ZeRO stages send the layers autocast runs in bf16 in bf16 and the rest in fp32.

`GradientBuckets` does what torch's DDP does, inside the DeepSpeed engine (whose own reduction the
Trainer then turns off, `engine.enable_backward_allreduce`):

- the trainable parameters are grouped by the dtype their gradient travels in (`wire_dtype`: under
  amp, DeepSpeed's per-parameter `comm_dtype`, bf16/fp16 for Linear and Conv, fp32 for the rest;
  otherwise the engine's communication_data_type) into buckets of `bucket_elements`, in the reverse of
  the module's order (roughly the order the backward produces them);
- in the backward of the micro-batch that ends the optimizer step, each gradient is copied into its
  bucket as soon as autograd has accumulated it (a post-accumulate-grad hook; the copy casts to the
  wire dtype), and a full bucket is divided by the world size and all-reduced asynchronously while
  the backward goes on (DeepSpeed pre-divides too: the same sum). Every rank launches the buckets in
  one fixed order, as DDP does: a full bucket waits for those before it;
- at the end of that backward (an autograd callback) the ranks wait for every bucket and copy the
  averages back into the gradients, in their own dtype, and the buckets are freed (they exist only
  during that backward). A parameter that got no gradient this step sends zeros (as DeepSpeed does),
  so every rank reduces the same buckets.

Per gradient element and step: one copy into the bucket and one back (12 bytes moved for an fp32
gradient on a bf16 wire, against 28 for DeepSpeed's), on the wire 2 (W - 1) / W x its wire bytes (a
ring all-reduce), and the reduction runs under the rest of the backward. One rank builds none of
this: there is nothing to average.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.distributed as dist


@dataclass
class _Bucket:
    params: list[torch.nn.Parameter]
    offsets: list[int]
    elements: int
    dtype: torch.dtype                            # the wire dtype
    buffer: torch.Tensor | None = None            # (elements,): made in the boundary backward, freed after it
    ready: int = 0                                # gradients copied in this step
    handle: object = None                         # the async all-reduce, once launched
    filled: set[int] = field(default_factory=set)


def wire_dtype(param: torch.nn.Parameter, default: torch.dtype) -> torch.dtype:
    """The dtype ``param``'s gradient travels in: DeepSpeed's `comm_dtype`, which its torch_autocast
    setup gives the parameters of the layers autocast runs in 16 bits, else ``default``."""
    return getattr(param, "comm_dtype", default)


class GradientBuckets:
    """The overlapped all-reduce of every trainable gradient of ``params`` over ``group`` (module docstring).
    ``boundary()`` says whether the backward under way ends the optimizer step (the engine's
    is_gradient_accumulation_boundary): the other micro-batches accumulate locally."""

    def __init__(self, params: list[torch.nn.Parameter], bucket_elements: int, default_dtype: torch.dtype,
                 boundary, group=None):
        self.group, self.boundary = group, boundary
        self.world = dist.get_world_size(group)
        trainable = [p for p in reversed(params) if p.requires_grad]
        by_dtype: dict[torch.dtype, list[torch.nn.Parameter]] = {}
        for p in trainable:
            by_dtype.setdefault(wire_dtype(p, default_dtype), []).append(p)
        self.buckets: list[_Bucket] = []
        self._where: dict[int, tuple[_Bucket, int]] = {}   # id(param) -> (bucket, index in it)
        for dtype, group_params in by_dtype.items():
            chunk: list[torch.nn.Parameter] = []
            for p in group_params + [None]:
                size = sum(q.numel() for q in chunk)
                if p is None or (chunk and size + p.numel() > bucket_elements):
                    if chunk:
                        self._add(chunk, dtype)
                    chunk = []
                if p is not None:
                    chunk.append(p)
        # every rank launches the buckets in one order (the collectives must pair up): the order their first
        # gradient comes in, so that a bucket seldom waits for one before it
        position = {id(p): i for i, p in enumerate(trainable)}
        self.buckets.sort(key=lambda b: min(position[id(p)] for p in b.params))
        self._next = 0   # the first bucket not launched yet this step
        self._queued = False
        self._handles = [p.register_post_accumulate_grad_hook(self._on_grad) for p in trainable]

    def _add(self, params: list[torch.nn.Parameter], dtype: torch.dtype) -> None:
        offsets, total = [], 0
        for p in params:
            offsets.append(total)
            total += p.numel()
        bucket = _Bucket(params, offsets, total, dtype)
        for i, p in enumerate(params):
            self._where[id(p)] = (bucket, i)
        self.buckets.append(bucket)

    @property
    def elements(self) -> dict[str, int]:
        """Elements per wire dtype (what one step sends, before the ring's 2 (W - 1) / W)."""
        out: dict[str, int] = {}
        for b in self.buckets:
            key = str(b.dtype).replace("torch.", "")
            out[key] = out.get(key, 0) + b.elements
        return out

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()

    # ---- the backward of the step's last micro-batch
    def _on_grad(self, param: torch.nn.Parameter) -> None:
        if not self.boundary():
            return
        if not self._queued:   # wait for every bucket once this backward is done
            torch.autograd.Variable._execution_engine.queue_callback(self._finish)
            self._queued = True
        bucket, i = self._where[id(param)]
        self._copy_in(bucket, i, param.grad)
        self._launch_ready()

    def _launch_ready(self) -> None:
        """Launch the full buckets in order, from the first one not launched yet."""
        while self._next < len(self.buckets) and self.buckets[self._next].ready == len(self.buckets[self._next].params):
            self._launch(self.buckets[self._next])
            self._next += 1

    def _copy_in(self, bucket: _Bucket, i: int, grad: torch.Tensor | None) -> None:
        if i in bucket.filled:   # a parameter used twice in the graph: its hook runs once, after both
            return
        p, start = bucket.params[i], bucket.offsets[i]
        if bucket.buffer is None:   # the caching allocator's on a GPU: no bucket lives between steps
            bucket.buffer = torch.empty(bucket.elements, dtype=bucket.dtype, device=p.device)
        view = bucket.buffer.narrow(0, start, p.numel())
        if grad is None:
            view.zero_()
        else:
            view.copy_(grad.reshape(-1))   # casts to the wire dtype
        bucket.filled.add(i)
        bucket.ready += 1

    def _launch(self, bucket: _Bucket) -> None:
        bucket.buffer.mul_(1.0 / self.world)   # the average, as DeepSpeed's pre-division
        bucket.handle = dist.all_reduce(bucket.buffer, group=self.group, async_op=True)

    def _finish(self) -> None:
        """End of the boundary backward: complete, wait for and copy back every bucket."""
        for bucket in self.buckets[self._next:]:   # a gradient that never came (an unused parameter): zeros
            for i, p in enumerate(bucket.params):
                self._copy_in(bucket, i, p.grad)
        self._launch_ready()
        for bucket in self.buckets:
            bucket.handle.wait()
            for p, start in zip(bucket.params, bucket.offsets):
                averaged = bucket.buffer.narrow(0, start, p.numel()).view_as(p)
                if p.grad is None:
                    p.grad = averaged.to(p.dtype)
                else:
                    p.grad.copy_(averaged)
            bucket.handle, bucket.ready, bucket.filled, bucket.buffer = None, 0, set(), None
        self._next, self._queued = 0, False


def build_gradient_buckets(engine, stage: int, world_size: int, bucket_elements: int) -> GradientBuckets | None:
    """Stage 0: take the gradient reduction over from DeepSpeed (module docstring) -- on one rank there
    is nothing to average, so none. None under ZeRO, which reduces itself."""
    if stage != 0:
        return None
    engine.enable_backward_allreduce = False   # DeepSpeed's own switch (its pipeline engine uses it too)
    if world_size == 1:
        return None
    return GradientBuckets(list(engine.module.parameters()), bucket_elements, engine.communication_data_type,
                           engine.is_gradient_accumulation_boundary)
