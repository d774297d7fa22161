"""Sections of docs/results/faults.md: benchmarks/faults/nonfinite.py (a step with an inf/NaN gradient on every
stage and precision) and the removed benchmarks/faults/checksum.py (the checkpoint manifest's checksum cost);
its JSON stays, and `git show b0417e1:benchmarks/faults/checksum.py` restores the script."""

from __future__ import annotations

from benchmarks.results_tables.format import MiB, fix, pct, sig, table


def checksum(files: dict) -> list[str]:
    """Seconds per GiB of each hash (memory, warm file, cold file); the share of a save; per model."""
    rep = files["checksum.json"]
    rows = [[r["algorithm"], fix(r["memory_s_per_gib"], 3), fix(r["warm_file_s_per_gib"], 3),
             fix(r["cold_file_s_per_gib"], 3)] for r in rep["hash"]]
    out = [f"One core; a {sig(rep['config']['mib'])} MiB file of random bytes, best of {rep['config']['repeats']}. "
           f"A plain cold read takes {fix(rep['read_cold_s_per_gib'], 3)} s/GiB: from a disk the read, not the "
           "hash, is the cost (rsclip_ds uses xxh3_128).", ""]
    out += table(["algorithm", "memory s/GiB", "warm file s/GiB", "cold file s/GiB"], rows)
    saves = [("disk", rep["save"])] + ([("memory (/dev/shm)", rep["save_in_memory"])] if rep.get("save_in_memory") else [])
    out += ["A save of the same size (fp32 tensors, torch.save, then fsync):", ""]
    out += table(["into", "torch.save(path) s", "to a file object s", "hashed on the way s", "hashed over file object"],
                 [[where, fix(s["plain_s"], 3), fix(s["file_object_s"], 3), fix(s["hashed_s"], 3),
                   pct(s["added_fraction"], 1)] for where, s in saves])
    models = [[r["model"], sig(r["params"]), sig(r["checkpoint_bytes"] / MiB),
               fix(r["save_s"], 3) + ("" if r["measured"] else " (scaled)"), sig(r["hash_cpu_s"], 2),
               pct(r["hash_cpu_fraction"], 1), fix(r["verify_s"], 3)] for r in rep["models"]]
    out += ["One checkpoint (fp32, ZeRO-2; bytes from `integrity.checkpoint_bytes`): the save, the checksum's CPU "
            "time on it (xxh3_128 from memory) and a resume's verification (cold read + hash):", ""]
    return out + table(["model", "parameters", "checkpoint MiB", "save s", "checksum CPU s", "share of the save",
                        "verify s"], models)


def nonfinite(files: dict) -> list[str]:
    """Per case (profile x precision, one row per launch's world size): who skipped the step with the
    inf/NaN gradient, whether it moved nothing and was counted with the learning rate held, whether the
    run's end equals the run without that batch on every rank, and whether every checkpoint is finite."""
    rows = []
    for name, rep in files.items():
        world = len(rep["ranks"])
        for i, row in enumerate(rep["ranks"][0]):
            per_rank = [ranks[i] for ranks in rep["ranks"]]
            still = all(all(r["unchanged"].values()) and r["counted"] for r in per_rank)
            equal = all(all(r["equal"].values()) and r["lr_equal"] and r["skipped"] == [0, 1] for r in per_rank)
            saved = row["checkpoints"] or {}
            rows.append([row["profile"], row["precision"], world, row["value"], row["guard"],
                         "skipped: nothing moved, counted, lr held" if still else "NOT SKIPPED",
                         "n/a (loss scale halved)" if row["scaled"] else ("yes" if equal else "NO"),
                         "yes" if all(r["finite"] for r in per_rank) else "NO",
                         f"{sum(saved.values())} of {len(saved)}" if saved else "-"])
    return ["A step-2 NaN or inf in one token-embedding row's gradient (a row no batch uses), on rank 0. \"Nothing "
            "moved\": every weight, fp32 master, AdamW moment and step count on every rank after step 2 equals "
            "after step 1, bit for bit; the run's end is compared with the run without step 2's batch.", ""] + table(
        ["profile", "precision", "ranks", "value", "who skips", "step 2", "end bit-equal to the run without the batch",
         "weights finite", "checkpoints finite"], rows)
