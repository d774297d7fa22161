"""The cases of benchmarks/throughput/openclip.py and the command line of each tool for a case.

A case is a tool at a precision (rsclip_ds: and a profile), optionally with a *peer* feature turned
on at the same settings on both sides (PEERS): open_clip's own flag against rsclip_ds's config key,
or a variable in both launches' environment (PEER_ENV).

Two ways to launch (`style`):
  harness  both tools get OMP_NUM_THREADS=<threads> from the driver (the committed results' way)
  users    nothing is set for threads: each tool's own default decides (torchrun sets
           OMP_NUM_THREADS=1 for every rank when it starts more than one and none is set;
           `rsclip-ds train` picks distributed.threads_per_rank=auto: cores / ranks less the
           rank's loader workers, at least 1); rsclip_ds keeps its default end-of-run checkpoint and
           open_clip its default --save-frequency 1 (a checkpoint at the epoch's end), both after
           the timed steps. Model, data, optimizer, schedule, loader workers and a log line every
           step stay as in the harness style: they are the like-for-like settings, and the rate is
           read from every step's line.
"""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass
from pathlib import Path

from benchmarks.harness import ROOT, deepspeed_cmd

OPENCLIP_MAIN = Path(__file__).resolve().parent / "openclip_main.py"
# --open-clip kit: open_clip from the GPU kit's wheels (../shared/gpu/kit.sh), not from a venv
KIT = Path("kit")
OPENCLIP_PRECISIONS = ("fp32", "amp_bf16", "pure_bf16")
# rsclip_ds precision -> the open_clip precisions it is compared with. amp_bf16 keeps fp32 weights
# and optimizer state as DeepSpeed's bf16 does (fp32 masters); pure_bf16 holds bf16 weights and
# AdamW states, no fp32 copy: less work per step, another numerical recipe. rsclip_ds's amp_bf16
# is open_clip's recipe itself (fp32 weights, the forward under torch.autocast in bf16): the
# planner's pick on one GPU (ddp, amp_bf16; benchmarks/gpu/run.py --planner-pick).
PAIRED = {"fp32": ("fp32",), "bf16": ("amp_bf16", "pure_bf16"), "bf16_masters": ("pure_bf16",),
          "amp_bf16": ("amp_bf16",)}
# rsclip_ds's pure-bf16 recipe: bf16 masters and AdamW states (docs/guides/precision.md)
RSCLIP_SETS = {"fp32": ["precision=fp32"], "bf16": ["precision=bf16"],
               "bf16_masters": ["precision=bf16", "bf16.master_weights=bf16"], "amp_bf16": ["precision=amp_bf16"]}
# a feature both tools have, at the same setting: open_clip_train flags, rsclip_ds --set overrides
PEERS = {
    # FLIP patch dropout, half the image tokens: timm's PatchDropout (open_clip --force-patch-dropout
    # on a timm tower) against rsclip_ds/model.py
    "patch_dropout": (["--force-patch-dropout", "0.5"], ["model.patch_dropout=0.5"]),
    # torch.compile of the model: open_clip compiles the model it wraps in DDP; rsclip_ds's key
    # (compile.enabled) comes with its own compile support
    "compile": (["--torchcompile"], ["compile.enabled=true"]),
    # torch's CPU allocator backing tensors of 2 MiB and more with transparent huge pages
    # (PEER_ENV): rsclip-ds train on CPU ranks asks for it by default; open_clip's users would have
    # to export the variable. No flag on either side: both launches get the variable.
    "huge_pages": ([], []),
}
# a peer's variables, in both tools' launch environments
PEER_ENV = {"huge_pages": {"THP_MEM_ALLOC_ENABLE": "1"}}
STYLES = ("harness", "users")


@dataclass(frozen=True)
class Case:
    tool: str                   # "open_clip" or "rsclip_ds"
    precision: str              # open_clip's --precision, or rsclip_ds's precision
    profile: str | None = None  # rsclip_ds: a ds_profiles/ name
    peer: str | None = None     # a PEERS key: that feature on, on both sides

    @property
    def name(self) -> str:
        name = "/".join(x for x in (self.tool, self.profile, self.precision) if x)
        return f"{name}+{self.peer}" if self.peer else name

    def partners(self) -> list[str]:
        """rsclip_ds: the names of the open_clip cases it is compared with (the same peer)."""
        return [Case("open_clip", p, peer=self.peer).name for p in PAIRED[self.precision]]


def cases(openclip_precisions, profiles, precisions, peers=(), peer_profile: str = "zero2",
          peer_precisions=None, base: bool = True) -> list[Case]:
    """The run order within a repeat: each open_clip case right before the rsclip_ds cases
    compared with it (the same machine state for a pair). Peers: for each peer and each of
    `peer_precisions` (default `precisions`), its first open_clip partner and rsclip_ds at
    `peer_profile`, both with the peer on. `base` False: the peer cases only."""
    out: list[Case] = []
    if base:
        for precision in precisions:   # an open_clip case paired twice (bf16, bf16_masters) runs once
            out += [c for p in PAIRED[precision] if p in openclip_precisions and (c := Case("open_clip", p)) not in out]
            out += [Case("rsclip_ds", precision, profile) for profile in profiles]
        out += [Case("open_clip", p) for p in openclip_precisions if Case("open_clip", p) not in out]
    for peer in peers:
        for precision in precisions if peer_precisions is None else peer_precisions:
            out += [c for c in (Case("open_clip", PAIRED[precision][0], peer=peer),
                                Case("rsclip_ds", precision, peer_profile, peer)) if c not in out]
    return out


def tool_env(tool: str, device: str, threads: int | None, peer: str | None = None) -> dict[str, str]:
    """The launch environment; `threads` None (the users style): no OMP_NUM_THREADS at all, not
    even one inherited from the driver's environment, so each tool's own default decides. Nor an
    inherited THP_MEM_ALLOC_ENABLE: only the `peer`'s PEER_ENV sets it (rsclip_ds's entry point
    decides otherwise)."""
    env = dict(os.environ, PYTHONUNBUFFERED="1", HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false")
    env.pop("OMP_NUM_THREADS", None)
    env.pop("THP_MEM_ALLOC_ENABLE", None)
    env.update(PEER_ENV.get(peer, {}))
    if threads is not None:
        env["OMP_NUM_THREADS"] = str(threads)
    for key in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_SIZE", "MASTER_ADDR", "MASTER_PORT", "DS_ACCELERATOR"):
        env.pop(key, None)
    if tool == "rsclip_ds":
        # the ranks import this tree, whatever an install points at; what else the path held stays
        # (the GPU kit's wheels: deepspeed, pydantic, webdataset 1.x)
        env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p)
        if device == "cpu":
            env["DS_ACCELERATOR"] = "cpu"
    else:
        env.pop("PYTHONPATH", None)     # the venv sees nothing of this environment
    return env


def openclip_python(venv: Path) -> list[str]:
    """The command that runs open_clip's Python: VENV/bin/python, or for KIT this Python with
    PYTHONPATH=$OPENCLIP_PYTHONPATH (the kit installs open_clip, timm and webdataset 0.2.86 apart
    from ours; tool_env drops our PYTHONPATH, `env` sets the kit's)."""
    if venv == KIT:
        return ["env", f"PYTHONPATH={os.environ['OPENCLIP_PYTHONPATH']}", sys.executable]
    return [str(venv / "bin" / "python")]


def openclip_cmd(bench, case: Case, inputs, port: int, name: str, style: str = "harness") -> list[str]:
    """torchrun + openclip_main.py (open_clip_train.main.main with the model registered)."""
    from benchmarks.throughput.openclip_shapes import SHAPES

    shape = SHAPES[bench.shape]
    # harness: no checkpoint, and no log folder beyond ./none/NAME/; users: open_clip's default
    # --save-frequency 1 into the run's folder
    saving = ["--openclip-logs", "none", "--save-frequency", "0"] if style == "harness" else ["--openclip-logs", "."]
    return [*openclip_python(inputs.venv), "-m", "torch.distributed.run", "--nproc_per_node", str(bench.ranks),
            "--master_port", str(port), str(OPENCLIP_MAIN), "--model-dir", str(inputs.openclip_dir), *saving,
            "--model", shape.openclip_name, "--siglip", "--precision", case.precision, "--device", bench.device,
            "--train-data", inputs.train_pattern, "--dataset-type", "webdataset",
            "--train-num-samples", str(bench.steps * bench.micro * bench.ranks), "--epochs", "1",
            "--batch-size", str(bench.micro), "--workers", str(bench.workers),
            "--lr", str(bench.lr), "--beta1", "0.9", "--beta2", "0.98", "--eps", "1e-6", "--wd", str(bench.weight_decay),
            "--warmup", str(bench.warmup), "--grad-clip-norm", str(bench.grad_clip), "--seed", "0",
            "--image-mean", "0.5", "0.5", "0.5", "--image-std", "0.5", "0.5", "0.5",
            "--log-every-n-steps", "1", "--zeroshot-frequency", "0",
            "--val-frequency", "0", "--report-to", "none", "--name", name,
            *(["--grad-checkpointing"] if bench.checkpointing else []),
            *(PEERS[case.peer][0] if case.peer else [])]


def rsclip_cmd(bench, case: Case, inputs, port: int, out_dir: Path, style: str = "harness") -> list[str]:
    sets = [f"profile={case.profile}", *RSCLIP_SETS[case.precision], f"steps={bench.steps}", "seed=0",
            f"output_dir={out_dir}", f"model.pretrained={inputs.hf_folder}", "loss.name=siglip",
            "loss.negatives=global", f"batch.micro_batch_size={bench.micro}", "batch.gradient_accumulation_steps=1",
            f"data.train_shards={inputs.train_pattern}", f"data.num_workers={bench.workers}",
            "data.random_resized_crop=[0.9,1.0]", f"optim.lr={bench.lr}", "optim.betas=[0.9,0.98]",
            "optim.eps=1e-6", f"optim.weight_decay={bench.weight_decay}", f"optim.warmup_steps={bench.warmup}",
            f"optim.gradient_clipping={bench.grad_clip}", "logging.log_every=1", "logging.progress=plain",
            *(["checkpoint.at_end=false"] if style == "harness" else []),
            *(["model.activation_checkpointing=true"] if bench.checkpointing else []),
            *(PEERS[case.peer][1] if case.peer else [])]
    return deepspeed_cmd() + ["--num_gpus", str(bench.ranks), "--master_port", str(port), "--module", "rsclip_ds",
                              "train"] + [a for s in sets for a in ("--set", s)]
