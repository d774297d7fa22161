"""Stage 0's overlapped all-reduce (rsclip_ds/gradients.py) on 2 forked gloo ranks, without DeepSpeed:
the gradients after the boundary backward are the mean of the ranks' own, bucket by bucket, in the
wire dtype each parameter asks for; the micro-batches before the boundary accumulate locally; a
parameter one rank never used still gets the average; the buckets exist only during that backward."""

from __future__ import annotations

import torch

from tests.unit.forked_ranks import run_ranks


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.LayerNorm(16), torch.nn.Linear(16, 4))
    for p in model[0].parameters():   # what DeepSpeed's torch_autocast setup marks: Linear/Conv in 16 bits
        p.comm_dtype = torch.bfloat16
    return model



def _run(rank: int, world: int) -> dict:
    from rsclip_ds.gradients import GradientBuckets

    model = _model()
    extra = torch.nn.Parameter(torch.ones(3))   # used by rank 0 only
    params = list(model.parameters()) + [extra]
    boundary = {"now": False}
    buckets = GradientBuckets(params, bucket_elements=100, default_dtype=torch.float32,
                              boundary=lambda: boundary["now"])
    g = torch.Generator().manual_seed(rank)
    xs = [torch.randn(5, 8, generator=g) for _ in range(2)]
    local = []
    for i, x in enumerate(xs):   # two micro-batches: the first accumulates locally, the second reduces
        boundary["now"] = i == 1
        loss = model(x).square().mean() + ((extra * 2).sum() if rank == 0 else 0)
        loss.backward()
        if i == 0:
            local = [p.grad.clone() for p in model.parameters()]   # after micro-batch 1: not reduced
    return {"grads": [p.grad.tolist() for p in model.parameters()], "extra": extra.grad.tolist(),
            "after_first": [t.tolist() for t in local], "elements": buckets.elements,
            "buckets": len(buckets.buckets), "freed": all(b.buffer is None for b in buckets.buckets)}


def test_the_boundary_backward_averages_every_gradient_over_the_ranks_in_its_wire_dtype(tmp_path):
    ranks = run_ranks(_run, 2, tmp_path)
    for r in ranks:
        assert "value" in r, r.get("traceback")
    a, b = ranks[0]["value"], ranks[1]["value"]
    # the reference: each rank's own accumulated gradients, computed here again on one thread as the forked
    # ranks run (another thread count sums the backward's reductions in another order), averaged
    refs, threads = [], torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        for rank in (0, 1):
            model = _model()
            g = torch.Generator().manual_seed(rank)
            for x in [torch.randn(5, 8, generator=g) for _ in range(2)]:
                model(x).square().mean().backward()
            refs.append([p.grad for p in model.parameters()])
    finally:
        torch.set_num_threads(threads)
    mean = [(x / 2 + y / 2) for x, y in zip(*refs)]   # each rank divides by the world, then the sum
    # the first Linear travels in bf16: each rank's gradient rounded to bf16, halved (exact), summed in bf16
    wire = [(x.bfloat16() * 0.5 + y.bfloat16() * 0.5).float() for x, y in zip(*refs)]
    for got in (a, b):
        for i, (g, m, w) in enumerate(zip(got["grads"], mean, wire)):
            assert torch.equal(torch.tensor(g), w if i < 2 else m), i
            if i < 2:   # and bf16's rounding away from the fp32 mean
                assert not torch.equal(w, m) and torch.allclose(w, m, rtol=2 ** -7, atol=2 ** -12)
        assert got["extra"] == [2.0, 2.0, 2.0]   # rank 0: 2 per micro-batch, twice; rank 1: zeros; averaged
        assert got["elements"] == {"bfloat16": 8 * 16 + 16, "float32": 16 + 16 + 16 * 4 + 4 + 3}
        assert got["buckets"] >= 3 and got["freed"]   # 100 elements per bucket: the fp32 ones split
    assert a["grads"] == b["grads"]
    # the first micro-batch was not reduced: each rank kept its own gradient
    assert a["after_first"] != b["after_first"]
