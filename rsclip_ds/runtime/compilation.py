"""The `compile` section: torch.compile of the model for training, layer by layer (regional) or whole.

`apply_compile(model, cfg, zero_stage=...)` runs before deepspeed.initialize and compiles lazily --
the graphs are traced and compiled in the first training forward and backward.

scope 'layers' (the default; torch's regional-compilation recipe): the forward of every encoder
layer of both towers (`{vision,text}_model.encoder.layers`) is compiled in place. The layers of a
tower share one code object and one shape, so dynamo compiles one graph per tower (and grad mode)
and every layer reuses it: compile time is that of one layer per tower, not of the model (measured
in docs/guides/pretraining.md#compilation). The embeddings, the pooling head, the pixel
normalisation and patch dropout run eager; the blocks -- nearly all the FLOPs -- run compiled.
The layer's `forward` is compiled, not its `__call__` (what `layer.compile()` would do): module
hooks stay eager around the compiled body. Under ZeRO-3 that matters: DeepSpeed gathers and
releases partitioned parameters in pre/post-forward hooks on every submodule. The layers are made
ZeRO-3 leaves (`deepspeed.utils.set_z3_leaf_module`: the layer's own hook gathers its whole
subtree, no hooks below it), so the compiled body sees gathered parameters and no hooks: one graph
per tower, as under ZeRO-1/2. Measured on 2 CPU ranks (tiny, aot_eager, every parameter
partitioned): losses and weights bit-equal to eager ZeRO-3; without the leaves each submodule's
hook breaks the graph (28 graphs instead of 4); compiling `__call__` traces the layer's own
hooks (10 graphs, 26 recompiles in step 1). Two kinds of layer stay eager in fine-tunes
(`stays_eager`: a ZeRO-3 leaf DeepSpeed cannot handle, a forward-only checkpointed layer).

scope 'model': `model.compile(...)` (what `DeepSpeedEngine.compile` does without DeepCompile,
which 0.19.8 enables on CUDA only): the whole DualEncoder's call in one graph (graph breaks
where patch dropout draws its patches). ZeRO-1/2 only: under ZeRO-3 it traces the partitioned
(empty) parameters.

Either way the optimizer step, ZeRO's gradient reduction and the loss scaler stay eager; the
contrastive loss (loop.py) runs outside the module, eager too.

What the compiled code sees, and why it does not recompile from step to step:
  * fixed shapes: every micro-batch is (micro, 3, S, S) uint8 and (micro, L) ids, and patch
    dropout keeps the same count of tokens; `dynamic=False` compiles them as static shapes
    instead of a second, dynamic graph when a shape changes;
  * no per-step Python numbers: the learning rate lives in the optimizer, the logit scale and
    bias are parameters (tensors, not constants), the pixel normalisation's constants are the
    model's fixed mean and std;
  * grad mode is guarded: 'global' accumulation's cached pass (no_grad) and its replay each
    compile once; turning patch dropout off for the last steps changes the vision tower's
    shapes: one more compile at that step;
  * evaluation runs eager (`eager_hook`): its batches end short and are padded with 1-item
    dummies, shapes a static graph would compile anew each time.

resolve.compile_refusal names the combinations that do not work, with the reason and the fix,
before any process group exists. This module imports torch only inside its functions (config.py
imports the section).
"""

from __future__ import annotations

import logging
from typing import Any, Callable, Literal, Optional

from pydantic import Field

from rsclip_ds.runtime.settings import Strict

log = logging.getLogger("rsclip_ds")


class CompileConfig(Strict):
    enabled: bool = Field(False, description="Compile the model with torch.compile for training; evaluation stays "
                          "eager. Off until a GPU run has shown it equal to eager and faster. The first step "
                          "includes the compilation; the start-up line says how long it took.")
    scope: Literal["layers", "model"] = Field("layers", description="'layers': compile each encoder layer of both "
                                              "towers (regional: one graph per tower, reused by every layer; "
                                              "ZeRO-1/2/3). 'model': the whole dual encoder in one graph (longer "
                                              "to compile; ZeRO-1/2 only). docs/guides/pretraining.md#compilation.")
    backend: str = Field("inductor", description="torch.compile backend: 'inductor' (generated kernels; needs a "
                         "C++ compiler on CPU), 'aot_eager' (traced graphs run by eager kernels: checks the "
                         "capture, no speed-up), or any name in torch.compiler.list_backends().")
    mode: Optional[Literal["default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs"]] = Field(
        None, description="torch.compile mode (inductor only); None: torch's default. 'reduce-overhead' and "
        "'max-autotune' use CUDA graphs (GPU only).")
    dynamic: bool = Field(False, description="Compile with dynamic shapes. False: static shapes -- training's "
                          "micro-batches all have one shape, so each graph compiles once.")


def available_backends() -> list[str]:
    import torch

    return list(torch.compiler.list_backends(exclude_tags=()))


def encoder_layers(model) -> list:
    """The transformer blocks of both towers, vision first: what scope 'layers' compiles."""
    return [layer for tower in (model.vision_model, model.text_model) for layer in tower.encoder.layers]


def stays_eager(*, trains: bool, upstream: bool, checkpointed: bool, zero_stage: int) -> str | None:
    """Why scope 'layers' leaves an encoder layer eager, or None to compile it. ``trains``: a
    parameter of the layer trains; ``upstream``: one before it in its tower does (the embeddings or
    an earlier layer), so its input requires grad -- the layers of a plain run, a LoRA or lock_*
    fine-tune's layers after the first trained one. Both cases below were measured on 2 CPU ranks.
    Leaving one layer eager loses its speed-up, not the others'."""
    if trains and not upstream and zero_stage == 3:
        # DeepSpeed 0.19.8 reduces a leaf's gradients in the leaf's full backward hook, which torch
        # fires before the leaf's own backward when no input requires grad: the parameters are
        # released under it ("size of tensor a (0) must match ... (128)", eager too)
        return "ZeRO-3 cannot make it a leaf: it trains but its input needs no gradient"
    if not trains and not upstream and checkpointed:
        # no backward passes through it: AOT autograd compiles an inference graph, and torch 2.13
        # rejects its checkpointed attention ("does not support RNG ops in recompute regions")
        return "forward only (frozen, nothing before it trains) and checkpointed"
    return None


def apply_compile(model, cfg: CompileConfig, *, zero_stage: int) -> dict[str, str]:
    """Compile ``model`` (a DualEncoder, fine-tuning controls applied) in place, lazily: the work
    happens in the first forward and backward. Call before deepspeed.initialize: under ZeRO-3 the
    layers must be leaves before the engine registers its hooks. Returns the encoder layers left
    eager (name: why; `stays_eager`), which rank 0 also logs. Raises dynamo's recompile limit to 16
    (a process-wide setting) for scope 'layers'."""
    import torch

    kwargs: dict[str, Any] = {"backend": cfg.backend, "dynamic": cfg.dynamic}
    if cfg.mode is not None:
        kwargs["mode"] = cfg.mode
    if cfg.scope == "model":
        model.compile(**kwargs)   # what DeepSpeedEngine.compile does without DeepCompile
        return {}
    # one code object for every layer of both towers: dynamo keeps one cache entry per guard set --
    # tower shape (the vision one changes when patch dropout is switched off: 3 shapes) x grad mode x,
    # in grad mode, whether the input requires grad (a fine-tune's first trained layer: no) = up to 9,
    # over torch's default limit of 8, past which the layer would silently run eager
    torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, 16)
    from rsclip_ds.runtime.layers import encoder_layer_grads

    eager: dict[str, str] = {}
    for name, layer, trains, upstream in encoder_layer_grads(model):
        why = stays_eager(trains=trains, upstream=upstream, zero_stage=zero_stage,
                          checkpointed=bool(getattr(layer, "gradient_checkpointing", False)))
        if why:
            eager[name] = why
            continue
        # the bound forward (transformers' checkpointing wrapper around the block), not __call__:
        # hooks stay eager. One code object for all layers: dynamo reuses a graph across layers of
        # one shape (inline_inbuilt_nn_modules: parameters are graph inputs, not guarded constants)
        layer.forward = torch.compile(layer.forward, **kwargs)
        if zero_stage == 3:   # gathered whole at the layer's own hook: no hooks inside the compiled body
            from deepspeed.utils import set_z3_leaf_module

            set_z3_leaf_module(layer, True)
    if eager:
        log.info("compile: %d of %d encoder layers stay eager: %s", len(eager), len(encoder_layers(model)),
                 "; ".join(f"{name} ({why})" for name, why in eager.items()))
    return eager


def eager_hook(hook: Callable[[int, Any], Any]) -> Callable[[int, Any], Any]:
    """``hook`` run with torch.compile switched off (torch.compiler.set_stance('force_eager')):
    the evaluation hook's forwards then run the module's own eager code, whatever their shapes,
    and neither recompile nor touch the training graphs."""
    def run_eager(step: int, engine):
        import torch

        with torch.compiler.set_stance("force_eager"):
            return hook(step, engine)
    return run_eager


def compile_line(cfg: CompileConfig, first_step_s: float, step_s: float | None) -> tuple[str, dict]:
    """The start-up line's compile part and the summary's record. torch.compile works lazily, in
    the first step: its cost is measured as the first step's time minus a later step's (the
    mean after step 1), so it also holds the first step's other lazy work (small next to it)."""
    record = {"scope": cfg.scope, "backend": cfg.backend, "mode": cfg.mode or "default", "first_step_s": first_step_s,
              "step_s": step_s, "compile_s": None if step_s is None else max(0.0, first_step_s - step_s)}
    after = f"{step_s:.2f} s per step after" if step_s is not None else "no later step to compare"
    what = f"~{record['compile_s']:.1f} s compilation, " if step_s is not None else ""
    return (f"compile: {cfg.scope}, {cfg.backend} (mode {record['mode']}), {what}first step {first_step_s:.1f} s "
            f"vs {after}", record)

