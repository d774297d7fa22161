"""benchmarks/memory/per_rank.py in its smallest case: the tiny preset, 2 CPU ranks, fp32, launched the
way users launch it (one launch, ~20 s on 2 idle cores: an engine build per profile).

It counts, per ds_profiles/*.json, the bytes each rank's engine holds. The tests compare those
measured bytes with numbers computed here from the parameter count Ψ of the model (counted by this
test, not taken from the report): the textbook ZeRO layout per role (fp32 weights 4 bytes, Adam's
fp32 master + m + v 12 bytes per parameter, partitioned over W ranks where the stage says so),
`rsclip_ds.planning.memory.model_state_bytes` for the totals, and `activation_bytes_per_sample` for
the saved activations. The fine-tuning controls and bf16 masters are measured by the same script
with --set (benchmarks/results/memory_*.json); what they hold in a real run is tested by
tests/integration/test_finetune.py and test_bf16_master_weights.py.
"""

from __future__ import annotations

import pytest
import torch

from rsclip_ds.planning import memory
from rsclip_ds.planning.activations import activation_bytes_per_sample
from rsclip_ds.model import new_dual_encoder, preset_config
from rsclip_ds.profiles import load_profile, runnable_profiles
from tests.integration.benchmark_helpers import run_benchmark

pytestmark = pytest.mark.slow
W, MICRO = 2, 4
PROFILES = runnable_profiles(on_gpu=False)   # every profile CPU ranks can run (not the CUDA-only ZeRO++ one)


@pytest.fixture(scope="module")
def report(tmp_path_factory) -> dict:
    tmp = tmp_path_factory.mktemp("bench")
    return run_benchmark("memory.per_rank", "--preset", "tiny", "--precision", "fp32", "--steps", "1",
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
    offload); optimizer states 12Ψ/W under ZeRO (on the CPU with optimizer offload); gradients at
    least this rank's 4Ψ/W partition and never more than a full copy's bytes (ZeRO-3 with
    offload keeps two partitions: the flat gradient buffer and the fp32 partition's .grad). Partitions are padded by
    a few elements, hence the 1%. Stage 0 (ddp): everything whole, and no fp32 master: torch's AdamW steps the
    fp32 weights in place, m and v are 8Ψ; the gradients are the parameters' own 4Ψ."""
    prof, m = load_profile(profile), _row(report, profile)["measured"]
    params_place = "cpu" if prof.offload_param else "gpu"
    opt_place = "cpu" if prof.offload_optimizer else "gpu"
    params = 4 * psi / (W if prof.stage == 3 else 1)
    assert m[f"params_{params_place}"] == pytest.approx(params, rel=0.01), m
    optimizer = 8 * psi if prof.stage == 0 else 12 * psi / W
    assert m[f"optimizer_{opt_place}"] == pytest.approx(optimizer, rel=0.01), m
    grads = m["grads_gpu"] + m["grads_cpu"]
    assert 0.99 * 4 * psi / W <= grads <= 1.01 * 4 * psi, m
    if prof.stage == 0:
        assert grads == 4 * psi, m
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
    per_sample = activation_bytes_per_sample(preset_config("tiny"), "fp32", prof.activation_checkpointing)
    assert row["activations"]["measured"] == pytest.approx(sum(per_sample.values()) * MICRO, rel=0.15), \
        row["activations"]
