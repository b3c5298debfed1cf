"""`HFTextDataModule(path=...)` reads the user's own text: a file, or a folder of text files (issue #34)."""

from __future__ import annotations

import pytest
import torch

from lightning_lowmem.demo.hf import PAD_ID, HFTextDataModule, read_text

TEXT = "The quick brown fox jumps over the lazy dog. " * 40  # 1800 bytes


def test_a_text_file_is_tokenized_byte_by_byte(tmp_path):
    (tmp_path / "mine.txt").write_text(TEXT)
    data = HFTextDataModule(seq_len=16, batch_size=2, path=str(tmp_path / "mine.txt"), val_fraction=0.5)
    data.setup("fit")
    assert data.ids.tolist() == list(TEXT.encode())  # the file, not the stdlib corpus
    row = data.train_set[3]
    real = row["attention_mask"].bool()
    assert row["input_ids"][real].tolist() == list(TEXT.encode()[48 : 48 + int(real.sum())])
    assert (row["input_ids"][~real] == PAD_ID).all() and (row["labels"][~real] == -100).all()
    assert len(data.train_set) + len(data.val_set) == len(TEXT) // 16
    batch = next(iter(data.train_dataloader()))
    assert batch["input_ids"].shape == (2, 16) and batch["input_ids"].dtype == torch.long


def test_a_folder_reads_its_text_files_in_order(tmp_path):
    (tmp_path / "b").mkdir()
    (tmp_path / "a.md").write_text("alpha " * 30)
    (tmp_path / "b" / "c.py").write_text("gamma " * 30)
    (tmp_path / "image.png").write_bytes(b"\x89PNG" * 50)  # not text: skipped
    data = HFTextDataModule(seq_len=16, batch_size=2, path=str(tmp_path))
    data.setup("fit")
    assert bytes(data.ids.to(torch.uint8).tolist()) == ("alpha " * 30 + "\n" + "gamma " * 30).encode()
    assert len(read_text(tmp_path, max_chars=100)) == 100  # max_chars still caps it


def test_bad_paths_are_one_clear_error(tmp_path):
    with pytest.raises(FileNotFoundError, match=r"`path`='.*nope' does not exist; give a text file or a folder"):
        HFTextDataModule(path=str(tmp_path / "nope"))
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match=r"holds no .txt/.md/.py/.rst file"):
        HFTextDataModule(path=str(tmp_path / "empty")).setup("fit")
