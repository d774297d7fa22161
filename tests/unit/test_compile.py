"""compile.enabled (rsclip_ds/runtime/compilation.py): the Trainer's compiled run against the eager run on 2
forked gloo ranks (ZeRO-2, fp32, tiny preset), and the refused combinations.

The backend here is 'aot_eager': torch.compile's capture (dynamo) and autograd tracing (AOT
autograd), run by eager kernels -- the whole path the Trainer wires, in seconds. inductor generates
kernels (80 s for the tiny model on one CPU core): measured by the removed benchmarks/throughput/compile.py
(docs/results/throughput.md#compile).
Tolerance: rtol 1e-5 on fp32 losses (aot_eager runs the same kernels, measured bit-equal; inductor
reorders float sums: 1e-7 relative measured on `tiny`).
"""

from __future__ import annotations

import logging

import pytest
import torch

from rsclip_ds.config import ConfigError, load_config
from rsclip_ds.runtime.compilation import CompileConfig, eager_hook, refusal
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
    recompiled frame, with or without a new graph."""

    def __init__(self):
        super().__init__()
        self.messages: list[str] = []
        torch._logging.set_logs(recompiles=True)
        logging.getLogger("torch._dynamo.guards.__recompiles").addHandler(self)

    def emit(self, record):
        self.messages.append(record.getMessage())


def _eval_forward(step: int, engine) -> None:
    """What the evaluation hook does: eval mode, no grad, a short batch and the 1-item padding
    dummy (evaluation/embed.py) -- shapes training never has."""
    engine.eval()
    with torch.no_grad():
        engine(torch.zeros(3, 3, 64, 64, dtype=torch.uint8), torch.ones(3, 40, dtype=torch.long))
        engine(torch.zeros(1, 3, 64, 64, dtype=torch.uint8), torch.ones(1, 1, dtype=torch.long))
    engine.train()


def _train(rank: int, world: int, out: str, tokenizer, compiled: bool) -> dict:
    from torch._dynamo.utils import counters

    from rsclip_ds.model import preset_bundle
    from rsclip_ds.trainer import Trainer

    counters.clear()
    run = load_config(None, [
        "profile=zero2", "precision=fp32", "steps=4", "seed=0", f"output_dir={out}", "optim.warmup_steps=2",
        f"batch.micro_batch_size={MICRO}", "batch.gradient_accumulation_steps=2", "batch.accumulation=global",
        "model.patch_dropout=0.5", "model.activation_checkpointing=true", "checkpoint.every=2",
        "checkpoint.at_end=false", "logging.progress=plain", "logging.log_every=1",
        f"compile.enabled={str(compiled).lower()}", "compile.backend=aot_eager"])
    graphs: dict[int, tuple[int, int]] = {}
    recompiles = _Recompiles()

    def count(step: int, engine) -> None:   # after each optimizer step (and the save's step)
        graphs[step] = (_graphs(), len(recompiles.messages))

    hooks = [count, eager_hook(_eval_forward)]
    with Trainer(run, model=preset_bundle("tiny", tokenizer, 0), loader=_batches(len(tokenizer), rank),
                 hooks=hooks) as trainer:
        summary = trainer.train()
        keys = sorted(trainer.parts.engine.module.state_dict())
    return {"losses": summary and summary["losses"], "lrs": summary and summary["lrs"],
            "compile": summary and summary.get("compile"), "graphs": [graphs[s] for s in sorted(graphs)],
            "keys": keys[:3] + keys[-3:], "recompiles": recompiles.messages}


@pytest.mark.slow   # ~20 s of capture and AOT tracing on 2 cores: not for the quick loop
def test_compiled_losses_equal_eager_and_nothing_recompiles_after_step_1(tmp_path, tiny_tokenizer):
    """2 ranks, ZeRO-2, 'global' accumulation (a no-grad pass and a replay per micro-batch) with patch
    dropout 0.5 (the kept patches drawn eagerly: the replay gets the same masks) and activation
    checkpointing; the lr changes (warmup, then cosine), checkpoints are saved at steps 2 and 4, and an
    eval-mode forward of other shapes runs after each step (through eager_hook, as the Trainer runs the
    evaluation). About 40 s on 2 idle cores (compiling step 1 is most of it)."""
    eager = run_ranks(_train, 2, tmp_path / "eager", str(tmp_path / "eager_run"), tiny_tokenizer, False,
                      launcher_env=True, timeout=300)
    compiled = run_ranks(_train, 2, tmp_path / "compiled", str(tmp_path / "compiled_run"), tiny_tokenizer, True,
                         launcher_env=True, timeout=300)
    for r in eager + compiled:
        assert "error" not in r, r.get("traceback")
    e, c = eager[0]["value"], compiled[0]["value"]
    assert e["lrs"][1] != e["lrs"][0] and e["lrs"][3] != e["lrs"][2]   # warmup, then cosine: the lr changes
    torch.testing.assert_close(torch.tensor(c["losses"]), torch.tensor(e["losses"]), rtol=1e-5, atol=0)
    assert e["graphs"] == [[0, 0]] * 5   # (graphs, recompiles) after steps 0..4; eager: nothing compiled
    for r in compiled:
        g = r["value"]["graphs"]
        # every graph made in step 1; steps 2-4 (a save, an eval forward each) compile nothing more
        assert g[0] == [0, 0] and g[1][0] > 0 and g[1:] == [g[1]] * 4, (g, r["value"]["recompiles"])
        # step 1's recompiles: the replay (grad on) of the frames its no-grad pass compiled, nothing else
        assert g[1][1] > 0 and all("grad_mode" in m for m in r["value"]["recompiles"]), r["value"]["recompiles"]
    assert c["keys"] == e["keys"]   # the compiled module's state dict keeps its names (checkpoints)
    rec = c["compile"]
    assert rec["backend"] == "aot_eager" and rec["compile_s"] > 0 and rec["first_step_s"] > rec["step_s"] > 0


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
    (["profile=zero3"], "does not work with ZeRO-3"),
    (["compile.backend=nonesuch"], "is not a torch.compile backend here"),
    (["compile.mode=reduce-overhead"], "captures CUDA graphs"),
    (["compile.backend=aot_eager", "compile.mode=max-autotune-no-cudagraphs"], "is an inductor option"),
])
def test_refused_combinations_name_the_reason_and_the_fix(keys, fragment):
    from rsclip_ds.trainer import check_run

    run = load_config(None, ["compile.enabled=true", *keys])
    with pytest.raises(ConfigError, match=fragment):
        check_run(run, shards=False)
    assert refusal(CompileConfig(), zero_stage=3, on_gpu=False) is None   # off: nothing to refuse
    for stage in (1, 2):
        assert refusal(CompileConfig(enabled=True), zero_stage=stage, on_gpu=False) is None
