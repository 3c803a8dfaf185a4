"""benchmarks/config_walk.py: the walk of the training config's reads through the
modules (which module reads, the returns to a module already left, the steps back up
the import layering), and the training run's walk staying within issue 36's aims."""

import pytest
import torch
from recorders import load_benchmark

from eagle3fn.train.config import TrainConfig

walk = load_benchmark("config_walk")

# a imports b imports c; d and e import each other (a cycle: neither is above the other)
IMPORTS = walk.reach({"a": {"b"}, "b": {"c"}, "c": set(), "d": {"e"}, "e": {"d"}})


def test_returns_to_a_module_already_left_are_counted():
    """a -> b -> a returns to a once; control: a -> b -> c never returns."""
    back = walk.walk_metrics(["a", "b", "a", "c", "b"], IMPORTS)
    assert (back["modules"], back["returns"], back["reentered"]) == (3, 2, {"a": 1, "b": 1})
    onward = walk.walk_metrics(["a", "b", "c"], IMPORTS)
    assert (onward["modules"], onward["returns"], onward["reentered"]) == (3, 0, {})


def test_steps_back_up_follow_the_imports():
    """c -> a steps up (a imports c through b); control: a -> b -> c steps only down,
    and between modules that import each other there is no up."""
    assert walk.walk_metrics(["c", "a"], IMPORTS)["up_pairs"] == [["c", "a"]]
    assert walk.walk_metrics(["a", "b", "c"], IMPORTS)["steps_up"] == 0
    assert walk.walk_metrics(["d", "e", "d"], IMPORTS)["steps_up"] == 0


def test_consecutive_reads_in_one_module_are_one_visit():
    sites = [walk.Read(m, "f", i, "C", "x") for i, m in enumerate(["a", "a", "b", "b", "a"])]
    assert walk.visits_of(sites) == ["a", "b", "a"]


def test_import_graph_of_the_package():
    """The loop imports the build (directly) and the loss (through the step); control:
    not the other way round."""
    reach = walk.reach(walk.import_graph())
    assert "eagle3fn.train.build" in reach["eagle3fn.train.loop"]
    assert "eagle3fn.loss" in reach["eagle3fn.train.loop"]
    assert "eagle3fn.train.loop" not in reach["eagle3fn.loss"]


def test_reads_are_recorded_where_eagle3fn_makes_them():
    """``lr_at`` reads two fields in train.step, ``packed_batches`` two in train.sources
    (its rows and row length are arguments, ``TrainConfig.packed_rows``, whose own reads
    inside TrainConfig are not recorded); control: a read from outside eagle3fn (this
    test) is not recorded either. The class is restored afterwards."""
    from eagle3fn.train.sources import packed_batches
    from eagle3fn.train.step import lr_at

    cfg = TrainConfig(model="m", data="d")
    with walk.recording_reads() as sites:
        lr_at(0, 10, cfg)
        assert cfg.packs and cfg.pack_length is None  # read here, not by eagle3fn
        packed_batches([[3, 4], [5]], cfg, *cfg.packed_rows(torch.device("cpu")))
    assert [(walk.short(s.module), s.name) for s in sites] == [
        ("train.step", "lr"), ("train.step", "warmup_ratio"), ("train.sources", "max_length"),
        ("train.sources", "pack_window")]
    assert "__getattribute__" not in vars(TrainConfig)


@pytest.mark.usefixtures("no_gpu")
def test_the_training_walk_stays_within_the_aims(tmp_path):
    """A packed online run of the tiny target: under 20 modules and under 10 steps back
    up (issue 36)."""
    cfg = walk.scenario_config("online-packed", tmp_path, 2)
    imports = walk.reach(walk.import_graph())
    got = walk.walk(cfg, imports)
    assert got["modules"] < 20 and got["steps_up"] < 10, got["walk"]
    assert got["modules"] >= 5 and got["returns"] >= 1  # the walk is seen at all
