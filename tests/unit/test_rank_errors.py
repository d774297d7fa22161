"""One rank's fatal error reaches every rank as itself (runtime/rank_errors.py), on forked ranks of a
real gloo group with a real TCPStore for the heartbeat (as the launcher's rendezvous store): the
failing rank says its error once and exits with its code; the others, blocked in a collective the
failing rank never joins, exit with the same code and "rank R failed: ..." from their heartbeat
threads, within a few heartbeats. Each rank's stderr goes to a file the test reads."""

from __future__ import annotations

import multiprocessing
import os
import signal
import sys
import time
from datetime import timedelta
from pathlib import Path

import pytest
import torch.distributed as dist

from rsclip_ds.config import ConfigError
from rsclip_ds.data.bad import DataError
from rsclip_ds.runtime.heartbeat import Heartbeat
from rsclip_ds.runtime.rank_errors import (RankError, RankErrors, describe, format_beat, is_peer_loss,
                                           parse_beat)
from rsclip_ds.data.workers import LoaderWorkerDied
from rsclip_ds.loop import NonFiniteLoss, Preempted
from rsclip_ds.runtime.rank_errors import PeerFailed

INTERVAL = 0.05


def _client(port: int):
    return lambda timeout: dist.TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=timeout),
                                         wait_for_workers=False)


def _rank_main(scenario, rank: int, world: int, folder: str, port: int) -> None:
    """One rank: stderr to a file, gloo group, heartbeat + RankErrors, then the scenario; an error
    takes the Trainer's way out (RankErrors.fail, then the exit code)."""
    import torch

    err = os.open(f"{folder}/rank{rank}.err", os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
    os.dup2(err, 2)
    sys.stderr = open(2, "w", buffering=1, closefd=False)   # pytest's capture object is not fd 2
    torch.set_num_threads(1)
    code = 99
    try:
        dist.init_process_group("gloo", init_method=f"file://{folder}/store", rank=rank, world_size=world)
        errors = RankErrors(rank, world, interval=INTERVAL, store_factory=_client(port), timeout=10)
        Heartbeat(rank, world, interval=INTERVAL, timeout=10, store_factory=_client(port), errors=errors).start()
        try:
            scenario(rank, world)
            code = 0
        except Exception as exc:   # what Trainer.__exit__ does
            code = errors.fail(exc).code
    except BaseException:   # the harness itself (or fail) broke: say how, for the test's message
        import traceback
        traceback.print_exc()
    finally:
        os._exit(code)


def run_ranks(scenario, world: int, folder: Path, timeout: float = 30) -> tuple[list[int], list[str], float]:
    """-> each rank's exit code and stderr, and the seconds until the last rank ended."""
    folder.mkdir(parents=True, exist_ok=True)
    master = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=10))
    ctx = multiprocessing.get_context("fork")
    procs = [ctx.Process(target=_rank_main, args=(scenario, r, world, str(folder), master.port)) for r in range(world)]
    t0 = time.monotonic()
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout)
        if p.exitcode is None:
            p.kill()
            p.join()
    seconds = time.monotonic() - t0
    return [p.exitcode for p in procs], [(folder / f"rank{r}.err").read_text() for r in range(world)], seconds


# the scenarios (module level: the forked ranks run them)
def _data_error_on_rank1(rank, world):
    if rank == 1:
        raise DataError("rank 1 stream 0: too much bad data (3 of 8 samples); check data.train_shards")
    dist.barrier()   # blocks: rank 1 never comes


def _value_error_on_rank0(rank, world):
    if rank == 0:
        raise ValueError("boom at step 5")
    dist.barrier()


def _same_config_error_everywhere(rank, world):
    raise ConfigError("output_dir /x is not shared by every rank")


def _rank1_killed(rank, world):
    if rank == 1:
        time.sleep(4 * INTERVAL)   # beat a few times first
        os.kill(os.getpid(), signal.SIGKILL)
    dist.barrier()


def test_a_known_error_on_one_rank_is_said_once_and_every_rank_exits_with_its_code(tmp_path):
    codes, err, seconds = run_ranks(_data_error_on_rank1, 3, tmp_path)
    message = "DataError: rank 1 stream 0: too much bad data (3 of 8 samples); check data.train_shards"
    assert codes == [5, 5, 5], (codes, err)
    assert err[1] == f"rsclip-ds: {message}\n"                        # one line, no traceback
    for r in (0, 2):
        assert err[r] == f"rsclip-ds: rank 1 failed: {message} (seen by rank {r}; exiting with its code 5)\n", err
    assert seconds < 10, seconds   # a few heartbeats, not a collective timeout


def test_an_unknown_error_keeps_its_traceback_on_the_failing_rank_only(tmp_path):
    codes, err, _ = run_ranks(_value_error_on_rank0, 2, tmp_path)
    assert codes == [1, 1], (codes, err)
    assert err[0].count("Traceback (most recent call last)") == 1 and err[0].rstrip().endswith("ValueError: boom at step 5")
    assert err[1] == "rsclip-ds: rank 0 failed: ValueError: boom at step 5 (seen by rank 1; exiting with its code 1)\n"


def test_the_same_error_on_every_rank_is_said_once(tmp_path):
    codes, err, seconds = run_ranks(_same_config_error_everywhere, 2, tmp_path)
    assert codes == [2, 2]
    assert "".join(err) == "rsclip-ds: error: output_dir /x is not shared by every rank\n", err
    assert seconds < 10


def test_a_rank_killed_without_a_word_is_named_by_the_one_whose_collective_broke(tmp_path):
    codes, err, seconds = run_ranks(_rank1_killed, 2, tmp_path)
    assert codes == [4, -signal.SIGKILL], (codes, err)
    assert err[1] == ""
    assert err[0].startswith("rsclip-ds: rank 0: rank 1 is gone (no heartbeat for ") and err[0].count("\n") == 1
    assert "without reporting an error: killed (SIGKILL" in err[0] and "Connection closed by peer" in err[0], err[0]
    assert "Traceback" not in err[0] and seconds < 10


# --------------------------------------------------------------------------- in one process

def test_exit_codes_and_lines_of_each_kind():
    cases = [(ConfigError("bad key"), 2, "error: bad key", False), (DataError("d"), 5, "DataError: d", False),
             (NonFiniteLoss("n"), 3, "NonFiniteLoss: n", True), (Preempted("p"), 75, "Preempted: p", True),
             (LoaderWorkerDied("w"), 7, "LoaderWorkerDied: w", False),
             (PeerFailed(RankError(1, 7, "LoaderWorkerDied", "w"), "; saved"), 7,
              "rank 1 failed: LoaderWorkerDied: w; saved", True),
             (KeyError("k"), 1, "KeyError: 'k'", False)]
    for err, code, line, shared in cases:
        f = describe(err)
        assert (f.code, f.line, f.shared) == (code, line, shared), err
    assert describe(KeyError("k")).known is False and describe(LoaderWorkerDied("w", shared=True)).shared
    assert is_peer_loss(RuntimeError("[gloo/pair.cc:534] Connection closed by peer [127.0.0.1]:6502"))
    assert not is_peer_loss(RuntimeError("shape mismatch")) and not is_peer_loss(DataError("Connection reset by peer"))


def test_heartbeat_values_carry_the_error_both_ways():
    e = RankError(3, 5, "DataError", "two words and more")
    assert parse_beat(3, format_beat(3, 12)) == ("12", "", "")
    assert parse_beat(3, format_beat(3, 12, e.to_json()).encode()) == ("12", "", e.to_json())
    assert parse_beat(0, format_beat(0, 7, e.to_json(), "1,2")) == ("7", "1,2", e.to_json())
    assert parse_beat(0, format_beat(0, 7)) == ("7", "", "") and parse_beat(1, None) == (None, "", "")
    assert RankError.from_json(e.to_json()) == e and RankError.from_json("") is None


# --------------------------------------------------------------------------- universal conversion

def _convert(rank, world, root):
    from rsclip_ds.reshard import convert_on_rank0

    t0 = time.monotonic()
    try:
        convert_on_rank0(Path(root), "step00000002", saved_world=2, world_size=world)
    except ConfigError as err:
        return {"error": str(err), "seconds": time.monotonic() - t0}
    return {"error": None}


def test_a_failed_universal_conversion_stops_every_rank_at_once_with_rank0s_error(tmp_path):
    """Rank 0 converts a checkpoint of 2 ranks for a run of 3 (here: 2 forked gloo ranks); its files
    were cut short (a copy that stopped): every rank gets rank 0's error at once, not a barrier
    that waits for DEEPSPEED_TIMEOUT."""
    import torch
    from deepspeed.checkpoint import ds_to_universal  # noqa: F401 -- imported before the fork, not in each rank

    from tests.unit.forked_ranks import run_ranks as run_forked

    tag = tmp_path / "ckpt" / "step00000002"
    tag.mkdir(parents=True)
    for name in ("mp_rank_00_model_states.pt", "zero_pp_rank_0_mp_rank_00_optim_states.pt",
                 "zero_pp_rank_1_mp_rank_00_optim_states.pt"):
        torch.save({"module": {"w": torch.zeros(1000)}}, tag / name)
        data = (tag / name).read_bytes()
        (tag / name).write_bytes(data[:len(data) // 2])
    results = run_forked(_convert, 2, tmp_path / "ranks", str(tmp_path / "ckpt"))
    errors = [r["value"]["error"] for r in results]
    assert errors[0] == errors[1] and errors[0].startswith(
        "rank 0 could not convert checkpoint step00000002 (written by 2 ranks) to DeepSpeed's universal format "
        "for this run's 2 ranks: "), errors
    assert "resume it on 2 ranks, which needs no conversion" in errors[0]
    assert max(r["value"]["seconds"] for r in results) < 30
    assert not (tag / "universal").exists()
