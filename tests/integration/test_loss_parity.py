"""Global-batch losses and 'global' accumulation equal one big single-process batch.

For every ZeRO stage on 2 and 3 CPU ranks (one launch per world size runs the three stages),
`parity_worker.py` takes one optimizer step with a client SGD (lr 1, no clipping), so the update
of every parameter is minus its rank-averaged gradient, and compares it with plain torch on the
concatenated batch:
  - siglip (ring) and clip (gathered, local-loss form), k = 1;
  - 'global' accumulation at k = 2 and 3 (k x micro x world samples in one loss);
  - siglip with chunked logits (chunk 3 of 8 rows) under 'global' accumulation;
and two controls that must *not* match (so the comparison can fail): per-rank negatives, and
plain DeepSpeed accumulation at k = 2.
Tolerance: 2e-5 absolute on gradients of magnitude up to ~2 (fp32; observed <= 1.4e-6).
"""

from __future__ import annotations

import json

import pytest

from tests.integration.helpers import ROOT, deepspeed_cmd, free_port, run_checked

pytestmark = pytest.mark.slow
ATOL = 2e-5


@pytest.fixture(scope="module", params=[2, 3], ids=lambda w: f"world{w}")
def parity(request, tmp_path_factory) -> dict:
    """{stage: {case: result}} of one launch on `world` ranks that runs ZeRO-1, 2 and 3."""
    world, out = request.param, tmp_path_factory.mktemp("parity") / "parity.json"
    cmd = deepspeed_cmd() + ["--num_gpus", str(world), "--master_port", str(free_port()),
                             str(ROOT / "tests/integration/parity_worker.py"),
                             "--stages", "1", "2", "3", "--out", str(out)]
    run_checked(cmd)
    result = json.loads(out.read_text())
    assert result["world"] == world
    return result["stages"]


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_distributed_loss_and_global_accumulation_match_the_big_batch(parity, stage):
    cases = parity[str(stage)]
    assert len(cases) == 11
    # the controls are there and flagged, so that the comparison below can fail
    assert sorted(n for n, c in cases.items() if not c["should_match"]) == [
        "clip/global/plain/k2", "clip/local/plain/k1", "siglip/global/plain/k2", "siglip/local/plain/k1"]
    for name, c in cases.items():
        if c["should_match"]:
            assert c["loss"] == pytest.approx(c["ref_loss"], abs=1e-5), name
            assert c["max_abs_err"] < ATOL, (name, c)
        else:   # the controls differ by far more than the tolerance
            assert c["max_abs_err"] > 20 * ATOL, (name, c)
