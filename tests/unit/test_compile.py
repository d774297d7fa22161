"""compile.enabled (rsclip_ds/runtime/compilation.py): regional compilation (each encoder layer) against
eager in one process under 'global' accumulation and patch dropout; the Trainer's compiled runs against
its eager run on 2 forked gloo ranks (ZeRO-2: both scopes; ZeRO-3: layers, every parameter partitioned;
the fine-tunes whose layers stay partly eager); which layers compile and become ZeRO-3 leaves; the refused
combinations.

The backend here is 'aot_eager': torch.compile's capture (dynamo) and autograd tracing (AOT
autograd), run by eager kernels -- the whole path the Trainer wires, in seconds. inductor generates
kernels (tiny, one process: 26 s for the layers, 53 s for the whole model, cold; the table in
docs/guides/pretraining.md#compilation).
Tolerance: rtol 1e-5 on fp32 losses (aot_eager runs the same kernels, measured bit-equal; inductor
reorders float sums: 1e-7 relative measured on `tiny`).
"""

from __future__ import annotations

import json
import logging

import pytest
import torch

from rsclip_ds.config import ConfigError, load_config
from rsclip_ds.model import apply_activation_checkpointing, apply_patch_dropout, new_dual_encoder, preset_config
from rsclip_ds.runtime.compilation import CompileConfig, apply_compile, eager_hook, encoder_layers
from tests.unit.forked_ranks import run_ranks

MICRO = 4


def _batches(vocab: int, rank: int):
    """The same fixed-shape micro-batches for the eager and the compiled run (per rank)."""
    g = torch.Generator().manual_seed(rank)
    while True:
        yield {"pixel_values": torch.randint(0, 256, (MICRO, 3, 64, 64), dtype=torch.uint8, generator=g),
               "input_ids": torch.randint(0, vocab, (MICRO, 40), generator=g)}


def _graphs() -> int:
    from torch._dynamo.utils import counters

    return counters["stats"]["unique_graphs"]


class _Recompiles(logging.Handler):
    """Counts dynamo's recompile reports (the `recompiles` log artifact: TORCH_LOGS=recompiles), one per
    recompiled frame, with or without a new graph. A context manager: leaving detaches it."""

    LOGGER = "torch._dynamo.guards.__recompiles"

    def __init__(self):
        super().__init__()
        self.messages: list[str] = []
        torch._logging.set_logs(recompiles=True)
        logging.getLogger(self.LOGGER).addHandler(self)

    def emit(self, record):
        self.messages.append(record.getMessage())

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        logging.getLogger(self.LOGGER).removeHandler(self)
        torch._logging.set_logs()


def _tiny(dropout: float = 0.5, checkpointing: bool = True):
    """The tiny DualEncoder as the Trainer prepares it: activation checkpointing, patch dropout."""
    model = new_dual_encoder(preset_config("tiny"), seed=0).train()
    if checkpointing:
        apply_activation_checkpointing(model)
    apply_patch_dropout(model, dropout)
    return model


@pytest.mark.parametrize("frozen, graphs", [(False, (4, 6)), (True, (6, 9))])
def test_regional_compile_reuses_one_graph_per_tower_and_equals_eager_under_global_accumulation(frozen, graphs):
    """scope 'layers' in one process, no DeepSpeed: 'global' accumulation (2 micro-batches: a no-grad pass,
    then the replay under the restored RNG, so patch dropout keeps the same patches) with activation
    checkpointing. Loss and every gradient equal the eager twin's; 4 graphs for 4 layers (vision and text
    x no-grad and grad: the 2 layers of a tower share theirs), all made in step 1; switching patch dropout
    off compiles the vision tower's new shape once (2 graphs), then nothing more. ``frozen``: the
    embeddings frozen (a LoRA-like fine-tune, here without checkpointing), so each tower's first
    layer gets an input that needs no grad -- a third graph per shape, 9 entries in all, past dynamo's
    default limit of 8 (apply_compile raises it: else the last one runs eager). ~6 s each on 2 cores."""
    from torch._dynamo.utils import counters

    from rsclip_ds.losses import siglip_loss
    from rsclip_ds.loop import global_optimizer_step
    from tests.helpers import LocalEngine

    torch._dynamo.reset()
    counters.clear()
    # frozen embeddings without checkpointing: the Trainer gives checkpointed layers an input that needs
    # grad (finetune.keep_checkpointed_inputs_differentiable), else eager reentrant checkpointing would
    # leave the first layer without gradients
    eager, compiled = _tiny(checkpointing=not frozen), _tiny(checkpointing=not frozen)
    for model in (eager, compiled) if frozen else ():
        model.vision_model.embeddings.requires_grad_(False)
        model.text_model.embeddings.requires_grad_(False)
    assert apply_compile(compiled, CompileConfig(enabled=True, backend="aot_eager"), zero_stage=2) == {}
    assert len(encoder_layers(compiled)) == 4
    g = torch.Generator().manual_seed(0)
    seen = []
    with _Recompiles() as recompiles:
        for step in range(4):
            if step == 2:   # what PatchDropoutSwitch does for the last steps
                eager.patch_dropout.enabled = compiled.patch_dropout.enabled = False
            batches = [{"pixel_values": torch.randint(0, 256, (MICRO, 3, 64, 64), dtype=torch.uint8, generator=g),
                        "input_ids": torch.randint(0, 1000, (MICRO, 40), generator=g)} for _ in range(2)]
            out = {}
            for name, model in (("eager", eager), ("compiled", compiled)):
                model.zero_grad(set_to_none=True)
                torch.manual_seed(step)   # the same patches drawn for both
                loss = global_optimizer_step(LocalEngine(model), batches, siglip_loss, torch.float32)
                out[name] = (loss, {n: p.grad for n, p in model.named_parameters()})
            torch.testing.assert_close(out["compiled"][0], out["eager"][0], rtol=1e-5, atol=0)
            for n, grad in out["eager"][1].items():
                torch.testing.assert_close(out["compiled"][1][n], grad, rtol=1e-5, atol=1e-7, msg=n)
            seen.append((_graphs(), len(recompiles.messages)))
    assert seen[0][0] == graphs[0] and seen[1] == seen[0], (seen, recompiles.messages)
    assert seen[2][0] == graphs[1] and seen[3] == seen[2], (seen, recompiles.messages)
    # why step 1 recompiled: the other tower's shape, the other grad mode (the input's) -- nothing per step
    assert all("size mismatch" in m or "grad_mode" in m or "requires_grad mismatch" in m
               for m in recompiles.messages), recompiles.messages
    torch._dynamo.reset()


def _compiled(layer) -> bool:
    return hasattr(layer.forward, "_torchdynamo_orig_callable")


@pytest.mark.parametrize("freeze, checkpointed, stage, eager", [
    ("", False, 2, []), ("", True, 3, []),
    # LoRA / lock_image with unlocked layers: the first trained layer's input needs no gradient
    ("vision_model.embeddings", False, 2, []),
    ("vision_model.embeddings", False, 3, ["vision_model.encoder.layers.0"]),
    # lock_image: a forward-only tower, checkpointed
    ("vision_model", True, 2, ["vision_model.encoder.layers.0", "vision_model.encoder.layers.1"]),
    ("vision_model", False, 3, []),
])
def test_which_layers_compile_and_which_become_zero3_leaves(freeze, checkpointed, stage, eager):
    """Every encoder layer's forward is compiled, and under ZeRO-3 made a leaf (its own hook gathers its
    subtree, no hooks below it: the compiled body sees gathered parameters), except the two cases
    stays_eager names (each failed on 2 CPU ranks: a released parameter in backward, AOT's refusal of a
    checkpointed forward-only graph). The rest of the model stays eager. Nothing is compiled here (lazy)."""
    from deepspeed.utils import z3_leaf_module

    model = new_dual_encoder(preset_config("tiny"), seed=0).train()
    if checkpointed:
        apply_activation_checkpointing(model)
    if freeze:
        model.get_submodule(freeze).requires_grad_(False)
    left = apply_compile(model, CompileConfig(enabled=True, backend="aot_eager"), zero_stage=stage)
    assert sorted(left) == eager
    names = {id(m): n for n, m in model.named_modules()}
    for layer in encoder_layers(model):
        compiled = names[id(layer)] not in eager
        assert _compiled(layer) == compiled and z3_leaf_module(layer) == (compiled and stage == 3), names[id(layer)]
    assert not _compiled(model.vision_model.embeddings) and not _compiled(model.vision_model.head)


def _eval_forward(step: int, engine) -> None:
    """What the evaluation hook does: eval mode, no grad, a short batch and the 1-item padding
    dummy (evaluation/embed.py) -- shapes training never has."""
    engine.eval()
    with torch.no_grad():
        engine(torch.zeros(3, 3, 64, 64, dtype=torch.uint8), torch.ones(3, 40, dtype=torch.long))
        engine(torch.zeros(1, 3, 64, 64, dtype=torch.uint8), torch.ones(1, 1, dtype=torch.long))
    engine.train()


def _weights(engine) -> float:
    """Sum of the trained parameters' full fp32 master weights (a collective under ZeRO-3: every rank calls it)."""
    from deepspeed.utils import safe_get_full_fp32_param

    return sum(safe_get_full_fp32_param(p).double().sum().item() for p in engine.module.parameters() if p.requires_grad)


def _train(rank: int, world: int, out: str, tokenizer, profile: str, scope: str | None, extra=()) -> dict:
    from torch._dynamo.utils import counters

    from rsclip_ds.model import preset_bundle
    from rsclip_ds.assembly import Trainer

    counters.clear()
    compiled = [f"compile.enabled={str(scope is not None).lower()}", f"compile.scope={scope or 'layers'}"]
    run = load_config(None, [
        f"profile={profile}", "precision=fp32", "steps=4", "seed=0", f"output_dir={out}", "optim.warmup_steps=2",
        f"batch.micro_batch_size={MICRO}", "batch.gradient_accumulation_steps=2", "batch.accumulation=global",
        "model.patch_dropout=0.5", "model.activation_checkpointing=true", "checkpoint.every=2",
        "checkpoint.at_end=false", "logging.progress=plain", "logging.log_every=1", *compiled,
        "compile.backend=aot_eager", *extra])
    graphs: dict[int, tuple[int, int]] = {}
    with _Recompiles() as recompiles:
        def count(step: int, engine) -> None:   # after each optimizer step (and the save's step)
            graphs[step] = (_graphs(), len(recompiles.messages))

        hooks = [count, eager_hook(_eval_forward)]
        with Trainer(run, model=preset_bundle("tiny", tokenizer, 0), loader=_batches(len(tokenizer), rank),
                     hooks=hooks) as trainer:
            summary = trainer.train()
            keys = sorted(trainer.parts.engine.module.state_dict())
            weights = _weights(trainer.parts.engine)
    return {"losses": summary and summary["losses"], "lrs": summary and summary["lrs"],
            "compile": summary and summary.get("compile"), "graphs": [graphs[s] for s in sorted(graphs)],
            "keys": keys[:3] + keys[-3:], "recompiles": recompiles.messages, "weights": weights}


def _runs(tmp_path, tokenizer, profile: str, scopes, extra=()) -> dict[str, list[dict]]:
    """The eager run and a compiled run per scope, 2 ranks each -> {name: per-rank results}."""
    runs = {}
    for scope in (None, *scopes):
        name = scope or "eager"
        runs[name] = run_ranks(_train, 2, tmp_path / name, str(tmp_path / f"{name}_run"), tokenizer, profile, scope,
                               extra, launcher_env=True, timeout=300)
        for r in runs[name]:
            assert "error" not in r, r.get("traceback")
    return runs


def _zero3_every_parameter_partitioned(folder) -> str:
    """ds_profiles/zero3.json with stage3_param_persistence_threshold 0: tiny's parameters (all under
    the default 1e5 elements) would otherwise stay whole on every rank and no hook would gather one. No
    `leaf_module` classes: the eager run is plain ZeRO-3, and the leaves are apply_compile's choice (a
    leaf class makes every layer of it a leaf, the one stays_eager keeps out too)."""
    from rsclip_ds.profiles import resolve_profile_path

    profile = json.loads(resolve_profile_path("zero3").read_text())
    profile["zero_optimization"]["stage3_param_persistence_threshold"] = 0
    profile["zero_optimization"].pop("leaf_module", None)
    path = folder / "zero3_partitioned.json"
    path.write_text(json.dumps(profile))
    return str(path)


@pytest.mark.slow   # 2 ranks, 2-3 Trainer runs plus step 1's capture: 12-16 s per profile on 2 cores (~40 s under load)
@pytest.mark.parametrize("profile, scopes, graphs", [("zero2", ("layers", "model"), None), ("zero3", ("layers",), 4)])
def test_compiled_losses_equal_eager_and_nothing_recompiles_after_step_1(tmp_path, tiny_tokenizer, profile, scopes,
                                                                         graphs):
    """2 ranks, 'global' accumulation (a no-grad pass and a replay per micro-batch) with patch dropout 0.5
    (the kept patches drawn eagerly: the replay gets the same masks) and activation checkpointing; the lr
    changes (warmup, then cosine), checkpoints are saved at steps 2 and 4, and an eval-mode forward of other
    shapes runs after each step (through eager_hook, as the Trainer runs the evaluation). ZeRO-2 compiles
    both scopes; ZeRO-3 (every parameter partitioned, gathered by DeepSpeed's hooks) the layers, which
    apply_compile makes ZeRO-3 leaves: 4 graphs, as without DeepSpeed (without the leaves each submodule's
    hook broke the graph: 28). Losses and final weights equal eager's."""
    if profile == "zero3":
        profile = _zero3_every_parameter_partitioned(tmp_path)
    runs = _runs(tmp_path, tiny_tokenizer, profile, scopes)
    e = runs["eager"][0]["value"]
    assert e["lrs"][1] != e["lrs"][0] and e["lrs"][3] != e["lrs"][2]   # warmup, then cosine: the lr changes
    assert e["graphs"] == [[0, 0]] * 5   # (graphs, recompiles) after steps 0..4; eager: nothing compiled
    for scope in scopes:
        c = runs[scope][0]["value"]
        torch.testing.assert_close(torch.tensor(c["losses"]), torch.tensor(e["losses"]), rtol=1e-5, atol=0)
        assert c["weights"] == pytest.approx(e["weights"], rel=1e-6)
        for r in runs[scope]:
            g, why = r["value"]["graphs"], r["value"]["recompiles"]
            # every graph made in step 1; steps 2-4 (a save, an eval forward each) compile nothing more
            assert g[0] == [0, 0] and g[1][0] > 0 and g[1:] == [g[1]] * 4, (scope, g, why)
            assert graphs is None or g[1][0] == graphs, (scope, g, why)
            # step 1's recompiles: the replay (grad on) of the frames its no-grad pass compiled; for the
            # layers also the other tower's shape (one code object for both towers' layers)
            assert g[1][1] > 0 and all("grad_mode" in m or (scope == "layers" and "size mismatch" in m)
                                       for m in why), why
        assert c["keys"] == e["keys"]   # the compiled module's state dict keeps its names (checkpoints)
        rec = c["compile"]
        assert rec["scope"] == scope and rec["backend"] == "aot_eager"
        assert rec["compile_s"] > 0 and rec["first_step_s"] > rec["step_s"] > 0


@pytest.mark.slow   # 2 Trainer runs on 2 ranks: 6-11 s per case on 2 cores
@pytest.mark.parametrize("profile, keys", [
    ("zero3", ["model.activation_checkpointing=false", "finetune.lock_image=true",
               "finetune.lock_image_unlocked_layers=1"]),
    ("zero2", ["finetune.lock_image=true"]),
])
def test_fine_tunes_compile_the_layers_they_can(tmp_path, tiny_tokenizer, profile, keys):
    """The two cases stays_eager leaves a layer eager, through the Trainer (the same run as above): ZeRO-3
    with only the last image layer trained and no checkpointing (the trained layer's input needs no
    gradient: eager, no leaf; before, 'size of tensor a (0) must match' in backward), and a locked image
    tower under activation checkpointing (forward only: eager; before, AOT autograd refused the graph).
    Losses and weights equal eager's; nothing compiles after step 1."""
    if profile == "zero3":
        profile = _zero3_every_parameter_partitioned(tmp_path)
    runs = _runs(tmp_path, tiny_tokenizer, profile, ["layers"], keys)
    e, c = runs["eager"][0]["value"], runs["layers"][0]["value"]
    torch.testing.assert_close(torch.tensor(c["losses"]), torch.tensor(e["losses"]), rtol=1e-5, atol=0)
    assert c["weights"] == pytest.approx(e["weights"], rel=1e-6)
    g = c["graphs"]
    assert g[1][0] > 0 and g[1:] == [g[1]] * 4, (g, c["recompiles"])


class _Small(torch.nn.Module):   # defined here: dynamo does not start a graph in torch.nn's own modules
    def __init__(self):
        super().__init__()
        self.a, self.drop, self.b = torch.nn.Linear(8, 8), torch.nn.Dropout(0.5), torch.nn.Linear(8, 2)

    def forward(self, x):
        return self.b(self.drop(self.a(x)))


def test_eager_hook_keeps_evaluation_out_of_the_compiled_graphs():
    """Without eager_hook an eval-mode forward of another shape compiles anew (the counter moves);
    with it, nothing compiles and the output is the eager module's. (A small module: eager_hook does
    not depend on the model; the Trainer run above has the DualEncoder.)"""
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    torch.manual_seed(0)
    model = _Small()
    plain = _Small()
    plain.load_state_dict(model.state_dict())   # the same weights, never compiled
    model.compile(backend="aot_eager", dynamic=False)
    model.train()(torch.ones(4, 8))
    trained = _graphs()
    assert trained > 0

    def forward(step, engine):
        with torch.no_grad():
            return engine.eval()(torch.arange(24.0).view(3, 8))

    out = eager_hook(forward)(0, model)
    assert _graphs() == trained
    torch.testing.assert_close(out, forward(0, plain), rtol=0, atol=0)
    forward(0, model)
    assert _graphs() > trained   # the same forward, compiled: a new graph
    torch._dynamo.reset()


@pytest.mark.parametrize("keys, fragment", [
    (["profile=zero3", "compile.scope=model"], "compile.scope=model does not work with ZeRO-3"),
    (["compile.backend=nonesuch"], "is not a torch.compile backend here"),
    (["compile.mode=reduce-overhead"], "captures CUDA graphs"),
    (["compile.backend=aot_eager", "compile.mode=max-autotune-no-cudagraphs"], "is an inductor option"),
])
def test_refused_combinations_name_the_reason_and_the_fix(keys, fragment):
    from rsclip_ds.assembly import check_run
    from rsclip_ds.resolve import compile_refusal as refusal

    run = load_config(None, ["compile.enabled=true", *keys])
    with pytest.raises(ConfigError, match=fragment):
        check_run(run, shards=False)
    assert refusal(CompileConfig(), zero_stage=3, on_gpu=False) is None   # off: nothing to refuse
    for stage in (1, 2, 3):   # the layers scope (the default) under every stage
        assert refusal(CompileConfig(enabled=True), zero_stage=stage, on_gpu=False) is None
    for stage in (1, 2):
        assert refusal(CompileConfig(enabled=True, scope="model"), zero_stage=stage, on_gpu=False) is None
