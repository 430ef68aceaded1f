"""The LM job's built-in data: stdlib split, strided subset, BPE tokenizer cache, LM blocks and
the per-rank step batches (every DP rank's micro-batches together are exactly one global batch)."""
import pytest
import torch

from launch.jobs.text_data import (
    EOS,
    StepBatches,
    atomic_write,
    encode_stream,
    files_digest,
    lm_blocks,
    stdlib_split,
    strided_subset,
    text_files,
    train_bpe_tokenizer,
)


def test_stdlib_split_is_disjoint_deterministic_and_nonempty():
    train, held = stdlib_split(0.05)
    assert train and held and not set(train) & set(held)
    assert (train, held) == stdlib_split(0.05)
    assert all(f.suffix == ".py" for f in train + held)
    assert len(held) < len(train) / 5


def test_strided_subset_respects_budget(tmp_path):
    files = []
    for i in range(10):
        f = tmp_path / f"f{i}.txt"
        f.write_text("x" * 100)
        files.append(f)
    assert strided_subset(files, None) == files
    assert strided_subset(files, 10_000) == files
    sub = strided_subset(files, 350)
    assert sub == files[::4] and sum(f.stat().st_size for f in sub) <= 350  # [::3] is 400
    with pytest.raises(ValueError, match="max_bytes"):
        strided_subset(files, 0)
    assert text_files([tmp_path]) == sorted(files, key=lambda p: p.name)
    with pytest.raises(FileNotFoundError):
        text_files([tmp_path / "missing"])


def test_atomic_write_and_digest(tmp_path):
    atomic_write(tmp_path / "a" / "x.txt", "héllo")
    atomic_write(tmp_path / "a" / "y.bin", b"\x00\x01")
    assert (tmp_path / "a" / "x.txt").read_text(encoding="utf-8") == "héllo"
    assert (tmp_path / "a" / "y.bin").read_bytes() == b"\x00\x01"
    assert sorted(f.name for f in (tmp_path / "a").iterdir()) == ["x.txt", "y.bin"]  # no temp
    key = files_digest(["a", "b"], 1)
    assert key == files_digest(["a", "b"], 1) and len(key) == 16
    assert len({key, files_digest(["ab"], 1), files_digest(["a", "b"], 2)}) == 3


def test_tokenizer_cache_and_encoding(tmp_path):
    texts = ["def f(x):\n    return x + 1\n", "class A:\n    pass\n"] * 20
    tok = train_bpe_tokenizer(texts, 300, cache_dir=tmp_path)
    assert len(list(tmp_path.glob("bpe-300-*.json"))) == 1
    again = train_bpe_tokenizer(texts, 300, cache_dir=tmp_path)
    assert again.get_vocab() == tok.get_vocab() and tok.token_to_id(EOS) == 0
    stream = encode_stream(tok, texts[:2])
    assert stream.dtype == torch.long and int((stream == 0).sum()) == 2 and stream[-1] == 0
    assert tok.decode(encode_stream(tok, ["é€ bytes"])[:-1].tolist()) == "é€ bytes"  # byte-level
    with pytest.raises(ValueError, match="vocab_size"):
        train_bpe_tokenizer(texts, 256)


def test_lm_blocks_shift_and_subset():
    stream = torch.arange(50)
    b = lm_blocks(stream, 9)
    assert b["input_ids"].shape == (5, 9)
    assert torch.equal(b["shift_labels"][:, :-1], b["input_ids"][:, 1:])
    assert torch.equal(b["shift_labels"][:, -1], b["input_ids"][:, -1] + 1)
    sub = lm_blocks(stream, 9, max_blocks=2)
    assert torch.equal(sub["input_ids"], b["input_ids"][[0, 4]])
    with pytest.raises(ValueError, match="block"):
        lm_blocks(torch.arange(5), 9)


@pytest.mark.parametrize("dp", [1, 2, 3])
def test_rank_batches_partition_the_global_batch(dp):
    blocks = {"input_ids": torch.arange(40).view(20, 2), "labels": torch.arange(40).view(20, 2)}
    per_rank = [iter(StepBatches(blocks, micro=2, gas=2, dp_size=dp, dp_rank=r, seed=1))
                for r in range(dp)]
    seen = []
    for _ in range(20 // (4 * dp)):  # one epoch
        step = [next(it) for it in per_rank]
        rows = [int(x) for rank_mbs in step for mb in rank_mbs for x in mb["input_ids"][:, 0]]
        assert len(rows) == len(set(rows)) == 4 * dp and all(len(m) == 2 for m in step)
        seen += rows
    assert len(set(seen)) == len(seen)
    with pytest.raises(ValueError, match="global batch"):
        StepBatches(blocks, micro=8, gas=2, dp_size=2, dp_rank=0)
