"""The peak memory per rank at real scale: benchmarks/memory/per_rank.py on git-rsclip-base (203M
parameters), 2 CPU ranks, fp32, micro 2, accumulation 4, for ZeRO-1 (which holds the full
gradients between micro-steps when it accumulates) and ZeRO-3 (which keeps its prefetched
parameters gathered from forward to backward): the measured peak of the second optimizer step
(the resident set's high-water mark, benchmarks/memory/peak.py) against `memory.peak`, evaluated
here from the test's own batch bytes. ~2-3 minutes on 2 idle cores (four engine builds of the
203M model), ~4 GiB per rank.

The two sides of the comparison differ in what they depend on. Below: the resident set holds at
least the live tensors, and the model counts those (the tensor bytes of the tiny preset match it
within 10-15%, tests/integration/test_benchmark_memory.py): a peak below 85% of the prediction
means the model over-counts, on any machine. Above: what the resident set holds beyond the tensors (malloc's
arenas and fragmentation, transparent huge pages, BLAS and gloo buffers) is the machine's: 11-12%
on the machine of benchmarks/results/memory_peak_base.json, against the benchmark's own 15%
target. Allowed here is 30%, which a prediction that left out a whole term still exceeds
(ZeRO-3's gathered weights are 23% of its peak: 1.11 / 0.77 = 1.44)."""

from __future__ import annotations

import pytest

from rsclip_ds.planning import memory
from rsclip_ds.profiles import load_profile
from tests.integration.benchmark_helpers import run_benchmark

pytestmark = pytest.mark.slow
W, MICRO, K, PRESET = 2, 2, 4, "git-rsclip-base"
BELOW, ABOVE = 0.85, 1.30   # measured / predicted (see the module docstring)


@pytest.fixture(scope="module")
def report(tmp_path_factory) -> dict:
    tmp = tmp_path_factory.mktemp("peak")
    return run_benchmark("memory.per_rank", "--preset", PRESET, "--precision", "fp32", "--steps", "1", "--micro", str(MICRO),
                         "--profiles", "zero1", "zero3", "--accumulation", str(K), out=tmp / "peak.json", ranks=W,
                         timeout=900)


@pytest.mark.parametrize("profile", ["zero1", "zero3"])
def test_peak_holds_the_models_bytes_and_not_much_more(report, profile):
    row = next(r for r in report["profiles"] if r["profile"] == profile)
    (measured,) = row["peaks"]
    assert measured["accumulation"] == K
    spec = memory.preset_spec(PRESET)
    config = memory._config(spec)
    # the benchmark's batches: float32 pixels and int64 token ids
    per_sample = 4 * 3 * config.vision_config.image_size ** 2 + 8 * config.text_config.max_position_embeddings
    prof = load_profile(profile)
    predicted = memory.peak(spec, prof, "fp32", W, W, micro=MICRO, accumulation_steps=K,
                            checkpointing=prof.activation_checkpointing, accumulation="plain", device="cpu",
                            input_bytes=per_sample)
    assert BELOW * predicted.host <= measured["measured"] <= ABOVE * predicted.host, (measured, predicted)
    if profile == "zero1":   # accumulating, it holds all of the gradients, not its partition
        assert predicted.gradients == 4 * (spec.params - -(-spec.params // W))
    else:                    # prefetching keeps all of the weights gathered
        assert predicted.gathered == 4 * spec.params
