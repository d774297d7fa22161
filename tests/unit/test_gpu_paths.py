"""The CUDA / NCCL paths a GPU-less review found wrong (issue 27), checked in-process on CPU: qgZ's
gradient dtype, the srun and per-rank GPU-binding launch foot-guns, threads per rank, and the
accelerator (not torch.cuda) deciding pinned memory and the device RNG. What only a GPU can
confirm is listed by benchmarks/gpu/first_run.py."""

from __future__ import annotations

import inspect

import pytest
import torch

from rsclip_ds.config import ConfigError, load_config
from rsclip_ds.profiles import load_profile
from rsclip_ds.resolve import build_ds_config
from rsclip_ds.runtime.distributed import LaunchError, check_launch_env, device_index, set_threads
from rsclip_ds.resolve import Device, auto_threads_per_rank, threads_per_rank
from rsclip_ds.loop import _rng_state, _set_saved_rng, client_state, TrainResult


# --------------------------------------------------------------------------- 1. qgZ under bf16

def _kernel_reads(wire: torch.Tensor) -> torch.Tensor:
    """Stand-in for swizzle_quant's input read (ops/csrc/quantization/pt_binding.cpp: the tensor's
    data_ptr taken as __half*): the bytes, whatever the dtype, as fp16 values."""
    return wire.contiguous().view(torch.float16).float()


def _wire(ds_config: dict, grad: torch.Tensor) -> torch.Tensor:
    """What ZeRO-3 hands all_to_all_quant_reduce: engine.communication_data_type (the config's, else
    the engine dtype), cast in __avg_scatter_grads when it differs from the engine dtype."""
    from deepspeed.runtime.config import get_communication_data_type

    comm = get_communication_data_type(ds_config) or grad.dtype
    return grad.to(comm) if comm != grad.dtype else grad


@pytest.mark.parametrize("precision,dtype", [("bf16", torch.bfloat16), ("fp32", torch.float32)])
def test_qgz_gradients_reach_the_fp16_kernel_as_fp16(precision, dtype):
    run = load_config(None, [f"precision={precision}", "profile=zero3_zeropp"])
    ds = build_ds_config(run, load_profile("zero3_zeropp"), 16, on_gpu=True, local_world_size=8)   # 2 nodes
    grad = torch.tensor([[1e-3, -2e-2], [3e-1, -4.0]], dtype=dtype)
    read = _kernel_reads(_wire(ds, grad))
    # before the fix: bf16 1e-3 was read as 0.814 (fp32: twice the elements, garbage)
    assert read.shape == grad.shape
    torch.testing.assert_close(read, grad.float(), rtol=2e-3, atol=0)


def test_deepspeed_still_casts_before_the_qgz_kernel():
    """The fix rests on stage3's __avg_scatter_grads casting to communication_data_type before
    all_to_all_quant_reduce; a DeepSpeed that stops doing so must fail here, not corrupt silently."""
    from deepspeed.runtime.zero.stage3 import DeepSpeedZeroOptimizer_Stage3

    src = inspect.getsource(DeepSpeedZeroOptimizer_Stage3)
    cast = src.index("full_grads_for_rank = [g.to(communication_data_type) for g in full_grads_for_rank]")
    assert cast < src.index("all_to_all_quant_reduce(full_grads_for_rank", cast)


def test_qgz_refuses_another_wire_dtype_and_others_follow_the_choice():
    run = load_config(None, ["precision=bf16", "profile=zero3_zeropp", "distributed.communication_data_type=bf16"])
    with pytest.raises(ConfigError, match="reads gradients as fp16 only.*communication_data_type=auto"):
        build_ds_config(run, load_profile("zero3_zeropp"), 16, on_gpu=True, local_world_size=8)
    for choice, expect in (("auto", "bf16"), ("fp32", "fp32")):
        run = load_config(None, ["precision=bf16", "profile=zero3", f"distributed.communication_data_type={choice}"])
        assert build_ds_config(run, load_profile("zero3"), 2, on_gpu=False).get("communication_data_type") == expect


def test_planner_gradient_bytes_follow_the_wire_dtype():
    from rsclip_ds.planning.memory import preset_spec
    from rsclip_ds.planning.planner import Budget, step_time

    spec, budget = preset_spec("git-rsclip-base"), Budget(16, 2, 80 * 2**30)
    prof = load_profile("zero2")
    bf16, fp32 = (step_time(spec, prof, "bf16", False, 32, 1, budget, comm=c).comm for c in ("auto", "fp32"))
    assert fp32.total_s > 1.5 * bf16.total_s   # gradients dominate ZeRO-2's traffic: 4 bytes instead of 2


# --------------------------------------------------------------------------- 5. launch foot-guns

def test_srun_tasks_without_a_launcher_are_refused_with_the_command_that_works():
    with pytest.raises(LaunchError, match=r"one of 8 tasks started by srun.*srun --ntasks-per-node=1"):
        check_launch_env({"SLURM_NTASKS": "8", "SLURM_STEP_NUM_TASKS": "8", "SLURM_PROCID": "3"})
    with pytest.raises(ConfigError, match="mpirun"):   # a ConfigError: the CLI's exit code 2
        check_launch_env({"OMPI_COMM_WORLD_SIZE": "4"})
    check_launch_env({"SLURM_STEP_NUM_TASKS": "8", "SLURM_PROCID": "3", "RANK": "3"})   # a launcher set the rank
    check_launch_env({"SLURM_STEP_NUM_TASKS": "1", "SLURM_PROCID": "0"})               # one task: a plain run
    check_launch_env({"SLURM_NTASKS": "8", "SLURM_PROCID": "0"})   # an sbatch script's own shell, not a task of srun


def test_per_rank_gpu_binding_is_refused_naming_the_fix():
    assert device_index(3, 8, None) == 3
    with pytest.raises(LaunchError, match=r"LOCAL_RANK=3 but this rank sees 1 GPU.*CUDA_VISIBLE_DEVICES=3.*--gpu-bind=none"):
        device_index(3, 1, "3")


def test_the_env_example_sets_no_network_interface():
    from pathlib import Path

    lines = (Path(__file__).resolve().parents[2] / "launch/deepspeed_env.example").read_text().splitlines()
    assert not [ln for ln in lines if ln.startswith("NCCL_SOCKET_IFNAME")]


# --------------------------------------------------------------------------- 3. threads per rank

def test_threads_per_rank_share_the_node_with_the_loader_workers():
    assert auto_threads_per_rank(96, 8, 3) == 9
    assert auto_threads_per_rank(96, 8, 11) == 1      # data.num_workers=auto takes the rest
    assert auto_threads_per_rank(2, 4, 0) == 1
    cpu16 = Device("cpu", cores=16)
    assert threads_per_rank("auto", cpu16, 2, 3)[0] == 5
    threads, why = threads_per_rank("auto", Device("cpu", cores=16, omp_threads=2), 2, 3)
    assert threads == 2 and "environment" in why
    assert threads_per_rank(3, Device("cpu", cores=16, omp_threads=2), 2, 3)[0] == 3
    before = torch.get_num_threads()
    try:
        env: dict = {}
        set_threads(5, env)
        assert torch.get_num_threads() == 5 and env["OMP_NUM_THREADS"] == "5"
    finally:
        torch.set_num_threads(before)


# --------------------------------------------------------------------------- 4. the accelerator decides

class _GpuStandIn:
    """DeepSpeed accelerator stand-in: one device generator, the current device's."""
    def __init__(self):
        self.state, self.set_calls = torch.tensor([7], dtype=torch.uint8), []

    def device_name(self):
        return "cuda"

    def current_device(self):
        return 1

    def get_rng_state(self, device_index=None):
        assert device_index is None   # the current device only, as the checkpoint keeps it
        return self.state

    def set_rng_state(self, state, device_index=None):
        assert device_index is None
        self.set_calls.append(state)


class _CpuStandIn(_GpuStandIn):
    def device_name(self):
        return "cpu"

    def get_rng_state(self, device_index=None):
        raise AssertionError("CPU ranks have no device generator to touch")


def test_the_loop_and_the_checkpoint_keep_the_same_device_rng():
    gpu = _GpuStandIn()
    cpu_state, device_state = _rng_state(gpu)
    assert torch.equal(cpu_state, torch.get_rng_state()) and device_state is gpu.state
    assert _rng_state(_CpuStandIn())[1] is None
    # an old checkpoint with every visible device's state: this rank restores its current device's
    _set_saved_rng({"torch": torch.get_rng_state(), "cuda": [torch.tensor([0]), torch.tensor([1])]}, gpu)
    assert [int(s) for s in gpu.set_calls] == [1]
    assert client_state(1, TrainResult(), None)["rng"]["cuda"] is None   # this host's CPU accelerator


def test_pinned_memory_is_the_callers_choice(tmp_path):
    from rsclip_ds.data.loader import build_train_loader
    from rsclip_ds.data.synthetic import make_synthetic
    from rsclip_ds.data.tokenizer import iter_captions, train_tokenizer

    index = make_synthetic(tmp_path, num_train=8, num_val=1, shard_size=4, image_size=32, seed=0, progress=False)
    tok = train_tokenizer(iter_captions([str(tmp_path / s["url"]) for s in index["train"]]), tmp_path / "tok",
                          vocab_size=200, max_length=16)
    run = load_config(None, [f"data.train_shards={index['train_pattern']}", "data.num_workers=0"])
    for pin in (False, True):
        loader = build_train_loader(run.data, tokenizer=tok, image_size=32, max_text_length=16, micro_batch_size=2,
                                    rank=0, world_size=1, seed=0, pin_memory=pin)
        assert loader.pin_memory is pin
