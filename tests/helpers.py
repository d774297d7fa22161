"""Helpers shared by test files: import them from here (`from tests.helpers import ...`), never
from another test file. Fixtures live in the conftest.py files."""

from __future__ import annotations

import io
import signal
import time
from contextlib import contextmanager
from typing import Callable

import numpy as np
from PIL import Image
from webdataset import TarWriter


def write_shards(root, counts, size=16, prefix="s"):
    """Shards of `counts` samples of random-noise JPEGs with two captions each -> brace pattern."""
    rng = np.random.default_rng(0)
    for s, n in enumerate(counts):
        with TarWriter(str(root / f"{prefix}-{s:02d}.tar"), encoder=False, mtime=0) as sink:
            for i in range(n):
                buf = io.BytesIO()
                Image.fromarray(rng.integers(0, 256, (size, size, 3), dtype=np.uint8)).save(buf, "JPEG")
                sink.write({"__key__": f"{prefix}{s}_{i:03d}", "jpg": buf.getvalue(),
                            "txt": f"shard {s} sample {i}\nanother caption {i}".encode()})
    return str(root / f"{prefix}-{{00..{len(counts) - 1:02d}}}.tar")


@contextmanager
def deadline(seconds):
    """A hang fails the test instead of blocking CI."""
    def _raise(*_):
        raise TimeoutError(f"loader did not deliver within {seconds} s (hang)")
    old = signal.signal(signal.SIGALRM, _raise)
    signal.alarm(seconds)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, old)


def wait_for(condition: Callable[[], bool], what: str, timeout: float = 30.0, poll: float = 0.01,
             detail: Callable[[], str] | None = None) -> None:
    """Return as soon as condition() is true; fail naming `what` (and detail(), e.g. an output
    tail) after `timeout` seconds.

    The poll interval only bounds how late we notice; it is never what makes a test pass."""
    end = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > end:
            raise AssertionError(f"timed out after {timeout} s waiting for {what}"
                                 + (f"\n{detail()}" if detail else ""))
        time.sleep(poll)


class LocalEngine:
    """What the train steps use of a DeepSpeed engine, in one process without DeepSpeed:
    forward, backward (gradients accumulate in .grad), step (a no-op: tests read .grad)."""

    def __init__(self, module):
        import torch

        self.module, self.device = module, torch.device("cpu")

    def __call__(self, *inputs):
        return self.module(*inputs)

    def backward(self, loss, scale_wrt_gas: bool = True):
        loss.backward()

    def step(self):
        pass


def planned_zero2(capsys, base: list[str], *sets: str) -> tuple[dict, dict]:
    """`rsclip-ds plan BASE --set S ... --json` run in-process -> (its JSON document, the row of
    zero2 without activation checkpointing): for tests that compare a plan with a setting against
    the plan without it."""
    import argparse
    import json

    from rsclip_ds.cli.plan import register, run

    parser = argparse.ArgumentParser()
    register(parser.add_subparsers(dest="command"))
    capsys.readouterr()
    assert run(parser.parse_args(base + [a for s in sets for a in ("--set", s)])) == 0
    doc = json.loads(capsys.readouterr().out)
    return doc, {(r["profile"], r["checkpointing"]): r for r in doc["rows"]}[("zero2", False)]
