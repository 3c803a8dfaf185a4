"""The training loop's wiring, checked where AdamW cannot hide it: the FIRST optimizer
step's gradients (``train(on_grads=...)``, after every micro-batch and the cross-rank
reduction, before clipping and the optimizer) equal a one-process oracle in fp64 within
1e-10 (max-abs difference over max-abs of the oracle, SPEC 8), for data parallelism,
ring and Ulysses sequence parallelism, gradient accumulation and the offline cache.

Weight comparisons after AdamW steps (test_train*.py) are blind to a constant gradient
scale; here a missing 1/world, a doubled reduction or a denominator that counts the
wrong rows moves every gradient. Each case carries negative controls (the oracle x2 and
x0.5, and a plausible wrong normalisation) that the same comparison must reject.

What the oracle is (SPEC 5), one process, trim "none" (the reference path) whatever
the run trims:
- ``token_mean``: the step's conversations concatenated into one right-padded batch;
  the denominator is the gated rows of the whole step.
- ``local_mean`` (the default): each micro-batch of each data-parallel rank is divided
  by its own ``B*sp*C`` (its ``B*T`` with the sequence right-padded to a multiple of
  ``sp``) and the step's gradient is the mean over those micro-batches: "gradients are
  averaged over all ranks" (SPEC 5, SpecForge's DDP average and ``loss /
  accumulation_steps``), which makes dp-2 and grad-accum-2 over the same batches agree.

Ranks forked from one preloaded server (tests/ranks.py; gloo, one launch for every
distributed case) keep the runtime small; a hang becomes a failure (collectives time
out after 60 s, the launch after 240 s).
"""

import pytest
import ranks
import torch
from loop_grad_cases import Oracle, concat, data_order, eval_run, first_grads, first_step_items, rank_main
from recorders import prepare_cache
from test_train import config, workdir  # noqa: F401 - the tiny target + data fixture

from eagle3fn.loss import LossConfig
from eagle3fn.parallel import ParallelConfig

TOL = 1e-10
CAUGHT = 1e-3  # a negative control must miss the loop's gradients by more than this
TOKEN = LossConfig(normalization="token_mean")


def rel(got: dict, want: dict) -> float:
    """Worst over the parameters of ``max|got - want| / max|want|`` (SPEC 8)."""
    assert got.keys() == want.keys()
    return max(((got[n] - want[n]).abs().max() / want[n].abs().max()).item() for n in want)


def scaled(grads: dict, factor: float) -> dict:
    return {n: g * factor for n, g in grads.items()}


def check(got: dict, want: dict, controls: dict[str, dict]) -> None:
    """``got`` within TOL of ``want``; each control (plus ``want`` x2 and x0.5) beyond CAUGHT."""
    controls = {"oracle x2": scaled(want, 2.0), "oracle x0.5": scaled(want, 0.5), **controls}
    errors = {name: rel(got, wrong) for name, wrong in controls.items()}
    err = rel(got, want)
    assert err <= TOL, f"loop vs oracle: {err:.3g}; loop vs the alternatives: {errors}"
    for name, e in errors.items():
        assert e > CAUGHT, f"negative control {name!r} not caught ({e:.3g})"


class Data:
    """The run's conversations, grouped as the loop groups them, and their fp64 features
    from the target (online) or from a cache (offline)."""

    def __init__(self, workdir, cache=None):
        from transformers import AutoTokenizer

        from eagle3fn.io.cache import FeatureCache
        from eagle3fn.io.data import tokenize_file
        from eagle3fn.io.target import load_target

        self.target = load_target(str(workdir / "model"), dtype=torch.float64)
        self.tok = AutoTokenizer.from_pretrained(workdir / "model")
        cfg = config(workdir, "unused")
        examples = tokenize_file(workdir / "chat.jsonl", self.tok, max_length=cfg.max_length)
        self.groups = [examples[i:i + cfg.batch_size] for i in range(0, len(examples), cfg.batch_size)]
        self.cache = None if cache is None else FeatureCache(cache, dtype=torch.float64)

    def __len__(self):
        return len(self.groups) if self.cache is None else len(self.cache)

    def batch(self, item: int):
        """(features, loss_mask) of item ``item``: a group of conversations or a shard."""
        from eagle3fn.io.batching import collate
        from eagle3fn.io.target import target_features

        if self.cache is not None:
            shard = self.cache.read(item)
            return shard.features, shard.loss_mask
        b = collate(self.groups[item], self.tok.pad_token_id)
        return target_features(self.target, b["input_ids"], b["attention_mask"]), b["loss_mask"]

    def step(self, cfg, dp: int = 1) -> list[list[int]]:
        return first_step_items(len(self), dp=dp, grad_accum=cfg.grad_accum, seed=cfg.seed)


def whole_step(data: Data, items: list[list[int]]):
    """The step's conversations as one batch: ``[(features, loss_mask, B*T, 1)]``."""
    return [(*concat([data.batch(i) for m in items for i in m]), None, 1.0)]


def per_micro_batch(data: Data, items: list[list[int]], sp: int = 1, pooled: bool = False):
    """``local_mean`` parts: every micro-batch of every rank divided by its ``B*sp*C``,
    weighted by 1/(their number). ``pooled``: the negative control where the summed
    losses are divided by the summed ``B*sp*C`` instead (a weighted mean)."""
    batches = [data.batch(i) for m in items for i in m]
    sizes = [f.input_ids.shape[0] * sp * -(-f.input_ids.shape[1] // sp) for f, _ in batches]
    if pooled:
        return [(*concat(batches), sum(sizes), 1.0)]
    return [(f, m, n, 1.0 / len(batches)) for (f, m), n in zip(batches, sizes)]


@pytest.fixture(scope="module", autouse=True)
def _one_thread():
    """Tiny fp64 shapes: intra-op threads only add scheduling noise (and stall on a busy
    machine); the spawned ranks run one thread each too."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def run_config(workdir, out, **kw):
    """test_train's tiny run in fp64 on the CPU, one epoch."""
    return config(workdir, out, device="cpu", precision="float64", epochs=1, **kw)


@pytest.fixture(scope="module")
def cache(workdir, tmp_path_factory):  # noqa: F811
    return prepare_cache(workdir, tmp_path_factory.mktemp("loop_grads") / "cache")


@pytest.fixture(scope="module")
def online(workdir):  # noqa: F811
    return Data(workdir)


@pytest.fixture(scope="module")
def offline(workdir, cache):  # noqa: F811
    return Data(workdir, cache)


def spawned_runs(workdir, cache, root) -> dict:
    """Every distributed case: name -> TrainConfig (world 2)."""
    ring, ulysses = ParallelConfig(ring=2), ParallelConfig(ulysses=2)
    return {
        "dp2-token": run_config(workdir, root / "dp2-token", loss=TOKEN),
        "dp2-local": run_config(workdir, root / "dp2-local", trim="none", trim_loss_positions=False),
        "ring2-token": run_config(workdir, root / "ring2-token", trim="backbone", trim_loss_positions=False,
                                  loss=TOKEN, parallel=ring),
        "ulysses2-token": run_config(workdir, root / "ulysses2-token", loss=TOKEN, parallel=ulysses),
        "ring2-local": run_config(workdir, root / "ring2-local", parallel=ring),
        "cache-ring2-token": run_config(workdir, root / "cache-ring2-token", cache=str(cache), loss=TOKEN,
                                        trim="backbone", trim_loss_positions=False, parallel=ring),
        "dp2-pack-token": run_config(workdir, root / "dp2-pack-token", loss=TOKEN, pack=True, max_length=160),
        "ring2-eval": run_config(workdir, root / "ring2-eval", parallel=ring, eval_holdout=2),
    }


@pytest.fixture(scope="module")
def spawned(workdir, cache, tmp_path_factory):  # noqa: F811
    """(configs, {name: first gradients}) of every distributed case, one 2-rank launch."""
    root = tmp_path_factory.mktemp("spawned")
    runs = spawned_runs(workdir, cache, root)
    ranks.launch(rank_main, (2, str(root / "pg"), runs, str(root / "grads.pt")), 2, "loop ranks")
    return runs, torch.load(root / "grads.pt", weights_only=False)


def test_data_parallel_token_mean(spawned, online):
    """dp-2, trim loss: each rank's micro-batch is one group; the count of gated rows is
    reduced over the ranks, so the loop gives the whole-step gradient. Control: each
    rank divides by its own gated rows and the ranks are averaged (DDP on a local mean)."""
    runs, got = spawned
    cfg = runs["dp2-token"]
    items = online.step(cfg, dp=2)
    oracle = Oracle.of_run(cfg, online.target)
    own = [(*online.batch(i), None, 0.5) for i in items[0]]
    check(got["dp2-token"], oracle.grads(whole_step(online, items)),
          {"per-rank token means, averaged": oracle.grads(own)})


def test_data_parallel_packed_token_mean(spawned, online):
    """dp-2 with --pack (SPEC 9): the 8 conversations packed (``io.packing.plan_rows``) into 4 rows of 160,
    two rows per micro-batch, one micro-batch per rank: the gradient of all 8
    conversations as one unpacked batch. Control: half of them (one rank's share)."""
    runs, got = spawned
    cfg = runs["dp2-pack-token"]
    oracle = Oracle.of_run(cfg, online.target)
    check(got["dp2-pack-token"], oracle.grads(whole_step(online, [[0, 1, 2, 3]])),
          {"half the conversations": oracle.grads(whole_step(online, [[0, 1]]))})


def test_data_parallel_local_mean(spawned, online):
    """dp-2, trim none, the default local_mean: the mean over the two ranks of each rank's
    loss over its own B*T (the groups' padded lengths differ). Controls: the summed
    losses over the summed B*T (a length-weighted mean), and one batch padded to the
    longest."""
    runs, got = spawned
    cfg = runs["dp2-local"]
    items = online.step(cfg, dp=2)
    oracle = Oracle.of_run(cfg, online.target)
    check(got["dp2-local"], oracle.grads(per_micro_batch(online, items)),
          {"summed losses / summed B*T": oracle.grads(per_micro_batch(online, items, pooled=True)),
           "one batch padded to the longest": oracle.grads(whole_step(online, items))})


@pytest.mark.parametrize("name", ["ring2-token", "ulysses2-token"])
def test_sequence_parallel_token_mean(spawned, online, name):
    """ring-2 (trim backbone) and Ulysses-2 (trim loss): the sequence split over two
    ranks, gated rows reduced over them: the whole-batch gradient."""
    runs, got = spawned
    cfg = runs[name]
    oracle = Oracle.of_run(cfg, online.target)
    check(got[name], oracle.grads(whole_step(online, online.step(cfg))), {})


def test_sequence_parallel_local_mean(spawned, online):
    """ring-2, trim loss, local_mean: the one-process local mean over the sequence
    right-padded to sp*C (SPEC 5; the batch has an odd length). Control: the unpadded
    B*T."""
    runs, got = spawned
    cfg = runs["ring2-local"]
    items = online.step(cfg)
    assert online.batch(items[0][0])[0].input_ids.shape[1] % 2, "the control needs an odd length"
    oracle = Oracle.of_run(cfg, online.target)
    check(got["ring2-local"], oracle.grads(per_micro_batch(online, items, sp=2)),
          {"unpadded B*T": oracle.grads(per_micro_batch(online, items))})


def test_grad_accum_token_mean(workdir, online, tmp_path):  # noqa: F811
    """grad_accum 2, trim loss, token_mean: one optimizer step over two micro-batches
    divides by the gated rows of the whole step (sum locally, divide once by the global
    count), as dp-2 does over the same two groups. Control: each micro-batch divided by
    its own gated rows and the two averaged."""
    cfg = run_config(workdir, tmp_path / "run", grad_accum=2, loss=TOKEN)
    got = first_grads(cfg)
    items = online.step(cfg)
    oracle = Oracle.of_run(cfg, online.target)
    own = [(*online.batch(m[0]), None, 0.5) for m in items]
    check(got, oracle.grads(whole_step(online, items)),
          {"per-micro-batch token means, averaged": oracle.grads(own)})


def test_grad_accum_local_mean(workdir, online, tmp_path):  # noqa: F811
    """grad_accum 2, trim none, local_mean: the mean of the two micro-batches' local
    means. Controls: the summed losses over the summed B*T; the 1/grad_accum dropped is
    the oracle x2."""
    cfg = run_config(workdir, tmp_path / "run", grad_accum=2, trim="none", trim_loss_positions=False)
    got = first_grads(cfg)
    items = online.step(cfg)
    oracle = Oracle.of_run(cfg, online.target)
    check(got, oracle.grads(per_micro_batch(online, items)),
          {"summed losses / summed B*T": oracle.grads(per_micro_batch(online, items, pooled=True))})


def test_offline_cache_sequence_parallel(spawned, offline):
    """The cache under ring-2 (each rank reads its window of the shard from disk), trim
    backbone, token_mean: the whole shard's gradient on its cached (float32-stored)
    features. Control: the shard next in the order (a data-order mistake)."""
    runs, got = spawned
    cfg = runs["cache-ring2-token"]
    items = offline.step(cfg)
    oracle = Oracle.of_run(cfg, offline.target)
    second = data_order(len(offline), cfg.seed)[1]
    check(got["cache-ring2-token"], oracle.grads(whole_step(offline, items)),
          {"the next shard": oracle.grads(whole_step(offline, [[second]]))})


def test_offline_cache_grad_accum(workdir, offline, cache, tmp_path):  # noqa: F811
    """The cache, one process, grad_accum 2, trim loss, local_mean: two shards, the mean
    of their local means. Control: the summed losses over the summed B*T."""
    cfg = run_config(workdir, tmp_path / "run", cache=str(cache), grad_accum=2)
    got = first_grads(cfg)
    items = offline.step(cfg)
    oracle = Oracle.of_run(cfg, offline.target)
    check(got, oracle.grads(per_micro_batch(offline, items)),
          {"summed losses / summed B*T": oracle.grads(per_micro_batch(offline, items, pooled=True))})


def test_held_out_evaluation_runs_in_the_sequence_parallel_layout(spawned, tmp_path):
    """Under ring-2 every rank evaluates only its chunk of each held-out batch (it used to
    evaluate the whole length alone, which runs out of memory exactly where sequence
    parallelism is needed), and the pooled held-out metrics equal the one-process run's
    in fp64. Control: the one-process run's batches are the whole length, longer than
    any chunk the ranks saw."""
    import dataclasses

    runs, got = spawned
    sp = got["ring2-eval"]
    one = eval_run(dataclasses.replace(runs["ring2-eval"], parallel=ParallelConfig(),
                                       out_dir=str(tmp_path / "one")))
    assert sp["eval"] and len(sp["eval"]) == len(one["eval"])
    for a, b in zip(sp["eval"], one["eval"]):
        for key in ("loss", "kl", "acc", "accept", "tau"):
            x, y = torch.tensor(a[key], dtype=torch.float64), torch.tensor(b[key], dtype=torch.float64)
            assert ((x - y).abs().max() / y.abs().max().clamp_min(1e-12)).item() <= 1e-9, (key, a[key], b[key])
    assert sp["lengths"] and max(sp["lengths"]) < min(one["lengths"]), (sp["lengths"], one["lengths"])
