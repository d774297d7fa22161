"""One GPU: samples/s, MFU, HFU and peak memory of our engine per profile x precision, against the
plain PyTorch twin (benchmarks/twin.py) and open_clip's trainer, and the first run on a new GPU
machine (docs/benchmarks/gpu.md).

    run.py        the cases and their driver: each case in its own process, the report
    variants.py   the variants (patch dropout, compile, distill) and twins, and their pairing
    peaks.py      peak FLOP/s and MFU per device, and the device tag of the JSON's name
    first_run.py  the first run on a GPU machine: one command, steps in order, one JSON
    step.sh       the GPU session's one command: run.py's parts in order within a time budget

Entry point: `python -m benchmarks.gpu ...` (__main__.py), the same as `python -m
benchmarks.gpu.run ...`, the form the docs show (tests/unit/test_doc_commands.py reads a
`python -m benchmarks.X.Y` command's flags from benchmarks/X/Y.py); `python -m
benchmarks.gpu.first_run ...`; `bash benchmarks/gpu/step.sh OUT_DIR`.
"""
