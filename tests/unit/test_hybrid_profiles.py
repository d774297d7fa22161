"""The hybrid-sharding profiles (zero3_hpz, zero3_zeropp): the per-node value resolved from the
launch, the refusals, and each resolved config parsed by DeepSpeed's own config classes. The
CPU-rank training parity of hpZ is tests/integration/test_hybrid_sharding.py."""

from __future__ import annotations

import json

import pytest

from rsclip_ds.config import ConfigError, load_config
from rsclip_ds.profiles import NOT_SHIPPED, PER_NODE, available_profiles, load_profile
from rsclip_ds.resolve import build_ds_config, resolve_per_node

HYBRID = {   # profile -> (hpZ on, the CUDA-only switches)
    "zero3_hpz": (True, []),
    "zero3_zeropp": (True, ["zero_quantized_weights", "zero_quantized_gradients"]),
}


def _write(tmp_path, body: dict):
    path = tmp_path / "mine.json"
    path.write_text(json.dumps(body))
    return path


@pytest.mark.parametrize("name", sorted(HYBRID))
def test_hybrid_profile_loads_and_is_documented(name):
    p = load_profile(name)
    hpz, cuda = HYBRID[name]
    assert p.stage == 3 and p.hpz is hpz and not p.offload_optimizer and not p.offload_param
    assert [c.split(":")[0] for c in p.cuda_only] == cuda
    assert p.strategy["zero_optimization"]["zero_hpz_partition_size"] == PER_NODE
    assert name in available_profiles()
    readme = (p.path.parent / "README.md").read_text()
    assert f"`{name}`" in readme


@pytest.mark.parametrize("name", sorted(HYBRID))
@pytest.mark.parametrize("world, per_node", [(16, 8), (4, 2), (8, 8)])
def test_resolved_config_is_accepted_by_deepspeeds_own_config(name, world, per_node):
    """What build_ds_config hands over, per-node value filled in, parsed by DeepSpeedConfig (the
    class deepspeed.initialize builds: it also rejects removed keys) and DeepSpeedZeroConfig."""
    from deepspeed.runtime.config import DeepSpeedConfig
    from deepspeed.runtime.zero.config import DeepSpeedZeroConfig

    run = load_config(None, ["precision=bf16", "batch.micro_batch_size=4", "batch.gradient_accumulation_steps=2"])
    ds = build_ds_config(run, load_profile(name), world, on_gpu=True, local_world_size=per_node)
    assert ds["zero_optimization"]["zero_hpz_partition_size"] == per_node
    zero = DeepSpeedZeroConfig(**ds["zero_optimization"])
    assert zero.stage == 3 and zero.zero_hpz_partition_size == per_node
    assert zero.zero_quantized_weights == zero.zero_quantized_gradients == bool(HYBRID[name][1])
    # without a process group DeepSpeedConfig counts one rank: the batch it checks is one rank's
    parsed = DeepSpeedConfig({**ds, "train_batch_size": 4 * 2})
    assert parsed.zero_config.zero_hpz_partition_size == per_node and parsed.zero_optimization_stage == 3
    assert parsed.bfloat16_config.enabled


def test_per_node_value_comes_from_the_launcher_when_not_given(monkeypatch):
    run = load_config(None, [])
    monkeypatch.setenv("LOCAL_SIZE", "4")   # what the deepspeed launcher sets on each node
    ds = build_ds_config(run, load_profile("zero3_hpz"), 8, on_gpu=True)
    assert ds["zero_optimization"]["zero_hpz_partition_size"] == 4
    monkeypatch.delenv("LOCAL_SIZE")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")   # torchrun's name
    assert build_ds_config(run, load_profile("zero3_hpz"), 8, on_gpu=True)["zero_optimization"][
        "zero_hpz_partition_size"] == 2


def test_unknown_gpus_per_node_is_refused_unless_one_rank(monkeypatch):
    """Outside a launcher (a plain process, `rsclip-ds plan` writing a config for a cluster) the
    GPUs per node are unknown: guessing 1 would switch hpZ off in a config meant for 8-GPU nodes."""
    monkeypatch.delenv("LOCAL_SIZE", raising=False)
    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    run = load_config(None, [])
    with pytest.raises(ConfigError, match="no launcher said how many ranks run per node"):
        build_ds_config(run, load_profile("zero3_hpz"), 8, on_gpu=True)
    one = build_ds_config(run, load_profile("zero3_hpz"), 1, on_gpu=True)   # `rsclip-ds train` alone
    assert one["zero_optimization"]["zero_hpz_partition_size"] == 1
    assert "zero_hpz_partition_size" not in build_ds_config(run, load_profile("zero3"), 8, on_gpu=True)[
        "zero_optimization"]


def test_profiles_without_per_node_values_are_unchanged():
    zero3 = load_profile("zero3")
    assert resolve_per_node(zero3, 6, 4) == zero3.strategy["zero_optimization"]   # no node arithmetic needed
    assert "zero_hpz_partition_size" not in build_ds_config(load_config(None, []), zero3, 6, on_gpu=True,
                                                            local_world_size=4)["zero_optimization"]


@pytest.mark.parametrize("world, per_node", [(6, 4), (3, 2), (2, 0)])
def test_world_that_is_not_whole_nodes_is_refused(world, per_node):
    with pytest.raises(ConfigError, match=rf"{world} ranks are not whole nodes of {per_node}: launch the same number"):
        build_ds_config(load_config(None, []), load_profile("zero3_hpz"), world, on_gpu=True,
                        local_world_size=per_node)


def test_quantized_profile_is_refused_on_cpu_ranks_with_the_reason():
    with pytest.raises(ConfigError, match="needs DeepSpeed's CUDA quantizer kernels for zero_quantized_weights"):
        build_ds_config(load_config(None, []), load_profile("zero3_zeropp"), 4, on_gpu=False, local_world_size=2)


def test_cpu_accelerator_really_lacks_the_quantizer():
    """The refusal above is DeepSpeed's fact, not ours: the CPU accelerator has no QuantizerBuilder
    (qwZ loads it in zero.Init, qgZ at the first reduction between nodes)."""
    from deepspeed.accelerator import get_accelerator

    if get_accelerator().device_name() != "cpu":
        pytest.skip("this checks the CPU accelerator")
    builder = get_accelerator().create_op_builder("QuantizerBuilder")
    with pytest.raises(ValueError, match="not been implemented on CPU backend"):
        builder.load()


@pytest.mark.parametrize("zero, fragment", [
    ({"stage": 3, "stage3_max_live_parameters": PER_NODE}, "['stage3_max_live_parameters'] cannot be 'local_world_size'"),
    ({"stage": 2, "zero_hpz_partition_size": PER_NODE}, "work only at ZeRO-3 (DeepSpeed ignores them at stage 2)"),
    ({"stage": 1, "zero_quantized_gradients": True}, "['zero_quantized_gradients'] work only at ZeRO-3"),
    ({"stage": 3, "zero_hpz_partition_size": "per_node"}, "zero_hpz_partition_size: Input should be a valid integer"),
    ({"stage": 3, "mics_shard_size": 8}, "MiCS ZeRO-3 sharding has been removed"),
])
def test_bad_hybrid_keys_are_refused_when_the_profile_loads(tmp_path, zero, fragment):
    with pytest.raises(ConfigError) as err:
        load_profile(str(_write(tmp_path, {"zero_optimization": zero})))
    assert fragment in str(err.value)


def test_fixed_partition_size_is_still_allowed(tmp_path):
    p = load_profile(str(_write(tmp_path, {"zero_optimization": {"stage": 3, "zero_hpz_partition_size": 8}})))
    assert p.hpz and build_ds_config(load_config(None, []), p, 16, on_gpu=True,
                                     local_world_size=8)["zero_optimization"]["zero_hpz_partition_size"] == 8


def test_top_level_key_deepspeed_removed_is_refused_with_its_message(tmp_path):
    with pytest.raises(ConfigError, match="Sparse compression of dense torch.nn.Embedding gradients has been removed"):
        load_profile(str(_write(tmp_path, {"zero_optimization": {"stage": 2}, "sparse_gradients": True})))


@pytest.mark.parametrize("name, fragment", [("zero3_mics", "MiCS .* was removed from DeepSpeed"),
                                            ("zero1_onebit_adam", "1-bit Adam, 0/1 Adam and 1-bit LAMB are not in")])
def test_profiles_deepspeed_cannot_run_say_why(name, fragment):
    assert name in NOT_SHIPPED and name not in available_profiles()
    with pytest.raises(ConfigError, match=f"profile '{name}' is not shipped: {fragment}"):
        load_profile(name)


def test_deepspeed_has_no_compressed_optimizer_or_mics():
    """The facts NOT_SHIPPED states, checked against the installed DeepSpeed: a later version that
    brings them back fails this test, and the profiles can be written then."""
    import deepspeed
    from deepspeed.runtime import config as ds_config

    assert not {"onebitadam", "zerooneadam", "onebitlamb"} & {n.lower() for n in ds_config.DEEPSPEED_OPTIMIZERS}
    assert "mics_shard_size" in ds_config._REMOVED_ZERO_CONFIG_KEYS
    assert not hasattr(deepspeed.runtime.fp16, "onebit")


def test_profiles_command_lists_the_hybrid_profiles_with_what_they_need(capsys, monkeypatch):
    from rsclip_ds.cli import main

    monkeypatch.setenv("COLUMNS", "250")   # rich wraps to the terminal: one line per profile
    assert main(["profiles"]) == 0
    lines = {line.split()[1]: line for line in capsys.readouterr().out.splitlines()
             if line.startswith(("│ zero", "│ ddp"))}
    assert set(lines) == set(available_profiles())
    assert "hpZ" in lines["zero3_hpz"] and "CUDA" not in lines["zero3_hpz"]
    assert "hpZ" in lines["zero3_zeropp"] and "CUDA" in lines["zero3_zeropp"]
    assert "hpZ" not in lines["zero3"]


def test_profile_sweeps_leave_out_only_what_the_accelerator_cannot_run():
    from rsclip_ds.profiles import runnable_profiles

    assert runnable_profiles(on_gpu=True) == available_profiles()
    assert runnable_profiles(on_gpu=False) == [n for n in available_profiles() if n != "zero3_zeropp"]
