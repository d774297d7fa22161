"""The `compile` section: torch.compile of the model through DeepSpeed's engine, for training.

`apply_compile(engine, cfg)` calls `DeepSpeedEngine.compile(backend, compile_kwargs)`. Without
DeepSpeed's DeepCompile (0.19.8 enables it on CUDA only, and rsclip_ds does not switch it on),
that is `engine.module.compile(...)`: torch.compile of the DualEncoder's call, lazily -- the
graphs are traced and compiled in the first training forward and backward. The optimizer step,
ZeRO's gradient reduction and the loss scaler stay eager; the contrastive loss (train.py) runs
outside the module, eager too.

What the compiled module sees, and why it does not recompile from step to step:
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

`refusal(...)` names the combinations that do not work, with the reason and the fix; the
Trainer's config check raises it before any process group exists. This module imports torch
only inside its functions (config.py imports the section).
"""

from __future__ import annotations

import logging
from typing import Any, Callable, Literal, Optional

from pydantic import Field

from rsclip_ds.runtime.settings import Strict

log = logging.getLogger("rsclip_ds")


class CompileConfig(Strict):
    enabled: bool = Field(False, description="Compile the model with torch.compile through DeepSpeed's "
                          "engine (`DeepSpeedEngine.compile`) for training; evaluation stays eager. ZeRO-1/2 "
                          "only (ZeRO-3 is refused: docs/guides/pretraining.md#compilation). The first step "
                          "includes the compilation; the start-up line says how long it took.")
    backend: str = Field("inductor", description="torch.compile backend: 'inductor' (generated kernels; needs a "
                         "C++ compiler on CPU), 'aot_eager' (traced graphs run by eager kernels: checks the "
                         "capture, no speed-up), or any name in torch.compiler.list_backends().")
    mode: Optional[Literal["default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs"]] = Field(
        None, description="torch.compile mode (inductor only); None: torch's default. 'reduce-overhead' and "
        "'max-autotune' use CUDA graphs (GPU only).")
    dynamic: bool = Field(False, description="Compile with dynamic shapes. False: static shapes -- training's "
                          "micro-batches all have one shape, so each graph compiles once.")


def refusal(cfg: CompileConfig, *, zero_stage: int, on_gpu: bool) -> str | None:
    """Why this combination cannot be compiled (with the fix), or None when it can."""
    if not cfg.enabled:
        return None
    backends = available_backends()
    if cfg.backend not in backends:
        return (f"compile.backend={cfg.backend!r} is not a torch.compile backend here; choose one of "
                f"{', '.join(sorted(b for b in backends if not b.endswith('TESTING_ONLY')))}")
    if zero_stage == 3:
        # plain torch.compile traces the module with ZeRO-3's partitioned parameters (0-element
        # placeholders that DeepSpeed's hooks gather around each submodule's forward): measured
        # here, "RuntimeError: b must be 2D" in the attention-pooling head's in_proj. DeepSpeed's
        # answer is DeepCompile (its own ZeRO-3 graph passes), CUDA-only in 0.19.8 and not wired here.
        return ("compile.enabled=true does not work with ZeRO-3: torch.compile traces the partitioned "
                "(empty) parameters that ZeRO-3 gathers only around each submodule's forward (measured: "
                "'b must be 2D' in the attention-pooling head). Use profile=zero1 or zero2 with compile, "
                "or set compile.enabled=false for ZeRO-3")
    if cfg.mode in ("reduce-overhead", "max-autotune") and not on_gpu:
        return (f"compile.mode={cfg.mode} captures CUDA graphs, which CPU ranks do not have: drop "
                f"compile.mode, or use 'max-autotune-no-cudagraphs'")
    if cfg.mode is not None and cfg.backend != "inductor":
        return f"compile.mode={cfg.mode} is an inductor option: set compile.backend=inductor or drop compile.mode"
    return None


def available_backends() -> list[str]:
    import torch

    return list(torch.compiler.list_backends(exclude_tags=()))


def apply_compile(engine, cfg: CompileConfig) -> None:
    """Compile ``engine``'s module in place (lazily: the work happens in the first forward and
    backward). Call after deepspeed.initialize, before the first step."""
    kwargs: dict[str, Any] = {"dynamic": cfg.dynamic}
    if cfg.mode is not None:
        kwargs["mode"] = cfg.mode
    engine.compile(backend=cfg.backend, compile_kwargs=kwargs)


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
    record = {"backend": cfg.backend, "mode": cfg.mode or "default", "first_step_s": first_step_s,
              "step_s": step_s, "compile_s": None if step_s is None else max(0.0, first_step_s - step_s)}
    after = f"{step_s:.2f} s per step after" if step_s is not None else "no later step to compare"
    what = f"~{record['compile_s']:.1f} s compilation, " if step_s is not None else ""
    return (f"compile: {cfg.backend} (mode {record['mode']}), {what}first step {first_step_s:.1f} s vs {after}",
            record)

