"""The memory model against DeepSpeed's own estimators, the activation probe, and the planner's
answers for a few budgets (the seed article's 80 GB model on 4 x 24 GB among them)."""

import argparse
import json
import math
import os
import subprocess
import sys

import pytest
import torch
from deepspeed.runtime.zero.stage3 import estimate_zero3_model_states_mem_needs
from deepspeed.runtime.zero.stage_1_and_2 import estimate_zero2_model_states_mem_needs

from rsclip_ds.planning.activations import _probe, activation_bytes_per_sample, saved_bytes
from rsclip_ds.planning.memory import GiB, logits_bytes, model_state_bytes, peak, preset_spec, scaled_spec
from rsclip_ds.planning.planner import Budget, Hardware, plan, recommend, step_seconds
from rsclip_ds.profiles import PROFILE_DIR, Profile, load_profile
from rsclip_ds.config import ConfigError
from rsclip_ds.model import new_dual_encoder, preset_config
from rsclip_ds.cli.plan import parse_bytes
from rsclip_ds.cli.plan import register as add_plan_parser
from rsclip_ds.cli.plan import run as cmd_plan

PSI, LAYER = 652_150_786, 32_768_000   # git-rsclip-large, its token embedding


@pytest.mark.parametrize("gpus", [1, 4, 8])
def test_zero2_states_and_step_cast_are_deepspeeds_estimate(gpus):
    s = model_state_bytes(PSI, 2, False, False, "bf16", gpus, gpus)
    _, ds_gpu = estimate_zero2_model_states_mem_needs(PSI, gpus, cpu_offload=False)
    # 2Ψ + 18Ψ/G: our states (2Ψ + 14Ψ/G) and the step's fp32 cast of the gradient partition
    assert s.gpu + 4 * math.ceil(PSI / gpus) == pytest.approx(ds_gpu, rel=1e-6)
    off = model_state_bytes(PSI, 2, True, False, "bf16", gpus, gpus)
    ds_cpu, ds_gpu = estimate_zero2_model_states_mem_needs(PSI, gpus, cpu_offload=True)
    assert off.gpu == ds_gpu                                                # 2Ψ
    if gpus <= 4:                                                           # max(4G, 16)Ψ x 1.5
        assert off.cpu_node == pytest.approx(ds_cpu / 1.5, rel=1e-6)


@pytest.mark.parametrize("gpus", [1, 4, 8])
def test_zero3_agrees_with_deepspeed_where_comparable(gpus):
    kw = dict(num_gpus_per_node=gpus, zero_init=True)
    # optimizer offload: 2Ψ/G + 4L on the GPU (DeepSpeed's largest layer: ours is the gathered
    # term of the peak), 16Ψ per node on the CPU (DeepSpeed x 1.5)
    s = model_state_bytes(PSI, 3, True, False, "bf16", gpus, gpus)
    ds_cpu, ds_gpu, _ = estimate_zero3_model_states_mem_needs(PSI, LAYER, cpu_offload=True,
                                                              cpu_offload_params=False, **kw)
    assert s.gpu + 4 * LAYER == pytest.approx(ds_gpu, rel=0.01)
    if gpus <= 4:   # beyond, our CPU peak is the fp32 model every rank builds first (4Ψ per rank)
        # + the flat 16-bit gradient partition DeepSpeed's estimator leaves out (2Ψ per node,
        # measured by benchmarks/memory/per_rank.py as grad_partitions_flat_buffer)
        assert s.cpu_node - ds_cpu / 1.5 == pytest.approx(2 * PSI, rel=0.01)
    # parameter + optimizer offload: nothing persistent on the GPU, 18Ψ per node
    s = model_state_bytes(PSI, 3, True, True, "bf16", gpus, gpus)
    ds_cpu, ds_gpu, _ = estimate_zero3_model_states_mem_needs(PSI, LAYER, cpu_offload=True, **kw)
    assert (s.gpu, ds_gpu) == (0, 4 * LAYER)
    assert s.cpu_node == pytest.approx(max(ds_cpu / 1.5 + 2 * PSI, 4 * PSI * gpus), rel=0.01)
    # no offload: we add the 16-bit parameter partition DeepSpeed's 18Ψ/G leaves out (2Ψ/G)
    s = model_state_bytes(PSI, 3, False, False, "bf16", gpus, gpus)
    _, ds_gpu, _ = estimate_zero3_model_states_mem_needs(PSI, LAYER, cpu_offload=False, **kw)
    ours = s.gpu + 4 * math.ceil(PSI / gpus) + 4 * LAYER   # + the step's fp32 gradient, DeepSpeed's layer
    assert ours - ds_gpu == pytest.approx(2 * PSI / gpus, rel=0.01)


def test_fp32_keeps_a_master_copy_like_deepspeed_and_zero1_shards_gradients():
    """DeepSpeed 0.19.8 behaviour measured by benchmarks/memory/per_rank.py: an fp32 master partition
    even in fp32 (20 bytes/param), and ZeRO-1 keeping only its gradient partition."""
    assert model_state_bytes(10**9, 3, False, False, "fp32", 4, 4).gpu == 20 * 10**9 // 4
    z1 = model_state_bytes(10**9, 1, False, False, "bf16", 4, 4)
    z2 = model_state_bytes(10**9, 2, False, False, "bf16", 4, 4)
    assert z1.gpu == z2.gpu == 2 * 10**9 + 14 * 10**9 // 4


def _profile(tmp_path, name: str, **zero) -> Profile:
    """A shipped profile with some zero_optimization values changed."""
    raw = json.loads((PROFILE_DIR / f"{name}.json").read_text())
    raw["zero_optimization"].update(zero)
    path = tmp_path / f"{name}_{len(list(tmp_path.iterdir()))}.json"
    path.write_text(json.dumps(raw))
    return load_profile(str(path))


def test_peak_terms_of_zero1_and_zero2(tmp_path):
    """ZeRO-1 holds the full gradients between micro-steps when it accumulates; a GPU allocates
    DeepSpeed's reduce buckets whole (twice with overlap_comm), CPU ranks only what is written."""
    spec = preset_spec("git-rsclip-base")
    psi, G, g = spec.params, 4, 2
    kw = dict(micro=8, checkpointing=False, accumulation="plain")
    z1, z2 = _profile(tmp_path, "zero1", reduce_bucket_size=10**7), _profile(tmp_path, "zero2", reduce_bucket_size=10**7)
    one, four = (peak(spec, z1, "bf16", G, G, accumulation_steps=k, **kw) for k in (1, 4))
    assert four.gradients == g * (psi - math.ceil(psi / G))      # full gradients instead of the partition
    assert one.gradients == g * 10**7                            # one bucket's worth waiting to be copied
    assert one.buckets == g * 10**7                              # overlap_comm off: one bucket
    two = peak(spec, z2, "bf16", G, G, accumulation_steps=4, **kw)
    assert two.gradients == g * 10**7 and two.buckets == 2 * g * 10**7
    huge = _profile(tmp_path, "zero2", reduce_bucket_size=10**9)   # larger than the model
    assert peak(spec, huge, "bf16", G, G, accumulation_steps=1, **kw).buckets == 2 * g * 10**9
    assert peak(spec, huge, "bf16", G, G, accumulation_steps=1, device="cpu", **kw).buckets == g * psi
    # the step: flat gradient copy (g) + fp32 cast (4) + AdamW's temporary (4, foreach on a GPU)
    assert one.step == (g + 4 + 4) * math.ceil(psi / G)
    assert one.allocated == one.states + max(one.train, one.step)
    assert one.reserved == int(one.allocated + 0.10 * max(one.train, one.step)) + GiB
    assert peak(spec, z1, "bf16", G, G, accumulation_steps=1, device="cpu", **kw).reserve == 0


def test_zero3_gathered_parameters(tmp_path):
    """With prefetching, ZeRO-3 keeps every parameter gathered from forward to backward (measured
    in 0.19.8, whatever the reuse distance); without, about half the reuse distance stays."""
    spec = preset_spec("git-rsclip-base")
    p, kw = 2, dict(micro=8, accumulation_steps=1)
    for reuse in (0, 10**9):
        pf = peak(spec, _profile(tmp_path, "zero3", stage3_max_reuse_distance=reuse), "bf16", 4, 4, **kw)
        assert pf.gathered == p * spec.params
    none = peak(spec, _profile(tmp_path, "zero3", stage3_prefetch_bucket_size=0, stage3_max_reuse_distance=0),
                "bf16", 4, 4, **kw)
    assert none.gathered == p * spec.largest_layer
    half = peak(spec, _profile(tmp_path, "zero3", stage3_prefetch_bucket_size=0, stage3_max_reuse_distance=10**8),
                "bf16", 4, 4, **kw)
    assert half.gathered == p * (5 * 10**7 + spec.largest_layer)
    assert none.allocated < half.allocated < pf.allocated
    # the step: the sub-group's fp32 gradient and AdamW's temporary (sub_group_size bounds both)
    small = peak(spec, _profile(tmp_path, "zero3", sub_group_size=10**7, reduce_bucket_size=10**7), "bf16", 4, 4,
                 grad_accum="bf16", **kw)
    assert small.step == (4 + 4) * 10**7 + 2 * 10**7   # + the reduce bucket ZeRO-3 keeps allocated


def test_probe_on_meta_matches_a_real_cpu_forward():
    cfg = preset_config("tiny")
    model = new_dual_encoder(cfg).train()
    params = list(model.parameters())
    real = (saved_bytes(lambda: model.vision_model(pixel_values=torch.randn(2, 3, 64, 64)), params),
            saved_bytes(lambda: model.text_model(input_ids=torch.randint(0, 1000, (2, 48))), params))
    assert _probe(cfg.to_json_string(), "fp32", False, 2) == real


@pytest.mark.parametrize("preset", ["tiny", "git-rsclip-large"])
def test_activations_grow_linearly_and_checkpointing_cuts_them(preset):
    cj = preset_config(preset).to_json_string()
    one, two = _probe(cj, "bf16", False, 1), _probe(cj, "bf16", False, 2)
    assert two[0] == pytest.approx(2 * one[0], rel=0.02) and two[1] == pytest.approx(2 * one[1], rel=0.02)
    full = activation_bytes_per_sample(preset, "bf16", False)
    ckpt = activation_bytes_per_sample(preset, "bf16", True)
    if preset == "git-rsclip-large":   # 24 layers: inputs + one recomputed layer, ~9x less
        assert full["vision"] > 6 * ckpt["vision"] and full["text"] > 6 * ckpt["text"]
        assert 190 * 2**20 < full["vision"] < 230 * 2**20        # ~207 MiB per 256 px image
        assert activation_bytes_per_sample(preset, "fp32", False)["vision"] == pytest.approx(2 * full["vision"], rel=0.01)


def test_80gb_model_needs_offload_on_one_gpu_and_on_4_x_24gb():
    spec = scaled_spec(5e9)
    assert 16 * spec.params == pytest.approx(80e9, rel=0.02)          # the article's ~80 GB of states
    one = plan(spec, Budget(1, 1, 24 * GiB), 1024)
    assert all(r.fits == ("offload" in r.profile) for r in one)
    four = plan(spec, Budget(4, 1, 24 * GiB), 1024)
    # ZeRO-3's 16Ψ/4 = 20 GB of states would fit, but with prefetching it keeps every 16-bit
    # weight gathered from forward to backward (2Ψ = 10 GB more; measured in 0.19.8): only the
    # profiles that offload fit, zero3_offload (no prefetching) among them
    zero3 = {r.checkpointing: r for r in four if r.profile == "zero3"}
    assert not any(r.fits for r in zero3.values())
    assert zero3[True].allocated_gib * GiB > 16 * spec.params / 4 + 2 * spec.params
    assert all(r.fits == ("offload" in r.profile) for r in four)
    best = recommend(four)
    assert best.fits and best.checkpointing and best.profile in ("zero3_offload", "zero2_offload")
    assert best.micro * best.accumulation * 4 == 1024


def test_git_rsclip_large_on_4_x_24gb():
    rows = plan(preset_spec("git-rsclip-large"), Budget(4, 1, 24 * GiB), 4096)
    # 6 profiles (ddp and the ZeRO ones) + 3 hybrid ones, each with and without checkpointing; one node: no hybrid
    # is a candidate
    assert len(rows) == 18 and all(r.fits for r in rows if r.profile != "zero3_hpz")
    assert {r.profile for r in rows if not r.candidate} == {"zero3_hpz", "zero3_zeropp", "zero3_mics"}
    best = recommend(rows)
    assert best.relative_speed == 1.0 and best.gpu_gib <= 24
    assert best.micro * best.accumulation * 4 == 4096 and best.micro <= best.max_micro
    ac = {r.profile: r.max_micro for r in rows if r.checkpointing}
    assert all(ac[r.profile] > 5 * r.max_micro for r in rows if not r.checkpointing)


def test_tiny_fits_everywhere():
    rows = plan(preset_spec("tiny"), Budget(2, 1, 4 * GiB), 64)
    assert all(r.fits and (r.micro, r.accumulation) == (32, 1) for r in rows)


def test_parse_bytes():
    assert parse_bytes("24GiB") == 24 * GiB and parse_bytes("80GB") == 80 * 10**9 and parse_bytes("24") == 24 * GiB


def _plan_args(argv):
    parser = argparse.ArgumentParser()
    add_plan_parser(parser.add_subparsers(dest="command"))
    return parser.parse_args(["plan", *argv])


def test_plan_json_and_written_config(tmp_path, capsys):
    out = tmp_path / "ds.json"
    args = _plan_args(["--model", "git-rsclip-base", "--gpus", "2", "--gpu-mem", "24", "--global-batch", "512",
                       "--json", "--write-config", str(out)])
    assert cmd_plan(args) == 0
    result = json.loads(capsys.readouterr().out)
    best = result["recommended"]
    assert set(best) >= {"profile", "checkpointing", "fits", "gpu_gib", "cpu_gib_node", "max_micro", "micro",
                         "accumulation", "relative_speed"}
    assert len(result["rows"]) == 18 and f"--set batch.micro_batch_size={best['micro']}" in result["command"]
    ds = json.loads(out.read_text())
    assert ds["train_batch_size"] == 512 and ds["train_micro_batch_size_per_gpu"] == best["micro"]
    assert ds["zero_optimization"]["stage"] == int(best["profile"][4])


# --------------------------------------------------------------------------- fine-tuning controls

def test_the_planner_counts_what_trains_under_locks_and_lora():
    from rsclip_ds.config import FinetuneConfig, LoraConfig
    from rsclip_ds.planning.memory import preset_spec

    full = preset_spec("git-rsclip-large")
    locked = preset_spec("git-rsclip-large", FinetuneConfig(lock_image=True))
    lora = preset_spec("git-rsclip-large", FinetuneConfig(lora=LoraConfig(towers=["image", "text"], rank=8)))
    assert full.trainable == full.params
    assert locked.trainable == full.text_params + 2 and locked.params == full.params
    # LoRA r=8 on q, k, v, out of 24 + 24 blocks of width 1024: 4 x 2 x 8 x 1024 per block
    assert lora.trainable == 48 * 4 * 2 * 8 * 1024 + 2 and lora.params == full.params + lora.trainable - 2
    states = [model_state_bytes(s.params, 1, False, False, "bf16", 4, 4, trainable=s.trainable)
              for s in (full, locked, lora)]
    # ZeRO-1 bf16: 2 bytes per weight for all, (2 + 12) per trainable element / 4 GPUs
    for s, st in zip((full, locked, lora), states):
        assert st.gpu == 2 * s.params + 14 * math.ceil(s.trainable / 4)


def test_a_locked_tower_saves_no_activations():
    from rsclip_ds.config import FinetuneConfig
    from rsclip_ds.model import preset_config

    config = preset_config("git-rsclip-base")
    full = activation_bytes_per_sample(config, "bf16")
    locked = activation_bytes_per_sample(config, "bf16", finetune_json=FinetuneConfig(lock_image=True).model_dump_json())
    assert locked["vision"] == 0 and locked["text"] == full["text"] > 0


def test_plan_takes_finetune_sets_only(capsys):
    parser = argparse.ArgumentParser()
    add_plan_parser(parser.add_subparsers(dest="command"))
    base = ["plan", "--gpus", "4", "--gpu-mem", "24GiB", "--global-batch", "256", "--json"]

    def planned(*sets):
        capsys.readouterr()
        assert cmd_plan(parser.parse_args(base + [a for s in sets for a in ("--set", s)])) == 0
        return json.loads(capsys.readouterr().out)

    full, locked = planned(), planned("finetune.lock_image=true")
    assert locked["trainable"] < full["trainable"] == full["params"]
    assert locked["recommended"]["gpu_gib"] < full["recommended"]["gpu_gib"]
    assert "--set finetune.lock_image=true" in locked["command"]
    with pytest.raises(ConfigError, match="finetune"):
        cmd_plan(parser.parse_args(base + ["--set", "steps=3"]))


def test_plan_json_stdout_is_only_json():
    """`rsclip-ds plan --json | jq` on a laptop: DeepSpeed's accelerator warning (printed to
    stdout at import when no GPU is found and DS_ACCELERATOR is unset) must go to stderr."""
    env = {k: v for k, v in os.environ.items() if k != "DS_ACCELERATOR"}
    proc = subprocess.run([sys.executable, "-m", "rsclip_ds", "plan", "--model", "tiny", "--gpus", "2",
                           "--gpu-mem", "8GiB", "--global-batch", "64", "--json"],
                          capture_output=True, text=True, env=env, timeout=300)
    assert proc.returncode == 0, proc.stderr
    doc = json.loads(proc.stdout)   # the whole of stdout, nothing before or after
    assert doc["model"] == "tiny" and doc["recommended"]["fits"]


@pytest.mark.parametrize("name", ["siglip", "clip"])
def test_logits_bytes_cover_what_the_loss_saves(name):
    """The loss's saved tensors, counted with saved_tensors_hooks on a real (local) loss, are
    within logits_bytes (siglip exactly: 4 fp32 (B, B) tensors)."""
    from rsclip_ds.losses import build_loss

    b, d = 256, 8
    fn = build_loss(name, negatives="local", rank=0, world_size=1, chunk_size=None)
    image = torch.nn.functional.normalize(torch.randn(b, d), dim=-1).requires_grad_()
    text = torch.nn.functional.normalize(torch.randn(b, d), dim=-1).requires_grad_()
    scale, bias = torch.tensor([2.3], requires_grad=True), torch.tensor([-10.0], requires_grad=True)
    saved = saved_bytes(lambda: fn(image, text, scale, bias), [image, text, scale, bias])
    assert saved <= logits_bytes(name, b, b) * 1.01
    if name == "siglip":
        assert saved == pytest.approx(logits_bytes(name, b, b), rel=0.01)


def test_fp32_gradient_accumulation_bytes(tmp_path):
    """bf16 with fp32 accumulation (bf16.grad_accum_dtype): ZeRO-2/3 keep an fp32 partition
    (+2 bytes per trainable parameter / G) and lose the step's fp32 cast; ZeRO-1 (BF16_Optimizer)
    holds a whole fp32 gradient copy; 'auto' is fp32 on zero2/zero3, bf16 on zero1."""
    spec = preset_spec("git-rsclip-base")
    G, kw = 4, dict(micro=8, accumulation_steps=4)
    tpart = math.ceil(spec.trainable / G)
    for name in ("zero2", "zero3"):
        prof = load_profile(name)
        bf, fp, auto = (peak(spec, prof, "bf16", G, G, grad_accum=d, **kw) for d in ("bf16", "fp32", "auto"))
        assert fp.states - bf.states == 2 * tpart and auto == fp
        assert bf.step - fp.step == 4 * min(tpart, int(prof.strategy["zero_optimization"].get("sub_group_size", 1e9)))
    z1 = load_profile("zero1")
    bf, fp, auto = (peak(spec, z1, "bf16", G, G, grad_accum=d, **kw) for d in ("bf16", "fp32", "auto"))
    assert fp.states - bf.states == 4 * spec.trainable - 2 * tpart and auto == bf


def test_the_speed_score_uses_the_communication_model():
    """Across nodes the network counts: ZeRO-2 all-reduces the gradients every micro-batch,
    ZeRO-1 once per step, so a slow network costs ZeRO-2 ~k times what it costs ZeRO-1; inside
    one node the network's bandwidth does not matter."""
    spec = preset_spec("git-rsclip-large")
    z1, z2 = load_profile("zero1"), load_profile("zero2")
    one, two, slow = Budget(8, 1, 80 * GiB), Budget(8, 2, 80 * GiB), Hardware(inter_bw=1.4e9)

    def secs(prof, budget, hw=Hardware()):
        return step_seconds(spec, prof, "bf16", False, 32, 16, budget, "plain", hw)
    assert secs(z2, one, slow) == secs(z2, one)
    d1, d2 = secs(z1, two, slow) - secs(z1, two), secs(z2, two, slow) - secs(z2, two)
    assert d1 > 0 and 8 < d2 / d1 < 16     # gradients 16x, the parameter all-gather once for both


def test_chunked_siglip_keeps_no_logits_from_forward_to_backward():
    """loss.chunk_size: each (chunk, B) block of logits is recomputed in backward, so the forward
    keeps none of them for backward -- less than one chunk's logits_bytes, where the unchunked form
    keeps the whole (B, B) (the ring's blocks on W ranks: docs/results/training.md#contrastive)."""
    from rsclip_ds.losses import siglip_loss_global

    b, d, chunk = 256, 8, 32
    image = torch.nn.functional.normalize(torch.randn(b, d), dim=-1).requires_grad_()
    text = torch.nn.functional.normalize(torch.randn(b, d), dim=-1).requires_grad_()
    scale, bias = torch.tensor([2.3], requires_grad=True), torch.tensor([-10.0], requires_grad=True)
    leaves = [image, text, scale, bias]
    whole = saved_bytes(lambda: siglip_loss_global(image, text, scale, bias), leaves)
    chunked = saved_bytes(lambda: siglip_loss_global(image, text, scale, bias, chunk_size=chunk), leaves)
    assert whole == pytest.approx(logits_bytes("siglip", b, b), rel=0.01)
    assert chunked < logits_bytes("siglip", chunk, b), chunked
