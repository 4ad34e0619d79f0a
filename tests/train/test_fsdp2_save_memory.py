"""Peak host memory of an FSDP2 checkpoint save, two ranks (each a fresh process, sharded over 2), on
a generated ~90 MB (fp32) checkpoint. Bound on a rank's growth while saving: a third of the fp32
state it holds (parameters + two moments of its shards, ~1.5 x the checkpoint: DCP writes one state
at a time and may copy what it writes) + two copies of the largest tensor (the HF export gathers one
tensor at a time) + 32 MiB. The previous path (the whole model as an fp32 state dict on every rank,
the whole optimizer state gathered on rank 0: >= 3 x the checkpoint there) exceeds it."""

import json

import pytest

pytestmark = pytest.mark.distributed

MiB = 1 << 20


def test_two_fsdp2_ranks_save_without_a_gathered_copy_of_their_state(tmp_path):
    from areal_npu.testing.load_memory import dense_config, write_checkpoint
    from areal_npu.testing.save_memory import measure_save
    from tests.support.ranks import start_processes

    cfg = dense_config(layers=4, hidden=512, ffn=1408)
    size = write_checkpoint(tmp_path / "model", cfg, shard_bytes=32 * MiB)
    largest = 4 * cfg.vocab_size * cfg.hidden_size  # the embedding / the output head, fp32
    args = (
        2,
        str(tmp_path / "model"),
        str(tmp_path / "rdv"),
        str(tmp_path / "rank"),
        str(tmp_path / "out"),
        "fsdp2",
    )
    start_processes(measure_save, args=args, nprocs=2, join=True)
    bound = None
    for rank in range(2):
        r = json.loads((tmp_path / f"rank.{rank}.json").read_text())
        growth, bound = r["peak"] - r["rss_before"], r["state"] / 3 + 2 * largest + 32 * MiB
        assert r["state"] >= 1.4 * size  # parameters + moments of its half: ~1.5 x the checkpoint
        assert growth <= bound, (growth / MiB, bound / MiB)
    assert 3 * size > bound  # rank 0 of the old path could not pass
    step = tmp_path / "out" / "ckpt" / "step_0"
    assert sorted(p.name for p in (step / "optim" / "exp_avg").iterdir()) == [
        ".metadata",
        "__0_0.distcp",
        "__1_0.distcp",
    ]
