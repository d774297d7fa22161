"""benchmarks/comms/scaling.py's arithmetic: one row of the table recomputed by hand.

git-rsclip-large, 64 nodes x 8 H200 on 100 Gb/s Ethernet (one NIC per node: 11.25 GB/s achieved,
1.41 GB/s per GPU), ZeRO-3, global batch 32768 = 64 per GPU in one micro-batch (no checkpointing:
it fits), 40% of 989 TFLOP/s.
"""

from __future__ import annotations

import math

import pytest

from rsclip_ds.planning.flops import flops_per_sample
from rsclip_ds.planning.memory import preset_spec
from rsclip_ds.model import preset_config
from rsclip_ds.planning.planner import ZERO3_MODULE_S, ZERO3_TOKEN_S, hooked_modules, tokens_per_sample
from tests.unit.benchmark_modules import import_benchmark


@pytest.fixture(scope="module")
def scaling():
    yield from import_benchmark("comms.scaling")


def test_one_row_by_hand(scaling):
    args = scaling.parse_args(["--out", "/dev/null"])
    spec = preset_spec("git-rsclip-large")
    row = scaling.scaling_row(spec, "zero3", 64, "eth-100g", args)
    assert (row["gpus"], row["micro"], row["accumulation"], row["checkpointing"]) == (512, 64, 1, False)

    # compute: 3 x forward FLOPs x 64 samples at 0.4 x 989e12
    compute = 3 * flops_per_sample(preset_config("git-rsclip-large")).forward * 64 / (0.4 * 989e12)
    assert row["compute_s"] == pytest.approx(compute, rel=1e-9)

    # network, per GPU: every ZeRO-3 collective at k = 1 spans the world; across nodes each GPU
    # moves (N-1)/N of its 1/8 share: gather 2(Ψ - Ψ_p), reduce-scatter 2Ψ, persistent gather 2Ψ_p;
    # the SigLIP ring sends 4 x ceil(511/2) blocks of (64, 1024) fp32, half of them across on an edge GPU
    psi, small, N, n = spec.params, spec.small_params, 64, 8
    inter_bw, intra_bw = 100 / 8 * 0.9e9 / 8, 360e9
    engine = 2 * (psi - small) + 2 * psi + 2 * small
    send = 4 * math.ceil(511 / 2) * 64 * spec.embed_dim * 4
    inter = ((N - 1) / N * engine / n + send / 2) / inter_bw
    intra = ((n - 1) / n * engine + send / 2) / intra_bw
    assert row["comm_inter_s"] == pytest.approx(inter, rel=1e-9)
    assert row["comm_intra_s"] == pytest.approx(intra, rel=1e-9)
    assert row["comm_s"] == pytest.approx(inter, rel=1e-9)     # every collective is network-bound here

    # the ZeRO-3 stage's host and hook time (planner.stage_seconds: measured on an H200), one micro-step
    host = ZERO3_MODULE_S * hooked_modules(spec) + ZERO3_TOKEN_S * 64 * tokens_per_sample(spec)
    assert row["host_s"] == pytest.approx(host, rel=1e-9)
    # no overlap: the step is the sum; 10.5M / 32768 = 320.4 steps an epoch
    step = compute + inter + host
    assert row["step_s"] == pytest.approx(step, rel=1e-9)
    assert row["epoch_h"] == pytest.approx(10.5e6 / 32768 * step / 3600, rel=1e-9)
    assert 0.6 < inter / step < 0.8         # the network is most of the step at this size
