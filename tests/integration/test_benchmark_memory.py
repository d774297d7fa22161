"""benchmarks/memory/per_rank.py on the tiny preset, 2 CPU ranks, fp32, launched the way users launch it.

One launch (~20 s on 2 idle cores: five engine builds) counts, per ds_profiles/*.json, the bytes
each rank's engine holds. The tests compare those measured bytes with numbers computed here from
the parameter count Ψ of the model (counted by this test, not taken from the report): the
textbook ZeRO layout per role (fp32 weights 4 bytes, Adam's fp32 master + m + v 12 bytes per
parameter, partitioned over W ranks where the stage says so), `rsclip_ds.planning.memory.model_state_bytes`
for the totals, and `activation_bytes_per_sample` for the saved activations.

A second launch (~20 s) runs the same with `--set finetune.lock_image=true`: the image tower is
frozen, so its Ψ_image parameters keep their weights (4 bytes each, partitioned as before) but no
gradients or optimizer states; the tests compare with the same layout evaluated at Ψ_t = Ψ - Ψ_image
(counted here from the model's vision tower) and with the full launch's bytes.

A third launch (~20 s) counts ZeRO-1/2/3 in bf16 with `--set bf16.master_weights=bf16`: a bf16
master and bf16 AdamW states, 6 bytes per parameter / W where fp32 masters hold 12.

`--build-rss` (two more launches, ~1 minute, fp32, glibc's default allocator only) measures the host
memory of building a ZeRO-3 run with the model built whole and inside deepspeed.zero.Init; the
tests check the parameter bytes each rank held after each build against 4Ψ and 4Ψ/W.
"""

from __future__ import annotations

import pytest
import torch

from rsclip_ds.planning import memory
from rsclip_ds.config import FinetuneConfig
from rsclip_ds.model import new_dual_encoder, preset_config
from rsclip_ds.profiles import load_profile, runnable_profiles
from tests.integration.benchmark_helpers import run_benchmark

pytestmark = pytest.mark.slow
W, MICRO = 2, 4
PROFILES = runnable_profiles(on_gpu=False)   # every profile CPU ranks can run (not the CUDA-only ZeRO++ one)


@pytest.fixture(scope="module")
def report(tmp_path_factory) -> dict:
    tmp = tmp_path_factory.mktemp("bench")
    return run_benchmark("memory.per_rank", "--preset", "tiny", "--precision", "fp32", "--steps", "2",
                         "--micro", str(MICRO), out=tmp / "memory.json", ranks=W, timeout=240)


@pytest.fixture(scope="module")
def model() -> torch.nn.Module:
    return new_dual_encoder(preset_config("tiny"))


@pytest.fixture(scope="module")
def psi(model) -> int:
    return sum(p.numel() for p in model.parameters())


def _row(report: dict, profile: str) -> dict:
    return next(r for r in report["profiles"] if r["profile"] == profile)


def test_ran_every_profile_on_two_ranks_with_the_counted_model(report, psi):
    assert report["environment"]["world_size"] == W
    assert [r["profile"] for r in report["profiles"]] == PROFILES
    assert report["config"]["parameters"] == psi


@pytest.mark.parametrize("profile", PROFILES)
def test_bytes_per_role_follow_the_zero_layout(report, psi, profile):
    """Weights 4Ψ on every rank below stage 3, 4Ψ/W at stage 3 (on the CPU with parameter
    offload); optimizer states 12Ψ/W always (on the CPU with optimizer offload); gradients at
    least this rank's 4Ψ/W partition and never more than a full copy's bytes (ZeRO-3 with
    offload keeps two partitions: the flat gradient buffer and the fp32 partition's .grad). Partitions are padded by
    a few elements, hence the 1%."""
    prof, m = load_profile(profile), _row(report, profile)["measured"]
    params_place = "cpu" if prof.offload_param else "gpu"
    opt_place = "cpu" if prof.offload_optimizer else "gpu"
    params = 4 * psi / (W if prof.stage == 3 else 1)
    assert m[f"params_{params_place}"] == pytest.approx(params, rel=0.01), m
    assert m[f"optimizer_{opt_place}"] == pytest.approx(12 * psi / W, rel=0.01), m
    grads = m["grads_gpu"] + m["grads_cpu"]
    assert 0.99 * 4 * psi / W <= grads <= 1.01 * 4 * psi, m
    assert m[f"params_{'gpu' if params_place == 'cpu' else 'cpu'}"] == 0
    assert m[f"optimizer_{'gpu' if opt_place == 'cpu' else 'cpu'}"] == 0


@pytest.mark.parametrize("profile", PROFILES)
def test_model_states_match_the_memory_model(report, psi, profile):
    """The memory model evaluated here from Ψ against the measured totals, within 10%."""
    prof, row = load_profile(profile), _row(report, profile)
    states = memory.model_state_bytes(psi, prof.stage, prof.offload_optimizer, prof.offload_param, "fp32", W, W)
    assert row["gpu"]["measured"] == pytest.approx(states.gpu, rel=0.10), row["measured"]
    if prof.offload_optimizer or prof.offload_param:
        # cpu_node = max(the fp32 model every rank builds, the offloaded states): only the
        # second branch is about the engine
        assert states.cpu_node > 4 * psi * W, "the tiny preset no longer exercises the offloaded-states branch"
        assert row["offload"]["measured"] == pytest.approx(states.cpu_node / W, rel=0.10), row["measured"]
    else:
        assert row["offload"]["measured"] == 0


@pytest.mark.parametrize("profile", PROFILES)
def test_activations_match_the_memory_model(report, profile):
    """Saved-for-backward bytes of one micro-batch against activation_bytes_per_sample x micro,
    with activation checkpointing as the profile turns it on (and the Trainer applied it)."""
    prof, row = load_profile(profile), _row(report, profile)
    assert row["activation_checkpointing"] == prof.activation_checkpointing
    per_sample = memory.activation_bytes_per_sample(preset_config("tiny"), "fp32", prof.activation_checkpointing)
    assert row["activations"]["measured"] == pytest.approx(sum(per_sample.values()) * MICRO, rel=0.15), \
        row["activations"]


# --------------------------------------------------------------------------- finetune.lock_image

LOCK = "finetune.lock_image=true"


@pytest.fixture(scope="module")
def lock_report(tmp_path_factory) -> dict:
    tmp = tmp_path_factory.mktemp("bench_lock")
    return run_benchmark("memory.per_rank", "--preset", "tiny", "--precision", "fp32", "--steps", "2",
                         "--micro", str(MICRO), "--set", LOCK, out=tmp / "memory_lock_image.json", ranks=W,
                         timeout=240)


@pytest.fixture(scope="module")
def psi_trained(model, psi) -> int:
    """Ψ_t: every parameter but the image tower's (the text tower and the logit scale and bias)."""
    return psi - sum(p.numel() for p in model.vision_model.parameters())


def test_locked_run_reports_its_controls(lock_report, psi, psi_trained):
    assert lock_report["config"]["set"] == [LOCK]
    assert lock_report["config"]["finetune"] == {"lock_image": True}
    assert lock_report["config"]["parameters"] == psi
    assert lock_report["config"]["trainable"] == psi_trained
    assert [r["profile"] for r in lock_report["profiles"]] == PROFILES


@pytest.mark.parametrize("profile", PROFILES)
def test_locked_tower_keeps_weights_but_no_gradients_or_optimizer_states(lock_report, psi, psi_trained, profile):
    """The ZeRO layout of the full launch with gradients and optimizer states at Ψ_t: weights 4Ψ
    (4Ψ/W at stage 3; ZeRO-1/2 hold the frozen ones whole, outside the flat buffer), optimizer
    12Ψ_t/W, gradients between this rank's 4Ψ_t/W partition and a full 4Ψ_t."""
    prof, m = load_profile(profile), _row(lock_report, profile)["measured"]
    params_place = "cpu" if prof.offload_param else "gpu"
    opt_place = "cpu" if prof.offload_optimizer else "gpu"
    assert m[f"params_{params_place}"] == pytest.approx(4 * psi / (W if prof.stage == 3 else 1), rel=0.01), m
    assert m[f"optimizer_{opt_place}"] == pytest.approx(12 * psi_trained / W, rel=0.01), m
    grads = m["grads_gpu"] + m["grads_cpu"]
    assert 0.99 * 4 * psi_trained / W <= grads <= 1.01 * 4 * psi_trained, m


@pytest.mark.parametrize("profile", PROFILES)
def test_locking_saves_the_locked_share_of_gradients_and_optimizer_states(report, lock_report, psi, psi_trained,
                                                                          profile):
    """Against the full launch: optimizer bytes scale by Ψ_t/Ψ exactly (0.54 on tiny), gradients +
    optimizer roughly (ZeRO-1/2 count the whole gradient buffer that straddles the partition
    boundary: 0.50 there)."""
    def held(row, role):
        return row["measured"][f"{role}_gpu"] + row["measured"][f"{role}_cpu"]
    full, lock = _row(report, profile), _row(lock_report, profile)
    share = psi_trained / psi
    assert held(lock, "optimizer") / held(full, "optimizer") == pytest.approx(share, rel=0.01)
    both = (held(lock, "grads") + held(lock, "optimizer")) / (held(full, "grads") + held(full, "optimizer"))
    assert both == pytest.approx(share, rel=0.10)


@pytest.mark.parametrize("profile", PROFILES)
def test_locked_model_states_match_the_memory_model(lock_report, psi, psi_trained, profile):
    """model_state_bytes(Ψ, trainable=Ψ_t) against the measured totals, within 10%."""
    prof, row = load_profile(profile), _row(lock_report, profile)
    states = memory.model_state_bytes(psi, prof.stage, prof.offload_optimizer, prof.offload_param, "fp32", W, W,
                                      trainable=psi_trained)
    assert row["gpu"]["measured"] == pytest.approx(states.gpu, rel=0.10), row["measured"]
    if prof.offload_optimizer or prof.offload_param:
        assert states.cpu_node > 4 * psi * W, "the locked tiny run no longer exercises the offloaded-states branch"
        assert row["offload"]["measured"] == pytest.approx(states.cpu_node / W, rel=0.10), row["measured"]
    else:
        assert row["offload"]["measured"] == 0


@pytest.mark.parametrize("profile", PROFILES)
def test_a_locked_tower_saves_fewer_activations(report, lock_report, profile):
    assert _row(lock_report, profile)["activations"]["measured"] < _row(report, profile)["activations"]["measured"]


@pytest.mark.parametrize("profile", PROFILES)
def test_locked_activations_match_the_memory_model(lock_report, profile):
    """activation_bytes_per_sample with the same controls x micro, within 15%."""
    prof, row = load_profile(profile), _row(lock_report, profile)
    finetune = FinetuneConfig(lock_image=True).model_dump_json()
    per_sample = memory.activation_bytes_per_sample(preset_config("tiny"), "fp32", prof.activation_checkpointing,
                                                    finetune, zero3=prof.stage == 3)
    assert row["activations"]["measured"] == pytest.approx(sum(per_sample.values()) * MICRO, rel=0.15), \
        row["activations"]


# --------------------------------------------------------------------------- bf16.master_weights=bf16

MASTERS = "bf16.master_weights=bf16"
NO_OFFLOAD = ("zero1", "zero2", "zero3")   # the offload profiles need DeepSpeedCPUAdam: a JIT build


@pytest.fixture(scope="module")
def masters_report(tmp_path_factory) -> dict:
    tmp = tmp_path_factory.mktemp("bench_masters")
    return run_benchmark("memory.per_rank", "--preset", "tiny", "--precision", "bf16", "--steps", "2",
                         "--micro", str(MICRO), "--set", MASTERS, "--profiles", *NO_OFFLOAD,
                         out=tmp / "memory_bf16_masters.json", ranks=W, timeout=240)


@pytest.mark.parametrize("profile", NO_OFFLOAD)
def test_bf16_masters_hold_no_fp32_copy(masters_report, psi, profile):
    """bf16 weights 2Ψ (2Ψ/W at stage 3); master + AdamW m + v 3 x 2 bytes = 6Ψ/W (12Ψ/W with fp32
    masters); gradients between this rank's 2Ψ/W bf16 partition and a full 2Ψ."""
    m = _row(masters_report, profile)["measured"]
    assert m["params_gpu"] == pytest.approx(2 * psi / (W if profile == "zero3" else 1), rel=0.01), m
    assert m["optimizer_gpu"] == pytest.approx(6 * psi / W, rel=0.01), m
    assert 0.99 * 2 * psi / W <= m["grads_gpu"] <= 1.01 * 2 * psi, m


@pytest.mark.parametrize("profile", NO_OFFLOAD)
def test_bf16_masters_match_the_memory_model(masters_report, psi, profile):
    prof, row = load_profile(profile), _row(masters_report, profile)
    states = memory.model_state_bytes(psi, prof.stage, False, False, "bf16", W, W, master="bf16")
    assert row["gpu"]["measured"] == pytest.approx(states.gpu, rel=0.10), row["measured"]


# --------------------------------------------------------------------------- --build-rss

@pytest.fixture(scope="module")
def build_report(tmp_path_factory) -> dict:
    tmp = tmp_path_factory.mktemp("build_rss")
    return run_benchmark("memory.per_rank", "--build-rss", "--preset", "tiny", "--precision", "fp32",
                         "--mmap-threshold", "default", "--ranks", str(W), out=tmp / "build_rss.json", ranks=None,
                         timeout=300)


def _variant(report: dict, build: str) -> dict:
    return next(v for v in report["variants"] if v["build"] == build)


def test_build_rss_launched_both_builds_on_two_ranks(build_report, psi):
    assert [(v["precision"], v["build"]) for v in build_report["variants"]] == [("fp32", "whole"),
                                                                               ("fp32", "zero.Init")]
    for v in build_report["variants"]:
        assert v["ok"], v
        assert v["world_size"] == W and len(v["ranks"]) == W
        assert v["parameters"] == psi and v["profile"] == "zero3" and v["allocator"] == "default"
        assert v["leaked_shm"] == []


def test_whole_build_holds_the_model_on_every_rank_zero_init_its_partition(build_report, psi):
    """After the model build: 4Ψ (fp32) on every rank when built whole, about 4Ψ/W inside
    zero.Init (each parameter split in W, padded by at most W-1 elements). After the engine build
    both hold the same partitions (tiny's parameters are all under the persistence threshold, but
    ZeRO-3 gathers those only in the first forward)."""
    whole, zero_init = _variant(build_report, "whole"), _variant(build_report, "zero.Init")
    for rank in range(W):
        assert whole["ranks"][rank]["model"]["params_held"] == 4 * psi
        held = zero_init["ranks"][rank]["model"]["params_held"]
        assert 4 * psi / W <= held <= 0.55 * 4 * psi, held
        engine = whole["ranks"][rank]["engine"]["params_held"]
        assert engine == zero_init["ranks"][rank]["engine"]["params_held"]
        assert engine == pytest.approx(4 * psi / W, rel=0.01)


def test_build_rss_readings_are_high_water_marks(build_report):
    """VmHWM never falls from one reading to the next and is never below VmRSS."""
    for v in build_report["variants"]:
        for r in v["ranks"]:
            hwm = [r[stage]["hwm"] for stage in ("start", "model", "engine")]
            assert hwm == sorted(hwm), hwm
            assert all(r[stage]["rss"] <= r[stage]["hwm"] for stage in ("start", "model", "engine")), r
