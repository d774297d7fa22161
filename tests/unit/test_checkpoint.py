"""Checkpoint bookkeeping without a process group: pointer, resolution, pruning, resume
errors, the loop's non-finite rule and the history round trip."""

from __future__ import annotations

import json
import math

import pytest
import torch

from rsclip_ds.checkpoint import (META, POINTER, Checkpointer, complete_tags, prepare_fresh_root, read_pointer, resume_tag,
                                  resolve_checkpoint, tag_for, weights_only_loads, _atomic_write)
from rsclip_ds.config import CheckpointConfig, ConfigError, load_config
from rsclip_ds.loop import NonFiniteLoss, TrainResult, _sync


def _fake_run(tmp_path, steps=(4, 8, 12), incomplete=(16,), pointer=12):
    out = tmp_path / "run"
    root = out / "checkpoints"
    for s in steps + incomplete:
        (root / tag_for(s)).mkdir(parents=True)
        (root / tag_for(s) / "mp_rank_00_model_states.pt").write_bytes(b"x")
    for s in steps:
        (root / tag_for(s) / META).write_text(json.dumps({"step": s, "world_size": 2}))
    if pointer:
        (root / POINTER).write_text(tag_for(pointer) + "\n")
    return out, root


def test_tags_sort_by_step():
    assert tag_for(40) == "step00000040" and sorted([tag_for(100), tag_for(20)]) == [tag_for(20), tag_for(100)]


def test_resolve_checkpoint_accepts_output_dir_root_and_tag_folder(tmp_path):
    out, root = _fake_run(tmp_path)
    assert resolve_checkpoint(out) == (root, "step00000012")
    assert resolve_checkpoint(root) == (root, "step00000012")
    assert resolve_checkpoint(root / "step00000008") == (root, "step00000008")
    with pytest.raises(FileNotFoundError, match="incomplete checkpoint"):
        resolve_checkpoint(root / "step00000016")
    with pytest.raises(FileNotFoundError, match="no complete checkpoint"):
        resolve_checkpoint(tmp_path / "elsewhere")


def test_atomic_write_replaces_and_leaves_no_temp_file(tmp_path):
    _atomic_write(tmp_path / POINTER, "step00000004\n")
    _atomic_write(tmp_path / POINTER, "step00000008\n")
    assert read_pointer(tmp_path) == "step00000008"
    assert [p.name for p in tmp_path.iterdir()] == [POINTER]


def test_prune_keeps_the_newest_complete_and_newer_incomplete(tmp_path):
    out, root = _fake_run(tmp_path, steps=(4, 8, 12), incomplete=(2, 16))
    ck = Checkpointer(CheckpointConfig(keep_last=2), root, rank=0, world_size=2, run_config={})
    ck._prune()
    assert sorted(p.name for p in root.iterdir() if p.is_dir()) == ["step00000008", "step00000012", "step00000016"]
    assert complete_tags(root) == ["step00000008", "step00000012"]


def test_resume_names_what_exists(tmp_path):
    _, root = _fake_run(tmp_path)
    assert resume_tag(root, "latest") == resume_tag(root, "auto") == "step00000012"
    assert resume_tag(root, "step00000004") == "step00000004"
    with pytest.raises(ConfigError, match="complete ones: step00000004, step00000008, step00000012"):
        resume_tag(root, "step00000016")
    with pytest.raises(ConfigError, match="expected 'auto', 'latest' or a tag"):
        resume_tag(root, "last")
    with pytest.raises(ConfigError, match="no complete checkpoint.*--resume auto"):
        resume_tag(tmp_path / "none", "latest")
    assert resume_tag(tmp_path / "none", "auto") is None    # auto: a fresh start


def test_a_fresh_run_refuses_another_runs_checkpoints_or_moves_them_aside(tmp_path):
    _, root = _fake_run(tmp_path)
    with pytest.raises(ConfigError, match=r"another run \(step00000004 \.\. step00000012\).*--resume auto.*"
                                          r"checkpoint.overwrite=true"):
        prepare_fresh_root(root, overwrite=False, rank=0)
    prepare_fresh_root(root, overwrite=True, rank=0)
    assert not root.exists()
    aside, = root.parent.glob("checkpoints.replaced-*")
    assert complete_tags(aside) == ["step00000004", "step00000008", "step00000012"]   # nothing deleted
    prepare_fresh_root(root, overwrite=False, rank=0)    # nothing there now: no complaint
    prepare_fresh_root(tmp_path / "never", overwrite=False, rank=0)


def test_due_steps(tmp_path):
    ck = Checkpointer(CheckpointConfig(every=4), tmp_path, rank=0, world_size=1, run_config={})
    assert [s for s in range(1, 11) if ck.due(s, 10)] == [4, 8, 10]
    ck = Checkpointer(CheckpointConfig(every=0, at_end=False), tmp_path, rank=0, world_size=1, run_config={})
    assert not any(ck.due(s, 10) for s in range(1, 11))


class Evil:   # any class outside the allow-list: unpickling it could run code
    pass


def test_weights_only_loads_refuses_arbitrary_objects(tmp_path):
    torch.save({"x": torch.ones(2), "evil": Evil()}, tmp_path / "bad.pt")
    torch.save({"x": torch.ones(2), "rng": torch.get_rng_state()}, tmp_path / "good.pt")
    with weights_only_loads():
        assert torch.load(tmp_path / "good.pt", weights_only=False)["x"].sum() == 2
        with pytest.raises(Exception, match="Weights only load failed"):
            torch.load(tmp_path / "bad.pt", weights_only=False)
    assert torch.load is torch.serialization.load   # restored


def test_consecutive_skipped_steps_stop_the_run_and_fp16_only_counts_them():
    from dataclasses import replace

    from tests.unit.fake_engine import FakeEngine, fake_batches, fault_plan, run_loop

    once = run_loop(FakeEngine(), fake_batches(), 6, 2, faults=fault_plan("inject_nan_at_step=1",
                                                                             "inject_nan_steps=1",
                                                                             "max_nonfinite_steps=2"))
    assert once.skipped == [1] and len(once.losses) == 6   # one skip, then finite steps: the count restarts
    faults = fault_plan("inject_nan_at_step=3", "max_nonfinite_steps=2")
    with pytest.raises(NonFiniteLoss, match=r"2 consecutive steps \(3..4\); each was skipped \(the weights are "
                                           r"those after step 2\)"):
        run_loop(FakeEngine(), fake_batches(), 8, 2, faults=faults)
    fp16 = run_loop(FakeEngine(), fake_batches(), 8, 2, faults=replace(faults, count_nonfinite=False))
    assert fp16.skipped_steps == 6 and fp16.skipped == []   # the loss scaler's skips: no count, no stop


def test_sync_on_one_process_means_losses_sums_counts_and_flags():
    losses, bad, stop, load = _sync([torch.tensor(1.5), torch.tensor(2.5)], {"decode": 3, "caption": 0}, True)
    assert losses == [1.5, 2.5] and bad == {"decode": 3, "caption": 0} and stop is True and load == []
    assert _sync([torch.tensor(math.nan)], {}, False)[2] is False
    # the per-rank load numbers come back as one row per rank (one rank here), bytes exact past 2**24
    _, bad, stop, load = _sync([torch.tensor(1.0)], {"decode": 1}, False, [0.5, 0.125, 2.0**40 + 1])
    assert load == [[0.5, 0.125, 2.0**40 + 1]] and bad == {"decode": 1} and stop is False


def test_train_result_round_trip_keeps_the_history():
    r = TrainResult(losses=[3.0, 2.0], lrs=[0.0, 1e-3], evals=[{"step": 2, "r@1": 0.5}], resumed_from=[1])
    back = TrainResult.from_dict(json.loads(json.dumps(r.to_dict())))
    assert back == r


def test_checkpoint_and_fault_keys_validate():
    run = load_config(None, ["checkpoint.every=50", "checkpoint.resume=latest", "faults.peer_timeout_s=5"])
    assert (run.checkpoint.every, run.checkpoint.resume, run.faults.peer_timeout_s) == (50, "latest", 5.0)
    with pytest.raises(ConfigError, match="checkpoint.bogus: unknown key; allowed here: at_end, every"):
        load_config(None, ["checkpoint.bogus=1"])


def test_a_pointer_to_a_tag_that_lost_its_meta_falls_back_to_the_newest_complete(tmp_path):
    """Resumed from an older tag, a run re-saves a newer tag; killed meanwhile, the pointer names
    a tag without meta: the newest complete one is used instead."""
    out, root = _fake_run(tmp_path, steps=(4, 8), incomplete=(12,), pointer=12)
    assert resolve_checkpoint(out) == (root, "step00000008")
    assert resume_tag(root, "latest") == "step00000008"


# --------------------------------------------------------------------------- another number of ranks

def _tag_of_ranks(tmp_path, world: int, data=lambda r: {"position": 10 + r}):
    """A complete tag written by ``world`` ranks: meta, each rank's client file, the history."""
    from rsclip_ds.checkpoint import HISTORY, RANK_FILE

    root = tmp_path / "checkpoints"
    tag_dir = root / tag_for(4)
    tag_dir.mkdir(parents=True)
    (tag_dir / META).write_text(json.dumps({"step": 4, "world_size": world}))
    for r in range(world):
        torch.save({"step": 4, "data": data(r), "rng": {"torch": torch.get_rng_state(), "cuda": None}},
                   tag_dir / RANK_FILE.format(r))
    (tag_dir / HISTORY).write_text(json.dumps(TrainResult(losses=[4.0, 3.0, 2.0, 1.0]).to_dict()))
    return root, tag_dir


def test_universal_loading_is_decided_by_the_saved_world_size(tmp_path):
    from rsclip_ds.config import load_config
    from rsclip_ds.profiles import load_profile
    from rsclip_ds.reshard import saved_run
    from rsclip_ds.resolve import World, deepspeed_config, resolve

    def plan(world: int, saved):
        r = resolve(load_config(None, []), load_profile("zero2"), World(world, world), saved=saved)
        return r.resume.mode, deepspeed_config(r).get("checkpoint", {}).get("load_universal", False)

    root, tag_dir = _tag_of_ranks(tmp_path, world=2)
    # stage 0 (the ddp profile): one file holds the whole model and optimizer, which any world loads as it is
    assert plan(3, saved_run(root, tag_for(4))) == ("whole", False)
    for r in range(2):   # ZeRO: each rank's partition of the optimizer state
        (tag_dir / f"zero_pp_rank_{r}_mp_rank_00_optim_states.pt").write_bytes(b"")
    saved = saved_run(root, tag_for(4))
    assert plan(2, saved) == ("same", False) and plan(3, saved) == ("universal", True)
    assert plan(3, None) == ("fresh", False)   # a fresh start


def test_new_ranks_get_every_old_ranks_data_a_derived_seed_and_the_history(tmp_path):
    from rsclip_ds.reshard import derived_seed, resharded_client_state
    from rsclip_ds.loop import restore_client_state

    _, tag_dir = _tag_of_ranks(tmp_path, world=2)
    states = [resharded_client_state(tag_dir, 2, rank, 4, seed=7) for rank in range(3)]
    assert all(s["data"] == {"remap_from": [{"position": 10}, {"position": 11}]} for s in states)
    seeds = [s["rng"]["seed"] for s in states]
    assert seeds == [derived_seed(7, 4, r) for r in range(3)] and len(set(seeds)) == 3
    assert derived_seed(7, 4, 0) != derived_seed(8, 4, 0) != derived_seed(7, 5, 0)
    assert 0 <= min(seeds) and max(seeds) < 2 ** 63
    step, result = restore_client_state(states[1])
    assert step == 4 and result.losses == [4.0, 3.0, 2.0, 1.0] and result.resumed_from == [4]
    first = torch.rand(3)
    restore_client_state(states[1])
    assert torch.equal(torch.rand(3), first)   # the same stream on every resume of that tag and size


def test_no_loader_state_stays_none(tmp_path):
    from rsclip_ds.reshard import resharded_client_state

    _, tag_dir = _tag_of_ranks(tmp_path, world=2, data=lambda r: None)
    assert resharded_client_state(tag_dir, 2, 0, 4, seed=0)["data"] is None


def test_a_world_size_change_needs_an_engine_built_for_universal_loading(tmp_path):
    from rsclip_ds.reshard import load_resharded

    root, tag_dir = _tag_of_ranks(tmp_path, world=2)
    for r in range(2):   # ZeRO partitions (a stage-0 tag loads on any world as it is)
        (tag_dir / f"zero_pp_rank_{r}_mp_rank_00_optim_states.pt").write_bytes(b"")

    class Engine:   # what deepspeed.initialize made without checkpoint.load_universal
        def load_universal_checkpoint(self):
            return False

    ck = Checkpointer(CheckpointConfig(), root, rank=0, world_size=3, run_config={"seed": 0})
    with pytest.raises(ConfigError, match="written by 2 ranks, this run has 3: load it with rsclip_ds.reshard"):
        ck.load(Engine(), "latest")
    with pytest.raises(ConfigError,
                       match=r"written by 2 ranks, this run has 3: build the engine from deepspeed_config\(resolve"):
        load_resharded(ck, Engine(), "latest")


def test_a_resave_drops_the_old_conversion(tmp_path):
    """A tag saved again (a run resumed from an older tag) must not keep the universal folder
    converted from its previous shards."""
    from rsclip_ds.checkpoint import UNIVERSAL_DIR, UNIVERSAL_DONE

    root, tag_dir = _tag_of_ranks(tmp_path, world=1)
    (tag_dir / UNIVERSAL_DIR).mkdir()
    (tag_dir / UNIVERSAL_DIR / UNIVERSAL_DONE).write_text("{}")

    class Engine:   # what a save reads: the weights it checks (finite.check_weights), then save_checkpoint
        module, optimizer = torch.nn.Linear(2, 1), None

        def save_checkpoint(self, *args, **kwargs):
            pass

    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'pg'}", rank=0, world_size=1)   # the save's barrier
    try:
        ck = Checkpointer(CheckpointConfig(), root, rank=0, world_size=1, run_config={})
        ck.save(Engine(), 4, {"result": TrainResult().to_dict(), "step": 4, "data": None, "rng": None})
    finally:
        dist.destroy_process_group()
    assert not (tag_dir / UNIVERSAL_DIR).exists() and (tag_dir / META).is_file()
    assert complete_tags(root) == [tag_for(4)]
