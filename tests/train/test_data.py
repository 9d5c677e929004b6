"""train/data.py: the mock dataset and real indexed .bin/.idx data, cut into per-rank microbatches."""

from __future__ import annotations

from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("megatron.core")

from charllm_nemo.errors import ConfigError  # noqa: E402
from charllm_nemo.train.config import TrainConfig  # noqa: E402
from charllm_nemo.train.data import (  # noqa: E402
    DataLayout,
    MicrobatchIterator,
    build_train_dataset,
    check_token_ids,
    collate,
    token_check,
)


def test_layout_follows_megatron_sampler_order() -> None:
    # gbs 8 = 2 microbatches x 2 sequences x dp 2: in each microbatch the DP ranks take
    # consecutive slices; step 1 starts at sample 8.
    r0, r1 = DataLayout(2, 8, 2, 0), DataLayout(2, 8, 2, 1)
    assert r0.num_microbatches == 2
    assert [list(r0.sample_indices(0, k)) for k in range(2)] == [[0, 1], [4, 5]]
    assert [list(r1.sample_indices(0, k)) for k in range(2)] == [[2, 3], [6, 7]]
    assert list(r0.sample_indices(1, 0)) == [8, 9]


def check_batches(cfg: TrainConfig, dataset: object, steps: int) -> None:
    layout = DataLayout(cfg.batch.micro_batch_size, cfg.batch.global_batch_size, 1, 0)
    batches = list(MicrobatchIterator(dataset, layout, steps))
    assert len(batches) == steps * layout.num_microbatches
    b, s = cfg.batch.micro_batch_size, cfg.model.seq_length
    for batch in batches:
        assert batch["tokens"].shape == (b, s) and batch["labels"].shape == (b, s)
        assert batch["tokens"].dtype == torch.int64
        assert int(batch["tokens"].max()) < cfg.model.vocab_size
        assert batch["attention_mask"].shape == (b, 1, s, s)
        assert batch["attention_mask"].dtype == torch.bool
        # Causal: position i sees j <= i (True = masked).
        mask = batch["attention_mask"][0, 0]
        upper = torch.ones(s, s, dtype=torch.bool).triu(1)
        assert bool(mask[upper].all()) and not bool(mask[~upper].any())
        # Labels are the tokens shifted by one.
        assert torch.equal(batch["tokens"][:, 1:], batch["labels"][:, :-1])


def test_mock_dataset_builds_offline() -> None:
    cfg = TrainConfig()
    cfg.batch.global_batch_size, cfg.batch.micro_batch_size = 4, 2
    ds = build_train_dataset(cfg, 3 * 4)
    assert len(ds) >= 12
    check_batches(cfg, ds, 3)


def test_a_huge_step_count_builds_a_bounded_mock_dataset_read_round_and_round(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """``batch.train_steps=10**9``: the dataset index was sized for every sequence of the run
    (billions: 3.2 GB, then bad_alloc); it is built at most MAX_DATASET_SAMPLES large (made small
    here) and the steps past it read it again."""
    from charllm_nemo.train import data

    monkeypatch.setattr(data, "MAX_DATASET_SAMPLES", 64)
    cfg = TrainConfig()
    cfg.batch.global_batch_size, cfg.batch.micro_batch_size, cfg.batch.train_steps = 4, 2, 10**9
    ds = build_train_dataset(cfg, cfg.batch.train_steps * cfg.batch.global_batch_size)
    assert 64 <= len(ds) < 10**6  # one epoch of the mock corpus at least, never billions
    layout = DataLayout(2, 4, 1, 0)
    it = MicrobatchIterator(ds, layout, cfg.batch.train_steps)
    it._step = 10**8  # far past the dataset's end: its sequences again, not an IndexError
    assert next(it)["tokens"].shape == (2, cfg.model.seq_length)


def test_real_data_past_the_dataset_limit_is_refused_naming_it() -> None:
    from charllm_nemo.train.validate_run import MAX_DATASET_SAMPLES, run_problems

    cfg = TrainConfig()
    cfg.data.path = "/nonexistent/corpus"
    cfg.batch.train_steps = 10**9
    problems = [p for p in run_problems(cfg, "cpu") if "batch.train_steps" in p]
    assert len(problems) == 1 and str(MAX_DATASET_SAMPLES) in problems[0]


def _corpus(prefix: str, high: int) -> None:
    """A Megatron indexed dataset at ``prefix``: 40 documents of 20-299 token ids in [0, high)."""
    from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder

    builder = IndexedDatasetBuilder(prefix + ".bin", dtype=__import__("numpy").int32)
    gen = torch.Generator().manual_seed(0)
    for _ in range(40):
        n = int(torch.randint(20, 300, (1,), generator=gen))
        builder.add_item(torch.randint(0, high, (n,), generator=gen))
        builder.end_document()
    builder.finalize(prefix + ".idx")


def test_indexed_bin_idx_dataset(tmp_path: Path) -> None:
    prefix = str(tmp_path / "corpus")
    _corpus(prefix, 1000)
    cfg = TrainConfig()
    cfg.data.path = prefix
    cfg.batch.global_batch_size, cfg.batch.micro_batch_size = 4, 1
    ds = build_train_dataset(cfg, 5 * 4)
    check_batches(cfg, ds, 5)


def test_missing_indexed_dataset_names_the_field(tmp_path: Path) -> None:
    cfg = TrainConfig()
    cfg.data.path = str(tmp_path / "nope")
    with pytest.raises(ConfigError, match=r"data\.path"):
        build_train_dataset(cfg, 4)


def test_data_tokenized_for_a_larger_vocabulary_is_refused_before_the_embedding(tmp_path: Path) -> None:
    # Ids up to 4999 into a 1024-row embedding: an IndexError on CPU, a device-side assert (and
    # a dead CUDA context) on a GPU. The iterator names both fields at the first microbatch.
    prefix = str(tmp_path / "corpus")
    _corpus(prefix, 5000)
    cfg = TrainConfig()
    cfg.data.path = prefix
    cfg.batch.global_batch_size, cfg.batch.micro_batch_size = 4, 1
    layout = DataLayout(1, 4, 1, 0)
    dataset = build_train_dataset(cfg, 4)
    it = MicrobatchIterator(dataset, layout, 1, **token_check(cfg))
    with pytest.raises(ConfigError) as info:
        next(it)
    msg = str(info.value)
    assert msg.startswith(f"data.path={prefix!r} holds token id ")
    assert "(step 0, microbatch 0) but model.vocab_size=1024 takes ids 0..1023" in msg
    cfg.model.vocab_size = 5000  # the tokenizer's size: the same data then trains
    assert len(list(MicrobatchIterator(dataset, layout, 1, **token_check(cfg)))) == 4
    assert token_check(TrainConfig()) == {}  # the mock dataset draws from vocab_size itself


def test_token_ids_are_checked_at_both_ends() -> None:
    ok = {"tokens": torch.tensor([[0, 5]]), "labels": torch.tensor([[5, 9]])}
    check_token_ids(ok, 10, "d", 0, 0)
    with pytest.raises(ConfigError, match=r"holds token id 10 .*\(at least 11\)"):
        check_token_ids({"tokens": ok["tokens"], "labels": torch.tensor([[5, 10]])}, 10, "d", 0, 0)
    with pytest.raises(ConfigError, match="holds token id -1 "):
        check_token_ids({"tokens": torch.tensor([[-1, 5]]), "labels": ok["labels"]}, 10, "d", 2, 3)


@pytest.mark.parametrize("cp_rank", [0, 1])
def test_each_context_parallel_rank_feeds_the_model_its_two_chunks_of_the_sequence(
    monkeypatch: pytest.MonkeyPatch, cp_rank: int
) -> None:
    # CP=2 (GPU only, so the process group is stood in for): the sequence is cut into 2 * cp
    # chunks and rank r keeps chunks r and 2 * cp - 1 - r (balanced causal work), for every
    # tensor the model and the loss see; megatron-core's rotary embedding and the pipeline
    # buffers expect seq_length / cp tokens.
    from megatron.core import parallel_state

    from charllm_nemo.train.loop import _forward_step

    monkeypatch.setattr(parallel_state, "get_context_parallel_world_size", lambda: 2)
    monkeypatch.setattr(parallel_state, "get_context_parallel_rank", lambda: cp_rank)
    cfg = TrainConfig()
    cfg.model.seq_length = 16
    cfg.batch.global_batch_size, cfg.batch.micro_batch_size = 2, 2
    ds = build_train_dataset(cfg, 2)
    full = collate([ds[0], ds[1]])
    seen: dict[str, torch.Tensor] = {}

    def model(tokens, position_ids, attention_mask, labels):  # type: ignore[no-untyped-def]
        seen.update(tokens=tokens, position_ids=position_ids, attention_mask=attention_mask, labels=labels)
        return torch.zeros(tokens.shape)

    _output, loss = _forward_step(iter([{k: v.clone() for k, v in full.items()}]), model)
    keep = torch.cat(
        [torch.arange(4 * cp_rank, 4 * cp_rank + 4), torch.arange(12 - 4 * cp_rank, 16 - 4 * cp_rank)]
    )
    for key in ("tokens", "position_ids", "labels"):
        assert torch.equal(seen[key], full[key][:, keep]), key
    assert torch.equal(seen["attention_mask"], full["attention_mask"][:, :, keep, :])
    assert loss.args[0].shape == (2, 8)  # the loss mask too
